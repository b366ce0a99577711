"""Transitional: ``data_dir`` now lives in :mod:`chatkv.storage.paths`.

Kept only until chatkv/engine.py imports it from there; then delete this file.
"""

from chatkv.storage.paths import data_dir

__all__ = ["data_dir"]
