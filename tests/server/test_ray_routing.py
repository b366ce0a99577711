"""The routing policy of ``chatkv serve --ray`` (``chatkv/server/ray/affinity.py``) and the
``--ray`` options, without a Ray cluster: what a request is keyed by, what the table learns
from answers and replica reports, the choice (affinity, yielding under load, least loaded),
the merged /metrics, and the refusals of bad options. The real cluster is
tests/server/test_ray_serve.py."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from chatkv.server.cli import _parser
from chatkv.server.history import prefix_keys
from chatkv.server.ray import options as ray_options
from chatkv.server.ray.affinity import (
    KEY_BYTES,
    STRONG_CHARS,
    AffinityTable,
    RouteKeys,
    choose,
    prompt_keys,
    route_keys,
)
from chatkv.server.ray.prom_merge import merge

SYS = {"role": "system", "content": "Be brief."}


def body(**kw) -> bytes:
    return json.dumps(kw).encode()


def chat_keys_of(messages, session=None) -> RouteKeys:
    headers = {"x-session-id": session} if session else {}
    return route_keys("/v1/chat/completions", headers, body(model="m", messages=messages))


def table(*replicas) -> AffinityTable:
    t = AffinityTable()
    t.set_replicas(replicas)
    return t


# ------------------------------------------------------------------ keys


def test_keys_of_a_chat_are_its_message_prefixes_as_the_replica_hashes_them():
    msgs = [
        SYS,
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "?"},
    ]
    k = chat_keys_of(msgs)
    assert k.kind == "chat" and k.session is None
    assert k.prefixes == [d.hex()[:KEY_BYTES] for d in prefix_keys(msgs)]  # what replicas report
    assert k.strong == [False, False, True, True]  # strong from the first assistant message on
    long_sys = {"role": "system", "content": "x" * STRONG_CHARS}
    assert chat_keys_of([long_sys, {"role": "user", "content": "q"}]).strong == [True, True]


def test_session_ids_from_the_header_or_the_body_and_new_is_no_session():
    assert chat_keys_of([{"role": "user", "content": "q"}], "abc").session == "abc"
    assert chat_keys_of([{"role": "user", "content": "q"}], "new").session is None
    k = route_keys(
        "/v1/chat/completions", {}, body(model="m", session_id="s1", messages=[{"role": "user", "content": "q"}])
    )
    assert k.session == "s1"
    k = route_keys("/v1/chat/completions", {"x-session-id": "h"}, body(session_id="b", messages=[]))
    assert k.session == "h"  # the header wins, as in the single server


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"[1,2]", b'{"messages": "no"}', b'{"messages": [{"role": 1}]}', b"\xff\xfe", b'{"prompt": {"a": 1}}'],
)
def test_a_body_the_router_cannot_read_is_routed_by_load(raw):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models"):
        k = route_keys(path, {}, raw)
        assert k.prefixes == [] and k.session is None


def test_completion_prompts_are_keyed_by_blocks():
    text = "abcdefgh" * 40  # 320 characters: 5 blocks of 64
    keys, strong = prompt_keys(text)
    assert len(keys) == 5 and not any(strong)
    assert prompt_keys(text + "different tail")[0][:5] == keys  # a shared prefix shares its keys
    assert prompt_keys("X" + text[1:])[0][0] != keys[0]
    ids, _ = prompt_keys(list(range(40)))
    assert len(ids) == 2 and prompt_keys(list(range(33)))[0] == ids
    k = route_keys("/v1/completions", {}, body(model="m", prompt=[text]))
    assert k.kind == "completion" and k.prefixes == keys


# ------------------------------------------------------------------ the table and the choice


def test_a_session_goes_to_its_holder_until_it_is_overloaded():
    t = table("a", "b")
    t.learn(RouteKeys(), "b", session="s1")  # the answer to "new" carried s1
    k = RouteKeys(session="s1")
    assert choose(k, ["a", "b"], {"a": 0, "b": 3}, t, imbalance=4) == ([["b"], ["a"]], "session")
    ranks, reason = choose(k, ["a", "b"], {"a": 0, "b": 5}, t, imbalance=4)
    assert reason == "yielded" and ranks[0] == ["a"]
    assert choose(RouteKeys(session="unknown"), ["a", "b"], {"a": 2, "b": 1}, t, 4)[0][0] == ["b"]


def test_a_stateless_history_goes_to_the_replica_that_answered_its_previous_prompt():
    t = table("a", "b")
    first = [SYS, {"role": "user", "content": "hi"}]
    t.learn(chat_keys_of(first), "a")
    nxt = chat_keys_of(first + [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}])
    assert choose(nxt, ["a", "b"], {"a": 1, "b": 0}, t, 4) == ([["a"], ["b"]], "prefix")
    # another conversation with the same short system prompt only breaks ties with it
    other = chat_keys_of([SYS, {"role": "user", "content": "other"}])
    assert choose(other, ["a", "b"], {"a": 1, "b": 0}, t, 4)[0][0] == ["b"]
    ranks, reason = choose(other, ["a", "b"], {"a": 0, "b": 0}, t, 4)
    assert (ranks[0], reason) == (["a"], "shared_prefix")


def test_the_least_loaded_then_the_replica_with_fewer_sessions_takes_a_new_conversation():
    t = table("a", "b", "c")
    for i in range(3):
        t.learn(RouteKeys(), "a", session=f"s{i}")
    t.learn(RouteKeys(), "b", session="t0")
    rng = random.Random(0)
    assert choose(RouteKeys(), ["a", "b", "c"], {}, t, 4, rng) == ([["c"], ["b"], ["a"]], "least_loaded")
    assert choose(RouteKeys(), ["a", "b", "c"], {"c": 2}, t, 4, rng)[0] == [["b"], ["a"], ["c"]]
    assert choose(RouteKeys(pin="a"), ["a", "b"], {}, t, 4) == ([["a"]], "pinned")
    assert choose(RouteKeys(pin="gone"), ["a", "b"], {}, t, 4)[1] == "least_loaded"
    assert choose(RouteKeys(), [], {}, t, 4) == ([], "none")


def test_reports_fill_in_and_take_back_but_never_move_a_session_an_answer_placed():
    t = table("a", "b")
    t.learn(RouteKeys(), "a", session="s1", at=100.0)
    t.merge_report("b", {"at": 101.0, "sessions": ["s1", "s2"], "prefixes": ["k1"]})
    assert t.session_holder("s1") == "a"  # b may hold s1's old KV; the answer is newer news
    assert t.session_holder("s2") == "b"  # something this process never saw
    assert t.prefix_holder(RouteKeys(prefixes=["k1"], strong=[True])) == ("b", True)
    t.merge_report("a", {"at": 102.0, "sessions": []})  # a spilled s1 after the answer
    assert t.session_holder("s1") is None
    t.learn(RouteKeys(), "a", session="s3", at=105.0)
    t.merge_report("a", {"at": 104.0, "sessions": []})  # a report older than the answer
    assert t.session_holder("s3") == "a"
    t.merge_report("a", {"junk": 1})
    t.merge_report("a", None)
    t.set_replicas(["a"])  # b died: what it held is forgotten
    assert t.session_holder("s2") is None and t.prefix_holder(RouteKeys(prefixes=["k1"], strong=[True]))[0] is None


def test_the_table_is_bounded():
    t = AffinityTable(max_sessions=3, max_prefixes=4)
    t.set_replicas(["a"])
    for i in range(10):
        t.learn(RouteKeys(prefixes=[f"p{i}"], strong=[True]), "a", session=f"s{i}")
    assert [t.session_holder(f"s{i}") for i in (6, 7, 9)] == [None, "a", "a"]
    assert t.prefix_holder(RouteKeys(prefixes=["p5"], strong=[True]))[0] is None
    assert t.prefix_holder(RouteKeys(prefixes=["p6"], strong=[True]))[0] == "a"


# ------------------------------------------------------------------ /metrics


def test_metrics_of_replicas_merge_into_one_valid_exposition():
    a = '# HELP x_total X\n# TYPE x_total counter\nx_total{model_name="m"} 1.0\n# HELP g G\n# TYPE g gauge\ng 2.0\n'
    b = '# HELP x_total X\n# TYPE x_total counter\nx_total{model_name="m"} 3.0\n# HELP g G\n# TYPE g gauge\ng 4.0\n'
    text = merge({"r1": a, "r2": b}, '# TYPE r counter\nr_total{reason="chat:session"} 5.0\n')
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples[("x_total", (("model_name", "m"), ("replica", "r1")))] == 1.0
    assert samples[("x_total", (("model_name", "m"), ("replica", "r2")))] == 3.0
    assert samples[("g", (("replica", "r2"),))] == 4.0
    assert samples[("r_total", (("reason", "chat:session"),))] == 5.0
    assert text.count("# TYPE x_total counter") == 1


# ------------------------------------------------------------------ the --ray options (hostile)


def check(*argv) -> str | None:
    return ray_options.check(_parser().parse_args(list(argv)))


@pytest.mark.parametrize("n", ["0", "-1", "1025", "100000"])
def test_bad_replica_counts_are_refused(n):
    assert check("--ray", "--replicas", n) == f"--replicas must be between 1 and {ray_options.MAX_REPLICAS}, got {n}"


def test_ray_options_need_ray_and_sane_resources(tmp_path):
    assert check("--replicas", "2") == "--replicas needs --ray"
    assert check("--ray-address", "auto") == "--ray-address needs --ray"
    assert "one of them > 0" in check("--ray", "--replica-cpus", "0")
    assert "one of them > 0" in check("--ray", "--replica-cpus", "-1")
    assert "not a directory" in check("--ray", "--model", str(tmp_path / "nope"))
    assert check("--ray", "--model", str(tmp_path)) is None
    assert check() is None


def test_ray_without_the_extra_names_the_fix():
    """As a user without ray installed runs it (the import blocked the way Python documents)."""
    code = "import sys; sys.modules['ray'] = None; from chatkv.server.cli import main; sys.exit(main(['--ray']))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    assert "pip install 'chatkv[ray]'" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_options_for_serve_s_own_tools():
    """``serve run chatkv.server.ray.deployments:app_builder model=DIR replicas=3 ...`` (strings, as
    Serve passes them)."""
    from chatkv.server.ray.deployments import app_builder, options_from_args

    o = options_from_args(
        {
            "model": "/m",
            "replicas": "3",
            "replica_cpus": "0.5",
            "routing": "round_robin",
            "max_concurrency": "8",
            "dtype": "float32",
            "data_dir": "/d",
        }
    )
    assert (o.replicas, o.replica_cpus, o.routing, o.replica.max_concurrency) == (3, 0.5, "round_robin", 8)
    assert (o.replica.model, o.replica.engine) == ("/m", {"dtype": "float32", "data_dir": "/d"})
    with pytest.raises(ValueError, match="model=DIR"):
        app_builder({"replicas": "2"})
