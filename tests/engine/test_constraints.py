"""Constrained decoding (chatkv.engine.constraints): every constraint kind walked with random
logits through the real sampler on the default model's real tokenizer, each output that ends
by stop checked (jsonschema, re.fullmatch, membership); validation errors; the compile cache;
the matcher's refusals, rollback and stop tokens; unconstrained rows untouched."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from chatkv.engine.constraints import (
    Constraint,
    ConstraintCompiler,
    apply_bitmask,
    compiler_for,
    constraint_of,
)
from chatkv.engine.sampling import SamplingParams, make_generator, mask_rows, sample
from chatkv.errors import InvalidRequest

pytestmark = pytest.mark.tiny_model("llama", seed=0)  # the engine tests' model (model_dir)


def _default_tokenizer():
    """The packaged default model's tokenizer: the converted model's files when the data dir has
    them, else read from the GGUF itself (no conversion of the weights)."""
    from transformers import AutoTokenizer

    from chatkv.storage.paths import data_dir
    from chatkv.weights import load_tokenizer, packaged_gguf_path
    from chatkv.weights.gguf import default_model_dir

    gguf = packaged_gguf_path()
    converted = default_model_dir(data_dir(), torch.bfloat16, gguf.stem)
    if (converted / "tokenizer.json").is_file():
        return load_tokenizer(converted)
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The walks sample a 49,152-float row one token at a time; on two cores shared with other
    work, torch's two threads made every op of the sampler wait for the busy one (a walk's token
    took ~120 ms instead of ~40 ms on one thread)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    try:
        t = _default_tokenizer()
    except Exception as err:  # the model package missing: nothing here can run on its vocabulary
        pytest.skip(f"the default model's tokenizer cannot be loaded: {err}")
    assert len(t) == 49152
    return t


@pytest.fixture(scope="module")
def compiler(tok):
    return ConstraintCompiler(tok)


@pytest.fixture(scope="module")
def bonus(tok):
    """+6 on the tokens that only close things (quotes, brackets, commas, parens) and on EOS:
    random logits plus this end in tens of tokens instead of wandering inside a string."""
    b = torch.zeros(len(tok))
    for i in range(len(tok)):
        s = tok.decode([i]).strip()
        if s and all(c in '"}],)' for c in s):
            b[i] = 6.0
    b[tok.eos_token_id] = 6.0
    return b


SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 10},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "integer"}},
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
            "grid": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer", "minimum": -3, "maximum": 3}, "maxItems": 2},
                "maxItems": 2,
            },
        },
        "required": ["tags", "grid"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, None]}},
        "required": ["colour", "size"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "temp": {"type": "number", "exclusiveMinimum": -10, "exclusiveMaximum": 40},
            "step": {"type": "integer", "multipleOf": 5},
        },
        "required": ["age", "ratio", "temp", "step"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "note": {"type": "string", "maxLength": 8},
            "done": {"type": "boolean"},
        },
        "required": ["id"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "word": {"type": "string", "minLength": 2, "maxLength": 4},
        },
        "required": ["code", "word"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer"}, {"type": "null"}, {"type": "string", "maxLength": 5}]},
            "n": {"allOf": [{"type": "integer"}, {"minimum": 3, "maximum": 7}]},
            "kind": {"const": "answer"},
        },
        "required": ["value", "n", "kind"],
        "additionalProperties": False,
    },
    {
        "$defs": {
            "p": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/p"}, "b": {"$ref": "#/$defs/p"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "maxLength": 20},
            "sources": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 3},
        },
        "required": ["answer", "sources"],
        "additionalProperties": False,
    },
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}], "items": False},
]
REGEX = r"[0-9]{3}-[0-9]{4}"
CHOICE = ["yes", "no", "maybe so"]
LARK = 'start: "(" expr ")"\nexpr: /[0-9]+/ | /[0-9]+/ " + " expr'
GBNF = 'root ::= "(" expr ")"\nexpr ::= [0-9]+ | [0-9]+ " + " expr'
SUM = r"\([0-9]+( \+ [0-9]+)*\)"


def _valid(params: SamplingParams, text: str) -> bool:
    if params.json_schema is not None or params.json_object:
        try:
            value = json.loads(text)
        except ValueError:
            return False
        if params.json_object:
            return isinstance(value, dict)
        try:
            jsonschema.validate(value, params.json_schema)
        except jsonschema.ValidationError:
            return False
        return True
    if params.regex is not None:
        return re.fullmatch(params.regex, text) is not None
    if params.choice is not None:
        return text in params.choice
    return re.fullmatch(SUM, text) is not None


def _walk(tok, compiler, params: SamplingParams, bonus, gen: torch.Generator, max_tokens: int = 100):
    """Sample with the real sampler from random logits masked by the matcher, as the engine
    would: (text, "stop") when it took EOS or the matcher could only end, (text, "length")."""
    params.validate()
    m = compiler.matcher(constraint_of(params))
    sampler_gen = make_generator(params)
    out: list[int] = []
    for _ in range(max_tokens):
        logits = (torch.randn(1, len(tok), generator=gen) * 2 + bonus).float()
        assert mask_rows(logits, [m]) == [None]
        t = sample(logits[0], params, out, sampler_gen)
        assert m.advance(t), (
            f"the sampler took token {t} ({tok.decode([t])!r}) the mask allowed, and advance refused it"
        )
        if t == tok.eos_token_id:
            return tok.decode(out), "stop"
        out.append(t)
        if m.is_done():
            return tok.decode(out), "stop"
    return tok.decode(out), "length"


CASES = [dict(json_schema=s) for s in SCHEMAS] + [
    dict(json_object=True),
    dict(regex=REGEX),
    dict(choice=CHOICE),
    dict(grammar=LARK),
    dict(grammar=GBNF),
]


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: next(iter(c)) + ("" if "json_schema" not in c else str(SCHEMAS.index(c["json_schema"]))),
)
def test_random_walks_end_valid(tok, compiler, bonus, case):
    """Every output that ends by stop satisfies its constraint; most walks end."""
    gen = torch.Generator().manual_seed(7)
    ended = 0
    for i, temperature in enumerate([1.0, 0.7, 1.5, 0.0]):
        params = SamplingParams(
            temperature=temperature, seed=i, top_k=50 if i == 1 else 0, top_p=0.9 if i == 2 else 1.0, **case
        )
        text, reason = _walk(tok, compiler, params, bonus, gen)
        if reason == "stop":
            ended += 1
            assert _valid(params, text), f"{case}: {text!r} ended by stop and is not valid"
    assert ended >= 2, f"only {ended} of 4 walks ended"


def test_walks_without_a_bonus_never_break_the_mask(tok, compiler):
    """Plain random logits, no help to end: every sampled token is one the matcher takes."""
    gen = torch.Generator().manual_seed(3)
    for case in (dict(json_schema=SCHEMAS[0]), dict(regex=REGEX), dict(grammar=LARK)):
        params = SamplingParams(temperature=1.0, seed=1, **case)
        text, reason = _walk(tok, compiler, params, torch.zeros(len(tok)), gen, max_tokens=40)
        if reason == "stop":
            assert _valid(params, text), text


def test_unconstrained_rows_are_untouched_and_sample_the_same(tok, compiler):
    """A batch mixing free and constrained rows: the free rows' logits are bit-identical and
    their sampled tokens the same as in a batch without the constrained rows."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, len(tok), generator=gen)
    before = logits.clone()
    matchers = [
        None,
        compiler.matcher(constraint_of(SamplingParams(choice=CHOICE))),
        None,
        compiler.matcher(constraint_of(SamplingParams(json_object=True))),
    ]
    assert mask_rows(logits, matchers) == [None] * 4
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.isinf(logits[1]).sum() > len(tok) - 100 and torch.isinf(logits[3]).sum() > 0
    free = SamplingParams(temperature=0.8, seed=5)
    alone = [sample(before[r], free, [], make_generator(free)) for r in (0, 2)]
    mixed = [sample(logits[r], free, [], make_generator(free)) for r in (0, 2)]
    assert alone == mixed
    untouched = before.clone()
    assert mask_rows(untouched, [None] * 4) == [None] * 4 and torch.equal(untouched, before)


