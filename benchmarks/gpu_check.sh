#!/usr/bin/env bash
# The GPU check of the Triton kernels and quantised KV dtypes, in one go (budget: under 5 minutes on an H100-class machine).
# NOT YET RUN ON A GPU: written and checked by reading only; the first run may need fixes.
#
#   benchmarks/gpu_check.sh            # from anywhere; PYTHON=/path/to/python to pick the interpreter
#
# Needs a CUDA build of torch (the project pins the CPU wheel: on a GPU machine install e.g.
# `pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128`), triton, and
# the test extras (pytest, transformers: pip install -e '.[test]').
#
# 1. tests/support/triton_kernel_cases.py natively (TRITON_INTERPRET unset): every kernel against the torch
#    reference for every kv dtype (fp32, fp16, int8 and fp8_e4m3 quantised KV under fp32 and fp16
#    queries; store_kv bit-exact, the fp8/int8 codecs against torch's casts), and chatkv's forward on
#    CUDA with the Triton kernels against transformers. On a fresh machine most of its time is Triton
#    compiling ~100 kernel variants (no cache yet); a second run takes seconds.
# 2. the engine equivalence tests, tests/model/test_model_equivalence.py. They take no device: they build
#    their LlamaModel on the CPU (from_pretrained without device=, EngineConfig's default "cpu"), so
#    here they check the CPU path only. The CUDA engine equivalence is covered by step 1's
#    test_model_forward_with_triton_matches_transformers / test_model_sliding_window_with_triton_matches_transformers.
# 3. benchmarks/bench_triton_decode.py: paged decode attention, Triton vs torch (gather + SDPA) vs
#    SDPA over pre-gathered KV, 1-64 sequences x 1k-32k tokens, for bf16, int8 and fp8_e4m3 KV, GB/s by
#    the bytes each reads (quantised rows: head_dim + 4 bytes) against a measured copy and the spec.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
unset TRITON_INTERPRET CHATKV_ATTENTION
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$PY" - <<'PY' || exit 2
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device (a CPU build of torch?)")
import triton
p = torch.cuda.get_device_properties(0)
print(f"gpu_check: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, triton {triton.__version__}")
PY

status=0
step() {  # step NAME SECONDS CMD...: run with a time limit, remember a failure, keep going
    local name="$1" limit="$2"; shift 2
    echo "== $name (limit ${limit}s)"
    local t0=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0))s"
    [ $rc -eq 0 ] || status=1
}

# limits add up to 290 s (the budget is 5 minutes); expected well under: ~17 s for step 2 on 2 CPU cores
step "kernel tests, native" 140 "$PY" -m pytest -q -x tests/support/triton_kernel_cases.py
step "engine equivalence (CPU path: these tests take no device)" 60 "$PY" -m pytest -q tests/model/test_model_equivalence.py
step "decode attention benchmark" 90 "$PY" benchmarks/bench_triton_decode.py
echo "gpu_check: $([ $status -eq 0 ] && echo all steps passed || echo SOME STEPS FAILED)"
exit $status
