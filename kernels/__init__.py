"""chatkv.kernels: attention over paged KV and KV storage.

``attention_backend(device)`` is the dispatch point: the torch reference in ``attention.py``
runs everywhere (and is the oracle for any faster kernel); the Triton kernels in
``triton_attention.py`` take the same arguments, ``quant=`` for int8/fp8 KV included (``kv_quant.py``:
quantised in ``store_kv``, dequantised inside attention), and run on CUDA (or on CPU under
``TRITON_INTERPRET=1``, which is how the tests check them).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from chatkv.kernels.attention import AttentionMetadata, build_metadata, paged_attention, store_kv

BACKENDS = ("auto", "torch", "triton")
ENV = "CHATKV_ATTENTION"  # auto (default): Triton on CUDA, torch elsewhere; torch / triton force one


def attention_backend(device, backend: str | None = None) -> tuple:
    """Return ``(store_kv, paged_attention)`` for ``device``.

    ``backend`` (default: ``$CHATKV_ATTENTION``, else ``auto``) picks the implementation: ``auto``
    takes Triton on a CUDA device when triton is installed and the torch reference elsewhere;
    ``torch`` and ``triton`` force one (Triton on a CPU device needs ``TRITON_INTERPRET=1``).
    """
    backend = (backend or os.environ.get(ENV) or "auto").strip().lower()
    if backend not in BACKENDS:
        raise ValueError(f"{ENV}={backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        on_cuda = torch.device(device).type == "cuda"
        backend = "triton" if on_cuda and importlib.util.find_spec("triton") is not None else "torch"
    if backend == "torch":
        return store_kv, paged_attention
    from chatkv.kernels import triton_attention  # imports triton: only when chosen

    return triton_attention.store_kv, triton_attention.paged_attention


__all__ = ["AttentionMetadata", "attention_backend", "build_metadata", "paged_attention", "store_kv"]
