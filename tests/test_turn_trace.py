"""How many chatkv source files one plain turn runs through (issue 21's measure).

A second turn of a session on an engine running its loop (the way the app and the server drive
it), traced with ``sys.setprofile`` / ``threading.setprofile`` on every thread: the set of
chatkv source files whose code ran. Issue 21 counted 30 and set a goal of at most 24; 33 before
its redesign (closing, cpu_threads and text_tokens joined the path with issues 19 and 20).

The turn as an object (chatkv/turn.py) took two files off the path and added one: rag.py (no
knowledge base: nothing of it runs) and session_leases.py (gone: the lease is storage-side,
``store.leases.hold``), so 32. Also off it: the spill functions when nothing spills, and the
KV manager's pressure relief. What is left of the 24 goal lies in storage (ten files: the
database row writes of both messages, the lease, and the write-behind's segment, manifest and
safetensors file on the writer thread) and in the engine's own core.

Two files joined the path in other commits of the same day: chatkv/hiradix_cache.py (the
host tier layered on the radix tree, issue 21 item 3: the tree of an engine with a host tier is
a HiRadixCache) and storage/message_tree.py (conversations as trees, issue 22: every stored
message records its branch's history). Then chatkv/speculative.py (issue 24: the speculation
policy looks at every decode step for a prompt-lookup match). Every file counts: the whole
path is 35 today, the bound, so it cannot grow unnoticed; the goal of 24 is not met."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from chatkv.engine import Engine

ROOT = Path(__file__).resolve().parents[1]
PARTS = tuple(str(ROOT / p) + os.sep for p in ("chatkv", "kernels", "retrieval", "storage", "tui"))
TODAY, GOAL = 35, 24
# functions a plain turn must not run: retrieval without a knowledge base, spilling when nothing spills
OFF_PATH = {("chatkv/snapshots.py", "spill"), ("chatkv/snapshots.py", "relieve"), ("chatkv/snapshots.py", "restore"),
            ("chatkv/session_manager.py", "relieve"), ("chatkv/session_manager.py", "_spill_now"),
            ("chatkv/session_manager.py", "_reload")}

pytestmark = pytest.mark.tiny_model("llama", seed=1)


def test_one_plain_turn_runs_through_at_most_todays_files(model_dir, tmp_path):
    files: set[str] = set()
    ran: set[tuple[str, str]] = set()
    recording = threading.Event()

    def profile(frame, event, arg):
        if recording.is_set() and frame.f_code.co_filename.startswith(PARTS):
            f = os.path.relpath(frame.f_code.co_filename, ROOT)
            files.add(f)
            ran.add((f, frame.f_code.co_name))

    threading.setprofile(profile)  # every thread started from here on, the loop's included
    try:
        engine = Engine.from_pretrained(model_dir, data_dir=str(tmp_path), dtype="float32", num_blocks=256, block_size=4)
        engine.start()
        s = engine.session(params=dict(max_tokens=4, temperature=0))
        s.send("Hello there")
        time.sleep(1.0)  # the first turn's write-behind settles
        sys.setprofile(profile)
        recording.set()
        s.send("And again")
        time.sleep(1.0)  # its write-behind, which is part of the turn
        recording.clear()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    engine.close()
    assert "chatkv/session_manager.py" in files and "chatkv/model.py" in files, sorted(files)  # it saw both threads
    assert len(files) <= TODAY, sorted(files)
    assert not ran & OFF_PATH, sorted(ran & OFF_PATH)
    assert "chatkv/rag.py" not in files and "chatkv/turn.py" in files, sorted(files)
    assert not any(f.startswith(("retrieval/", "tui/")) for f in files), sorted(files)  # no knowledge base, no app
