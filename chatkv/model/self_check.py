"""Quantised weight modes prove themselves on the CPU they run on.

The int4 and int8 modes, and the bf16 weights their prefill uses, run on kernels this project
did not write and that differ between CPUs: torch's int4/int8 packing, oneDNN's prepacked
matmuls, whatever ISA path each picks. So when a quantised mode loads, ``verify`` runs one
fixed prompt of 64 tokens (``PROMPT_TOKENS``: at least chatkv.model.prefill.SCRATCH_ROWS, the
rows from which int4 steps dequantise into the scratch buffer) through the mode's two paths:

- **decode**: one token a step, the few-row kernel (int4/int8 GEMV);
- **batched**: the whole prompt in one step, the many-row path (bf16 weights when
  ``quant_dense_rows`` allows it: dequantised into a scratch buffer, or the resident copy with
  ``quant_dense="copy"``; else the quantised kernel over many rows);

and compares their logits with a **reference**: the same quantised numbers dequantised to
float32 and computed with plain ``F.linear`` (no prepacking), a float32 residual, the same
attention. Quantisation error is therefore not measured, only what the kernels add to it.

The gate, per path, over the prompt's 64 positions:

- mean |logit difference| <= ``MAX_MEAN`` (0.05) times the reference logits' standard
  deviation, and
- top-1 agreement with the reference >= ``MIN_TOP1`` (80%).

Measured on the default model (AMD EPYC, torch 2.13, std 3.78): every quantised mode and path
is within 0.058-0.082 mean error (0.015-0.022 of the std; the gate is 0.19), and agrees on
top-1 at 90-98% of the positions: bfloat16 activations flip near-ties, so top-1 is the
looser gate. A kernel off by bfloat16 rounding passes; one that computes a wrong product is
off by the std's order.

The verdict is cached in ``<cache dir>/weight-checks.json`` keyed by the CPU (model name and
flags), the torch version and ISA, the model's fingerprint, and the mode, so a start-up
after the first pays nothing. The reference model is built only when a verdict is missing, and
streams: each projection's float32 weight is made from the model's files when the reference's
single batched step reaches it and dropped after, and its output matrix is computed in chunks of
rows, so the check adds about one layer's float32 weights to the loaded model's memory, whatever
the model's size.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from chatkv.storage.files import atomic_write, make_private_dir
from chatkv.storage.paths import cache_dir

log = logging.getLogger("chatkv.model.self_check")

MIN_TOP1 = 0.80
MAX_MEAN = 0.05
PROMPT = (
    "The lighthouse keeper climbed the spiral stairs each evening, counting the steps as his father had "
    "taught him, and lit the lamp before the fishing boats came home across the grey water of the bay. "
    "On the night of the storm he saw a light that did not belong to any boat he knew."
)
PROMPT_TOKENS = 64  # >= chatkv.model.prefill.SCRATCH_ROWS, or the batched path would not reach the scratch matmul
_PROJ = tuple(f"self_attn.{x}_proj.weight" for x in "qkvo") + tuple(
    f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")
)
_lock = threading.Lock()  # one check at a time, and one writer of the cache file per process


@dataclass
class Verdict:
    ok: bool
    reason: str  # the failed check, or what passed
    paths: dict  # path -> {"top1": .., "mean": .., "std": ..}
    seconds: float


def machine_key() -> str:
    """This CPU (model name and ISA flags), torch's version and the ISA torch dispatches to."""
    model = flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].strip()
    except OSError:
        model = platform.processor()
    cap = torch.backends.cpu.get_cpu_capability()
    return f"{model}|{hashlib.sha256(flags.encode()).hexdigest()[:12]}|torch {torch.__version__}|{cap}"


def cpu_model() -> str:
    return machine_key().split("|", 1)[0] or "unknown CPU"


def cache_file() -> Path:
    return cache_dir() / "weight-checks.json"


