"""The fork servers of the tests that kill or race child processes, both ends of their line
protocol (multiprocess_child.py, session_kill_child.py and kv_store_kill_child.py serve it;
test_multiprocess, test_session_durability and test_kv_store drive it).

A child script imports what its workers need once (torch, transformers, chatkv), runs no torch
op, and then serves; each worker is a fork of it, so a trial costs no imports:

    (prints)   ready
    go ARG   -> forks a worker running ``work(ARG)``; prints its pid
    reap PID -> waits for that worker; prints "reaped <wait status>"
    quit

This module imports nothing but the standard library at its top: a child script imports it as
``fork_server`` (run as a script, tests/support/ is its sys.path[0]), the tests as ``tests.support.fork_server``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Callable


def warm_up(model_dir: str) -> None:
    """Import everything an engine worker on ``model_dir`` needs (transformers imports lazily,
    ~1.5 s), running no torch op: the tokenizer, the config and a store opened once."""
    import tempfile
    from pathlib import Path

    import chatkv.engine.core  # noqa: F401
    import chatkv.sessions.manager  # noqa: F401
    from chatkv.storage.repository import Store
    from chatkv.weights import load_config, load_tokenizer

    load_config(model_dir)
    load_tokenizer(model_dir)
    with tempfile.TemporaryDirectory() as d:
        Store.open(None, Path(d)).close()


def log_to(log: str) -> None:
    """In a worker: its stdout to ``log`` and its stderr to ``log.err`` (appended; os-level, so
    a line written with one ``write()`` is never split by a kill)."""
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    err = os.open(log + ".err", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    sys.stdout = os.fdopen(1, "w")
    sys.stderr = os.fdopen(2, "w")


def serve(work: Callable[[str], None], interpreter_exit: bool = False) -> None:
    """Serve the protocol on stdin/stdout. A worker ends with ``os._exit(1)`` whatever
    ``work`` does (its events are what it wrote before). With ``interpreter_exit``, a worker
    whose ``work`` raises SystemExit returns from serve() instead: the script's main returns and
    the interpreter exits as an ordinary one does, atexit handlers and all."""
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "go":
            pid = os.fork()
            if pid == 0:
                leaving = False
                try:
                    work(arg)
                except SystemExit:
                    if not interpreter_exit:
                        raise
                    leaving = True
                finally:
                    if not leaving:
                        os._exit(1)
                return
            print(pid, flush=True)
        elif cmd == "reap":
            _, status = os.waitpid(int(arg), 0)
            print(f"reaped {status}", flush=True)
        elif cmd == "quit":
            break


class ForkServer:
    """The test's end: starts ``script`` (with ``args``) and waits for its "ready"."""

    def __init__(self, script, *args: str, env: dict | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, str(script), *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        if self.proc.stdout.readline().strip() != "ready":
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the fork server {script} did not start")

    def _ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def go(self, arg: str) -> int:
        """Fork a worker with ``arg``; its pid."""
        return int(self._ask(f"go {arg}"))

    def reap(self, pid: int) -> int:
        """Wait for worker ``pid``; its wait status (os.WIFSIGNALED and the like read it)."""
        reply = self._ask(f"reap {pid}")
        assert reply.startswith("reaped "), reply
        return int(reply.split()[1])

    def close(self, timeout: float) -> None:
        """Ask it to quit; kill it if it has not within ``timeout`` seconds."""
        from tests.support.processes import quit_child  # torch: the test's end only

        quit_child(self.proc, timeout)
