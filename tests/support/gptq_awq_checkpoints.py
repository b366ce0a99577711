"""Tiny GPTQ and AWQ checkpoints, quantised and packed here from the formats' descriptions.

Nothing is committed: each test makes its checkpoint in a temporary directory in well under a
second from a seeded tiny model (tests/support/tiny.py), so ``make_checkpoint`` is how to make one
again. The packing is written from the formats' documented layouts, not from chatkv's reader
(chatkv/weights/gptq_awq.py, whose docstring describes the same layouts):

- both formats: ``w = scale * (code - zero)`` per group of inputs, 4-bit codes and zeros, fp16
  scales, 8 codes to an int32 word, nibble ``i`` at bits ``4i``;
- GPTQ: ``qweight [K / 8, N]`` (a word holds 8 consecutive inputs of one output), ``qzeros
  [G, N / 8]`` (8 consecutive outputs), ``scales [G, N]``, ``g_idx [K]`` (each input's group).
  ``checkpoint_format`` "gptq" stores ``zero - 1``, "gptq_v2" the zero. Act order (``desc_act``):
  the inputs are taken in a random order and the i-th of them is in group ``i // group_size``, as
  GPTQ assigns groups in the order it quantises the columns;
- AWQ (GEMM): ``qweight [K, N / 8]`` and ``qzeros [G, N / 8]``, a word holding outputs
  ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]`` in nibble ``i``; ``scales [G, N]``.

Quantisation is round-to-nearest per group (GPTQ's own quantiser's grid, without its error
feedback, which only changes which codes are chosen): asymmetric over ``[min(x, 0), max(x, 0)]``
with ``zero = round(-min / scale)``; symmetric with ``scale = 2 max|x| / 15`` and zero 8.
Every float tensor is fp16, as such checkpoints store them; the float model returned is the same
model with every parameter rounded to fp16 (the reference the quantisation is measured against).
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tests.support.tiny import make_model

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: shared by the llama and qwen2 checkpoints: inputs 128 and 256, so groups of up to 128 fit
DIMS = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256, num_hidden_layers=2)


@dataclass
class Spec:
    method: str = "gptq"  # gptq | awq
    group_size: int = 128  # -1: one group over all inputs
    sym: bool = False
    desc_act: bool = False
    checkpoint_format: str = "gptq"  # gptq (v1: zero - 1 stored) | gptq_v2
    mismatched_order: bool = False  # act order: q, k, v (and gate, up) each their own input order
    model_type: str = "llama"
    seed: int = 0
    extra: dict = field(default_factory=dict)  # more quantization_config fields

    @property
    def name(self) -> str:
        parts = [self.model_type, self.method, f"g{self.group_size}", "sym" if self.sym else "asym"]
        if self.desc_act:
            parts.append("act-order" + ("-mismatched" if self.mismatched_order else ""))
        if self.method == "gptq" and self.checkpoint_format != "gptq":
            parts.append(self.checkpoint_format)
        return "-".join(parts)


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., W]`` of uint ``[..., 8 W]`` values 0..15: value ``8w + i`` at bits ``4i`` of word ``w``."""
    v = nibbles.long().view(*nibbles.shape[:-1], -1, 8)
    word = sum(v[..., i] << (4 * i) for i in range(8))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def quantise(w: torch.Tensor, groups: torch.Tensor, n_groups: int, sym: bool, awq: bool):
    """Round-to-nearest codes ``[N, K]``, fp16 scales ``[G, N]`` and integer zeros ``[G, N]`` of ``w``
    (float32 ``[N, K]``) with input ``k`` in group ``groups[k]``."""
    n, k = w.shape
    scales = torch.empty(n_groups, n, dtype=torch.float16)
    zeros = torch.empty(n_groups, n, dtype=torch.long)
    codes = torch.empty(n, k, dtype=torch.long)
    for g in range(n_groups):
        cols = (groups == g).nonzero().flatten()
        x = w[:, cols]
        if awq:  # AutoAWQ's grid: the group's own min and max
            lo, hi = x.amin(1), x.amax(1)
        else:  # GPTQ's: the range widened to hold 0
            lo, hi = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
        if sym:
            hi = torch.maximum(lo.abs(), hi)
            lo = -hi
        s = ((hi - lo) / 15).clamp(min=1e-6).half()
        z = torch.full((n,), 8, dtype=torch.long) if sym else torch.round(-lo / s.float()).long().clamp(0, 15)
        codes[:, cols] = (torch.round(x / s.float()[:, None]).long() + z[:, None]).clamp(0, 15)
        scales[g], zeros[g] = s, z
    return codes, scales, zeros