def test_choice_ends_when_nothing_else_can_follow(tok, compiler):
    m = compiler.matcher(constraint_of(SamplingParams(choice=["yes", "no"])))
    ids = tok.encode("yes", add_special_tokens=False)
    for t in ids:
        assert not m.is_done()
        assert m.advance(t)
    assert m.is_done() and m.eos_allowed()
    row = torch.zeros(len(tok))
    m.mask_into(row)
    assert torch.isfinite(row).nonzero().flatten().tolist() == [tok.eos_token_id]


def test_advance_refuses_and_stays_usable_rollback_and_reset(tok, compiler):
    m = compiler.matcher(constraint_of(SamplingParams(regex=REGEX)))
    digits = tok.encode("123", add_special_tokens=False)
    letter = tok.encode("a", add_special_tokens=False)[0]
    assert not m.advance(letter)  # refused, the matcher goes on
    for t in digits:
        assert m.advance(t)
    assert not m.eos_allowed()
    dash = tok.encode("-", add_special_tokens=False)[0]
    assert m.validate([dash, letter]) == 1  # a proposal: one token acceptable, nothing consumed
    assert m.advance(dash)
    m.rollback(1)  # the dash rejected again
    assert not m.advance(letter) and m.advance(dash)
    m.reset()
    assert not m.advance(dash) and m.advance(digits[0])


