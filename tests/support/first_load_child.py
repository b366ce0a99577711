"""Load a model as ``chatkv --model FILE`` does, in a process of its own, and print its peak RSS.

    python -m tests.support.first_load_child MODEL.gguf DATA_DIR

The caller sets CHATKV_HOME and CHATKV_CACHE_DIR: with empty ones the load is a first load (the
file prepared, the weight self-check run); run again with the same ones it is a warm load.
transformers and the modules its llama config imports are loaded before the load either way, so
that both measure the model's memory and not which libraries each path happens to import. Prints
one JSON line: ``peak`` (bytes, the process's maximum resident set), ``weights`` (the mode that
runs), ``generated`` (token ids of a short greedy answer: the model works).
"""

from __future__ import annotations

import json
import resource
import sys

from transformers import AutoConfig, AutoTokenizer  # noqa: F401 - the same libraries in both loads (docstring)

# a first load asks transformers for the config (which imports its llama modules, and through them
# sympy and torch.distributed); a warm one reads what it answered then (chatkv.weights.load_cache)
AutoConfig.for_model("llama")


def main(model: str, data_dir: str) -> None:
    from chatkv.engine.core import Engine
    from chatkv.engine.sampling import SamplingParams

    engine = Engine.from_pretrained(model, progress=False, data_dir=data_dir, num_blocks=8)
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak": peak, "weights": engine.weights.weights, "generated": list(out[0].token_ids)}))
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