def group_index(k: int, group_size: int, desc_act: bool, gen: torch.Generator) -> torch.Tensor:
    """Each input's group: consecutive inputs, or (act order) the i-th of a random order in group i // size."""
    size = k if group_size == -1 else group_size
    if not desc_act:
        return torch.arange(k) // size
    order = torch.randperm(k, generator=gen)
    g = torch.empty(k, dtype=torch.long)
    g[order] = torch.arange(k) // size
    return g


def pack(spec: Spec, codes, scales, zeros, groups) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors of one projection (``qweight``, ``qzeros``, ``scales``[, ``g_idx``])."""
    if spec.method == "awq":
        order = torch.tensor(AWQ_ORDER)
        n = codes.shape[0]
        # output 8c + AWQ_ORDER[i] goes to nibble i of word c
        cols = (torch.arange(0, n, 8)[:, None] + order[None, :]).flatten()
        return {
            "qweight": _words(codes.t()[:, cols]),
            "qzeros": _words(zeros[:, cols]),
            "scales": scales,
        }
    stored = (zeros - 1) & 0xF if spec.checkpoint_format == "gptq" else zeros
    return {
        "qweight": _words(codes).t().contiguous(),  # [N, K/8] words of 8 consecutive inputs -> [K/8, N]
        "qzeros": _words(stored),
        "scales": scales,
        "g_idx": groups.to(torch.int32),
    }


def dequantised(codes, scales, zeros, groups) -> torch.Tensor:
    """float32 ``[N, K]``: ``scale * (code - zero)`` of each input's group."""
    return scales.float().t()[:, groups] * (codes - zeros.t()[:, groups]).float()


def quant_config(spec: Spec) -> dict:
    if spec.method == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": spec.group_size, "zero_point": True, "version": "gemm"}
    else:
        qc = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": spec.group_size,
            "desc_act": spec.desc_act,
            "sym": spec.sym,
            "checkpoint_format": spec.checkpoint_format,
            "pack_dtype": "int32",
            "lm_head": False,
        }
    qc.update(spec.extra)
    return qc


def make_checkpoint(out_dir: Path, spec: Spec):
    """Write ``spec``'s checkpoint to ``out_dir``: config.json with its quantization_config,
    model.safetensors (packed projections, fp16 float tensors), the tiny tokenizer. Returns
    ``(float_model, dequantised_model, tensors)``: transformers float32 models of the fp16-rounded
    weights and of the same with each projection's quantisation dequantised (``dequantised``),
    and the projections' packed tensors by file name."""
    from safetensors.torch import save_file

    float_dir = out_dir.parent / (out_dir.name + "-float")
    model = make_model(float_dir, spec.model_type, seed=spec.seed, **DIMS)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    deq = copy.deepcopy(model)  # to hold the dequantised weights
    gen = torch.Generator().manual_seed(1000 + spec.seed)
    state = {k: v.half() for k, v in model.state_dict().items()}
    packed: dict[str, torch.Tensor] = {}
    for i in range(model.config.num_hidden_layers):
        shared: dict[str, torch.Tensor] = {}  # one act order per input: q/k/v's and gate/up's (unless mismatched)
        for proj in PROJECTIONS:
            part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"model.layers.{i}.{part}.{proj}"
            w = model.state_dict()[name + ".weight"]
            k = w.shape[1]
            share = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gu", "up_proj": "gu"}.get(proj)
            if share in shared and not spec.mismatched_order:
                groups = shared[share]
            else:
                groups = group_index(k, spec.group_size, spec.desc_act and spec.method == "gptq", gen)
                if share:
                    shared[share] = groups
            n_groups = int(groups.max()) + 1
            codes, scales, zeros = quantise(w, groups, n_groups, spec.sym, spec.method == "awq")
            for part_name, t in pack(spec, codes, scales, zeros, groups).items():
                packed[f"{name}.{part_name}"] = t
            del state[name + ".weight"]
            with torch.no_grad():
                deq.get_parameter(name + ".weight").copy_(dequantised(codes, scales, zeros, groups))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({**state, **packed}, str(out_dir / "model.safetensors"))
    config = json.loads((float_dir / "config.json").read_text())
    config["dtype"] = "float16"
    config.pop("torch_dtype", None)
    config["quantization_config"] = quant_config(spec)
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    for f in float_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, out_dir / f.name)
    shutil.rmtree(float_dir)
    return model.eval(), deq.eval(), packed
