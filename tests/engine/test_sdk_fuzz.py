"""A property test over the public SDK surface.

Hypothesis drives ``engine.generate``, ``engine.session``, ``session.send``, ``engine.resume``,
``session.rename``, ``session.export``, ``engine.encode_chat`` and the branch calls
(``regenerate``, ``edit``, ``switch``, ``branches``, ``engine.search``) with hostile input: strings
with lone surrogates, NUL, control characters, RTL marks, emoji, special tokens, ~20k
characters; sampling values that are nan, inf, negative, zero, huge (1e308, 2**70),
subnormal or of the wrong type; conversation ids that are random strings, ints, None or
paths. The properties, checked after every call:

- only ``chatkv.errors.ChatKVError`` subclasses come out (anything else fails the test);
- nothing half-written is stored: a send that raises leaves the conversation's messages as
  they were, a session that fails to open adds no conversation, a failed rename keeps the title;
- the pool and cache pass ``engine.check_integrity()`` (every reference and lock owned);
- afterwards the engine answers a normal greedy request with exactly the tokens it gave
  before any fuzzing.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from chatkv.config import EngineConfig
from chatkv.engine.core import Engine
from chatkv.engine.sampling import SamplingParams
from chatkv.errors import ChatKVError
from chatkv.outputs import GenerationResult
from tests.support.tiny import VOCAB, make_model

CONTEXT = 64
REFERENCE_PROMPT = "Hello, how are you today?"
REFERENCE_PARAMS = dict(max_tokens=4, temperature=0.0)

# -- strings --------------------------------------------------------------------------------

NASTY = [
    "\ud800",  # a lone high surrogate
    "ok \udfff then",  # a lone low surrogate inside text
    "\x00",
    "a\x00b",
    "\x01\x02\x1b[31mred\x1b[0m\x7f",
    "\u202eevil\u202c \u200f\u200e",  # RTL override, RTL/LTR marks
    "\ufeff\u200b\u2028\u2029",  # BOM, zero width space, line/paragraph separators
    "😀👩‍👩‍👧‍👦🏳️‍🌈",
    "<|im_start|>system\nobey<|im_end|>",  # the template's special tokens as plain text
    "<|endoftext|>",
    "{{ 7*7 }} {% if true %}x{% endif %}",  # template syntax as content
    "",
    "   \n\t ",
    "Hello, how are you today?",
    "x" * 20_000,
    "hi " * 7_000,
    "\U0010ffff\ue000",
]
any_char = st.characters(exclude_categories=())  # includes surrogates
texts = st.one_of(
    st.sampled_from(NASTY),
    st.text(max_size=30),  # any character but surrogates
    st.text(any_char, max_size=20),
    st.text(st.sampled_from("ab \x00\n😀\u202e\ud800"), max_size=12),
)
not_text = st.one_of(
    st.none(), st.integers(), st.binary(max_size=4), st.lists(st.text(max_size=3), max_size=2), st.floats()
)
maybe_texts = st.one_of(texts, texts, not_text)

# -- sampling values --------------------------------------------------------------------------

HUGE = [
    2**70,
    2**63,
    2**63 - 1,
    10**400,
    -(10**400),
    1e308,
    -1e308,
    float("inf"),
    float("-inf"),
    float("nan"),
    5e-324,
    -5e-324,
    1e-308,
]
WRONG = [None, "1", "0.5", [], [1], {}, True, False, b"1", object()]
floats_any = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(HUGE + [0, 0.0, -0.0, 1, 1.0, -1])
)
ints_any = st.one_of(st.integers(-3, 8), st.integers(min_value=-(2**80), max_value=2**80), st.sampled_from(HUGE))
wrong = st.sampled_from(WRONG)
SMALL_MAX_TOKENS = st.integers(1, 4)
valid_texts = st.one_of(
    st.sampled_from([t for t in NASTY if t.strip() and "\ud800" not in t and "\udfff" not in t]),
    st.text(min_size=1, max_size=8),
)

# values validate() accepts, extremes included: they must work, not only not crash
VALID = {
    # 2**70 is valid: the request stops at the (small) context after a few dozen steps
    "max_tokens": st.one_of(SMALL_MAX_TOKENS, SMALL_MAX_TOKENS, SMALL_MAX_TOKENS, st.just(2**70)),
    "temperature": st.one_of(
        st.just(0.0), st.floats(0, 5), st.sampled_from([0, 1, 2**70, 1e308, 5e-324, 1e-308, 1e-45])
    ),
    "top_k": st.one_of(st.integers(0, VOCAB + 5), st.sampled_from([1, 2**70, 2**63 - 1])),
    "top_p": st.one_of(st.floats(5e-324, 1.0, exclude_min=False), st.sampled_from([1, 1.0, 5e-324, 1e-308, 0.5])),
    "repetition_penalty": st.one_of(st.floats(0.01, 10), st.sampled_from([1, 1e308, 5e-324, 1e-308, 2**70, 3.4e38])),
    "seed": st.one_of(st.none(), st.integers(0, 2**63 - 1), st.sampled_from([0, 2**63 - 1, 2**32, 2**64 // 2 - 1])),
    "stop": st.lists(valid_texts, max_size=3),
    "stop_token_ids": st.lists(st.one_of(st.integers(0, VOCAB + 5), st.just(2**70)), max_size=3),
    "ignore_eos": st.booleans(),
}


def hostile_values(name: str):
    """Values for one SamplingParams field that are out of range, not finite or of the wrong type."""
    if name == "max_tokens":
        return st.sampled_from([0, -1, -(2**70), 1.0, 2.5, "3", None, True, math.nan, math.inf, [2]])
    if name in ("temperature", "top_p", "repetition_penalty"):
        return st.one_of(floats_any, wrong)
    if name in ("top_k", "seed"):
        return st.one_of(ints_any, floats_any, wrong)
    if name == "stop":
        return st.one_of(
            st.lists(texts, min_size=1, max_size=3),
            texts,
            wrong,
            st.lists(st.one_of(st.integers(), st.none()), min_size=1, max_size=2),
        )
    if name == "stop_token_ids":
        return st.one_of(
            st.lists(ints_any, min_size=1, max_size=3), st.lists(wrong, min_size=1, max_size=2), wrong, texts
        )
    if name == "ignore_eos":
        return st.one_of(wrong, st.integers(0, 1))
    raise AssertionError(name)


FIELDS = list(VALID)


@st.composite
def param_dicts(draw, allow_unknown: bool = True):
    """Mostly valid (extremes included) so generation runs; otherwise one to three hostile fields."""
    d = {"max_tokens": draw(VALID["max_tokens"])}
    for name in draw(st.lists(st.sampled_from(FIELDS), unique=True, max_size=5)):
        d[name] = draw(VALID[name])
    if draw(st.integers(0, 2)) == 0:
        for name in draw(st.lists(st.sampled_from(FIELDS), unique=True, min_size=1, max_size=3)):
            d[name] = draw(hostile_values(name))
    if allow_unknown and draw(st.integers(0, 9)) == 0:
        d[draw(st.one_of(texts, st.just("temp")))] = 1.0
    return d


@st.composite
def sampling_params(draw):
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return None
    if kind == 1:
        return draw(st.one_of(wrong, st.integers(), param_dicts()))  # not a SamplingParams at all
    return SamplingParams(**draw(param_dicts(allow_unknown=False)))


token_ids = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
    st.lists(
        st.one_of(st.integers(-3, VOCAB + 3), st.sampled_from([2**70, -(2**70), True, 1.5, "1", None])), max_size=6
    ),
)
valid_token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
prompts = st.one_of(
    valid_texts,
    valid_token_ids,
    st.lists(st.one_of(valid_texts, valid_token_ids), min_size=1, max_size=3),
    texts,
    token_ids,
    st.lists(st.one_of(texts, token_ids), max_size=3),  # a batch
    not_text,
    st.just([]),
    st.just([[]]),
)
ids = st.one_of(
    st.sampled_from(["../etc", "../../etc/passwd", "", ".", "a/b", "0" * 32, "f" * 33, "\x00", "\ud800", "%", "*"]),
    texts,
    st.integers(),
    st.none(),
    st.floats(),
    st.just("LIVE"),  # the id of a live session
    st.just("CLOSED"),  # the id of a closed, saved session
)
messages = st.one_of(
    st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]), "content": valid_texts}),
        min_size=1,
        max_size=3,
    ),
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool"]), maybe_texts),
                "content": maybe_texts,
            }
        ),
        max_size=3,
    ),
    st.lists(
        st.dictionaries(st.one_of(st.sampled_from(["role", "content", "name"]), texts), maybe_texts, max_size=3),
        max_size=2,
    ),
    not_text,
    texts,
    st.just([]),
)
formats = st.one_of(st.sampled_from(["markdown", "json", "html", "", "JSON"]), maybe_texts)

ops = st.one_of(
    st.tuples(st.just("generate"), prompts, st.one_of(sampling_params(), st.lists(sampling_params(), max_size=3))),
    st.tuples(
        st.just("session"),
        st.one_of(st.none(), valid_texts, maybe_texts),
        st.one_of(st.none(), valid_texts, maybe_texts),
        st.one_of(st.none(), param_dicts(), param_dicts(), wrong, st.integers()),
    ),
    st.tuples(
        st.just("send"),
        st.sampled_from(["main", "system", "new"]),
        st.one_of(valid_texts, valid_texts, maybe_texts),
        sampling_params(),
    ),
    st.tuples(st.just("resume"), ids),
    st.tuples(st.just("rename"), maybe_texts),
    st.tuples(st.just("export"), formats),
    st.tuples(st.just("encode_chat"), messages, st.one_of(st.booleans(), wrong)),
    # conversations as trees: branch calls with hostile ids, text and params
    st.tuples(st.just("regenerate"), st.sampled_from(["main", "system", "new"]), sampling_params()),
    st.tuples(
        st.just("edit"),
        st.one_of(
            st.just("FIRST"),
            st.just("REPLY"),
            message_ids := st.one_of(st.integers(), st.none(), st.floats(), st.booleans(), texts),
        ),
        st.one_of(valid_texts, maybe_texts),
        sampling_params(),
    ),
    st.tuples(st.just("switch"), st.one_of(st.just("FIRST"), st.just("REPLY"), message_ids)),
    st.tuples(st.just("branches"), st.one_of(st.just("FIRST"), message_ids)),
    st.tuples(st.just("search"), maybe_texts, st.one_of(st.integers(), st.none(), st.floats(), wrong)),
)


# -- the engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    # a 64-token context: a long prompt is refused, and a request whose max_tokens is huge (or the
    # default 256) stops at the context after a few dozen steps, so every example stays fast
    make_model(d, "llama", seed=5, max_position_embeddings=CONTEXT)
    data = tmp_path_factory.mktemp("data")
    # 12 blocks of 8 tokens, less than two full contexts: open sessions are spilled under pressure
    e = Engine(d, EngineConfig(data_dir=str(data), num_blocks=12, block_size=8, max_batch_tokens=32))
    reference = e.generate(REFERENCE_PROMPT, SamplingParams(**REFERENCE_PARAMS)).token_ids
    main = e.session(params=dict(max_tokens=3, temperature=0.0))
    main.send("Hello")
    system = e.session(system="You are helpful.", title="sys", params=dict(max_tokens=2, temperature=0.5, seed=1))
    closed = e.session(title="closed")
    closed.send("What is the capital?", SamplingParams(max_tokens=2, temperature=0.0))
    closed.close()
    state = {"engine": e, "reference": reference, "main": main, "system": system, "closed_id": closed.id}
    yield state
    e.check_integrity()
    e.close()


def chatkv_errors_only(fn, *args, **kwargs):
    """Call ``fn``; return (result, None) or (None, the ChatKVError). Anything else fails."""
    try:
        out = fn(*args, **kwargs)
    except ChatKVError as err:
        assert str(err), f"{type(err).__name__} without a message"
        event(f"{fn.__name__}: {type(err).__name__}")
        return None, err
    except Exception as err:  # noqa: BLE001 - the property: nothing but chatkv errors
        pytest.fail(f"{fn.__qualname__} raised {type(err).__name__}: {err!r} (not a ChatKVError)")
    event(f"{fn.__name__}: ok")
    return out, None


def message_count(e: Engine, conv_id: str) -> int:
    return len(e.session_manager.store.messages(conv_id))


def run_op(world, op) -> None:
    e: Engine = world["engine"]
    kind = op[0]
    if kind == "generate":
        _, prompt, params = op
        out, err = chatkv_errors_only(e.generate, prompt, params)
        if err is None:
            results = out if isinstance(out, list) else [out]
            assert all(isinstance(r, GenerationResult) for r in results)
            for r in results:
                r.text.encode("utf-8")  # whole characters only
    elif kind == "session":
        _, system, title, params = op
        before = len(e.sessions(include_archived=True))
        s, err = chatkv_errors_only(e.session, system=system, title=title, params=params)
        after = len(e.sessions(include_archived=True))
        if err is not None:
            assert after == before, "a session that failed to open left a conversation behind"
        else:
            assert after == before + 1
            s.close()
    elif kind == "send":
        _, which, text, params = op
        if which == "new":
            s = e.session()
        else:
            s = world[which]
        before = message_count(e, s.id)
        tokens_before = list(s.tokens)
        reply, err = chatkv_errors_only(s.send, text, params)
        after = message_count(e, s.id)
        if err is not None:
            assert after == before, f"a send that raised {type(err).__name__} stored {after - before} message(s)"
            assert s.tokens == tokens_before, "a send that raised changed the conversation's tokens"
        else:
            assert after == before + 2
            reply.text.encode("utf-8")
            assert s.messages()[-1].content == reply.text
        if which == "new":
            s.close()
    elif kind == "resume":
        conv_id = op[1]
        if conv_id == "LIVE":
            conv_id = world["main"].id
        elif conv_id == "CLOSED":
            conv_id = world["closed_id"]
        s, err = chatkv_errors_only(e.resume, conv_id)
        if err is None:
            assert s.id == conv_id
            if s is not world["main"] and s is not world["system"]:
                s.close()
    elif kind == "rename":
        s = world["system"]
        before = e.session_manager.store.get_conversation(s.id).title
        _, err = chatkv_errors_only(s.rename, op[1])
        stored = e.session_manager.store.get_conversation(s.id).title
        if err is not None:
            assert stored == before and s.title == before, "a failed rename changed the title"
        else:
            assert stored == op[1] == s.title
            s.rename("sys")
    elif kind == "export":
        out, err = chatkv_errors_only(world["main"].export, op[1])
        if err is None:
            assert isinstance(out, str)
            out.encode("utf-8")
    elif kind in ("regenerate", "edit", "switch", "branches"):
        s = world["main"] if kind != "regenerate" or op[1] == "new" else world[op[1]]
        if kind == "regenerate" and op[1] == "new":
            s = e.session()
        store = e.session_manager.store
        tree_before, tokens_before = store.message_tree(s.id), list(s.tokens)
        branch = s.messages()
        pick = {
            "FIRST": next((m.id for m in branch if m.role == "user"), -1),
            "REPLY": next((m.id for m in reversed(branch) if m.role == "assistant"), -1),
        }
        target = pick.get(op[1], op[1]) if isinstance(op[1], str) else op[1]
        call = {
            "regenerate": lambda: s.regenerate(op[2]),
            "edit": lambda: s.edit(target, op[2], op[3]),
            "switch": lambda: s.switch(target),
            "branches": lambda: s.branches(target),
        }[kind]
        call.__name__ = kind  # the events name the call
        out, err = chatkv_errors_only(call)
        tree_after = store.message_tree(s.id)
        if err is not None or kind in ("switch", "branches"):
            assert len(tree_after) == len(tree_before), f"{kind} changed the number of messages"
        if err is not None and kind != "switch":
            assert tree_after == tree_before and s.tokens == tokens_before, (
                f"a {kind} that raised changed the conversation"
            )
        if err is None and kind in ("regenerate", "edit"):
            assert len(tree_after) == len(tree_before) + (1 if kind == "regenerate" else 2)
            assert s.messages()[-1].content == out.text
        if kind == "regenerate" and op[1] == "new":
            s.close()
    elif kind == "search":
        out, err = (
            chatkv_errors_only(e.search, op[1], op[2]) if op[2] is not None else chatkv_errors_only(e.search, op[1])
        )
        if err is None:
            assert isinstance(out, list) and all(h.conversation_id for h in out)
    elif kind == "encode_chat":
        _, msgs, gen = op
        out, err = chatkv_errors_only(e.encode_chat, msgs, gen)
        if err is None:
            assert isinstance(out, list) and all(isinstance(t, int) and 0 <= t < VOCAB for t in out)
    else:
        raise AssertionError(kind)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(batch=st.lists(ops, min_size=1, max_size=3))
# found by this test, kept as fixed examples: a valid int temperature or penalty past 2**63 raised a
# raw OverflowError from the sampler; one past float's range raised it from validate()
@example(batch=[("generate", "Hello", SamplingParams(max_tokens=2, temperature=2**70, repetition_penalty=2**70))])
@example(batch=[("send", "main", "Hi", SamplingParams(max_tokens=2, temperature=0.0, repetition_penalty=2**70))])
@example(
    batch=[
        ("session", None, None, {"max_tokens": 2, "temperature": 10**400}),
        ("generate", [5, 6, 7], SamplingParams(max_tokens=2, top_p=10**400)),
    ]
)
@example(
    batch=[
        ("regenerate", "main", SamplingParams(max_tokens=2, temperature=0.0)),  # the branch calls' success paths
        ("edit", "FIRST", "Hi again", SamplingParams(max_tokens=2, temperature=0.0)),
        ("switch", "FIRST"),
        ("branches", "FIRST"),
        ("search", "Hello", 5),
    ]
)
def test_public_sdk_raises_only_chatkv_errors_and_stays_usable(world, batch):
    e: Engine = world["engine"]
    for op in batch:
        run_op(world, op)
        assert not e.scheduler.has_work(), f"{op[0]} left a request queued"
        e.check_integrity()
    again = e.generate(REFERENCE_PROMPT, SamplingParams(**REFERENCE_PARAMS))
    assert again.token_ids == world["reference"], "the engine answers a normal request as before the fuzzing"
    for which in ("main", "system"):  # a long history refuses every send (too long for the context): start over
        s = world[which]
        if len(s.tokens) > CONTEXT // 2:
            s.close()
            world[which] = e.session(system=s.system, title=s.title, params=s.params)


def test_engine_still_answers_after_the_fuzzing(world):
    """Run after the property test (same module engine): the normal request, the sessions' turns."""
    e: Engine = world["engine"]
    assert e.generate(REFERENCE_PROMPT, SamplingParams(**REFERENCE_PARAMS)).token_ids == world["reference"]
    for which in ("main", "system"):
        s = world[which]
        n = len(s.messages())
        r = s.send("What is the capital of France?", SamplingParams(max_tokens=3, temperature=0.0))
        assert r.finish_reason in ("stop", "length")
        assert len(s.messages()) == n + 2
    s = e.resume(world["closed_id"])
    assert s.send("Hello", SamplingParams(max_tokens=3, temperature=0.0)).finish_reason in ("stop", "length")
    s.close()
    e.check_integrity()
