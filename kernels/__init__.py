"""chatkv.kernels: attention over paged KV and KV storage.

``attention_backend(device)`` is the dispatch point: the torch reference in ``attention.py``
runs everywhere (and is the oracle for any faster kernel); the Triton kernels in
``triton_attention.py`` take the same arguments, ``quant=`` for int8/fp8 KV included (``kv_quant.py``:
quantised in ``store_kv``, dequantised inside attention), and run on CUDA (or on CPU under
``TRITON_INTERPRET=1``, which is how the tests check them).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _hand_the_bare_name_to_its_distribution() -> None:
    """This file imported as the bare ``kernels``: give that name to the distribution that owns it.

    Run from the repository's root (pytest's rootdir, ``python -c``, a benchmark that puts the root
    on ``sys.path``), the folder ``kernels/`` is found as a top-level package ahead of site-packages,
    and it would shadow Hugging Face's ``kernels``, which transformers 5.25 requires and imports at
    ``import transformers``. chatkv itself only ever imports this folder as ``chatkv.kernels``. When
    the rest of ``sys.path`` holds a real ``kernels``, it is loaded and put in ``sys.modules``, and
    the import statement returns it; without one, this file serves the name as it always has.
    """
    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    rest = [p for p in sys.path if isinstance(p, str) and os.path.realpath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", rest)
    if spec is None or spec.loader is None:  # nothing else by that name (or only a namespace folder)
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module  # the import system returns what sys.modules holds after this file ran
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _hand_the_bare_name_to_its_distribution()

import torch  # noqa: E402

from chatkv.kernels.attention import AttentionMetadata, build_metadata, paged_attention, store_kv  # noqa: E402

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
