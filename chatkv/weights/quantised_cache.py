"""Weights quantised on load, kept so that the next load of the same model in the same mode quantises nothing.

The int4 and int8 modes quantise every weight that is not already in their form when the model
loads: a float directory's projections (``--weights int4``/``int8``), a GGUF's wider tensors (Q5,
Q6, Q8, IQ4: int8 per channel in the int4 mode) and the output matrix (int8 per channel). At a
1.7B model's size that is seconds of every start. The first load writes what it made into one
safetensors file in the user's cache directory, ``quantised/<key>.safetensors``, keyed by the
model's fingerprint (chatkv.weights.fingerprint: every file that decides its weights) and the
mode; a later load reads each weight from it instead of quantising it again, bit for bit the same
numbers (tests/weights/test_quantised_cache.py).

It costs disk: the quantised form of what the model did not hold in that form (for a 1.7B Q4_K_M,
its Q6_K projections and output matrix as int8: benchmarks/README.md). A file that cannot be
written (a read-only or full disk) costs only the next start the quantising; one that cannot be
read (damaged, truncated) is ignored and written again. ``CHATKV_QUANTISED_CACHE=0`` turns it off.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Callable

import torch

from chatkv.weights.quantised import Q4Weight, Q8Weight

log = logging.getLogger("chatkv.weights")

__all__ = ["QuantisedCache"]

#: the stored forms' layout: a file of another version is not read
VERSION = 1


class QuantisedCache:
    """What one load quantises, read from or kept for the next load of ``model_dir`` in ``mode``."""

    def __init__(self, model_dir: str | Path, mode: str, root: Path | None = None):
        self.made: dict[str, torch.Tensor] = {}
        self.path: Path | None = None
        self._names: set[str] = set()
        if os.environ.get("CHATKV_QUANTISED_CACHE", "1").strip() == "0":
            return
        try:
            from chatkv.storage.paths import cache_dir
            from chatkv.weights.fingerprint import model_fingerprint

            root = Path(root) if root is not None else cache_dir()
            key = hashlib.sha256(f"{model_fingerprint(model_dir)}|{mode}|{VERSION}".encode()).hexdigest()[:32]
        except OSError as e:  # an unreadable model file fails the load itself, with its own error
            log.debug("no quantised cache (%s)", e)
            return
        self.path = root / "quantised" / f"{key}.safetensors"
        if self.path.is_file():
            from safetensors import safe_open

            try:
                with safe_open(str(self.path), framework="pt") as st:
                    self._names = set(st.keys())
            except Exception as e:  # noqa: BLE001 - damaged or truncated: quantised again and rewritten
                log.debug("quantised cache %s unreadable (%s)", self.path, e)
                self._names = set()

    def _read(self, names: list[str]) -> list[torch.Tensor] | None:
        if self.path is None or not all(n in self._names for n in names):
            return None
        from safetensors import safe_open

        try:
            with safe_open(str(self.path), framework="pt") as st:
                return [st.get_tensor(n).clone() for n in names]  # copies out of the mapping, closed with it
        except Exception as e:  # noqa: BLE001 - changed since it was opened: quantised again
            log.debug("quantised cache %s unreadable (%s)", self.path, e)
            self._names = set()
            return None

    def has(self, name: str) -> bool:
        return f"{name}.codes" in self._names

    def int8(self, name: str, make: Callable[[], Q8Weight]) -> Q8Weight:
        """``name``'s int8 form: read, or made by ``make`` and kept for ``save``."""
        got = self._read([f"{name}.codes", f"{name}.scale"])
        if got is not None:
            return Q8Weight(*got)
        q = make()
        if self.path is not None:
            self.made[f"{name}.codes"], self.made[f"{name}.scale"] = q.codes, q.scale
        return q

    def int4(self, name: str, make: Callable[[], Q4Weight]) -> Q4Weight:
        """``name``'s int4 form (codes kept two a byte): read, or made by ``make`` and kept for ``save``."""
        got = self._read([f"{name}.codes", f"{name}.scale", f"{name}.minimum"])
        if got is not None:
            packed, scale, minimum = got
            codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
            return Q4Weight(codes, scale, minimum)
        q = make()
        if self.path is not None:
            self.made[f"{name}.codes"] = q.codes[:, 0::2] | (q.codes[:, 1::2] << 4)
            self.made[f"{name}.scale"], self.made[f"{name}.minimum"] = q.scale, q.minimum
        return q

    def save(self) -> None:
        """Write what this load made (with what the file already held) for the next load; best effort."""
        if self.path is None or not self.made:
            self.made = {}
            return
        from chatkv.storage.files import atomic_write, make_private_dir
        from chatkv.storage.tensor_file import TensorFileWriter

        tensors = dict(self.made)
        self.made = {}
        if self._names:  # a file that lacked some of this load's weights: rewritten whole
            from safetensors import safe_open

            try:
                with safe_open(str(self.path), framework="pt") as st:
                    for n in self._names - set(tensors):
                        tensors[n] = st.get_tensor(n).clone()
            except Exception:  # noqa: BLE001 - unreadable: only this load's weights
                pass
        try:
            make_private_dir(self.path.parent)
            atomic_write(self.path, lambda tmp: _write(tmp, tensors, TensorFileWriter), durable=False)
        except Exception as e:  # noqa: BLE001 - a full or read-only disk: the next start quantises again
            log.debug("quantised cache not written (%s)", e)


def _write(path: Path, tensors: dict[str, torch.Tensor], writer) -> None:
    """``tensors`` into the safetensors file ``path`` straight from their memory (safetensors'
    ``save_file`` makes a bytes copy of each first: 433 MB more at the peak of a 1.7B model's load)."""
    out = writer(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], {"format": "pt"})
    try:
        for n, t in tensors.items():
            out.write(n, t)
        out.close()
    except BaseException:
        out.abandon()
        raise
