"""How many chatkv source files one plain turn runs through, and why each is there.

A second turn of a session on an engine running its loop (the way the app and the server drive
it), traced with ``sys.setprofile`` / ``threading.setprofile`` on every thread: the set of
chatkv source files whose code ran. The test loads the tokenizer once first, so the turn it
traces is a warm start's, as every start after a model's first is: its tokenizer is chatkv's
own (chatkv/weights/direct_tokenizer.py: tokenizers and jinja2 without transformers).

The bound is 37 because each file on the path does one job of a plain turn under the default
configuration, and ``ON_PATH`` names the job of each of its 37 files. The path must stay inside
``ON_PATH`` (a file that joins the path must name its job there) and within ``BOUND``, so it
cannot grow unnoticed. No file of it leaves without turning a default feature off or merging two
jobs: the host tier, speculation (``speculative="auto"``) and the thread governor are on by
default and do their work in every turn (a residency check per match and insert; a prompt
lookup at every decode step, its proposals verified; a look at the load every 0.5 s), and so is
the deterministic engine (every row's products computed alone); the
writer thread's four files are the KV snapshot written behind every turn. A shorter path takes
a design choice, not a removal: e.g. writing the snapshot when the conversation goes idle rather
than after each turn would take kv_writer, kv_store, kv_segments and files off the path.

``OFF_PATH`` lists what a plain turn must not run: retrieval without a knowledge base (nothing of
chatkv/rag runs), and the spill, restore and pressure-relief functions when nothing spills."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from chatkv.engine.core import Engine
from chatkv.weights import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
PARTS = tuple(str(ROOT / p) + os.sep for p in ("chatkv", "kernels", "retrieval", "storage", "tui"))
BOUND = 37  # the files of ON_PATH: one job each
# functions a plain turn must not run: retrieval without a knowledge base, spilling when nothing spills
OFF_PATH = {
    ("chatkv/sessions/snapshots.py", "spill"),
    ("chatkv/sessions/snapshots.py", "relieve"),
    ("chatkv/sessions/snapshots.py", "restore"),
    ("chatkv/sessions/manager.py", "relieve"),
    ("chatkv/sessions/manager.py", "_spill_now"),
    ("chatkv/sessions/manager.py", "_reload"),
}

# why each file is on a plain turn's path: one job each (a turn on the caller's thread, the loop
# thread that steps the engine, the writer thread that writes the KV behind the turn)
ON_PATH = {
    "chatkv/sessions/session.py": "the SDK's Session.send: checks the message, default sampling",
    "chatkv/sessions/manager.py": "the only writer of a Session's state: begin, commit, settle, pin",
    "chatkv/sessions/turn.py": "the turn as an object: plan, admit, commit the user message, drive, settle, reply",
    "chatkv/sessions/template.py": "the chat template's rendering of the new user turn and the reply's close",
    "chatkv/engine/text_tokens.py": "the rendered text tokenised with the user's text as data (no control tokens)",
    "chatkv/weights/direct_tokenizer.py": "the tokenizer itself on a warm start (tokenizers + jinja2, proved equal to "
    "transformers' at the cold load): its encode and decode",
    "chatkv/sessions/context_window.py": "the KV window's plan for the prompt and its stored state",
    "chatkv/errors.py": "check_text: the message must be a str without surrogates",
    "chatkv/outputs.py": "the reply's Usage mapped to the stored message's columns",
    "chatkv/engine/closing.py": "the close gate: a turn that close() must wait for",
    "chatkv/engine/core.py": "add_request, step = schedule -> run -> postprocess, on_loop",
    "chatkv/engine/loop.py": "the loop thread that owns the engine's state and streams the output",
    "chatkv/model/cpu_threads.py": "adaptive_threads (default on): compute threads = free cores, looked at every 0.5 s",
    "chatkv/engine/scheduler.py": "admission, the token budget, appending tokens, stop/length, finish",
    "chatkv/engine/sequence.py": "the request's state and its usage/result",
    "chatkv/engine/sampling.py": "the request's SamplingParams checked, then greedy/sampled tokens",
    "chatkv/engine/speculative.py": "speculative='auto' (default): prompt lookup, proposals, their verification",
    "chatkv/engine/detokenize.py": "incremental text and stop strings of the reply",
    "chatkv/engine/model_runner.py": "the flattened batch and its attention metadata, the forward",
    "chatkv/model/forward.py": "the model's forward",
    "kernels/attention.py": "paged attention over the block tables, storing the new KV",
    "kernels/cpu_invariant.py": "deterministic (default on): each row's products and attention computed alone",
    "chatkv/kvcache/manager.py": "attach the retained prefix, reserve blocks, release/retain at finish, "
    "export for disk",
    "chatkv/kvcache/block_pool.py": "the blocks and their reference counts",
    "chatkv/kvcache/radix.py": "the prefix tree: match, insert, lock",
    "chatkv/kvcache/hiradix.py": "host_cache_bytes (default 256 MiB): the tree's host-tier residency on match/insert",
    "chatkv/sessions/snapshots.py": "write-behind: the turn's new KV queued for disk, the disk budget",
    "storage/repository.py": "the two message rows and the conversation's token history, in transactions",
    "storage/message_tree.py": "each message records its branch's token history as a delta (branches)",
    "storage/records.py": "the checks of what the store takes and the records it returns",
    "storage/models.py": "the ORM rows and their column types (token ids, UTC times), the message hash",
    "storage/db.py": "SQLite write transactions begin IMMEDIATE",
    "storage/leases.py": "the conversation's lease for the turn, renewed while held, fencing both writes",
    "storage/kv_writer.py": "the writer thread that takes the queued KV",
    "storage/kv_segments.py": "the conversation's KV as appended segments and their manifest",
    "storage/kv_store.py": "one segment's safetensors file, checksummed",
    "storage/files.py": "atomic, fsynced file writes in private directories",
}

pytestmark = pytest.mark.tiny_model("llama", seed=1)


def test_one_plain_turn_runs_through_at_most_bound_files(model_dir, tmp_path):
    files: set[str] = set()
    ran: set[tuple[str, str]] = set()
    recording = threading.Event()

    def profile(frame, event, arg):
        if recording.is_set() and frame.f_code.co_filename.startswith(PARTS):
            f = os.path.relpath(frame.f_code.co_filename, ROOT)
            files.add(f)
            ran.add((f, frame.f_code.co_name))

    load_tokenizer(model_dir)  # the cold load: every later start is warm, with the direct tokenizer
    threading.setprofile(profile)  # every thread started from here on, the loop's included
    try:
        engine = Engine.from_pretrained(
            model_dir, data_dir=str(tmp_path), dtype="float32", num_blocks=256, block_size=4
        )
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
    assert "chatkv/sessions/manager.py" in files and "chatkv/model/forward.py" in files, sorted(
        files
    )  # it saw both threads
    assert len(files) <= BOUND, sorted(files)
    assert files <= set(ON_PATH), f"on the turn's path with no job named in ON_PATH: {sorted(files - set(ON_PATH))}"
    assert not ran & OFF_PATH, sorted(ran & OFF_PATH)
    assert "chatkv/rag/context.py" not in files and "chatkv/sessions/turn.py" in files, sorted(files)
    assert not any(f.startswith(("retrieval/", "tui/")) for f in files), sorted(files)  # no knowledge base, no app
