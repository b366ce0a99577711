"""Write the fixtures tests/weights/test_gguf_quant_types.py reads: the tiny K-quant llama of
tests/support/kquant_fixtures.py (``write_f16``: same seeded weights, every width a multiple of 256)
quantised by llama.cpp's own ``llama-quantize`` to each further type people download, and llama.cpp's
logits on each file.

    TREE=/path/to/llama.cpp    # built: build/bin/llama-quantize and build/bin/libllama.so
    .venv/bin/python -m tests.support.quant_type_fixtures $TREE

(the llama.cpp tree inside llama-cpp-python 0.3.36's sdist; gcc compiles tests/support/llama_logits.c
against it for the logits, as tests/support/arch_fixtures.py does.)

Written to tests/data/:

- ``tiny-{type}.gguf`` for each of ``TYPES`` (none needs an importance matrix: llama-quantize asks
  for one only for the 1- and 2-bit IQ types and Q2_K_S);
- ``tiny-quant-types-llama-cpp.safetensors`` (safetensors, never pickle): for each file and each of
  kquant_fixtures.prompts() the next-token logits llama.cpp computes after every token
  (``{type}.{i}.logits`` [T, vocab]), through its C API without repacked weight buffers.

Rerunning it writes the same bytes (seeded weights; llama-quantize is deterministic).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.arch_fixtures import _tree_version, logits_of_files
from tests.support.kquant_fixtures import DATA, prompts, tensor_types, write_f16

TYPES = ("Q4_0", "Q4_1", "Q4_K_S", "Q5_K_S", "Q8_0", "IQ4_NL", "IQ4_XS")
REFERENCE = DATA / "tiny-quant-types-llama-cpp.safetensors"


def fixture(kind: str) -> Path:
    return DATA / f"tiny-{kind}.gguf"


def llama_cpp_logits(tree: Path) -> dict:
    """llama.cpp's logits on each of ``TYPES``' fixtures for each prompt (tests/support/llama_logits.c)."""
    return logits_of_files(tree, {kind: fixture(kind) for kind in TYPES}, prompts())


def main(tree: Path) -> None:
    quantize = tree / "build" / "bin" / "llama-quantize"
    DATA.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        f16 = Path(tmp) / "tiny-F16.gguf"
        write_f16(f16)
        for kind in TYPES:
            subprocess.run(
                [str(quantize), str(f16), str(fixture(kind)), kind, "1"],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            types = sorted(set(tensor_types(fixture(kind)).values()))
            print(kind, fixture(kind).stat().st_size, json.dumps(types))
    from safetensors.torch import save_file

    save_file(llama_cpp_logits(tree), str(REFERENCE), metadata={"llama_cpp": _tree_version(tree)})
    print("wrote", REFERENCE, REFERENCE.stat().st_size)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
