"""Every weight mode, on both of its paths, against transformers on the same weights.

The default model's answer to "What is the capital of France?" in int4 mode rests on a margin,
not on any single kernel: in exact float32 arithmetic of the int4 weights the first token is
"The" by 0.10 logits over "L", while a bfloat16 residual stream (with the RMSNorm computed as a
LayerNorm over [x, -x]) leaves the logits 0.21 off on average, so the order of each CPU's own
kernel sums would decide between "The capital of France is Paris." and "L'Étoile, la
Marseillaise, ...". The quantised modes therefore keep the residual in float32
(chatkv/model/forward.py, "Precision").

So the test that catches such an error on any machine measures the error itself, per mode and path,
against transformers' float32 forward over the numbers the mode computes with (the
quantisation dequantised: quantisation error is not what is tested here):

- mean |logit error| <= 0.045 of the reference logits' std: between the two residuals' errors
  on chat prompts of the default template (a bf16 residual 0.046-0.063, the float32 residual
  0.026-0.038, 0.017-0.021 on a plain-text prompt; AMD EPYC);
- top-1 agreement over the prompt >= 85%, and the France prompt's answer token equal;
- both paths: ``batched`` (the whole prompt in one step: bf16 weights when
  ``quant_dense_rows`` is 16, dequantised into a scratch buffer or, with ``quant_dense="copy"``,
  a resident copy; the quantised kernel over many rows when it is 0) and
  ``decode`` (one token a step: the int4/int8 GEMV).

And the self-check (chatkv.model.self_check) with deliberately broken kernels: a mode that
fails falls back int4 -> int8 -> bf16 with a warning naming the failed path; asked for by
name it raises WeightCheckFailed; the verdict is cached per machine.
"""

from __future__ import annotations

import logging

import pytest
import torch

from chatkv.config import EngineConfig
from chatkv.engine.core import Engine
from chatkv.errors import WeightCheckFailed
from chatkv.model import self_check as weight_check
from chatkv.model.forward import LlamaModel
from chatkv.weights import ensure_default_model, load_tokenizer
from chatkv.weights.gguf import read_q4
from chatkv.weights.loading import read_weights
from chatkv.weights.quantised import Int4Linear

MAX_MEAN = 0.045  # of the reference logits' std
MIN_TOP1 = 0.85


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_default_model(tmp_path_factory.mktemp("home"))


@pytest.fixture(scope="module")
def prompts(model_dir):
    tok = load_tokenizer(model_dir)
    france = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True
    )
    france = list(france["input_ids"] if hasattr(france, "keys") else france)
    assert len(france) == 37
    return {"france": france, "story": weight_check.prompt_ids(tok)}


@pytest.fixture(scope="module")
def weights(model_dir):
    return read_weights(model_dir), read_q4(model_dir)