def _load_cache(f: Path) -> dict:
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _store(f: Path, key: str, verdict: Verdict) -> None:
    try:  # best effort: an unwritable cache only costs the next start another check
        make_private_dir(f.parent)
        data = _load_cache(f)
        data[key] = asdict(verdict)
        text = json.dumps(data, indent=1)
        atomic_write(f, lambda tmp: tmp.write_text(text), durable=False)
    except OSError as err:
        log.debug("weight check verdict not cached (%s)", err)


def mode_name(weights: str, head: str, dense_rows: int, dense: str = "scratch") -> str:
    """The verdict key's mode; the scratch path names its row threshold and version (a verdict
    on the earlier scratch code, from 16 rows, does not vouch for this one)."""
    from chatkv.model.prefill import SCRATCH_ROWS

    kind = f"scratch v2, int4 from {SCRATCH_ROWS} rows" if dense == "scratch" else dense
    return f"weights {weights}, head {head}, dense rows {dense_rows}" + (f" ({kind})" if dense_rows else "")


def reference_weight(name: str, t: torch.Tensor, how: str, q4: dict) -> torch.Tensor:
    """float32 of the numbers weight ``name`` is computed with in mode ``how`` (float, int4, int8)."""
    from chatkv.weights.quantised import GROUP, quantize_int4, quantize_int8

    if how == "int4" and t.shape[1] % GROUP == 0:
        return (q4[name] if name in q4 else quantize_int4(t)).dequantize()
    if how == "int8":
        return quantize_int8(t).dequantize()
    return t.float()


def group_modes(config, mode: str, q4: dict) -> dict[str, str]:
    """Each projection's mode as chatkv.model.forward stores it (``projection_mode`` of its fused group)."""
    from chatkv.model.forward import PROJECTION_GROUPS, projection_mode

    out = {}
    for i in range(config.num_hidden_layers):
        for group in PROJECTION_GROUPS:
            names = [f"layers.{i}.{g}.weight" for g in group]
            for n in names:
                out[n] = projection_mode(names, mode, q4)
    return out


class _ReferenceWeights(dict):
    """The reference's weights by name, each read from the model's files when asked for and not
    kept: a projection as the float32 of the numbers its mode computes with (``reference_weight``),
    anything else in its stored dtype. A dict subclass only for ``in`` and the names."""

    def __init__(self, weights, q4: dict, modes: dict[str, str]):
        super().__init__(dict.fromkeys(weights))
        self.weights, self.q4, self.modes = weights, q4, modes

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self:
            raise KeyError(name)
        how = self.modes.get(name, "float")
        if name.endswith(_PROJ):
            if how == "int4" and name in self.q4:
                return self.q4[name].dequantize()  # the file's own 4-bit numbers, not the float weight
            return reference_weight(name, self.weights.read(name), how, self.q4)
        return self.weights.read(name)


class ChunkedHead:
    """The reference's output matrix: float32 rows made ``CHUNK`` at a time from ``rows(a, b)`` and
    dropped after their logits (a vocabulary of 128k x 4096 is 2 GiB in float32)."""

    CHUNK = 8192

    def __init__(self, rows, vocab: int):
        self.rows, self.vocab, self.bias, self.out_features = rows, vocab, None, vocab

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(x.shape[0], self.vocab, dtype=torch.float32)
        for a in range(0, self.vocab, self.CHUNK):
            b = min(a + self.CHUNK, self.vocab)
            out[:, a:b] = x.float() @ self.rows(a, b).t()
        return out


