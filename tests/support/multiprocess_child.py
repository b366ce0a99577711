"""Helper of tests/sessions/test_multiprocess.py: processes that share one store and one conversation.

Run as a script (``multiprocess_child.py MODEL_DIR``) it is a small fork server, so torch,
transformers and chatkv are imported once, not once per worker (nothing runs a torch op
before forking, and torch uses one thread, so the forked workers start clean). It speaks
lines on stdin/stdout:

    (prints)   ready
    go {json} -> forks a worker with these settings; prints its pid
    reap PID  -> waits for that worker; prints "reaped <wait status>"
    quit

A worker opens an Engine on ``data`` (``db_url``: the database, None for SQLite in
``data``), resumes conversation ``conv``, and writes one JSON line per event to ``log``
(one ``write()`` each, so a kill never splits a line), stderr to ``log.err``:

    {"ev": "ready", "pid": p}
    {"ev": "sent", "q": text, "id": reply message id, "text": reply}   send returned
    {"ev": "busy", "q": text, "error": message}                         ConversationBusy: will retry
    {"ev": "generating", "q": text}    (hold, exit) the reply has begun streaming
    {"ev": "done"}                     engine closed

Modes:
- ``race``: waits until the file ``go`` exists, then sends ``n`` messages "<question> [<tag>.<i>]",
  retrying each on ConversationBusy until it is stored;
- ``hold``: streams one message and stops after its first piece ("generating") until the file
  ``release`` exists (or it is killed), then finishes the reply;
- ``exit``: streams one message, and after its first piece leaves the interpreter
  (``sys.exit``) without closing the stream, the session or the engine.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback

import torch

PARAMS = dict(max_tokens=4, temperature=0.0)
HOLD_PARAMS = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
NUM_BLOCKS = 256
QUESTIONS = [
    "Hello, how are you today?",
    "What is the capital of France?",
    "The quick brown fox jumps over the lazy dog.",
    "Key-value caches keep attention state.",
]
_SERVER_PID = os.getpid()
_KEEP: list = []
_DEADLINE_S = 120.0  # a worker nobody stopped (the test was interrupted) ends by itself


def _emit(**event) -> None:
    event["t"] = time.monotonic()
    os.write(1, (json.dumps(event) + "\n").encode())


def _wait_file(path: str, started: float) -> None:
    while not os.path.exists(path):
        if os.getppid() != _SERVER_PID or time.monotonic() - started > _DEADLINE_S:
            os._exit(5)
        time.sleep(0.005)


def open_engine(model_dir: str, data: str, db_url: str | None):
    from chatkv.config import EngineConfig
    from chatkv.engine.core import Engine

    return Engine(model_dir, EngineConfig(data_dir=data, db_url=db_url, num_blocks=NUM_BLOCKS))


def _worker(a: dict) -> None:
    from chatkv.engine.sampling import SamplingParams
    from chatkv.errors import ConversationBusy

    started = time.monotonic()
    engine = open_engine(a["model_dir"], a["data"], a.get("db_url"))
    s = engine.resume(a["conv"])
    _emit(ev="ready", pid=os.getpid())
    if a["mode"] == "race":
        _wait_file(a["go"], started)
        rng = random.Random(a["tag"])
        for i in range(a["n"]):
            q = f"{QUESTIONS[i % len(QUESTIONS)]} [{a['tag']}.{i}]"
            while True:
                try:
                    r = s.send(q, SamplingParams(**PARAMS))
                except ConversationBusy as e:
                    _emit(ev="busy", q=q, error=str(e))
                    time.sleep(rng.uniform(0, 0.02))  # not a correctness wait: only fewer futile tries
                    continue
                _emit(ev="sent", q=q, id=r.message_id, text=r.text)
                break
    else:
        q = f"{QUESTIONS[1]} [{a['tag']}]"
        stream = s.stream(q, SamplingParams(**HOLD_PARAMS))
        first = next(stream)
        assert isinstance(first, str), f"the reply ended before its first piece: {first!r}"
        _emit(ev="generating", q=q)
        if a["mode"] == "exit":
            _KEEP.append(stream)  # not finalised before the atexit handlers run
            sys.exit(0)  # stream, session and engine left open: interpreter exit must release the lease
        _wait_file(a["release"], started)
        reply = [p for p in stream][-1]
        _emit(ev="sent", q=q, id=reply.message_id, text=reply.text)
    engine.close()
    _emit(ev="done")


def _run_worker(a: dict) -> None:
    from fork_server import log_to

    log_to(a["log"])
    try:
        _worker(a)
    except SystemExit:
        raise  # mode "exit": a normal interpreter exit, atexit handlers run
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)
    os._exit(0)


def _warm_up(model_dir: str) -> None:
    """Import everything a worker needs, running no torch op."""
    from fork_server import warm_up

    try:
        import psycopg  # noqa: F401  (the PostgreSQL workers' driver)
    except ImportError:
        pass  # their tests fail, saying why (tests/support/pg.py)
    warm_up(model_dir)


def main() -> None:
    torch.set_num_threads(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _warm_up(sys.argv[1])
    from fork_server import serve  # tests/support/fork_server.py (tests/support/ is this script's sys.path[0])

    # a worker ends in os._exit, but in mode "exit": an ordinary interpreter exit, atexit handlers run
    serve(lambda arg: _run_worker(json.loads(arg)), interpreter_exit=True)


if __name__ == "__main__":
    main()