def transformers_reference(model_dir, weights, mode: str, head: str):
    """transformers' float32 model over the numbers ``mode``/``head`` compute with (their
    quantisation dequantised by chatkv.model.self_check.reference_weight)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4
        from transformers.modeling_utils import no_init_weights

    floats, q4 = weights
    q4 = q4 if mode == "int4" else {}
    config = AutoConfig.from_pretrained(model_dir)  # the oracle's own config, never chatkv's cached copy of it
    with no_init_weights():
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {
        "model." + n: weight_check.reference_weight(n, t, mode, q4) if n.endswith(weight_check._PROJ) else t.float()
        for n, t in floats.items()
    }
    state["lm_head.weight"] = weight_check.reference_weight(
        "embed_tokens.weight", floats["embed_tokens.weight"], head, {}
    )
    hf.config.tie_word_embeddings = False
    hf.lm_head.weight = torch.nn.Parameter(state["lm_head.weight"])  # untied: the head may be quantised alone
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf.eval()


# dense rows 16: the many-row steps' bf16 weights dequantised into a scratch buffer (the default)
# or held as a resident copy; 0: the quantised kernel for every step
CASES = [
    ("int4", "int8", 16, "scratch"),
    ("int4", "int8", 16, "copy"),
    ("int4", "int8", 0, "scratch"),
    ("int8", "float", 16, "scratch"),
    ("int8", "float", 16, "copy"),
]


@pytest.mark.parametrize(
    "mode, head, dense, kind", CASES, ids=[f"{m}-head_{h}-dense{d}" + (f"-{k}" if d else "") for m, h, d, k in CASES]
)
def test_every_weight_mode_and_path_matches_transformers_on_its_own_weights(
    model_dir, weights, prompts, mode, head, dense, kind
):
    hf = transformers_reference(model_dir, weights, mode, head)
    model = LlamaModel.from_pretrained(
        model_dir, dtype=torch.bfloat16, weights_mode=mode, head_mode=head, dense_rows=dense, dense=kind
    )
    for name, ids in prompts.items():
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        for path in ("batched", "decode"):
            got = weight_check.path_logits(model, ids, batched=path == "batched")
            m = weight_check.compare(got, ref)
            where = (mode, head, dense, kind, name, path, m)
            assert m["mean"] <= MAX_MEAN * m["std"], where
            assert m["top1"] >= MIN_TOP1, where
            if name == "france":  # the answer's first token: "The" (capital of France is Paris)
                assert int(got[-1].argmax()) == int(ref[-1].argmax()), where


# -- the self-check ------------------------------------------------------------------------------


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATKV_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "weight-checks.json"


def broken(path: str):
    """An Int4Linear whose ``path`` (decode: the int4 kernel; batched: the bf16 weights) is wrong by
    a permutation of its outputs, at the model's own sizes only: like a kernel fault that shows at real sizes, it
    passes the load-time kernel probe of chatkv.weights.quantised (64 x 64 random weights), and has the
    scale of a real kernel fault, not of rounding."""
    real = Int4Linear.__call__

    def call(self, x):
        y = real(self, x)
        dense = self.dense is not None and x.shape[0] >= self.dense_rows
        wrong = self.out_features >= 576 and dense == (path == "batched")
        return y.roll(1, dims=-1) if wrong else y

    return call


def test_a_deterministic_engine_checks_the_one_kernel_all_its_steps_take(model_dir, tmp_path, fresh_cache, monkeypatch):
    """A deterministic engine computes every step with the few-row kernel (no dense path): broken,
    it fails the check and the engine falls back to int8, as the batched kernels' engine does."""
    monkeypatch.setattr(Int4Linear, "__call__", broken("decode"))
    monkeypatch.setattr("chatkv.model.forward.int4_mm_many", lambda x, p, s: broken_many(x, p, s))
    e = Engine(model_dir, EngineConfig(data_dir=str(tmp_path / "data"), num_blocks=8))
    assert e.model.invariant and e.weights.weights == "int8" and "fallback" in e.weights.label, e.weights
    e.close()


def broken_many(x, packed, scales_zeros):
    """``int4_mm_many`` wrong as ``broken("decode")`` makes the few-row kernel wrong."""
    from chatkv.kernels.cpu_invariant import int4_mm_many

    y = int4_mm_many(x, packed, scales_zeros)
    return y.roll(1, dims=-1) if y.shape[-1] >= 576 else y


