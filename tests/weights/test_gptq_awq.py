"""GPTQ and AWQ checkpoints run on the int4 path with their own codes, scales and zeros.

The checkpoints are made here (tests/support/gptq_awq_checkpoints.py: a seeded tiny Llama or
Qwen2 with biases, round-to-nearest quantised and packed from the formats' descriptions), for
GPTQ symmetric and asymmetric, groups of 32/64/128 and -1, act order (a random ``g_idx``; q/k/v
sharing it, and not), both GPTQ zero conventions, and AWQ groups of 64/128. Checked:

- the Q4Weight chatkv reads equals, bit for bit, a dequantisation of the packed tensors written
  here from the format description, and the packer's own ``scale * (code - zero)``;
- the int4 model's logits (both paths: the whole prompt in one step, and one token a step)
  against transformers' float32 forward over the dequantised weights, within the gate of
  tests/model/test_weight_paths.py (mean |error| <= 0.045 of the logits' std, top-1 >= 85%);
- against the float model (quantisation error included). The int4 gates of
  tests/model/test_quant_weights.py (greedy tokens, perplexity) are the default model's; on a
  random tiny model any int4 is far outside them (chatkv's own int4 of the float model: top-1 66%,
  mean |error| 0.23 of the std), so here: the error is the checkpoint's own quantisation error
  (transformers on its dequantised weights) within the same 0.045 of the std, and at most 1.5x
  the error of chatkv's own int4 (groups of 32) of the same float model;
- the engine picks int4 for such a directory and generates; ``weights=bf16`` computes the
  dequantised float weights; the self-check's reference of such a checkpoint is its own numbers;
- bad configs and damaged checkpoints fail naming the directory and the field or tensor.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from chatkv.engine.core import Engine
from chatkv.engine.sampling import SamplingParams
from chatkv.errors import ModelNotFound, UnsupportedModel
from chatkv.model import self_check as weight_check
from chatkv.model.forward import LlamaModel
from chatkv.model.modes import choose
from chatkv.weights.gptq_awq import AWQ_ORDER, JoinedLinear, read_checkpoint_q4, read_int4
from chatkv.weights.loading import load_config, read_weights
from chatkv.weights.quantised import Int4Linear
from tests.support.gptq_awq_checkpoints import Spec, make_checkpoint

MAX_MEAN = 0.045  # of the reference logits' std (tests/model/test_weight_paths.py)
MIN_TOP1 = 0.85
PROMPT = list(range(5, 69))  # 64 tokens: past the scratch path's threshold (chatkv.model.prefill)

SPECS = {
    s.name: s
    for s in [
        Spec("gptq", 32, sym=True),
        Spec("gptq", 64),
        Spec("gptq", 128),
        Spec("gptq", -1),
        Spec("gptq", 64, checkpoint_format="gptq_v2"),
        Spec("gptq", 128, desc_act=True),
        Spec("gptq", 64, desc_act=True),
        Spec("gptq", 32, sym=True, desc_act=True),
        Spec("gptq", 32, desc_act=True, mismatched_order=True),
        Spec("awq", 64),
        Spec("awq", 128),
        Spec("gptq", 64, desc_act=True, model_type="qwen2"),
        Spec("awq", 128, model_type="qwen2"),
    ]
}
LOGIT_SPECS = [
    "llama-gptq-g32-sym",
    "llama-gptq-g128-asym",
    "llama-gptq-g64-asym-gptq_v2",
    "llama-gptq-g64-asym-act-order",
    "llama-gptq-g32-sym-act-order",
    "llama-gptq-g32-asym-act-order-mismatched",
    "llama-awq-g64-asym",
    "llama-awq-g128-asym",
    "qwen2-gptq-g64-asym-act-order",
    "qwen2-awq-g128-asym",
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory, float model, dequantised model, packed tensors), made once each."""
    made = {}

    def get(name: str):
        if name not in made:
            d = tmp_path_factory.mktemp("ckpt") / name
            made[name] = (d, *make_checkpoint(d, SPECS[name]))
        return made[name]

    return get


