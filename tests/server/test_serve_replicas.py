"""Two real ``chatkv serve`` processes (replicas) on one PostgreSQL database and one data
directory (the shared KV snapshots), driven over loopback HTTP with ``X-Session-Id``.

- handover: a conversation answered by replica A and then by replica B continues on B with
  its KV restored from the snapshot A wrote (B's usage and B's ``/metrics`` say so), and back
  on A with B's turn in its history and B's KV restored;
- race: both replicas, two clients each, answer the same conversation at once. Each request
  is answered or refused with 409 ``session_busy`` (the client retries), never anything else;
  afterwards no message is lost, duplicated or interleaved, and the token history is exactly
  the messages (``check_history`` from tests/sessions/test_multiprocess.py: every reply is
  transformers' greedy continuation of the whole stored history before it).

The servers are started as a user starts them (the ``chatkv`` console script, one torch
thread each), waited for by polling ``/health``, and stopped with SIGTERM, which must end
them gracefully with status 0. Nothing waits a fixed time for a result: the deadlines only
turn a hang into a failure.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from chatkv.storage.kv_segments import SegmentStore
from chatkv.storage.kv_store import token_hash
from chatkv.storage.repository import Store
from tests.sessions.test_multiprocess import MODEL, SYSTEM, check_history
from tests.support.multiprocess_child import QUESTIONS
from tests.support.processes import one_torch_thread
from tests.support.serving import raw
from tests.support.tiny import make_model

NAME = "tiny"
MAX_TOKENS = 4
TURNS_EACH = 3  # race: turns per client, two clients per server
DEADLINE_S = 90.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


try:
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform == "linux" else None
except OSError:
    _LIBC = None


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the test process dies (even by SIGKILL), so no
    server outlives it. (libc is loaded beforehand: nothing is loaded between fork and exec.)"""
    _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _chatkv_command() -> list[str]:
    """The ``chatkv`` console script of this interpreter's environment (as a user runs it)."""
    script = shutil.which("chatkv", path=str(Path(sys.executable).parent))
    if script:
        return [script]
    return [sys.executable, "-c", "import sys; from chatkv.cli import main; sys.exit(main())"]