def reference_model(config, weights, q4: dict, mode: str, head: str, embed: torch.Tensor | None = None):
    """The float32 model computing exactly the numbers ``mode``/``head`` store, with plain F.linear,
    holding one projection's float32 weight at a time: each is made from the model's files when the
    single batched step computes it (chatkv.model.forward.LazyLinear) and dropped after, and the
    output matrix is computed in chunks of rows. ``weights``: chatkv.weights.loading.read_weights of
    the model; ``embed``: the checked model's own embedding matrix (the same numbers, not read again)."""
    from chatkv.model.gemma3 import model_class
    from chatkv.weights.quantised import quantize_int4, quantize_int8

    modes = group_modes(config, mode, q4)
    cls = model_class(config)  # the forward of the config's model_type (LlamaModel, Gemma3Model)
    model = cls(config, _ReferenceWeights(weights, q4, modes), torch.float32, pack=False, lazy=True)
    tied = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in weights
    model.embed = embed if embed is not None else weights.read("embed_tokens.weight")  # its own dtype

    def rows(a: int, b: int) -> torch.Tensor:
        # an untied output matrix is read a chunk of rows at a time too (decoded alone where quantised)
        part = model.embed[a:b] if tied else weights.read("lm_head.weight", rows=(a, b))
        if head == "int8":
            return quantize_int8(part).dequantize()  # per row: a chunk's rows are quantised as the whole's
        if head == "int4" and part.shape[1] % 32 == 0:
            return quantize_int4(part).dequantize()  # per group of 32 within a row: the same
        return part.float()

    model.lm_head = ChunkedHead(rows, config.vocab_size if not tied else model.embed.shape[0])
    return model


def prompt_ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    while len(ids) < PROMPT_TOKENS:  # a tokenizer with long tokens: repeat the text
        ids = ids + ids
    return ids[:PROMPT_TOKENS]