def test_extra_stop_tokens_only_where_the_constraint_may_end(tok, compiler):
    """generation_config's other EOS ids (and stop_token_ids) are allowed exactly where EOS is."""
    other = 0  # <|endoftext|>, not the tokenizer's EOS
    assert other != tok.eos_token_id
    m = compiler.matcher(constraint_of(SamplingParams(regex="[0-9]+")), stop_ids=[other, tok.eos_token_id])
    row = torch.zeros(len(tok))
    m.mask_into(row)
    assert row[other] == float("-inf") and row[tok.eos_token_id] == float("-inf")
    assert not m.advance(other)
    assert m.advance(tok.encode("42", add_special_tokens=False)[0])
    row = torch.zeros(len(tok))
    m.mask_into(row)
    assert row[other] == 0 and row[tok.eos_token_id] == 0
    assert m.validate([other]) == 1
    assert m.advance(other) and m.is_done()


def test_compiled_once_per_constraint_and_bounded(tok):
    c = ConstraintCompiler(tok, capacity=2)
    a = dict(type="object", properties={"x": {"type": "integer"}, "y": {"type": "string"}}, required=["x"])
    b = dict(required=["x"], properties={"y": {"type": "string"}, "x": {"type": "integer"}}, type="object")
    c.matcher(constraint_of(SamplingParams(json_schema=a)))
    c.matcher(constraint_of(SamplingParams(json_schema=json.dumps(a))))  # the same schema as a JSON str
    assert c.compiles == 1
    c.matcher(constraint_of(SamplingParams(json_schema=b)))  # keys in another order: properties come out in
    assert c.compiles == 2  # the schema's order (as OpenAI's do), so it is another constraint
    c.matcher(constraint_of(SamplingParams(regex="a+")))
    c.matcher(constraint_of(SamplingParams(regex="b+")))  # evicts the schemas, least recently used
    assert len(c) == 2
    c.matcher(constraint_of(SamplingParams(regex="a+")))
    assert c.compiles == 4
    c.matcher(constraint_of(SamplingParams(json_schema=a)))
    assert c.compiles == 5 and len(c) == 2
    assert compiler_for(tok) is compiler_for(tok)


def test_properties_come_out_in_the_schemas_order(tok, compiler):
    """{"z", "a"} is written z first (a caller's "reasoning" before its "answer"), not sorted."""
    for order in (["z", "a"], ["a", "z"]):
        schema = {
            "type": "object",
            "properties": {k: {"type": "integer", "minimum": 0, "maximum": 9} for k in order},
            "required": order,
            "additionalProperties": False,
        }
        m = compiler.matcher(constraint_of(SamplingParams(json_schema=schema)))
        text = f'{{"{order[0]}": 1, "{order[1]}": 2}}'
        assert m.validate(tok.encode(text, add_special_tokens=False)) == len(tok.encode(text, add_special_tokens=False))
        wrong = f'{{"{order[1]}": 2, "{order[0]}": 1}}'
        assert m.validate(tok.encode(wrong, add_special_tokens=False)) < len(
            tok.encode(wrong, add_special_tokens=False)
        )


