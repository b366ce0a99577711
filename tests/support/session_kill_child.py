"""Helper for the kill -9 test of session spills (tests/sessions/test_session_durability.py).

Run as a script (``session_kill_child.py MODEL_DIR``) it is a small fork server, so that torch, transformers and
chatkv are imported once and not once per trial. Nothing runs a torch op before
forking (and torch uses one thread), so the forked workers start clean. It
speaks lines on stdin/stdout:

    (prints)   ready
    go MODE MODEL_DIR DATA_DIR NUM_BLOCKS CONV_ID|new LOG TAG
            -> forks a worker; prints its pid
    reap PID -> waits for that (killed) worker; prints "reaped <wait status>"
    quit

A worker opens an Engine on DATA_DIR and resumes CONV_ID (or starts a new
conversation). MODE "loop": then it forever sends a turn and spills the
session. MODE "midreply": it sends one turn, then starts a second and stops
generating after two engine steps (the user message is committed, the reply is
not), printing "generating", and waits to be killed. MODE "behind": it sends turns
forever and never spills; only write-behind puts the KV on disk. Its stdout is
LOG (stderr LOG.err); it prints one JSON line per event, each with a single
write() after the event happened (or before it starts), with "t" its time.monotonic():

    {"ev": "ready", "conv": id, "messages": n}      engine open, session resumed
    {"ev": "turn", "n": i, "q": text}               about to send
    {"ev": "committed", "messages": n, "id": message id, "text": reply}
                                                    send returned: the reply is in the DB
    {"ev": "spill", "tokens": t}                    about to spill
    {"ev": "spilled", "tokens": t, "wrote": bool}   spill returned
    {"ev": "generating", "q": text}                 (midreply) stuck in the middle of a reply

The parent SIGKILLs the worker at a random moment and checks what is left.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

PARAMS = dict(max_tokens=4, temperature=0.0)
QUESTIONS = [
    "Hello, how are you today?",
    "What is the capital of France?",
    "The quick brown fox jumps over the lazy dog.",
    "Key-value caches keep attention state.",
]
MAX_HISTORY = 2000  # tokens; past this the worker only re-spills (keep NUM_BLOCKS * 16 above it)


_SERVER_PID = os.getpid()
_DEADLINE_S = 120.0  # a worker nobody killed (the test was interrupted) ends by itself


def _orphaned(started: float) -> bool:
    return os.getppid() != _SERVER_PID or time.monotonic() - started > _DEADLINE_S


def _emit(**event) -> None:
    event["t"] = time.monotonic()
    os.write(1, (json.dumps(event) + "\n").encode())  # one write: a kill never splits it


def _worker(mode: str, model_dir: str, data_dir: str, num_blocks: int, conv: str, tag: str) -> None:
    from chatkv.config import EngineConfig
    from chatkv.engine.core import Engine

    started = time.monotonic()
    engine = Engine(model_dir, EngineConfig(data_dir=data_dir, num_blocks=num_blocks))
    s = engine.session(params=PARAMS) if conv == "new" else engine.resume(conv)
    count = len(s.messages())
    _emit(ev="ready", conv=s.id, messages=count)
    if mode == "midreply":
        r = s.send(QUESTIONS[0])
        _emit(ev="committed", messages=count + 2, id=r.message_id, text=r.text)
        step, steps = engine.run_batch, []  # each round's step, whichever thread runs the engine loop

        def stuck_step():
            steps.append(1)
            if len(steps) > 2:
                _emit(ev="generating", q=QUESTIONS[1])
                while not _orphaned(started):
                    time.sleep(0.1)
                os._exit(5)
            return step()

        engine.run_batch = stuck_step
        s.send(QUESTIONS[1], engine_params(max_tokens=16, ignore_eos=True))
        raise AssertionError("the reply should never have finished")
    i = 0
    while not _orphaned(started) and mode == "behind":
        if len(s.tokens) >= MAX_HISTORY:
            time.sleep(0.01)
            continue
        q = f"{QUESTIONS[i % len(QUESTIONS)]} ({tag}.{i})"
        _emit(ev="turn", n=i, q=q)
        r = s.send(q)
        count += 2
        _emit(ev="committed", messages=count, id=r.message_id, text=r.text, tokens=len(s.tokens))
        i += 1
    while not _orphaned(started):
        if len(s.tokens) < MAX_HISTORY:
            q = f"{QUESTIONS[i % len(QUESTIONS)]} ({tag}.{i})"
            _emit(ev="turn", n=i, q=q)
            r = s.send(q)
            count += 2
            _emit(ev="committed", messages=count, id=r.message_id, text=r.text)
        _emit(ev="spill", tokens=len(s.tokens))
        wrote = s.spill()
        _emit(ev="spilled", tokens=len(s.tokens), wrote=wrote)
        i += 1


def engine_params(**kw):
    from chatkv.engine.sampling import SamplingParams

    return SamplingParams(**{**PARAMS, **kw})


def _run_worker(mode: str, model_dir: str, data_dir: str, num_blocks: int, conv: str, log: str, tag: str) -> None:
    from fork_server import log_to

    log_to(log)
    try:
        _worker(mode, model_dir, data_dir, num_blocks, conv, tag)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)
    os._exit(4)


def main() -> None:
    torch.set_num_threads(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # no tokenizer thread pool to inherit
    from fork_server import serve, warm_up  # tests/support/fork_server.py (tests/support/ is this script's sys.path[0])

    warm_up(sys.argv[1])  # everything a worker needs, no torch op run

    def work(arg: str) -> None:
        mode, model_dir, data_dir, num_blocks, conv, log, tag = arg.split(" ")
        _run_worker(mode, model_dir, data_dir, int(num_blocks), conv, log, tag)

    serve(work)


if __name__ == "__main__":
    main()
