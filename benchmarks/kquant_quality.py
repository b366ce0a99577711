"""What a Q4_K_M file's wider tensors cost in the int4 mode: int4 groups or int8 per channel.

A Q4_K_M GGUF keeps most projections in Q4_K (computed exactly by the int4 mode) and some in
Q6_K (attn_v and ffn_down of some layers), Q5_0/Q5_1 (llama-quantize's fallback for rows that
are not whole 256-blocks) or Q8_0; its output matrix is Q6_K. These cannot be int4 groups
exactly. This measures, on one GGUF, against its exact float32 dequantisation (and against
llama.cpp's own logits on the same file when ``llama_cpp`` imports):

  exact        the file's weights dequantised, float32 compute
  wide->int4   every non-Q4 projection requantised to int4 groups of 32 (what the int4 mode does on load)
  wide->int8   every non-Q4 projection requantised to int8, one scale per output channel
  fused->int8  as wide->int8, for every fused projection (qkv, gate+up) holding a non-Q4 one: all
               its parts int8 (what a loader that fuses q, k and v into one matmul would compute)
  head int8    the output matrix int8 per channel (what ``head_weights=auto`` picks with int4)
  engine       the int4 mode as shipped (bf16 activations, int4 kernel, int8 head)

Figures: over ``tests/llama_cpp_reference.PROMPTS`` the max |logit difference| of the last
token (mean and worst over prompts, the llama.cpp gate's measure), teacher-forced top-1
agreement with ``exact`` and perplexity over the first ``--tokens`` tokens of the fixed text.

    .venv/bin/python benchmarks/kquant_quality.py model-Q4_K_M.gguf [--tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chatkv.config import EngineConfig  # noqa: E402
from chatkv.engine.model_runner import BatchItem, ModelRunner  # noqa: E402
from chatkv.model.forward import Linear, LlamaModel  # noqa: E402
from chatkv.weights import convert_gguf, load_tokenizer  # noqa: E402
from chatkv.weights.gguf import _hf_name, read_q4  # noqa: E402
from chatkv.weights.loading import load_config, read_weights  # noqa: E402
from chatkv.weights.quantised import quantize_int4, quantize_int8  # noqa: E402


def cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


def logits_all(model: LlamaModel, ids: list[int], chunk: int = 512) -> torch.Tensor:
    runner = ModelRunner(model, EngineConfig(block_size=16, num_blocks=-(-len(ids) // 16) + 1))
    table = runner.pool.allocate(-(-len(ids) // 16))
    return torch.cat(
        [
            runner.forward(runner.build_batch([BatchItem(ids[s : s + chunk], s, table, logits="all")]))
            for s in range(0, len(ids), chunk)
        ]
    ).float()


def main() -> None:
    from gguf import GGUFReader

    from tests.support.llama_cpp_reference import PROMPTS, ppl_text, prompt_ids

    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--variants", default="", help="comma-separated subset (exact always runs)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    types = {_hf_name(t.name).removeprefix("model."): t.tensor_type.name for t in GGUFReader(args.gguf).tensors}
    with tempfile.TemporaryDirectory() as tmp:
        exact_dir = convert_gguf(Path(args.gguf), Path(tmp) / "f32", dtype=torch.float32, progress=False)
        bf16_dir = convert_gguf(Path(args.gguf), Path(tmp) / "bf16", dtype=torch.bfloat16, progress=False)
        tok = load_tokenizer(exact_dir)
        prompts = prompt_ids(tok)
        text = tok(ppl_text())["input_ids"][: args.tokens]
        config, exact_w = load_config(exact_dir), read_weights(exact_dir)
        q4 = read_q4(bf16_dir)
        wide = sorted(
            n
            for n, k in types.items()
            if n.startswith("layers.") and exact_w[n].dim() == 2 and k not in ("Q4_0", "Q4_1", "Q4_K")
        )
        head = "lm_head.weight" if "lm_head.weight" in exact_w else "embed_tokens.weight"

        def swapped(names, how):
            w = dict(exact_w)
            for n in names:
                w[n] = (quantize_int4(w[n]) if how == "int4" else quantize_int8(w[n])).dequantize()
            return w

        def head_int8(model):  # only the output use of a tied matrix is quantised
            model.lm_head = Linear(quantize_int8(exact_w[head]).dequantize(), pack=False)
            return model

        fused = set(wide)
        for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            for i in range(config.num_hidden_layers):
                names = [f"layers.{i}.{g}.weight" for g in group]
                if fused & set(names):
                    fused |= set(names)
        variants = {
            "exact": lambda: LlamaModel(config, exact_w, torch.float32),
            "wide->int4": lambda: LlamaModel(config, swapped(wide, "int4"), torch.float32),
            "wide->int8": lambda: LlamaModel(config, swapped(wide, "int8"), torch.float32),
            "fused->int8": lambda: LlamaModel(config, swapped(sorted(fused), "int8"), torch.float32),
            "head int8": lambda: head_int8(LlamaModel(config, exact_w, torch.float32)),
            "engine int4": lambda: LlamaModel.from_pretrained(
                bf16_dir, dtype=torch.bfloat16, weights_mode="int4", head_mode="int8"
            ),
            "engine int8": lambda: LlamaModel.from_pretrained(
                bf16_dir, dtype=torch.bfloat16, weights_mode="int8", head_mode="int8"
            ),
        }
        llama = None
        try:
            from common import prepare_llama_cpp

            llama_cpp = prepare_llama_cpp()
            if llama_cpp is None:
                raise ImportError("llama_cpp")
            llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=512, n_threads=2, logits_all=True, verbose=False)
            llama = []
            for ids in prompts:
                llm.reset()
                llm.eval(ids)
                llama.append(torch.tensor(llm.scores[len(ids) - 1], dtype=torch.float32))
            del llm
        except ImportError:
            pass
        rows, ref_last, ref_text = {}, None, None
        keep = {"exact", *filter(None, args.variants.split(","))}
        for name, make in variants.items():
            if args.variants and name not in keep:
                continue
            model = make()
            last = [logits_all(model, ids)[-1] for ids in prompts]
            full = logits_all(model, text)
            if name == "exact":
                ref_last, ref_text = last, full
            d = [(a - b).abs().max().item() for a, b in zip(last, ref_last)]
            logp = torch.log_softmax(full[:-1], -1).gather(1, torch.tensor(text[1:])[:, None])
            row = {
                "vs exact mean": round(sum(d) / len(d), 4),
                "vs exact max": round(max(d), 4),
                "top1 vs exact": round((full.argmax(-1) == ref_text.argmax(-1)).float().mean().item(), 4),
                "ppl": round(math.exp(-logp.mean().item()), 4),
            }
            if llama is not None:
                dl = [(a - b).abs().max().item() for a, b in zip(last, llama)]
                row["vs llama.cpp mean"], row["vs llama.cpp max"] = round(sum(dl) / len(dl), 4), round(max(dl), 4)
                row["top1 = llama.cpp"] = sum(int(a.argmax() == b.argmax()) for a, b in zip(last, llama))
            rows[name] = row
            print(name, json.dumps(row), flush=True)
            del model
    counts: dict[str, int] = {}
    for n, k in types.items():
        counts[k] = counts.get(k, 0) + 1
    print(
        json.dumps(
            {
                "gguf": Path(args.gguf).name,
                "cpu": cpu(),
                "torch": torch.__version__,
                "types": counts,
                "wide projections": len(wide),
                "in the 4-bit file": len(q4),
                "prompts": len(PROMPTS),
                "ppl tokens": len(text),
            }
        )
    )


if __name__ == "__main__":
    main()