def test_a_padded_model_vocabulary_never_samples_past_the_tokenizer(tmp_path):
    """The tiny models' tokenizer (384 tokens) under logits padded to 400: the padding is -inf."""
    from tests.support.tiny import make_tokenizer

    small = make_tokenizer(tmp_path)
    c = ConstraintCompiler(small)
    m = c.matcher(constraint_of(SamplingParams(json_object=True)))
    row = torch.zeros(400)
    m.mask_into(row)
    assert torch.isinf(row[len(small) :]).all() and torch.isfinite(row[: len(small)]).any()
    assert not m.advance(390)


def test_apply_bitmask_bit_layout():
    row = torch.zeros(70)
    mask = torch.tensor([0b101, -(1 << 31), 0b10], dtype=torch.int32)  # tokens 0, 2, 63 (the sign bit), 65
    apply_bitmask(row, mask)
    assert torch.isfinite(row).nonzero().flatten().tolist() == [0, 2, 63, 65]
    longer = torch.zeros(100)
    apply_bitmask(longer, mask)
    assert torch.isfinite(longer).nonzero().flatten().tolist() == [0, 2, 63, 65]
    for other in (torch.zeros(70, dtype=torch.bfloat16), torch.zeros(2, 70)[:, 0]):  # no numpy view: torch's path
        apply_bitmask(other, mask[:1] if other.shape[0] == 2 else mask)
        assert torch.isfinite(other).nonzero().flatten().tolist() == ([0] if other.shape[0] == 2 else [0, 2, 63, 65])


@pytest.mark.parametrize(
    "kwargs, says",
    [
        (
            dict(json_schema={"type": "integer"}, regex="a"),
            "at most one constraint per request; got json_schema and regex",
        ),
        (dict(choice=["a"], json_object=True), "got choice and json_object"),
        (dict(choice=[]), "choice must be a non-empty list"),
        (dict(choice=["a", ""]), "choice must be a non-empty list of non-empty strings"),
        (dict(choice="abc"), "choice must be a non-empty list"),
        (
            dict(json_schema={"type": "strnig"}),
            "json_schema is not a JSON schema chatkv can enforce: Invalid type: strnig",
        ),
        (dict(json_schema={"type": "array", "uniqueItems": True}), 'Unimplemented keys: ["uniqueItems"]'),
        (dict(json_schema={"properties": {"a": {"not": {"type": "string"}}}}), 'Unimplemented keys: ["not"]'),
        (dict(json_schema=[1, 2]), "json_schema must be a JSON schema object"),
        (dict(json_schema="{not json"), "json_schema is a str that is not JSON"),
        (dict(json_schema={"type": "object", "default": {1, 2}}), "json_schema is not JSON-serialisable"),
        (dict(regex="[a-"), "regex is not a valid regular expression"),
        (dict(regex=""), "regex must be a non-empty str"),
        (dict(grammar='root ::= "a" | b'), "grammar is not a valid lark or GBNF grammar"),
        (dict(grammar=5), "grammar must be a non-empty str"),
        (dict(json_object=1), "json_object must be a bool"),
        (dict(regex="a+", ignore_eos=True), "ignore_eos cannot be combined with regex"),
    ],
)
def test_bad_constraints_are_named(kwargs, says):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**kwargs).validate()
    assert says in str(err.value)


def test_an_unsatisfiable_schema_is_refused_when_compiled(compiler):
    """min > max inside a property is found once a tokenizer compiles it: still InvalidRequest."""
    params = SamplingParams(
        json_schema={
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}},
            "required": ["a"],
        }
    )
    with pytest.raises(InvalidRequest, match="unsatisfiable"):
        params.validate()
        compiler.matcher(constraint_of(params))


