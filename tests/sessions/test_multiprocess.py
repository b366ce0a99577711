"""Several processes, one store: real worker processes (tests/support/multiprocess_child.py) and this one
share a data directory (SQLite, or a real PostgreSQL server from tests/support/pg.py, plus one snapshot
directory) and race on one conversation.

What must hold afterwards, checked on the stored data itself (``check_history``): user and
assistant messages strictly alternate; every message a process reports as sent is stored
exactly once; the stored token history is exactly the conversation's messages, turn by turn
(each user message's rendered tokens where the history says, each reply's generated tokens
and the end-of-turn tokens after them, nothing else); and every reply is what transformers
generates greedily from the stored history before it, so each turn was computed on the whole
history, the other process's turns included, whatever KV it restored.

Nothing here waits a fixed time for a result: workers are driven by files they poll and
report through logs the test polls (the deadlines only turn a hang into a failure).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from chatkv.config import EngineConfig
from chatkv.engine.core import Engine
from chatkv.engine.sampling import SamplingParams
from chatkv.errors import ConversationBusy
from chatkv.sessions.template import TurnRenderer
from chatkv.storage.kv_segments import SegmentStore
from chatkv.storage.kv_store import token_hash
from chatkv.storage.repository import Store
from chatkv.weights import load_tokenizer
from tests.support import multiprocess_child as child
from tests.support.fork_server import ForkServer
from tests.support.pg import backend_url
from tests.support.processes import one_torch_thread
from tests.support.tiny import make_model

SYSTEM = "You are a helpful assistant."
PARAMS = SamplingParams(**child.PARAMS)
MODEL = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=4096,
)
HELPER = Path(__file__).resolve().parents[1] / "support" / "multiprocess_child.py"
ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 90.0
TURNS_EACH = 3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("mp-model") / "model"
    return make_model(d, "llama", seed=11, **MODEL), d


class Workers(ForkServer):
    """Client of the fork server in tests/support/multiprocess_child.py."""

    def __init__(self, model_dir: Path):
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, PYTHONPATH=path, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        super().__init__(HELPER, model_dir, env=env)

    def go(self, **settings) -> int:
        return super().go(json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in settings.items()}))


@pytest.fixture(scope="module")
def workers(model):
    w = Workers(model[1])
    yield w
    w.close(timeout=30)


def events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def wait_for(log: Path, pred, what: str) -> list[dict]:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        ev = events(log)
        if pred(ev):
            return ev
        if time.monotonic() > deadline:
            err = Path(str(log) + ".err")
            raise AssertionError(
                f"worker never reached '{what}'; events {ev}\n{err.read_text() if err.exists() else ''}"
            )
        time.sleep(0.01)


def has(name: str):
    return lambda ev: any(e["ev"] == name for e in ev)


def engine_at(model_dir: Path, data: Path, db_url: str | None = None) -> Engine:
    return Engine(model_dir, EngineConfig(data_dir=str(data), db_url=db_url, num_blocks=child.NUM_BLOCKS))


@torch.no_grad()
def greedy(ref, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``ids``, ``n`` tokens, not stopping at an end token."""
    out = list(ids)
    for _ in range(n):
        out.append(int(ref(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


def proc_state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()[0]


def check_history(ref, model_dir: Path, store: Store, conv: str):
    """The invariants of the module docstring; returns (messages, tokens, [(reply start, generated)])."""
    msgs = store.messages(conv)
    roles = [m.role for m in msgs]
    assert roles == ["user", "assistant"] * (len(msgs) // 2), f"messages do not alternate: {roles}"
    tokens = list(store.get_conversation(conv).token_ids)
    renderer = TurnRenderer(load_tokenizer(model_dir))
    pos, turns = 0, []
    for u, a in zip(msgs[::2], msgs[1::2]):
        if pos == 0:
            delta = renderer.first([{"role": "system", "content": SYSTEM}, {"role": "user", "content": u.content}])
        else:
            delta = renderer.user_turn(u.content)
        assert tokens[pos : pos + len(delta)] == delta, f"user message {u.id} {u.content!r} is not in the token history"
        pos += len(delta)
        gen = tokens[pos : pos + (a.generated_tokens or 0)]
        turns.append((pos, gen))
        pos += len(gen)
        closing = renderer.close_reply(gen)
        assert tokens[pos : pos + len(closing)] == closing, f"reply {a.id} is not closed in the token history"
        pos += len(closing)
        assert gen == greedy(ref, tokens[: turns[-1][0]], len(gen)), f"reply {a.id} was computed on another history"
        if not gen:
            assert a.status == "interrupted" and a.content == ""
    assert pos == len(tokens), f"{len(tokens) - pos} tokens in the history belong to no message"
    return msgs, tokens, turns


def check_sent(msgs, sent: list[dict]) -> None:
    """Every reported send is stored exactly once: its reply under its id, its question just before."""
    by_id = {m.id: i for i, m in enumerate(msgs)}
    users = [m.content for m in msgs if m.role == "user"]
    for ev in sent:
        assert users.count(ev["q"]) == 1, f"{ev['q']!r} stored {users.count(ev['q'])} times"
        i = by_id[ev["id"]]
        assert (msgs[i].role, msgs[i].content, msgs[i - 1].content) == ("assistant", ev["text"], ev["q"])


def new_conversation(model_dir: Path, data: Path, db_url: str | None) -> str:
    with engine_at(model_dir, data, db_url) as e:
        s = e.session(system=SYSTEM, params=child.PARAMS)
        s.send(f"{child.QUESTIONS[0]} [first]")
        return s.id


# ------------------------------------------------------------------ the race


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_two_processes_race_on_one_conversation(backend, request, model, workers, tmp_path):
    ref, model_dir = model
    db_url = backend_url(request, backend)
    data = tmp_path / "data"  # the SQLite file (sqlite) and the snapshot directory (both)
    conv = new_conversation(model_dir, data, db_url)
    go = tmp_path / "go"
    logs = [tmp_path / f"w{i}.log" for i in range(2)]
    pids = [
        workers.go(
            mode="race",
            model_dir=model_dir,
            data=data,
            db_url=db_url,
            conv=conv,
            tag=f"w{i}",
            n=TURNS_EACH,
            go=go,
            log=log,
        )
        for i, log in enumerate(logs)
    ]
    for log in logs:
        wait_for(log, has("ready"), "ready")
    go.touch()  # both start sending at once
    for log in logs:
        wait_for(log, has("done"), "done")
    assert [workers.reap(pid) for pid in pids] == [0, 0]

    sent = [e for log in logs for e in events(log) if e["ev"] == "sent"]
    busy = [e for log in logs for e in events(log) if e["ev"] == "busy"]
    assert len(sent) == 2 * TURNS_EACH
    for e in busy:  # the loser's error says which conversation and why
        assert f"conversation '{conv}'" in e["error"] and "another process" in e["error"]
    with Store.open(db_url, data) as store:
        msgs, tokens, turns = check_history(ref, model_dir, store, conv)
        check_sent(msgs, sent)
        assert len(msgs) == 2 * (1 + 2 * TURNS_EACH) and not [m for m in msgs if m.status != "complete"]
        assert store.leases.holder(conv) is None  # every lease was given back
    print(f"{backend}: {len(sent)} turns from two processes, {len(busy)} busy answers retried")

    # a third process (this one) continues on top, from the snapshot the last holder left
    with engine_at(model_dir, data, db_url) as e:
        s = e.resume(conv)
        r = s.send(f"{child.QUESTIONS[3]} [after]")
        assert r.usage.restored_tokens > 0
        with Store.open(db_url, data) as store:
            check_history(ref, model_dir, store, conv)


# ------------------------------------------------------------------ a live turn elsewhere


def test_a_live_turn_elsewhere_is_left_alone_and_the_loser_retries(model, workers, tmp_path):
    ref, model_dir = model
    data = tmp_path / "data"
    e1 = engine_at(model_dir, data)
    s = e1.session(system=SYSTEM, params=child.PARAMS)
    s.send(f"{child.QUESTIONS[0]} [p.0]")
    conv, log, release = s.id, tmp_path / "hold.log", tmp_path / "release"
    pid = workers.go(
        mode="hold", model_dir=model_dir, data=data, db_url=None, conv=conv, tag="w", release=release, log=log
    )
    wait_for(log, has("generating"), "generating")
    before = s.messages()
    assert before[-1].role == "user" and before[-1].content.endswith("[w]")  # its turn is stored, its reply is coming

    # resume() elsewhere (another store) while the worker generates: no "interrupted" reply is written
    with engine_at(model_dir, data) as e2:
        other = e2.resume(conv)
        assert other.messages() == before
    # a turn here is refused, saying who holds the conversation; nothing is stored
    with pytest.raises(ConversationBusy) as err:
        s.send(f"{child.QUESTIONS[2]} [p.1]")
    assert f"conversation '{conv}'" in str(err.value) and f"process {pid} " in str(err.value)
    assert err.value.conversation_id == conv
    assert s.messages() == before

    release.touch()
    ev = wait_for(log, has("done"), "done")  # the worker's reply is stored, its engine closed
    assert workers.reap(pid) == 0
    kv_key = e1.session_manager.snapshots.key(conv)
    manifest = SegmentStore(data / "kv").manifest_path(kv_key)
    worker_snapshot = manifest.read_bytes()

    # the session here is behind now; spilling it must not write its older history's KV over the
    # worker's, even when its record of what the disk holds is gone (as after a failed write)
    e1.session_manager.snapshots._tracks.pop(conv, None)
    assert s.spill()
    e1.session_manager.snapshots.flush()
    assert manifest.read_bytes() == worker_snapshot

    # the retry reloads the conversation: the worker's turn is in its context, its KV from the worker's snapshot
    r = s.send(f"{child.QUESTIONS[2]} [p.1]")
    msgs, tokens, turns = check_history(ref, model_dir, e1.session_manager.store, conv)
    check_sent(msgs, [e for e in ev if e["ev"] == "sent"])
    assert [m.content for m in msgs if m.role == "user"][-2:] == [before[-1].content, f"{child.QUESTIONS[2]} [p.1]"]
    assert s.tokens == tokens and r.usage.prompt_tokens == turns[-1][0]
    worker_kv = turns[-2][0] + len(turns[-2][1]) - 1  # every token of its turn but the last generated one
    man = SegmentStore(data / "kv").read_manifest(kv_key)
    assert man is not None and man.token_hash == token_hash(tokens[: man.end])
    assert r.usage.prompt_tokens - r.usage.computed_tokens >= worker_kv, "the worker's KV was recomputed"
    assert r.usage.restored_tokens > 0
    e1.check_integrity()
    e1.close()


# ------------------------------------------------------------------ a crashed holder


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_crashed_holder_does_not_block_the_conversation(backend, request, model, workers, tmp_path):
    ref, model_dir = model
    db_url = backend_url(request, backend)
    data = tmp_path / "data"
    e1 = engine_at(model_dir, data, db_url)
    s = e1.session(system=SYSTEM, params=child.PARAMS)
    s.send(f"{child.QUESTIONS[0]} [p.0]")
    log = tmp_path / "hold.log"
    pid = workers.go(
        mode="hold",
        model_dir=model_dir,
        data=data,
        db_url=db_url,
        conv=s.id,
        tag="w",
        release=tmp_path / "never",
        log=log,
    )
    wait_for(log, has("generating"), "generating")
    os.kill(pid, signal.SIGKILL)
    store = e1.session_manager.store
    while proc_state(pid) != "Z":
        time.sleep(0.01)  # killed, not reaped yet: a zombie, still holding its (unexpired) lease row
    assert store.leases.holder(s.id).pid == pid

    r = s.send(f"{child.QUESTIONS[2]} [p.1]")  # the dead holder's lease is broken, its turn closed
    status = workers.reap(pid)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    msgs, tokens, _ = check_history(ref, model_dir, store, s.id)
    assert [(m.role, m.status, m.content) for m in msgs[2:]] == [
        ("user", "complete", f"{child.QUESTIONS[1]} [w]"),
        ("assistant", "interrupted", ""),
        ("user", "complete", f"{child.QUESTIONS[2]} [p.1]"),
        ("assistant", "complete", r.text),
    ]
    e1.close()
    with engine_at(model_dir, data, db_url) as e2:  # resuming again closes nothing more
        e2.resume(s.id).send(f"{child.QUESTIONS[3]} [p.2]")
        msgs = e2.resume(s.id).messages()
        assert sum(m.status == "interrupted" for m in msgs) == 1 and len(msgs) == 8
        check_history(ref, model_dir, e2.session_manager.store, s.id)


def test_interpreter_exit_mid_turn_releases_the_lease(model, workers, tmp_path):
    ref, model_dir = model
    data = tmp_path / "data"
    conv = new_conversation(model_dir, data, None)
    log = tmp_path / "exit.log"
    pid = workers.go(mode="exit", model_dir=model_dir, data=data, db_url=None, conv=conv, tag="w", log=log)
    wait_for(log, has("generating"), "generating")
    status = workers.reap(pid)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, Path(str(log) + ".err").read_text()
    with Store.open(None, data) as store:
        assert store.leases.holder(conv) is None, "the exiting process left its lease behind"
    with engine_at(model_dir, data) as e:
        s = e.resume(conv)
        s.send(f"{child.QUESTIONS[2]} [p.1]")
        msgs, _, _ = check_history(ref, model_dir, e.session_manager.store, conv)
        assert [m.role for m in msgs] == ["user", "assistant"] * 3
        assert msgs[2].content == f"{child.QUESTIONS[1]} [w]" and msgs[3].status == "interrupted"
