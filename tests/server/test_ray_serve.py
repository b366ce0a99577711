"""``chatkv serve --ray`` on a real local Ray instance (2 CPUs): two engine replicas of a tiny
model behind the ingress, one SQLite store and one data directory (the shared KV snapshots),
driven over loopback HTTP.

- affinity: 8 sessions x 4 turns at once; every turn after a session's first finds >= 80% of
  its history in the answering replica's memory, and each session stays on one replica. The
  same run through a round-robin deployment of the same model (same store) is reported next
  to it, and its sessions' turns find their history in memory far less (they alternate
  replicas, so the KV comes from the other replica's snapshot or is recomputed);
- a stateless client re-sending its whole history is routed to the replica that answered its
  previous request (the router's prefix keys), which reports the history cached;
- ``ray.kill`` of a replica mid-conversation: the next turns of its sessions succeed on the
  other replica, their history restored from the shared snapshots (restored > 0), and the
  store holds exactly what the clients sent and received (``check_history``: every reply is
  transformers' greedy continuation of the stored history); Ray's replacement replica rejoins
  the routing and answers new sessions;
- hostile: a replica killed during a streamed reply ends the stream with an error event (no
  hang), the next turn goes on elsewhere; two clients on one session across replicas get
  their replies or 409 ``session_busy``, nothing lost or duplicated.

Ray starts once for the module (about 15 s of the module's ~60 s on 2 cores), which is why
these cases share one file past 400 lines. Nothing waits a fixed time for a result: every
wait polls a state with a deadline.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the test extra installs ray[serve]: pip install -e '.[test]'")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from ray import serve  # noqa: E402

from chatkv.server.ray.deployments import ReplicaOptions, ServeOptions, deploy  # noqa: E402
from chatkv.storage.kv_segments import SegmentStore  # noqa: E402
from chatkv.storage.repository import Store  # noqa: E402
from tests.sessions.test_multiprocess import MODEL, SYSTEM, check_history  # noqa: E402
from tests.support.processes import one_torch_thread  # noqa: E402
from tests.support.serving import raw, user  # noqa: E402
from tests.support.tiny import make_model  # noqa: E402

NAME = "tiny"
MAX_TOKENS = 6
DEADLINE_S = 90.0
SESSIONS, TURNS = 8, 4


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, url: str, data: Path, model_dir: Path, ref):
        self.url, self.data, self.model_dir, self.ref = url, data, model_dir, ref

    def options(self, app: str, routing: str, prefix: str) -> ServeOptions:
        engine = dict(data_dir=str(self.data), dtype="float32", block_size=4, num_blocks=1024)
        return ServeOptions(
            ReplicaOptions(str(self.model_dir), NAME, engine),
            replicas=2,
            routing=routing,
            replica_cpus=0.5,
            stats_period_s=1.0,
            route_prefix=prefix,
            app_name=app,
        )

    def store(self) -> Store:
        return Store.open(None, self.data)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with one_torch_thread():  # the reference forwards share the 2 cores with the replicas
        model_dir = tmp_path_factory.mktemp("ray-model") / "model"
        ref = make_model(model_dir, "llama", seed=11, **MODEL)
        data = tmp_path_factory.mktemp("ray-data")
        ray.init(
            num_cpus=2,
            object_store_memory=80 * 2**20,
            include_dashboard=False,
            logging_level=logging.WARNING,
            runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}},
        )
        try:
            port = _free_port()
            serve.start(
                http_options={"host": "127.0.0.1", "port": port},
                logging_config={"log_level": "WARNING", "enable_access_log": False},
            )
            c = Cluster(f"http://127.0.0.1:{port}", data, model_dir, ref)
            deploy(c.options("affinity", "affinity", "/"))
            yield c
        finally:
            serve.shutdown()
            ray.shutdown()


# ------------------------------------------------------------------ helpers


def chat(url: str, messages: list[dict], session: str | None = None, **extra) -> tuple[int, dict, dict]:
    headers = {"X-Session-Id": session} if session else {}
    return raw(
        url,
        "/v1/chat/completions",
        {"model": NAME, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **extra},
        headers,
    )


def answered(url: str, messages: list[dict], session: str | None = None, tries: list | None = None):
    """(reply, usage, headers) of a request that must succeed; a 409 session_busy (the previous
    turn's lease not yet released: the reply reaches the client just before its turn ends) is
    retried until the deadline. ``tries`` gets one entry per request sent."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        status, body, headers = chat(url, messages, session)
        if tries is not None:
            tries.append(status)
        if status == 409 and body["error"]["code"] == "session_busy" and time.monotonic() < deadline:
            time.sleep(0.01)  # not a wait for a result: only fewer futile tries
            continue
        assert status == 200, (status, body)
        return body["choices"][0]["message"]["content"], body["usage"], headers


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    status, text, _ = raw(url, "/metrics")
    assert status == 200, text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def replicas_routed(url: str) -> set[str]:
    """The engine replicas the ingress's router routes to now (``chatkv:router_replicas``)."""
    return {
        dict(labels)["replica"]
        for (name, labels), v in metrics(url).items()
        if name == "chatkv:router_replicas" and v == 1
    }


def poll(what: str, check, deadline_s: float = DEADLINE_S):
    deadline = time.monotonic() + deadline_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {deadline_s} s: {what}"
        time.sleep(0.05)


def snapshot_end(data: Path, conv: str) -> int:
    store = SegmentStore(data / "kv")
    ends = [store.read_manifest(k).end for k in store.scan()[0] if k.startswith(conv + "-")]
    return max((e for e in ends if e is not None), default=0)


def run_sessions(url: str, n: int, turns: int, tag: str) -> list[list[dict]]:
    """``n`` sessions at once, ``turns`` turns each; per session, per turn: replica, usage, q, a."""
    out: list[list[dict]] = [[] for _ in range(n)]
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            sid = "new"
            for t in range(turns):
                q = f"Question {t} of {tag} session {i}?"
                msgs = [{"role": "system", "content": SYSTEM}, *user(q)] if t == 0 else user(q)
                tries: list = []
                reply, usage, headers = answered(url, msgs, sid, tries)
                sid = headers["x-session-id"]
                out[i].append(
                    {
                        "sid": sid,
                        "replica": headers["x-chatkv-replica"],
                        "usage": usage,
                        "q": q,
                        "a": reply,
                        "tries": len(tries),
                    }
                )
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(f"session {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * DEADLINE_S)
    assert not errors, errors
    return out


def history_len(prev: dict) -> int:
    """Tokens of the conversation before a turn's new message: the previous prompt and reply."""
    return prev["usage"]["prompt_tokens"] + prev["usage"]["completion_tokens"]


def summary(runs: list[list[dict]]) -> dict:
    later = [(prev, cur) for turns in runs for prev, cur in zip(turns, turns[1:])]
    hist = sum(history_len(p) for p, _ in later)
    return {
        "memory": sum(c["usage"]["chatkv"]["cached_tokens"] for _, c in later) / hist,
        "restored": sum(c["usage"]["chatkv"]["restored_tokens"] for _, c in later) / hist,
        "computed": sum(c["usage"]["chatkv"]["computed_tokens"] for _, c in later),
        "moves": sum(p["replica"] != c["replica"] for p, c in later),
        "turns": len(later),
    }


def check_store(c: Cluster, runs: list[list[dict]]) -> None:
    """The store holds exactly what the clients sent and received, each reply computed on the
    whole stored history before it."""
    with c.store() as store:
        for turns in runs:
            msgs, _, _ = check_history(c.ref, c.model_dir, store, turns[0]["sid"])
            assert [(m.role, m.content, m.status) for m in msgs] == [
                x for t in turns for x in (("user", t["q"], "complete"), ("assistant", t["a"], "complete"))
            ]
            assert store.leases.holder(turns[0]["sid"]) is None


# ------------------------------------------------------------------ affinity vs round robin


def test_sessions_stay_on_their_replica_and_hit_their_history(cluster):
    c = cluster
    before = metrics(c.url)
    runs = run_sessions(c.url, SESSIONS, TURNS, "affinity")
    for turns in runs:
        assert len({t["replica"] for t in turns}) == 1, [t["replica"] for t in turns]  # never moved
        for prev, cur in zip(turns, turns[1:]):
            u = cur["usage"]
            assert u["chatkv"]["cached_tokens"] >= 0.8 * history_len(prev), (prev["usage"], u)
            assert u["prompt_tokens_details"]["cached_tokens"] >= 0.8 * history_len(prev)
    assert len({t[0]["replica"] for t in runs}) == 2, "the first turns were not spread over both replicas"
    after = metrics(c.url)
    routed = after.get(("chatkv:router_decisions_total", (("reason", "chat:session"),)), 0) - before.get(
        ("chatkv:router_decisions_total", (("reason", "chat:session"),)), 0
    )
    assert routed == sum(t["tries"] for turns in runs for t in turns[1:])  # each later turn's requests, by session
    check_store(c, runs)

    # the same run through round robin: a second app on the same Ray instance, store and snapshots
    deploy(c.options("rr", "round_robin", "/rr"))
    try:
        rr = run_sessions(c.url + "/rr", SESSIONS, TURNS, "round-robin")
        check_store(c, rr)
        race_on_one_session(c, c.url + "/rr")
    finally:
        serve.delete("rr")
    a, b = summary(runs), summary(rr)
    print(
        f"\n{SESSIONS} sessions x {TURNS} turns, turns 2+ ({a['turns']}): history found in the replica's memory "
        f"affinity {a['memory']:.1%} vs round robin {b['memory']:.1%}; restored from snapshots "
        f"{a['restored']:.1%} vs {b['restored']:.1%}; tokens computed {a['computed']} vs {b['computed']}; "
        f"turns on another replica than the previous one {a['moves']} vs {b['moves']}"
    )
    assert a["moves"] == 0 and b["moves"] > 0, (a, b)
    for turns in rr:  # a turn on another replica than the last one cannot find the last turn's KV in memory
        for prev, cur in zip(turns, turns[1:]):
            if cur["replica"] != prev["replica"]:
                assert cur["usage"]["chatkv"]["cached_tokens"] < history_len(prev), (prev, cur)
    assert b["memory"] < a["memory"], (a, b)


def race_on_one_session(c: Cluster, url: str) -> None:
    """Hostile: two clients send turns to one session at once through round robin (so across
    both replicas): each request is answered or refused with 409 session_busy, and the store
    holds every answered turn once, in some order, nothing else."""
    _, _, h = answered(url, [{"role": "system", "content": SYSTEM}, *user("Race start")], "new")
    sid = h["x-session-id"]
    sent, busy, errors, lock, through = [], [], [], threading.Lock(), set()

    def client(tag: str) -> None:
        try:
            for i in range(3):
                q = f"Race {tag} turn {i}"
                deadline = time.monotonic() + DEADLINE_S
                while True:
                    assert time.monotonic() < deadline, f"{q} never got through"
                    status, body, headers = chat(url, user(q), sid)
                    with lock:
                        through.add(headers.get("x-chatkv-replica"))
                    if status == 200:
                        with lock:
                            sent.append((q, body["choices"][0]["message"]["content"], headers["x-chatkv-replica"]))
                        break
                    assert status == 409 and body["error"]["code"] == "session_busy", (status, body)
                    with lock:
                        busy.append(body["error"]["message"])
                    time.sleep(0.01)  # only fewer futile tries
        except BaseException as e:  # noqa: BLE001
            errors.append(f"{tag}: {e}")

    threads = [threading.Thread(target=client, args=(t,)) for t in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * DEADLINE_S)
    assert not errors, errors
    assert len(through) == 2, f"round robin did not send them through both replicas: {through}"
    with c.store() as store:
        msgs, _, _ = check_history(c.ref, c.model_dir, store, sid)
        pairs = [(u.content, a.content) for u, a in zip(msgs[2::2], msgs[3::2])]
        assert sorted(pairs) == sorted((q, a) for q, a, _ in sent)
        assert all(m.status == "complete" for m in msgs)
    print(f"race on one session across replicas: {len(sent)} turns answered, {len(busy)} answered 409 session_busy")


# ------------------------------------------------------------------ stateless clients


def test_a_stateless_client_is_routed_to_the_replica_holding_its_history(cluster):
    c = cluster
    convs = [[{"role": "system", "content": SYSTEM}, *user(f"Stateless conversation {i} begins.")] for i in range(4)]
    homes: list[str | None] = [None] * len(convs)
    history = [0] * len(convs)
    before = metrics(c.url)
    for turn in range(4):
        for i, msgs in enumerate(convs):  # interleaved: each replica answers others in between
            reply, usage, headers = answered(c.url, msgs)
            if turn == 0:
                homes[i] = headers["x-chatkv-replica"]
            else:
                assert headers["x-chatkv-replica"] == homes[i], f"conversation {i} moved at turn {turn}"
                assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.8 * history[i], (usage, history[i])
                assert usage["chatkv"]["cached_tokens"] >= 0.8 * history[i], (usage, history[i])
            history[i] = usage["prompt_tokens"] + usage["completion_tokens"]
            msgs += [{"role": "assistant", "content": reply}, *user(f"Then question {turn} of {i}?")]
    after = metrics(c.url)
    key = ("chatkv:router_decisions_total", (("reason", "chat:prefix"),))
    assert after.get(key, 0) - before.get(key, 0) == 3 * len(convs)


# ------------------------------------------------------------------ failure


def actor_of(replica: str):
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].endswith(f"#{replica}") and "EngineReplica" in a["name"]:
            return ray.get_actor(a["name"], namespace=a["namespace"])
    raise AssertionError(f"no actor for replica {replica}")


def kill(c: Cluster, replica: str) -> None:
    """``ray.kill`` the replica, then wait until the router has dropped it (Ray tells it)."""
    ray.kill(actor_of(replica), no_restart=True)
    poll(f"the router drops {replica}", lambda: replica not in replicas_routed(c.url))


def test_a_killed_replica_s_sessions_continue_on_the_other(cluster):
    c = cluster
    runs = run_sessions(c.url, 4, 2, "failover")
    for turns in runs:  # the second turn's write-behind is on disk before the kill
        last = turns[-1]
        end = last["usage"]["prompt_tokens"] + last["usage"]["completion_tokens"] - 1
        poll(f"snapshot of {last['sid']}", lambda: snapshot_end(c.data, last["sid"]) >= end)
    replicas = {t[0]["replica"] for t in runs}
    victim = max(replicas, key=lambda r: sum(t[0]["replica"] == r for t in runs))
    survivors = replicas_routed(c.url) - {victim}
    kill(c, victim)

    for turns in runs:
        q = f"After the kill, {turns[0]['sid'][:6]}?"
        reply, usage, headers = answered(c.url, user(q), turns[0]["sid"])
        moved = turns[0]["replica"] == victim
        turns.append(
            {"sid": turns[0]["sid"], "replica": headers["x-chatkv-replica"], "usage": usage, "q": q, "a": reply}
        )
        if moved:
            assert headers["x-chatkv-replica"] in survivors
            assert usage["chatkv"]["restored_tokens"] > 0, usage
            assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.8 * history_len(turns[-2]), usage
        else:
            assert headers["x-chatkv-replica"] == turns[0]["replica"]
    check_store(c, runs)

    # Ray replaces the replica; the new one joins the routing and takes new sessions
    fresh = poll("a replacement replica", lambda: replicas_routed(c.url) - survivors - {victim})
    homes = set()
    for i in range(4):
        _, _, h = answered(c.url, [{"role": "system", "content": SYSTEM}, *user(f"New after restart {i}")], "new")
        homes.add(h["x-chatkv-replica"])
    assert homes & fresh, (homes, fresh)


def test_a_replica_killed_during_a_streamed_reply(cluster):
    """Hostile: the stream ends with an error event and [DONE] (no hang, no bare cut); the
    user message is stored and its reply closed as interrupted; the next turn goes on."""
    c = cluster
    _, _, h = answered(c.url, [{"role": "system", "content": SYSTEM}, *user("Stream, then die.")], "new")
    sid, home = h["x-session-id"], h["x-chatkv-replica"]
    req = urllib.request.Request(
        c.url + "/v1/chat/completions",
        method="POST",
        headers={"Content-Type": "application/json", "X-Session-Id": sid},
        data=json.dumps(
            {
                "model": NAME,
                "messages": user("A long answer please"),
                "max_tokens": 900,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode(),
    )
    events = []
    with urllib.request.urlopen(req, timeout=DEADLINE_S) as r:
        assert r.headers["x-chatkv-replica"] == home
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            events.append(line[6:])
            if len(events) == 3:
                ray.kill(actor_of(home), no_restart=True)
    assert events[-1] == b"[DONE]", events[-3:]
    err = json.loads(events[-2])
    assert err["error"]["code"] == "replica_unavailable", err
    poll(f"the router drops {home}", lambda: home not in replicas_routed(c.url))

    reply, usage, h2 = answered(c.url, user("Still there?"), sid)
    assert h2["x-chatkv-replica"] != home
    with c.store() as store:
        msgs = store.messages(sid)
        assert [(m.role, m.content) for m in msgs][:2] == [
            ("user", "Stream, then die."),
            ("assistant", msgs[1].content),
        ]
        assert [(m.role, m.content, m.status) for m in msgs[2:]] == [
            ("user", "A long answer please", "complete"),
            ("assistant", msgs[3].content, "interrupted"),
            ("user", "Still there?", "complete"),
            ("assistant", reply, "complete"),
        ]
        assert store.leases.holder(sid) is None


# ------------------------------------------------------------------ same shapes as the single server


def test_the_same_answers_as_the_single_server(cluster, tmp_path):
    """Refusals and response shapes through Ray equal the single-process server's for the same
    requests (the replicas run its app; this checks the ingress relays them unchanged)."""
    from chatkv.engine.core import Engine
    from chatkv.server import create_app
    from tests.support.serving import Running

    c = cluster
    engine = Engine.from_pretrained(
        str(c.model_dir), data_dir=str(tmp_path), dtype="float32", block_size=4, num_blocks=256
    )
    single = Running(create_app(engine, model_name=NAME, owns_engine=True))
    try:
        ok = {"model": NAME, "messages": user("Hi"), "max_tokens": 3, "temperature": 0}
        cases = [
            ("/v1/chat/completions", b"{not json", {}),
            ("/v1/chat/completions", {**ok, "n": 2}, {}),
            ("/v1/chat/completions", {**ok, "model": "nope"}, {}),
            ("/v1/chat/completions", {"model": NAME}, {}),
            ("/v1/chat/completions", ok, {"X-Session-Id": "no-such-session"}),
            ("/v1/chat/completions", {**ok, "max_tokens": 10**6}, {}),
            ("/v1/completions", {"model": NAME, "prompt": "abc", "logprobs": 2}, {}),
            ("/v1/nothing", None, {}),
        ]
        for path, body, headers in cases:
            want, got = raw(single.url, path, body, headers), raw(c.url, path, body, headers)
            assert got[0] == want[0], (path, body if not isinstance(body, bytes) else body[:20], want[:2], got[:2])
            if isinstance(want[1], dict) and "error" in want[1]:
                assert {k: got[1]["error"][k] for k in ("type", "code", "param")} == {
                    k: want[1]["error"][k] for k in ("type", "code", "param")
                }, (path, want[1], got[1])
        for path in ("/v1/models", "/health"):
            want, got = raw(single.url, path), raw(c.url, path)
            assert got[0] == want[0] == 200 and set(got[1]) == set(want[1]), (want, got)
        want, got = raw(single.url, "/v1/chat/completions", ok), raw(c.url, "/v1/chat/completions", ok)
        assert (
            got[0] == want[0] == 200 and set(got[1]) == set(want[1]) and set(got[1]["usage"]) == set(want[1]["usage"])
        )
        assert (
            got[1]["choices"][0]["message"]["content"] == want[1]["choices"][0]["message"]["content"]
        )  # same greedy reply
        streamed = {**ok, "stream": True, "stream_options": {"include_usage": True}}
        want, got = raw(single.url, "/v1/chat/completions", streamed), raw(c.url, "/v1/chat/completions", streamed)
        assert got[2]["content-type"] == want[2]["content-type"]

        def shape(text: str) -> list:
            events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            return [e if e == "[DONE]" else sorted(json.loads(e)) for e in events]

        assert shape(got[1]) == shape(want[1])
    finally:
        single.stop()


def test_a_client_that_goes_away_mid_stream_frees_its_request(cluster):
    """Hostile: the client closes the connection after a few events; the cancellation crosses
    the proxy, the ingress and the replica, and the engine drops the request (nothing stays
    running on any replica)."""
    c = cluster

    def finished(reason: str) -> float:
        return sum(
            v
            for (name, labels), v in metrics(c.url).items()
            if name == "chatkv:request_success_total" and dict(labels).get("finished_reason") == reason
        )

    aborted = finished("aborted")
    req = urllib.request.Request(
        c.url + "/v1/chat/completions",
        method="POST",
        headers={"Content-Type": "application/json"},
        data=json.dumps(
            {
                "model": NAME,
                "messages": user("Talk for a long time"),
                "max_tokens": 900,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode(),
    )
    r = urllib.request.urlopen(req, timeout=DEADLINE_S)
    seen = 0
    for line in r:
        seen += line.startswith(b"data: ")
        if seen == 3:
            break
    r.close()

    def running() -> float:
        m = metrics(c.url)
        return sum(
            v
            for (name, _), v in m.items()
            if name in ("chatkv:num_requests_running", "chatkv:server_requests_in_flight")
        )

    poll("no request left running on the replicas", lambda: running() == 0)
    assert finished("aborted") == aborted + 1  # stopped, not run to its 900 tokens
