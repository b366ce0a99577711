"""The ``chatkv`` console script (``chatkv/cli.py``): it hands each subcommand to its face, and
loads a face's heavy dependencies only for the subcommand that needs them: ``chatkv --help`` and
a one-shot never import Textual or the server stack, ``chatkv serve`` never imports the app, and
a one-shot, which stores nothing, never imports the conversation store (SQLAlchemy: start-up time).

Each case runs in a fresh interpreter and reads that process's ``sys.modules`` after ``main``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]

# what the chat face must not load, and what the server face must not load
SERVER_STACK = ("starlette", "uvicorn", "prometheus_client", "ray", "chatkv.server")
APP_STACK = ("textual", "chatkv.tui.app")
STORE_STACK = ("sqlalchemy", "alembic", "chatkv.storage.models", "chatkv.storage.repository", "chatkv.sessions.manager")

_PROBE = """
import json, sys
from chatkv.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as e:
    status = e.code
roots = {"starlette", "uvicorn", "prometheus_client", "ray", "textual", "sqlalchemy", "alembic"}
loaded = sorted(m for m in list(sys.modules) if m.split(".")[0] in roots
                or m.startswith(("chatkv.server", "chatkv.tui", "chatkv.storage", "chatkv.sessions.manager")))
print("\\nPROBE " + json.dumps({"status": status, "loaded": loaded}), file=sys.stderr)
"""


def probe(*args: str, home) -> tuple[dict, subprocess.CompletedProcess]:
    env = dict(os.environ, CHATKV_HOME=str(home))
    p = subprocess.run(
        [sys.executable, "-c", _PROBE, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    line = [ln for ln in p.stderr.splitlines() if ln.startswith("PROBE ")]
    assert line, p.stderr
    return json.loads(line[-1][len("PROBE ") :]), p


def _under(loaded: list[str], stack: tuple[str, ...]) -> list[str]:
    return [m for m in loaded if any(m == s or m.startswith(s + ".") for s in stack)]


def test_the_console_script_is_chatkv_cli_main():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert conf["project"]["scripts"] == {"chatkv": "chatkv.cli:main"}
    script = Path(sys.executable).parent / "chatkv"  # as installed (pip install -e .)
    if script.exists():
        assert "from chatkv.cli import main" in script.read_text(), "reinstall: pip install --no-deps -e ."


def test_help_loads_neither_the_app_nor_the_server(tmp_path):
    out, p = probe("--help", home=tmp_path)
    assert out["status"] == 0
    assert (
        "--resume" in p.stdout and "chatkv serve" in p.stdout and "chatkv kb" in p.stdout
    )  # the chat's options, then the others
    assert _under(out["loaded"], SERVER_STACK + APP_STACK) == []


def test_a_one_shot_loads_neither_the_app_nor_the_server(model_dir, tmp_path):
    out, p = probe("--model", model_dir, "--max-tokens", "3", "What is the capital of France?", home=tmp_path)
    assert out["status"] == 0, p.stderr
    assert p.stdout.strip(), "a one-shot prints its reply"
    assert _under(out["loaded"], SERVER_STACK + APP_STACK) == []
    assert _under(out["loaded"], STORE_STACK) == []  # it stores nothing


def test_serve_help_is_the_servers_and_loads_no_app_and_no_ray(tmp_path):
    out, p = probe("serve", "--help", home=tmp_path)
    assert out["status"] == 0
    assert "--api-key" in p.stdout and "--ray" in p.stdout
    assert _under(out["loaded"], APP_STACK + ("ray", "chatkv.server.ray.deployments")) == []


def test_kb_goes_to_the_knowledge_base_face(tmp_path):
    out, p = probe("kb", "list", home=tmp_path)
    assert out["status"] == 0, p.stderr
    assert p.stdout == ""  # no knowledge base yet
    assert _under(out["loaded"], SERVER_STACK + APP_STACK) == []
    out, p = probe("kb", "info", "missing", home=tmp_path)  # a ChatKVError: one line and status 2, no traceback
    assert out["status"] == 2 and "Traceback" not in p.stderr and p.stderr.startswith("chatkv: ")


def test_the_chat_module_refuses_another_command_instead_of_answering_it(tmp_path):
    """``python -m chatkv.tui.cli serve`` would otherwise send "serve" to the model as a one-shot."""
    env = dict(os.environ, CHATKV_HOME=str(tmp_path))
    for command in ("serve", "ingest", "kb"):
        p = subprocess.run(
            [sys.executable, "-m", "chatkv.tui.cli", command],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        assert p.returncode == 2 and p.stdout == ""
        assert f"python -m chatkv.cli {command}" in p.stderr and "Traceback" not in p.stderr
