"""Which weights an engine computes with: the ``weights`` and ``head_weights`` options.

- ``weights``: ``auto | bf16 | fp32 | int4 | int8`` for the layers' projections. ``bf16`` and
  ``fp32`` are the float model in that dtype; ``int4``/``int8`` are chatkv.weights.quantised's modes
  (bfloat16 activations, CPU only). ``auto``: ``int4`` when the model is a converted GGUF
  whose projections are 4-bit (its own numbers are computed, nothing is lost that the file
  had not lost already, and it passed the quality gate against llama.cpp's own logits:
  tests/model/test_quant_weights.py), or a GPTQ/AWQ checkpoint (chatkv.weights.gptq_awq: its own
  codes, scales and zeros, likewise; its float weights would only be those numbers dequantised);
  otherwise the float model in the ``dtype`` option's dtype.
  Quantising a float model is never chosen by ``auto``: it costs quality, so it is asked for.
- ``head_weights``: ``auto | float | int8 | int4`` for the output matrix (tied to the
  embeddings or not). ``auto``: ``int8`` (per output channel) with a GGUF's own int4
  weights, which passes the same gate against llama.cpp (perplexity within 0.1% of
  llama.cpp's; the float head is 1.5 ms of a 7 ms token); ``int4`` does not pass (+5.8%
  perplexity) and is never picked; ``float`` otherwise: the logits are where quantisation
  error shows first.

The quantised modes change the KV the model computes, so they are part of the engine's
fingerprint: a snapshot written by one mode is never restored into another.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from chatkv.config import HEADS, WEIGHTS
from chatkv.errors import InvalidRequest
from chatkv.weights.gguf import QUANT_FILE
from chatkv.weights.gptq_awq import checkpoint_kind
from chatkv.weights.quantised import int4_supported, int8_supported

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FLOAT = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class WeightChoice:
    dtype: torch.dtype | None  # None: the model's own
    weights: str  # float | int4 | int8 (chatkv.model.forward.WEIGHT_MODES)
    head: str
    label: str  # what was picked, for the user: "int4 (the GGUF's own 4-bit weights)"

    def fingerprint(self, base: str) -> str:
        if self.weights == "float" and self.head == "float":
            return base
        return hashlib.sha256(f"{base}:{self.weights}:{self.head}".encode()).hexdigest()[:32]


def choose(weights: str, head: str, dtype: str, device: str, model_dir: Path) -> WeightChoice:
    if weights not in WEIGHTS:
        raise InvalidRequest(f"weights {weights!r} unknown; use one of {', '.join(WEIGHTS)}")
    if head not in HEADS:
        raise InvalidRequest(f"head_weights {head!r} unknown; use one of {', '.join(HEADS)}")
    if dtype != "auto" and dtype not in _DTYPES:
        raise InvalidRequest(f"dtype '{dtype}' unknown; use auto or one of {sorted(_DTYPES)}")
    want = None if dtype == "auto" else _DTYPES[dtype]
    cpu = torch.device(device).type == "cpu"
    gguf_q4 = (Path(model_dir) / QUANT_FILE).is_file()
    own_q4 = checkpoint_kind(model_dir)  # "GPTQ"/"AWQ": a checkpoint of 4-bit projections
    auto_head = head == "auto"
    head = "float" if auto_head else head
    if weights == "auto":
        if (gguf_q4 or own_q4) and cpu and want in (None, torch.bfloat16) and int4_supported():
            weights = "int4"
            label = f"int4 (the checkpoint's own {own_q4} weights)" if own_q4 else "int4 (the GGUF's own 4-bit weights)"
        else:
            label = "the float model in " + ("its own dtype" if want is None else dtype)
            return _quantised_head(WeightChoice(want, "float", head, label), cpu, want)
    elif weights in _FLOAT:
        if want is not None and want != _FLOAT[weights]:
            raise InvalidRequest(f"weights {weights} and dtype {dtype} disagree; give one of them")
        return _quantised_head(WeightChoice(_FLOAT[weights], "float", head, weights), cpu, _FLOAT[weights])
    else:
        label = weights
    if not cpu:
        raise InvalidRequest(f"weights {weights} run on CPU only (device {device}); use bf16 or fp32 there")
    if want not in (None, torch.bfloat16):
        raise InvalidRequest(f"weights {weights} compute in bfloat16, not dtype {dtype}; use dtype auto or bfloat16")
    if not (int4_supported() if weights == "int4" else int8_supported()):
        raise InvalidRequest(f"this torch build has no CPU {weights} matmul kernel; use weights bf16")
    if auto_head and weights == "int4" and gguf_q4 and int8_supported():
        head = "int8"
    return _quantised_head(WeightChoice(torch.bfloat16, weights, head, label), cpu, torch.bfloat16)


def _quantised_head(c: WeightChoice, cpu: bool, dtype: torch.dtype | None) -> WeightChoice:
    if c.head == "float":
        return c
    if not cpu or dtype != torch.bfloat16:
        raise InvalidRequest(f"head_weights {c.head} computes in bfloat16 on CPU; use weights int4/int8/bf16 there")
    if not (int4_supported() if c.head == "int4" else int8_supported()):
        raise InvalidRequest(f"this torch build has no CPU {c.head} matmul kernel; use head_weights float")
    return WeightChoice(torch.bfloat16, c.weights, c.head, f"{c.label}, output matrix {c.head}")