class Server:
    """One ``chatkv serve`` subprocess on a free loopback port; its output goes to ``log``."""

    def __init__(self, name: str, model_dir: Path, data: Path, db_url: str, log: Path):
        self.name, self.log = name, log
        self.args = [
            "serve",
            "--model",
            str(model_dir),
            "--served-model-name",
            NAME,
            "--data-dir",
            str(data),
            "--db-url",
            db_url,
            "--dtype",
            "float32",
            "--log-level",
            "warning",
        ]
        self.env = dict(
            os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", CHATKV_HOME=str(data)
        )
        self.launches = 0
        self._launch()

    def _launch(self) -> None:
        self.port = _free_port()  # someone else may bind it first: wait_ready() then launches again
        self.url = f"http://127.0.0.1:{self.port}"
        self.launches += 1
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [*_chatkv_command(), *self.args, "--port", str(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                preexec_fn=_die_with_parent if _LIBC is not None else None,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:] if self.log.exists() else ""

    def wait_ready(self) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while True:
            if self.proc.poll() is not None:
                if "address already in use" in self.output() and self.launches < 3:
                    self._launch()
                    continue
                raise AssertionError(
                    f"server {self.name} exited ({self.proc.returncode}) before it was ready:\n{self.output()}"
                )
            try:
                status, _, _ = raw(self.url, "/health")
                if status == 200:
                    return
            except OSError:
                pass  # not listening yet
            assert time.monotonic() < deadline, f"server {self.name} not ready after {DEADLINE_S} s:\n{self.output()}"
            time.sleep(0.05)

    def stop(self) -> int | None:
        """SIGTERM, then its exit status; killed (and None returned) if it has not ended within the deadline."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


class Replicas:
    def __init__(self, a: Server, b: Server, db_url: str, data: Path):
        self.a, self.b, self.db_url, self.data = a, b, db_url, data

    def store(self) -> Store:
        return Store.open(self.db_url, self.data)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_torch_thread():  # the reference forward passes here share 2 cores with both servers
        yield


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("replicas-model") / "model"
    return make_model(d, "llama", seed=11, **MODEL), d


@pytest.fixture(scope="module")
def replicas(postgres, model, tmp_path_factory):
    """Servers A and B, started together on one fresh database and one data directory."""
    db_url = postgres.database()
    root = tmp_path_factory.mktemp("replicas")
    data = root / "data"
    servers: list[Server] = []
    try:
        for name in ("A", "B"):
            servers.append(Server(name, model[1], data, db_url, root / f"{name}.log"))
        for s in servers:
            s.wait_ready()
        for s in servers:  # each opens its conversation store now (a one-time cost), so neither starts a race late
            answered(s, "new", user("Warm up."))
        yield Replicas(*servers, db_url, data)
    finally:
        statuses = {s.name: s.stop() for s in servers}  # every server is ended, whatever happened
    for s in servers:
        assert statuses[s.name] == 0, (
            f"server {s.name} did not stop gracefully on SIGTERM (status {statuses[s.name]}):\n{s.output()}"
        )
    assert "Traceback" not in "".join(s.output() for s in servers), "".join(s.output() for s in servers)


# ------------------------------------------------------------------ helpers


def chat(server: Server, session: str, messages: list[dict]) -> tuple[int, dict, dict]:
    return raw(
        server.url,
        "/v1/chat/completions",
        {"model": NAME, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0},
        {"X-Session-Id": session},
    )


def answered(server: Server, session: str, messages: list[dict]) -> tuple[str, dict, str]:
    """(reply text, usage, session id) of a request that must succeed."""
    status, body, headers = chat(server, session, messages)
    assert status == 200, f"server {server.name}: {status} {body}\n{server.output()}"
    return body["choices"][0]["message"]["content"], body["usage"], headers["x-session-id"]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def scrape(server: Server) -> dict[str, float]:
    status, text, _ = raw(server.url, "/metrics")
    assert status == 200
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels.keys() - {"model_name"}
    }


def snapshot_key(data: Path, conv: str) -> str | None:
    keys = [k for k in SegmentStore(data / "kv").scan()[0] if k.startswith(conv + "-")]
    assert len(keys) <= 1, keys  # one tenant here
    return keys[0] if keys else None


def wait_for_snapshot(r: Replicas, conv: str, end: int):
    """The conversation's manifest once it holds at least ``end`` tokens of the stored history
    (a server writes it behind the reply, in a background thread)."""
    deadline = time.monotonic() + DEADLINE_S
    with r.store() as store:
        tokens = list(store.get_conversation(conv).token_ids)
    while True:
        key = snapshot_key(r.data, conv)
        man = SegmentStore(r.data / "kv").read_manifest(key) if key else None
        if man is not None and man.end >= end:
            assert man.token_hash == token_hash(tokens[: man.end]), "the snapshot holds another history"
            return man
        assert time.monotonic() < deadline, f"no snapshot of {end} tokens of {conv}: {man}"
        time.sleep(0.02)


def kv_len(usage: dict) -> int:
    """Tokens of a turn's KV a snapshot can hold after it: all but the last generated one."""
    return usage["prompt_tokens"] + usage["completion_tokens"] - 1


# ------------------------------------------------------------------ handover


def test_a_conversation_moves_between_replicas_with_its_kv(replicas, model):
    r, (ref, model_dir) = replicas, model
    a, b = r.a, r.b
    t1, u1, conv = answered(a, "new", [{"role": "system", "content": SYSTEM}, *user(f"{QUESTIONS[0]} [h.1]")])
    man1 = wait_for_snapshot(r, conv, kv_len(u1))

    # turn 2 on B, which has never seen the conversation: its history's KV comes from A's snapshot
    before = scrape(b)
    t2, u2, sid = answered(b, conv, user(f"{QUESTIONS[1]} [h.2]"))
    after = scrape(b)
    assert sid == conv
    assert u2["prompt_tokens_details"]["cached_tokens"] >= man1.end, (u2, man1.end)
    assert u2["chatkv"]["restored_tokens"] > 0, u2
    assert u2["chatkv"]["computed_tokens"] <= u2["prompt_tokens"] - man1.end  # only what the snapshot lacks
    assert after["chatkv:kv_restores_total"] - before.get("chatkv:kv_restores_total", 0) == 1
    assert after["chatkv:kv_restore_bytes_total"] > before.get("chatkv:kv_restore_bytes_total", 0)
    assert (
        after["chatkv:prompt_tokens_restored_total"] - before.get("chatkv:prompt_tokens_restored_total", 0)
        == u2["chatkv"]["restored_tokens"]
    )

    # turn 3 back on A: it reloads the history under the lease (B's turn is in it) and B's KV from disk
    man2 = wait_for_snapshot(r, conv, kv_len(u2))
    before = scrape(a)
    t3, u3, _ = answered(a, conv, user(f"{QUESTIONS[2]} [h.3]"))
    after = scrape(a)
    assert u3["prompt_tokens_details"]["cached_tokens"] >= man2.end, (u3, man2.end)
    assert u3["chatkv"]["restored_tokens"] > 0, u3
    assert after["chatkv:kv_restores_total"] - before.get("chatkv:kv_restores_total", 0) == 1

    with r.store() as store:
        msgs, tokens, turns = check_history(ref, model_dir, store, conv)
        assert [(m.role, m.content, m.status) for m in msgs] == [
            ("user", f"{QUESTIONS[0]} [h.1]", "complete"),
            ("assistant", t1, "complete"),
            ("user", f"{QUESTIONS[1]} [h.2]", "complete"),
            ("assistant", t2, "complete"),
            ("user", f"{QUESTIONS[2]} [h.3]", "complete"),
            ("assistant", t3, "complete"),
        ]
        # each turn's prompt was the whole stored history before its reply
        assert [u["prompt_tokens"] for u in (u1, u2, u3)] == [start for start, _ in turns]
        assert store.leases.holder(conv) is None


# ------------------------------------------------------------------ the race


def test_two_replicas_race_on_one_conversation(replicas, model):
    r, (ref, model_dir) = replicas, model
    first = f"{QUESTIONS[0]} [first]"
    t0, _, conv = answered(r.a, "new", [{"role": "system", "content": SYSTEM}, *user(first)])

    sent: list[tuple[str, str, str]] = []  # (server, question, reply)
    busy: list[dict] = []
    wrong: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(4)

    def client(server: Server, tag: str) -> None:
        rng = random.Random(tag)
        try:
            start.wait(DEADLINE_S)
            deadline = time.monotonic() + DEADLINE_S
            for i in range(TURNS_EACH):
                q = f"{QUESTIONS[i % len(QUESTIONS)]} [{tag}.{i}]"
                while True:
                    assert time.monotonic() < deadline, f"{tag}: {q!r} never got through"
                    status, body, _ = chat(server, conv, user(q))
                    if status == 200:
                        with lock:
                            sent.append((server.name, q, body["choices"][0]["message"]["content"]))
                        break
                    if status == 409 and isinstance(body, dict) and body["error"]["code"] == "session_busy":
                        with lock:
                            busy.append(body["error"])
                        time.sleep(rng.uniform(0, 0.02))  # not a correctness wait: only fewer futile tries
                        continue
                    raise AssertionError(f"{tag} on server {server.name}: {q!r} answered {status} {body}")
        except BaseException as e:  # noqa: BLE001 - reported below
            with lock:
                wrong.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(s, f"{s.name}{k}")) for s in (r.a, r.b) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * DEADLINE_S)
    assert not any(t.is_alive() for t in threads), "a client hangs"
    assert not wrong, "\n".join(wrong) + "\n" + r.a.output() + r.b.output()
    assert len(sent) == 4 * TURNS_EACH
    for e in busy:  # the loser is told which conversation is busy
        assert conv in e["message"] and e["param"] == "session_id", e

    with r.store() as store:
        msgs, tokens, turns = check_history(ref, model_dir, store, conv)
        assert len(msgs) == 2 * (1 + len(sent)) and all(m.status == "complete" for m in msgs)
        assert (msgs[0].content, msgs[1].content) == (first, t0)
        stored = [(u.content, a.content) for u, a in zip(msgs[::2], msgs[1::2])]
        for _, q, reply in sent:  # every answered request is stored once, its reply right after it
            assert [p for p in stored if p[0] == q] == [(q, reply)], (q, reply, stored)
        assert store.leases.holder(conv) is None
        order = "".join(m.content.rsplit("[", 1)[1][0] for m in msgs[2::2])
    print(
        f"{len(sent)} turns over two replicas, stored in the order {order}; {len(busy)} requests answered 409 "
        f"session_busy ({sum('another process' in e['message'] for e in busy)} for the other replica) and retried"
    )
