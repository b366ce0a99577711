"""Shared test set-up.

Quantised weight modes check themselves against the float path when they load and cache the
verdict per machine (chatkv.weight_check); the suite keeps that cache in one temporary
directory of its own, shared by every test and child process of the run, so the user's cache
is never touched and each mode is checked once per run."""

from __future__ import annotations

import os
import tempfile

_cache = tempfile.mkdtemp(prefix="chatkv-test-cache-")
os.environ.setdefault("CHATKV_CACHE_DIR", _cache)