@pytest.mark.parametrize("path", ["decode", "batched"])
def test_a_broken_int4_kernel_falls_back_to_int8_naming_the_check(
    model_dir, tmp_path, fresh_cache, monkeypatch, caplog, path
):
    """The batched kernels' engine (``deterministic=False``), whose steps of many rows take another path
    (the dense one) than its decode steps: the check names the path that failed."""
    monkeypatch.setattr(Int4Linear, "__call__", broken(path))
    with caplog.at_level(logging.WARNING, logger="chatkv.model.self_check"):
        e = Engine(model_dir, EngineConfig(data_dir=str(tmp_path / "data"), num_blocks=8, deterministic=False))
    assert e.weights.weights == "int8" and e.weights.head == "float", e.weights
    assert "fallback" in e.weights.label
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and f"{path} path" in warned[0] and "falling back to int8" in warned[0], warned
    other = "batched" if path == "decode" else "decode"
    assert f"{other} path" not in warned[0].split("):", 1)[1]  # only the path that failed is named
    # and it answers, on int8
    ids = e.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    from chatkv.engine.sampling import SamplingParams

    assert "Paris" in e.generate(ids, SamplingParams(max_tokens=16, temperature=0)).text


def test_int4_asked_for_by_name_fails_with_the_check_instead_of_answering_wrong(
    model_dir, tmp_path, fresh_cache, monkeypatch
):
    monkeypatch.setattr(Int4Linear, "__call__", broken("decode"))
    with pytest.raises(WeightCheckFailed, match=r"weights int4 .*failed their check on this CPU .*decode path: top-1"):
        Engine(model_dir, EngineConfig(data_dir=str(tmp_path / "data"), num_blocks=8, weights="int4"))


def test_the_verdict_is_cached_per_machine_and_mode(model_dir, tmp_path, fresh_cache, monkeypatch):
    runs = []
    real = weight_check.run_check
    monkeypatch.setattr(weight_check, "run_check", lambda *a: runs.append(1) or real(*a))
    cfg = dict(data_dir=str(tmp_path / "data"), num_blocks=8)
    assert Engine(model_dir, EngineConfig(**cfg)).weights.weights == "int4"
    assert len(runs) == 1 and fresh_cache.is_file()
    assert Engine(model_dir, EngineConfig(**cfg)).weights.weights == "int4"
    assert len(runs) == 1  # cached: start-up pays nothing
    Engine(model_dir, EngineConfig(quant_dense_rows=0, **cfg))
    assert len(runs) == 2  # another path is another verdict
    key = weight_check.machine_key()
    monkeypatch.setattr(weight_check, "machine_key", lambda: key + "-another-cpu")
    Engine(model_dir, EngineConfig(**cfg))
    assert len(runs) == 3  # another machine (or torch) checks again
    # a failed verdict is cached too: the next start falls back at once, warning again
    monkeypatch.setattr(Int4Linear, "__call__", broken("decode"))
    monkeypatch.setattr(weight_check, "machine_key", lambda: key + "-a-broken-cpu")
    assert Engine(model_dir, EngineConfig(**cfg)).weights.weights == "int8"
    n = len(runs)
    assert Engine(model_dir, EngineConfig(**cfg)).weights.weights == "int8" and len(runs) == n


def test_a_damaged_verdict_cache_is_checked_again(model_dir, tmp_path, fresh_cache):
    fresh_cache.parent.mkdir(parents=True)
    fresh_cache.write_bytes(b"\xff\xfe not json")
    e = Engine(model_dir, EngineConfig(data_dir=str(tmp_path / "data"), num_blocks=8))
    assert e.weights.weights == "int4"
    assert weight_check.machine_key() in fresh_cache.read_text()


