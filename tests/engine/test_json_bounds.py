"""JSON a small model can close (chatkv.engine.schema_bounds through the real llguidance matcher
on the tiny models' real byte-level tokenizer): after 16 integer digits, or 10 after the point,
no digit is allowed and the object may close; ``json_object``'s numbers too. A schema's own
bounds are kept; a lark grammar's ``%json`` is bounded too; loops with no finite value are found
and schemas with a way out are not."""

from __future__ import annotations

import json

import pytest
import torch

from chatkv.engine.constraints import Constraint, ConstraintCompiler, check
from chatkv.engine.schema_bounds import INT_LIMIT, bounded, no_finite_instance
from chatkv.errors import InvalidRequest
from tests.support.tiny import make_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def compiler(tok):
    return ConstraintCompiler(tok)


def allowed_after(tok, compiler, c: Constraint, text: str) -> set[str]:
    """The single characters the constraint allows after ``text`` (fed one character a token)."""
    m = compiler.matcher(c)
    for ch in text:
        for t in tok.encode(ch, add_special_tokens=False):
            assert m.advance(t), f"{text!r} refused at {ch!r}"
    logits = torch.zeros(len(tok))
    m.mask_into(logits)
    out = set()
    for i in torch.nonzero(logits > float("-inf")).flatten().tolist():
        s = tok.decode([i])
        if len(s) == 1:
            out.add(s)
    return out


DIGITS = set("0123456789")
SCHEMA = {
    "type": "object",
    "properties": {"population": {"type": "integer"}, "area": {"type": "number"}},
    "required": ["population", "area"],
    "additionalProperties": False,
}


def test_an_integer_stops_at_16_digits(tok, compiler):
    c = Constraint("json_schema", '{"type":"object","properties":{"p":{"type":"integer"}},"required":["p"]}')
    assert DIGITS <= allowed_after(tok, compiler, c, '{"p": ' + "1" * 15)
    after = allowed_after(tok, compiler, c, '{"p": ' + "1" * 16)
    assert not after & DIGITS and "}" in after


def test_a_number_has_16_digits_before_its_point_and_10_after(tok, compiler):
    c = Constraint("json_schema", json.dumps(SCHEMA))
    head = '{"population": 3, "area": '
    assert not allowed_after(tok, compiler, c, head + "9" * 16) & DIGITS
    assert DIGITS <= allowed_after(tok, compiler, c, head + "-12." + "5" * 9)
    after = allowed_after(tok, compiler, c, head + "-12." + "5" * 10)
    assert not after & DIGITS and "}" in after and "e" not in after


def test_json_objects_numbers_are_bounded_at_any_depth(tok, compiler):
    c = Constraint("json_object", '{"type":"object"}')
    assert DIGITS <= allowed_after(tok, compiler, c, '{"a": [{"b": ' + "7" * 15)
    after = allowed_after(tok, compiler, c, '{"a": [{"b": ' + "7" * 16)
    assert not after & DIGITS and {"}", ","} <= after
    assert DIGITS <= allowed_after(tok, compiler, c, '{"a": "' + "7" * 40)  # a string's digits are text


def test_a_schemas_own_bounds_are_kept():
    s = {
        "type": "object",
        "properties": {
            "small": {"type": "integer", "minimum": 0, "maximum": 9},
            "big": {"type": "integer", "minimum": 10**17},
            "step": {"type": "number", "multipleOf": 0.5},
            "one": {"type": "integer", "const": 3},
            "list": {"type": "array", "items": {"type": ["integer", "null"]}},
        },
    }
    out = bounded(s)
    p = out["properties"]
    assert p["small"] == s["properties"]["small"]
    assert p["big"] == {"type": "integer", "minimum": 10**17}  # no maximum below its minimum
    assert p["step"]["multipleOf"] == 0.5 and p["step"]["maximum"] == INT_LIMIT
    assert p["one"] == {"type": "integer", "const": 3}
    assert p["list"]["items"]["minimum"] == -INT_LIMIT and p["list"]["items"]["maximum"] == INT_LIMIT
    assert "minimum" not in s["properties"]["list"]["items"]  # a copy: the caller's schema is unchanged
    check(Constraint("json_schema", '{"type":"integer","minimum":100000000000000000}'))


def test_a_lark_grammars_json_is_bounded_and_checked(tok, compiler):
    """The ``%json`` schemas of a lark grammar (a forced tool call's) are held to the same rules."""
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})
    c = Constraint("grammar", f'start: "<" args ">"\nargs: %json {schema}')
    assert DIGITS <= allowed_after(tok, compiler, c, '<{"n": ' + "5" * 15)
    assert not allowed_after(tok, compiler, c, '<{"n": ' + "5" * 16) & DIGITS
    loop = json.dumps({"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]})
    with pytest.raises(InvalidRequest, match="no finite JSON value"):
        check(Constraint("grammar", f"start: args\nargs: %json {loop}"))


TREE = {
    "type": "object",
    "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/Tree"}}},
    "required": ["kids"],
}
FINITE = [  # (schema, has a finite value)
    ({"$ref": "#"}, False),
    ({"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}, False),
    ({"type": "object", "properties": {"n": {"$ref": "#"}}}, True),  # n is optional
    ({"type": "object", "properties": {"n": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["n"]}, True),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, False),
    ({"type": "array", "items": {"$ref": "#"}}, True),  # [] ends it
    ({"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}, False),
    ({"$defs": {"Tree": TREE}, "$ref": "#/$defs/Tree"}, True),  # a tree with no children ends
    ({"type": ["object", "null"], "properties": {"n": {"$ref": "#"}}, "required": ["n"]}, True),  # null ends it
]


@pytest.mark.parametrize("schema,finite", FINITE, ids=[str(i) for i in range(len(FINITE))])
def test_loops_with_no_finite_value_are_found(schema, finite):
    assert (no_finite_instance(schema) is None) == finite
    if not finite:
        with pytest.raises(InvalidRequest, match="no finite JSON value"):
            check(Constraint("json_schema", json.dumps(schema)))


def test_a_long_chain_of_refs_is_judged_quickly_and_right():
    """300 definitions each requiring the next: finite when the last one ends, not when it loops."""
    import time

    defs = {
        f"D{i}": {"type": "object", "properties": {"n": {"$ref": f"#/$defs/D{i + 1}"}}, "required": ["n"]}
        for i in range(300)
    }
    ends = {"$defs": {**defs, "D300": {"type": "integer"}}, "$ref": "#/$defs/D0"}
    loops = {"$defs": {**defs, "D300": {"$ref": "#/$defs/D0"}}, "$ref": "#/$defs/D0"}
    t = time.perf_counter()
    assert no_finite_instance(ends) is None
    assert "no finite JSON value" in no_finite_instance(loops)
    assert time.perf_counter() - t < 5
