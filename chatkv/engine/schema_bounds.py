"""JSON schemas made safe to decode with: numbers a small model can close, and refusals of
schemas that no finite JSON value satisfies.

Numbers: a JSON parser reads a number of any length, and so does llguidance's grammar of
``{"type": "integer"}``: a small model that starts writing ``1111...`` may never stop. As
llama.cpp's json-schema-to-grammar does, what the grammar allows is bounded: an integer has at
most 16 digits, a number at most 16 digits before its point and 10 after it (and no exponent).
A schema's own ``minimum``/``maximum``/``multipleOf`` are kept; a bound is only added where the
schema gives none. ``json_object`` (any object) is the bounded "any JSON value" of ``ANY_OBJECT``.
Whitespace is already bounded: chatkv's JSON is compact (constraints.py), no free whitespace.

Finite instances: ``{"$ref": "#"}``, or an object whose required property refers back to the
object itself, passes llguidance's checks but has no value that ever ends; the model would be
made to generate until its limit and then fail. ``no_finite_instance`` finds such a schema by a
least fixpoint over its ``$ref`` targets (a target is finite once some branch of it is).
"""

from __future__ import annotations

import copy
from urllib.parse import unquote

INT_LIMIT = 10**16 - 1  # 16 digits
FRACTION = 1e-10  # 10 digits after the point (llguidance takes a multipleOf of up to ~15 digits)
MAX_ROUNDS = 32  # passes over a schema's refs before no_finite_instance gives up judging it
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONES = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames")
_NUMBER = {"type": "number", "minimum": -INT_LIMIT, "maximum": INT_LIMIT, "multipleOf": FRACTION}
ANY_VALUE = {
    "anyOf": [
        {"type": "null"},
        {"type": "boolean"},
        _NUMBER,
        {"type": "string"},
        {"type": "array", "items": {"$ref": "#/$defs/chatkv_any"}},
        {"type": "object", "additionalProperties": {"$ref": "#/$defs/chatkv_any"}},
    ]
}
ANY_OBJECT = {
    "type": "object",
    "additionalProperties": {"$ref": "#/$defs/chatkv_any"},
    "$defs": {"chatkv_any": ANY_VALUE},
}


def _subschemas(node: dict):
    """(container, key) of every subschema directly under ``node`` (keywords holding schemas)."""
    for k in _SCHEMA_MAPS:
        v = node.get(k)
        if isinstance(v, dict):
            yield from ((v, name) for name in v)
    for k in _SCHEMA_LISTS:
        v = node.get(k)
        if isinstance(v, list):
            yield from ((v, i) for i in range(len(v)))
    for k in _SCHEMA_ONES:
        v = node.get(k)
        if isinstance(v, list):  # items as a list (draft 4-7 tuples)
            yield from ((v, i) for i in range(len(v)))
        elif isinstance(v, dict):
            yield node, k


def _types(node: dict) -> set[str] | None:
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    return None


def _bound_number(node: dict, integer: bool) -> None:
    if "const" in node or "enum" in node:
        return
    low = node.get("minimum", node.get("exclusiveMinimum"))
    high = node.get("maximum", node.get("exclusiveMaximum"))
    if low is None and (high is None or high >= -INT_LIMIT):
        node["minimum"] = -INT_LIMIT
    if high is None and (low is None or low <= INT_LIMIT):
        node["maximum"] = INT_LIMIT
    if not integer and "multipleOf" not in node:
        node["multipleOf"] = FRACTION


def bounded(schema):
    """A copy of ``schema`` whose integers and numbers have at most the digits the module doc says."""
    out = copy.deepcopy(schema)
    stack = [out]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        types = _types(node) or set()
        if "number" in types:
            _bound_number(node, integer=False)
        elif "integer" in types:
            _bound_number(node, integer=True)
        stack.extend(c[k] for c, k in _subschemas(node))
    return out


def _resolve(root, ref: str):
    """The schema ``ref`` (``#`` or ``#/a/b``) points at in ``root``; None where it points nowhere."""
    node = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def no_finite_instance(schema) -> str | None:
    """Why no finite JSON value satisfies ``schema`` through its ``$ref`` loops, or None.
    Only loops are judged (a ``false`` schema, or contradictory keywords, are llguidance's)."""
    finite: dict[str, bool] = {}  # a $ref's target: finite so far (least fixpoint: False until shown)
    seen: list[str] = []

    def fin(node) -> bool:
        if not isinstance(node, dict):
            return True
        ok = True
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            if ref not in finite:
                finite[ref] = False
                seen.append(ref)
            ok = finite[ref]
        for k in ("allOf",):
            if isinstance(node.get(k), list):
                ok = all([fin(s) for s in node[k]]) and ok
        for k in ("anyOf", "oneOf"):
            if isinstance(node.get(k), list) and node[k]:
                ok = any([fin(s) for s in node[k]]) and ok
        types = _types(node)
        if types is None or "const" in node or "enum" in node:
            return ok
        branches = []
        for t in types:
            if t == "object":
                props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
                extra = node.get("additionalProperties", True)
                req = node.get("required") if isinstance(node.get("required"), list) else []
                branches.append(all([fin(props[r] if r in props else extra) for r in req if isinstance(r, str)]))
            elif t == "array":
                least = node.get("minItems", 0)
                least = least if isinstance(least, int) else 0
                prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
                items = node.get("items", True)
                need = prefix[:least] + ([items] if least > len(prefix) else [])
                branches.append(all([fin(s) for s in need]))
            else:
                branches.append(True)
        return ok and any(branches)

    try:
        fin(schema)
        i = 0
        while i < len(seen):  # every ref reachable from the root, found before any is judged
            fin(_resolve(schema, seen[i]))
            i += 1
        for _ in range(MAX_ROUNDS):
            known = len(seen)
            top = fin(schema)
            changed = False
            for ref in reversed(list(seen)):  # the deepest first: a chain of refs settles in one round
                target = _resolve(schema, ref)
                now = True if target is None else fin(target)  # nowhere: llguidance names it
                if now and not finite[ref]:
                    finite[ref], changed = True, True
            if not changed and len(seen) == known:  # a fixpoint: every ref judged, nothing moved
                break
        else:
            return None  # not settled: not refused here (llguidance still compiles it)
    except RecursionError:
        return "the schema is nested too deeply"
    if top:
        return None
    loops = [r for r in seen if not finite[r]]
    return (
        f"no finite JSON value satisfies it: every value must hold another through the $ref "
        f"{loops[0]!r} (a loop with no way out; make the property optional or add a branch that ends)"
        if loops
        else "no finite JSON value satisfies it"
    )