def path_logits(model, ids: list[int], batched: bool) -> torch.Tensor:
    """Logits after every token of ``ids``: one step for all (batched) or one token a step."""
    from chatkv.config import EngineConfig
    from chatkv.engine.model_runner import BatchItem, ModelRunner

    blocks = -(-len(ids) // 16)
    runner = ModelRunner(model, EngineConfig(block_size=16, num_blocks=blocks + 1, enable_prefix_caching=False))
    table = runner.pool.allocate(blocks)
    spans = [(0, len(ids))] if batched else [(i, i + 1) for i in range(len(ids))]
    return torch.cat(
        [runner.forward(runner.build_batch([BatchItem(ids[a:b], a, table, logits="all")])) for a, b in spans]
    )


def compare(got: torch.Tensor, ref: torch.Tensor) -> dict:
    finite = bool(torch.isfinite(got).all())
    top1 = float((got.argmax(-1) == ref.argmax(-1)).float().mean()) if finite else 0.0
    std = float(ref.std(-1).mean())
    mean = float((got - ref).abs().mean()) if finite else float("inf")
    return {"top1": round(top1, 4), "mean": round(mean, 4), "std": round(std, 4)}


def run_check(model, reference, ids: list[int]) -> Verdict:
    t0 = time.perf_counter()
    ref = path_logits(reference, ids, batched=True)
    paths = {p: compare(path_logits(model, ids, batched=p == "batched"), ref) for p in ("decode", "batched")}
    failed = [
        f"{p} path: top-1 agreement {m['top1']:.0%} (gate {MIN_TOP1:.0%}), mean |logit error| "
        f"{m['mean']:.3g} (gate {MAX_MEAN * m['std']:.3g})"
        for p, m in paths.items()
        if m["top1"] < MIN_TOP1 or not m["mean"] <= MAX_MEAN * m["std"]
    ]
    reason = (
        "; ".join(failed)
        if failed
        else "passed: " + ", ".join(f"{p} top-1 {m['top1']:.0%}, mean error {m['mean']:.3g}" for p, m in paths.items())
    )
    return Verdict(not failed, reason, paths, round(time.perf_counter() - t0, 2))


FALLBACK = {"int4": "int8", "int8": "float"}  # the next mode to try when one fails its check


def load_checked(model_dir: Path, choice, config, tokenizer, base_fingerprint: str, explicit: bool):
    """Load the model for ``choice`` (chatkv.model.modes.WeightChoice); a quantised mode must
    pass ``verify`` first. A mode that fails falls back int4 -> int8 -> bf16 (a quantised head
    to float with it) with one warning naming the failed check; asked for by name
    (``explicit``), it raises WeightCheckFailed with that message instead. Returns
    ``(model, choice)``, the choice that runs."""
    from chatkv.errors import WeightCheckFailed
    from chatkv.model.gemma3 import model_class
    from chatkv.model.modes import WeightChoice
    from chatkv.weights.loading import load_config

    cls = model_class(load_config(model_dir))  # the forward of its model_type: LlamaModel, Gemma3Model
    while True:
        model = cls.from_pretrained(
            model_dir,
            dtype=choice.dtype,
            device=config.device,
            weights_mode=choice.weights,
            head_mode=choice.head,
            dense_rows=config.quant_dense_rows,
            dense=config.quant_dense,
            deterministic=config.deterministic,
        )
        if choice.weights == "float" and choice.head == "float":
            return model, choice
        verdict = verify(
            model,
            model_dir,
            choice.fingerprint(base_fingerprint),
            tokenizer,
            config.quant_dense_rows,
            config.quant_dense,
        )
        if verdict.ok:
            if getattr(model, "int8_groups", 0):
                choice = WeightChoice(
                    choice.dtype,
                    choice.weights,
                    choice.head,
                    f"{choice.label}; {model.int8_groups} projection groups holding the GGUF's wider "
                    "tensors (Q5/Q6/Q8) in int8",
                )
            return model, choice
        what = (
            f"weights {choice.weights} (output matrix {choice.head}) failed their check on this CPU "
            f"({cpu_model()}): {verdict.reason}"
        )
        if explicit:
            raise WeightCheckFailed(f"{what}. Use --weights bf16 (or int8) on this machine.")
        weights = FALLBACK.get(choice.weights, "float")
        nxt = "bf16" if weights == "float" else weights
        log.warning("%s; falling back to %s", what, nxt)
        del model
        choice = WeightChoice(
            choice.dtype, weights, "float", f"{nxt} (fallback: {choice.weights} failed its check here)"
        )


def verify(model, model_dir: Path, fingerprint: str, tokenizer, dense_rows: int, dense: str = "scratch") -> Verdict:
    """The cached or fresh verdict on ``model`` (a quantised LlamaModel) on this machine."""
    from chatkv.weights.gptq_awq import read_int4
    from chatkv.weights.loading import load_config, read_weights, release_freed_memory

    key = f"{machine_key()}|{fingerprint}|{mode_name(model.weights_mode, model.head_mode, dense_rows, dense)}"
    if getattr(model, "fused_decode", False):  # its decode path is the fused C ops: a verdict per their source
        from chatkv.kernels import cpu_decode

        key += f"|fused decode {cpu_decode.digest()}{' amx' if cpu_decode.amx() else ''}"  # tiles: other sums
    f = cache_file()
    with _lock:
        hit = _load_cache(f).get(key)
        if isinstance(hit, dict) and isinstance(hit.get("ok"), bool):
            return Verdict(hit["ok"], str(hit.get("reason", "")), dict(hit.get("paths") or {}), 0.0)
        q4 = read_int4(model_dir) if model.weights_mode == "int4" else {}
        reference = reference_model(
            load_config(model_dir),
            read_weights(model_dir),
            q4 or {},
            model.weights_mode,
            model.head_mode,
            model.embed,
        )
        verdict = run_check(model, reference, prompt_ids(tokenizer))
        del reference
        release_freed_memory()  # the reference's float32 weights, made and freed one at a time
        log.info(
            "weight check (%s) on %s: %s in %.1f s",
            mode_name(model.weights_mode, model.head_mode, dense_rows, dense),
            cpu_model(),
            verdict.reason,
            verdict.seconds,
        )
        _store(f, key, verdict)
        return verdict