def test_the_norm_is_exact_to_float32_at_the_models_real_activations(model_dir, prompts):
    """The quantised modes' RMSNorm (chatkv.model.forward.rms: torch's rms_norm on the float32 residual)
    at every norm of the default model, on the real residual stream of both prompts (outlier
    channels of hundreds), is float64's RMSNorm to float32 rounding. The LayerNorm over
    [x, -x] it replaced is held to what it measured, to show why it went: its variance is
    ~40x further off (1.3e-5 relative here), enough to move an answer decided by 0.1 logits."""
    import torch.nn.functional as F

    model = LlamaModel.from_pretrained(model_dir, dtype=torch.bfloat16, weights_mode="int4", head_mode="int8")
    seen = []
    real = model.rms

    def record(x, weight, out=None):
        if x.dtype == torch.float32 and weight.dim() == 1:
            seen.append((x.clone(), weight))
        return real(x, weight, out)

    model.rms = record
    for ids in prompts.values():
        weight_check.path_logits(model, ids, batched=True)
    assert len(seen) == 2 * (2 * model.num_layers + 1)
    peak = max(float(x.abs().max()) for x, _ in seen)
    assert peak > 100, peak  # the outliers
    worst_rms = worst_ln = 0.0
    for x, weight in seen:
        exact = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + model.eps) * weight.double()
        rms = real(x, weight).double()  # what the model computes (rounded to bf16)
        assert torch.equal(rms, exact.float().to(torch.bfloat16).double()) or (
            (rms != exact.float().to(torch.bfloat16).double()).float().mean() <= 1e-3
        )
        ours = F.rms_norm(x, (x.shape[-1],), weight.float(), eps=model.eps).double()
        ln = F.layer_norm(
            torch.stack((x, -x), dim=-2), (2, x.shape[-1]), torch.stack((weight, weight)).float(), None, model.eps
        )[..., 0, :].double()
        scale = exact.abs().clamp_min(1e-3)
        worst_rms = max(worst_rms, float(((ours - exact).abs() / scale).max()))
        worst_ln = max(worst_ln, float(((ln - exact).abs() / scale).max()))
    assert worst_rms <= 2e-6, worst_rms  # float32 rounding (measured 3e-7)
    assert worst_ln > 10 * worst_rms, (worst_ln, worst_rms)  # why the [x, -x] LayerNorm is gone


def test_a_prefill_crossing_the_scratch_threshold_matches_transformers(model_dir, weights, prompts, monkeypatch):
    """int4 with the scratch path (the default): a step of at least ``SCRATCH_ROWS`` rows
    dequantises into the scratch buffer, a shorter one runs the int4 kernel. Here the threshold
    is 32 and a 40-token prompt is prefilled in two chunks, 33 rows (scratch) then 7 (the
    kernel), and in one step of 40: every position's logits against transformers."""
    from chatkv.config import EngineConfig
    from chatkv.engine.model_runner import BatchItem, ModelRunner
    from chatkv.model import prefill as quant_prefill
    from chatkv.model.prefill import ScratchInt4

    monkeypatch.setattr(quant_prefill, "SCRATCH_ROWS", 32)
    model = LlamaModel.from_pretrained(
        model_dir, dtype=torch.bfloat16, weights_mode="int4", head_mode="int8", dense_rows=16, dense="scratch"
    )
    assert model.layers[0].qkv.dense.min_rows == 32
    steps = []  # rows of each step that dequantised, once per step (layer 0's qkv)
    real = ScratchInt4.weight_t

    def weight_t(self):
        if self is model.layers[0].qkv.dense:
            steps.append(True)
        return real(self)

    monkeypatch.setattr(ScratchInt4, "weight_t", weight_t)
    ids = prompts["story"][:40]
    hf = transformers_reference(model_dir, weights, "int4", "int8")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    for spans in ([(0, 33), (33, 40)], [(0, 40)]):
        runner = ModelRunner(model, EngineConfig(block_size=16, num_blocks=4, enable_prefix_caching=False))
        table = runner.pool.allocate(3)
        got, dequantised = [], []
        for a, b in spans:
            before = len(steps)
            got.append(runner.forward(runner.build_batch([BatchItem(ids[a:b], a, table, logits="all")])))
            dequantised.append(len(steps) - before)
        assert dequantised == ([1, 0] if len(spans) == 2 else [1]), (spans, dequantised)  # scratch from 32 rows only
        m = weight_check.compare(torch.cat(got), ref)
        assert m["mean"] <= MAX_MEAN * m["std"], (spans, m)
        assert m["top1"] >= MIN_TOP1, (spans, m)