def logits(hf, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


# -- the numbers ------------------------------------------------------------------------------------


def format_dequantisation(spec: Spec, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """float32 ``[N, K]`` of one projection's packed tensors, as the format describes them: GPTQ's
    code of input k, output n is nibble k % 8 of qweight[k // 8, n], its zero nibble n % 8 of
    qzeros[g, n // 8] (+1 in the v1 format), g = g_idx[k]; AWQ's code is the nibble i of
    qweight[k, n // 8] with AWQ_ORDER[i] == n % 8, groups consecutive inputs."""
    qweight = t["qweight"].numpy().view(np.uint32)
    qzeros = t["qzeros"].numpy().view(np.uint32)
    scales = t["scales"].float().numpy()
    if spec.method == "gptq":
        k_all, n_all = qweight.shape[0] * 8, qweight.shape[1]
        k, n = np.arange(k_all), np.arange(n_all)
        codes = (qweight[k // 8, :] >> (4 * (k % 8))[:, None]) & 15  # [K, N]
        zeros = ((qzeros[:, n // 8] >> (4 * (n % 8))) & 15) + (1 if spec.checkpoint_format == "gptq" else 0)
        groups = t["g_idx"].numpy()
    else:
        k_all, n_all = qweight.shape[0], qweight.shape[1] * 8
        n = np.arange(n_all)
        nibble = np.array([AWQ_ORDER.index(j) for j in range(8)])[n % 8]
        codes = (qweight[:, n // 8] >> (4 * nibble)) & 15
        zeros = (qzeros[:, n // 8] >> (4 * nibble)) & 15
        groups = np.arange(k_all) // (k_all if spec.group_size == -1 else spec.group_size)
    w = scales[groups, :] * (codes.astype(np.float32) - zeros[groups, :].astype(np.float32))
    return torch.from_numpy(np.ascontiguousarray(w.T))


@pytest.mark.parametrize("name", list(SPECS))
def test_the_checkpoints_own_numbers_are_read_bit_for_bit(checkpoints, name):
    d, _, deq, packed = checkpoints(name)
    spec = SPECS[name]
    q4 = read_checkpoint_q4(d)
    state = deq.state_dict()
    assert len(q4) == 7 * 2  # every projection of both layers; the float tensors are not among them
    for proj in q4.keys():
        q = q4[proj]
        base = "model." + proj.removesuffix(".weight")
        parts = {p: packed[f"{base}.{p}"] for p in ("qweight", "qzeros", "scales", "g_idx") if f"{base}.{p}" in packed}
        got = q.dequantize()
        assert torch.equal(got, format_dequantisation(spec, parts)), proj
        assert torch.equal(got, state[base + ".weight"]), proj  # the packer's scale * (code - zero)
        assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 15
        # an act order over more than one group is an input permutation (one group needs none)
        assert (q.perm is not None) == (spec.desc_act and q.codes.shape[1] > spec.group_size), proj


# -- the logits -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", LOGIT_SPECS)
def test_int4_logits_match_transformers_on_the_dequantised_weights_and_the_float_model(checkpoints, name):
    d, float_model, deq, _ = checkpoints(name)
    model = LlamaModel.from_pretrained(d, dtype=torch.bfloat16, weights_mode="int4")
    assert all(isinstance(l.down, Int4Linear) for l in model.layers)
    if SPECS[name].mismatched_order:  # q, k, v with their own act orders: one int4 linear each
        assert isinstance(model.layers[0].qkv, JoinedLinear) and len(model.layers[0].qkv.parts) == 3
    else:
        assert isinstance(model.layers[0].qkv, Int4Linear)
    ref_deq, ref_float = logits(deq, PROMPT), logits(float_model, PROMPT)
    own_error = weight_check.compare(ref_deq, ref_float)  # the checkpoint's own quantisation error
    # chatkv's own int4 (groups of 32, quantised on load) of the same float model, for scale
    floats = {k.removeprefix("model."): v for k, v in float_model.state_dict().items()}
    rtn = LlamaModel(load_config(d), floats, torch.bfloat16, weights_mode="int4")
    rtn_error = weight_check.compare(weight_check.path_logits(rtn, PROMPT, batched=True), ref_float)
    for path in ("batched", "decode"):
        got = weight_check.path_logits(model, PROMPT, batched=path == "batched")
        m = weight_check.compare(got, ref_deq)
        assert m["mean"] <= MAX_MEAN * m["std"] and m["top1"] >= MIN_TOP1, (path, m)
        f = weight_check.compare(got, ref_float)
        assert abs(f["mean"] - own_error["mean"]) <= MAX_MEAN * f["std"], (path, f, own_error)
        assert f["mean"] <= 1.5 * rtn_error["mean"], (path, f, rtn_error)


@pytest.mark.parametrize("dense_rows, dense", [(16, "copy"), (0, "scratch")])
def test_an_act_order_computes_alike_on_every_dense_path(checkpoints, dense_rows, dense):
    d, _, deq, _ = checkpoints("llama-gptq-g64-asym-act-order")
    model = LlamaModel.from_pretrained(d, dtype=torch.bfloat16, weights_mode="int4", dense_rows=dense_rows, dense=dense)
    assert model.layers[0].qkv.perm is not None
    ref = logits(deq, PROMPT)
    for path in ("batched", "decode"):
        m = weight_check.compare(weight_check.path_logits(model, PROMPT, batched=path == "batched"), ref)
        assert m["mean"] <= MAX_MEAN * m["std"] and m["top1"] >= MIN_TOP1, (dense_rows, dense, path, m)


def test_float_weights_are_the_checkpoints_numbers_dequantised(checkpoints):
    d, _, deq, _ = checkpoints("qwen2-gptq-g64-asym-act-order")
    weights = read_weights(d)
    assert not any(n.endswith((".qweight", ".qzeros", ".scales", ".g_idx")) for n in weights)
    assert "layers.0.self_attn.q_proj.bias" in weights  # qwen2's biases come from the same file
    model = LlamaModel.from_pretrained(d, dtype=torch.float32)  # what --weights fp32/bf16 computes
    got = weight_check.path_logits(model, PROMPT, batched=True)
    assert torch.allclose(got, logits(deq, PROMPT), atol=2e-4), (got - logits(deq, PROMPT)).abs().max()


def test_the_self_checks_reference_of_a_checkpoint_is_its_own_numbers(checkpoints):
    """chatkv.model.self_check builds its reference from ``reference_weight`` over the directory's
    own 4-bit weights; given ``read_int4``'s, that is the checkpoint's dequantisation exactly."""
    d, _, deq, _ = checkpoints("llama-gptq-g64-asym-act-order")
    ref = weight_check.reference_model(load_config(d), read_weights(d), read_int4(d), "int4", "float")
    got = weight_check.path_logits(ref, PROMPT, batched=True)
    assert torch.allclose(got, logits(deq, PROMPT), atol=2e-4), (got - logits(deq, PROMPT)).abs().max()


def test_auto_runs_the_checkpoints_own_int4_and_generates(checkpoints, tmp_path):
    d, _, deq, _ = checkpoints("llama-awq-g128-asym")
    assert choose("auto", "auto", "auto", "cpu", d).label == "int4 (the checkpoint's own AWQ weights)"
    assert choose("bf16", "auto", "auto", "cpu", d).weights == "float"  # asked for float: dequantised
    engine = Engine.from_pretrained(d, data_dir=str(tmp_path), num_blocks=16)
    try:
        assert (engine.weights.weights, engine.weights.head) == ("int4", "float")
        out = engine.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert len(out.token_ids) == 8
        ref = logits(deq, PROMPT)[-1]
        top2 = ref.topk(2).values
        assert top2[0] - top2[1] > 0.1, top2  # a clear first token, far beyond the int4 path's error
        assert out.token_ids[0] == int(ref.argmax())
    finally:
        engine.close()


# -- errors -----------------------------------------------------------------------------------------


def _edit_config(d, **fields):
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"].update(fields)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"bits": 3}, "bits"),
        ({"bits": 8}, "bits"),
        ({"group_size": 16}, "group_size"),
        ({"group_size": 48}, "group_size"),
        ({"quant_method": "bitsandbytes"}, "quant_method"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format"),
    ],
)
def test_an_unsupported_quantization_config_is_named(checkpoints, tmp_path, fields, field):
    import shutil

    d = tmp_path / "model"
    shutil.copytree(checkpoints("llama-gptq-g64-asym")[0], d)
    _edit_config(d, **fields)
    for load in (load_config, lambda d: LlamaModel.from_pretrained(d, dtype=torch.bfloat16, weights_mode="int4")):
        with pytest.raises(UnsupportedModel) as e:
            load(d)
        assert str(d / "config.json") in str(e.value) and f"quantization_config.{field}" in str(e.value)


@pytest.mark.parametrize("fields, field", [({"version": "gemv"}, "version"), ({"zero_point": False}, "zero_point")])
def test_an_awq_layout_other_than_gemm_is_named(checkpoints, tmp_path, fields, field):
    import shutil

    d = tmp_path / "model"
    shutil.copytree(checkpoints("llama-awq-g64-asym")[0], d)
    _edit_config(d, **fields)
    with pytest.raises(UnsupportedModel) as e:
        load_config(d)
    assert str(d / "config.json") in str(e.value) and f"quantization_config.{field}" in str(e.value)


def _damaged(checkpoints, tmp_path, edit):
    import shutil

    d = tmp_path / "model"
    shutil.copytree(checkpoints("llama-gptq-g64-asym")[0], d)
    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize(
    "what, edit, needle",
    [
        ("missing qzeros", lambda t: t.pop("model.layers.1.mlp.up_proj.qzeros"), "no 'layers.1.mlp.up_proj.qzeros'"),
        (
            "scales of another group size",
            lambda t: t.update({"model.layers.0.self_attn.o_proj.scales": torch.ones(1, 128, dtype=torch.float16)}),
            "'layers.0.self_attn.o_proj.scales' has shape [1, 128], expected [2, 128]",
        ),
        (
            "8-bit codes",
            lambda t: t.update({"model.layers.0.mlp.down_proj.qweight": torch.zeros(64, 128, dtype=torch.int32)}),
            "'layers.0.mlp.down_proj.qweight' has shape [64, 128], expected [32, 128]",
        ),
        (
            "codes not int32",
            lambda t: t.update({"model.layers.0.mlp.gate_proj.qweight": torch.zeros(16, 256, dtype=torch.int64)}),
            "'layers.0.mlp.gate_proj.qweight' is I64",
        ),
    ],
)
def test_a_damaged_checkpoint_is_named(checkpoints, tmp_path, what, edit, needle):
    d = _damaged(checkpoints, tmp_path, edit)
    for load in (
        lambda: LlamaModel.from_pretrained(d, dtype=torch.bfloat16, weights_mode="int4"),
        lambda: read_weights(d),  # the float path reads the same parts
    ):
        with pytest.raises(ModelNotFound) as e:
            load()
        assert str(d) in str(e.value) and needle in str(e.value), (what, str(e.value))


@pytest.mark.parametrize(
    "group, error, needle",
    [
        (1, UnsupportedModel, "not a multiple of 32"),  # one input moves to the next group: 63 and 65 inputs
        (7, ModelNotFound, "names groups outside 0..1"),  # a group the scales do not have
    ],
)
def test_a_g_idx_that_is_not_whole_groups_of_32_is_refused(checkpoints, tmp_path, group, error, needle):
    def edit(t):
        g = t["model.layers.0.self_attn.q_proj.g_idx"].clone()
        g[0] = group
        t["model.layers.0.self_attn.q_proj.g_idx"] = g

    d = _damaged(checkpoints, tmp_path, edit)
    with pytest.raises(error) as e:
        LlamaModel.from_pretrained(d, dtype=torch.bfloat16, weights_mode="int4")
    assert str(d) in str(e.value) and "layers.0.self_attn.q_proj.weight" in str(e.value), str(e.value)
    assert "g_idx" in str(e.value) and needle in str(e.value), str(e.value)


def test_an_act_order_checkpoint_passes_the_self_check_on_its_own_numbers(checkpoints, tmp_path):
    """The engine's self-check compares the int4 model with its reference over the directory's own
    4-bit weights (``read_int4``); a reference quantised again from the dequantised float weights
    would mix an act order's scattered groups and fail the model it should vouch for."""
    d, _, _, _ = checkpoints("llama-gptq-g64-asym-act-order")
    with Engine.from_pretrained(d, data_dir=str(tmp_path), num_blocks=16) as engine:
        assert (engine.weights.weights, engine.weights.label) == ("int4", "int4 (the checkpoint's own GPTQ weights)")