def test_from_dict_and_the_constraint_key():
    p = SamplingParams.from_dict({"max_tokens": 4, "choice": ["a", "b"]})
    assert p.constrained and constraint_of(p) == Constraint("choice", '["a", "b"]')
    assert not SamplingParams().constrained and constraint_of(SamplingParams()) is None
    assert constraint_of(SamplingParams(json_object=True)).kind == "json_object"


# -- through the real Engine (a tiny model with a real byte-level BPE tokenizer) ----------------


@pytest.fixture(scope="module")
def engine(model_dir):
    from chatkv.engine.core import Engine

    e = Engine.from_pretrained(model_dir, dtype="float32")
    yield e
    e.close()


PROMPTS = ["The quick brown fox", "What is the capital", "Hello, how are you", "Key-value caches keep"]
OBJ = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": -50, "maximum": 50}, "b": {"enum": ["x", "y"]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


def test_engine_batch_mixes_constrained_and_free_requests(engine):
    """Constrained and free requests share steps; each constrained output that ends by stop is
    valid; the free ones are token for token what they are without the constrained ones."""
    free = [SamplingParams(max_tokens=12, temperature=0.8, seed=3), SamplingParams(max_tokens=10, temperature=0)]
    alone = engine.generate([PROMPTS[0], PROMPTS[2]], free)
    constrained = [
        SamplingParams(max_tokens=80, temperature=1.0, seed=s, **c)
        for s, c in enumerate(
            [dict(json_schema=OBJ), dict(regex=REGEX), dict(choice=CHOICE), dict(json_object=True), dict(grammar=LARK)]
        )
    ]
    mixed = engine.generate(
        [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[1], PROMPTS[3], PROMPTS[0]],
        [free[0], constrained[0], free[1], constrained[1], constrained[2], constrained[3], constrained[4]],
    )
    assert [r.token_ids for r in (mixed[0], mixed[2])] == [r.token_ids for r in alone]
    assert [r.text for r in (mixed[0], mixed[2])] == [r.text for r in alone]
    stopped = 0
    for params, r in zip(constrained, mixed[1:2] + mixed[3:]):
        assert r.finish_reason in ("stop", "length"), r
        if r.finish_reason == "stop":
            stopped += 1
            assert _valid(params, r.text), (params, r.text)
    assert stopped >= 3, [r.finish_reason for r in mixed]


def test_engine_constrained_walks_end_valid(engine):
    """More seeds per kind through the engine: every output ending by stop validates."""
    cases = [dict(json_schema=OBJ), dict(json_schema=SCHEMAS[8]), dict(regex=REGEX), dict(choice=CHOICE)]
    params = [
        SamplingParams(max_tokens=60, temperature=t, seed=s, **c) for c in cases for s, t in enumerate([1.0, 0.7, 0.0])
    ]
    results = engine.generate([PROMPTS[i % 4] for i in range(len(params))], params)
    for p, r in zip(params, results):
        if r.finish_reason == "stop":
            assert _valid(p, r.text), (p, r.text)
        else:
            assert r.finish_reason == "length" and r.usage.generated_tokens == p.max_tokens


def test_engine_length_first_is_reported_as_length(engine):
    r = engine.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0, json_schema=OBJ))
    assert r.finish_reason == "length" and len(r.token_ids) == 3
    assert r.text.startswith("{")


def test_engine_refuses_a_constraint_it_cannot_enforce(engine):
    with pytest.raises(InvalidRequest, match=r'Unimplemented keys: \["uniqueItems"\]'):
        engine.generate(PROMPTS[0], SamplingParams(json_schema={"type": "array", "uniqueItems": True}))
    with pytest.raises(InvalidRequest, match="unsatisfiable"):
        engine.generate(
            PROMPTS[0],
            SamplingParams(
                json_schema={
                    "type": "object",
                    "required": ["a"],
                    "properties": {"a": {"type": "integer", "minimum": 3, "maximum": 1}},
                }
            ),
        )
    assert engine.generate(PROMPTS[0], SamplingParams(max_tokens=2, temperature=0)).finish_reason == "length"
