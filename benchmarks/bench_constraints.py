"""Constrained decoding: xgrammar against llguidance on the default model's tokenizer.

Measured on this CPU, for the 49,152-token vocabulary of the packaged SmolLM2:

- compile: seconds to compile each JSON schema (cold: every library cache off), a regex, a
  choice, a grammar and "any JSON object";
- mask: microseconds to fill one request's token bitmask, at every step of biased random
  walks through each schema (median and p99 over all steps), and to apply a bitmask to one
  49,152-float logits row (the library's own apply, and chatkv's: chatkv.engine.constraints);
- coverage: for each schema feature (nested objects, arrays, enums, bounded numbers, optional
  fields, string patterns, anyOf, $ref, const, additionalProperties, string lengths), whether it
  compiles and whether every walk that ends (EOS allowed and taken) validates with jsonschema;
  regex, choice and grammar outputs are checked with re / membership / the grammar's language.

A walk samples from random normal logits plus a bonus for the tokens that close things
(quotes, brackets, commas, EOS), masked by the library, so it ends in tens of tokens.

    python benchmarks/bench_constraints.py [--walks 5] [--threads N]

(Past 400 lines on purpose: both libraries' runs, the coverage walks and the table share one
set of schemas and one tokenizer, and read as one comparison.)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import cpu_line, load_average  # noqa: E402

SCHEMAS = {
    "nested objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 12}, "zip": {"type": "integer"}},
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            },
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "arrays": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
            "scores": {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
        },
        "required": ["tags", "scores"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3, None]}},
        "required": ["colour", "size"],
        "additionalProperties": False,
    },
    "number bounds": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "temp": {"type": "number", "exclusiveMinimum": -10, "exclusiveMaximum": 40},
        },
        "required": ["age", "ratio", "temp"],
        "additionalProperties": False,
    },
    "optional fields": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "note": {"type": "string", "maxLength": 10},
            "done": {"type": "boolean"},
        },
        "required": ["id"],
        "additionalProperties": False,
    },
    "string pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "string lengths": {
        "type": "object",
        "properties": {"word": {"type": "string", "minLength": 2, "maxLength": 5}},
        "required": ["word"],
        "additionalProperties": False,
    },
    "anyOf": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 6}, {"type": "null"}]}},
        "required": ["value"],
        "additionalProperties": False,
    },
    "$ref / $defs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "const": {
        "type": "object",
        "properties": {"kind": {"const": "answer"}, "n": {"type": "integer"}},
        "required": ["kind", "n"],
        "additionalProperties": False,
    },
    "rag answer": {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "maxLength": 20},
            "sources": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 3},
        },
        "required": ["answer", "sources"],
        "additionalProperties": False,
    },
}
SCHEMAS.update(
    {
        "multipleOf": {
            "type": "object",
            "properties": {"n": {"type": "integer", "multipleOf": 5}, "h": {"type": "number", "multipleOf": 0.5}},
            "required": ["n", "h"],
            "additionalProperties": False,
        },
        "prefixItems": {
            "type": "array",
            "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 3}],
            "items": False,
        },
    }
)
# keywords a library may compile without enforcing: a walk that ends shows whether it does
SCHEMAS.update(
    {
        "allOf": {
            "type": "object",
            "properties": {"v": {"allOf": [{"type": "integer"}, {"minimum": 3, "maximum": 7}]}},
            "required": ["v"],
            "additionalProperties": False,
        },
        "oneOf overlapping": {
            "type": "object",
            "properties": {"v": {"oneOf": [{"type": "integer"}, {"type": "number"}]}},
            "required": ["v"],
            "additionalProperties": False,
        },
        "propertyNames": {
            "type": "object",
            "propertyNames": {"pattern": "^[a-c]+$", "maxLength": 3},
            "additionalProperties": {"type": "integer"},
            "maxProperties": 2,
        },
        "uniqueItems": {
            "type": "object",
            "properties": {"v": {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True, "maxItems": 3}},
            "required": ["v"],
            "additionalProperties": False,
        },
        "not": {
            "type": "object",
            "properties": {"v": {"not": {"type": "string"}}},
            "required": ["v"],
            "additionalProperties": False,
        },
        "if/then": {
            "type": "object",
            "properties": {"v": {"type": "integer", "if": {"minimum": 0}, "then": {"maximum": 5}}},
            "required": ["v"],
            "additionalProperties": False,
        },
    }
)
REGEX = r"[0-9]{3}-[0-9]{4}"
CHOICE = ["yes", "no", "maybe so"]
GRAMMAR_GBNF = 'root ::= "(" expr ")"\nexpr ::= [0-9]+ | [0-9]+ " + " expr'
GRAMMAR_LARK = 'start: "(" expr ")"\nexpr: /[0-9]+/ | /[0-9]+/ " + " expr'
GRAMMAR_RE = r"\([0-9]+( \+ [0-9]+)*\)"


def load_default_tokenizer():
    """The default model's tokenizer: the converted model's directory when there is one, else
    read from the packaged GGUF (no model conversion)."""
    from transformers import AutoTokenizer

    from chatkv.storage.paths import data_dir
    from chatkv.weights import load_tokenizer, packaged_gguf_path
    from chatkv.weights.gguf import default_model_dir

    gguf = packaged_gguf_path()
    converted = default_model_dir(data_dir(), torch.bfloat16, gguf.stem)
    if (converted / "tokenizer.json").is_file():
        return load_tokenizer(converted)
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


# -- the two libraries behind one small interface ---------------------------------------------


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab: int, eos: int, threads: int):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos])
        self.threads = threads

    def compile(self, kind: str, spec):
        c = self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)
        if kind == "json_schema":
            return c.compile_json_schema(json.dumps(spec), any_whitespace=False)
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec))
        return c.compile_grammar(spec)  # GBNF

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, vocab: int):
        return self.xgr.allocate_token_bitmask(1, vocab)

    def fill(self, m, bitmask) -> None:
        m.fill_next_token_bitmask(bitmask, 0)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m) -> bool:
        return m.is_terminated()

    def apply(self, logits, bitmask) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, vocab: int, eos: int, threads: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos)

    def compile(self, kind: str, spec):
        M = self.llg.LLMatcher
        compact = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        if kind == "json_schema":
            g = M.grammar_from_json_schema(json.dumps(spec), overrides=compact)
        elif kind == "json_object":
            g = M.grammar_from_json_schema('{"type": "object"}', overrides=compact)
        elif kind == "regex":
            g = M.grammar_from_regex(spec)
        elif kind == "choice":
            g = self.llg.grammar_from("choice", json.dumps(spec))
        else:
            g = M.grammar_from_lark(spec)
        err = M.validate_grammar(g, self.tok)
        if err:
            raise ValueError(err)
        # as chatkv does: a template matcher, its first mask computed (the lexer is built
        # lazily), copied for each request
        m = M(self.tok, g, log_level=0)
        self.fill(m, self.bitmask(self.tok.vocab_size))
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def bitmask(self, vocab: int):
        return self.lt.allocate_token_bitmask(1, vocab)

    def fill(self, m, bitmask) -> None:
        self.lt.fill_next_token_bitmask(m, bitmask, 0)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m) -> bool:
        return m.is_stopped()

    def apply(self, logits, bitmask) -> None:
        self.lt.apply_token_bitmask_inplace(logits, bitmask)


# -- measurements -----------------------------------------------------------------------------


def closing_bonus(tok, vocab: int, eos: int) -> torch.Tensor:
    """+6 for the tokens that only close things (quotes, brackets, commas) and EOS, so walks end."""
    bonus = torch.zeros(vocab)
    for i in range(min(vocab, len(tok))):
        s = tok.decode([i])
        if s.strip() and all(c in '"}],)' for c in s.strip()):
            bonus[i] = 6.0
    bonus[eos] = 6.0
    return bonus


def walk(
    lib,
    compiled,
    vocab: int,
    eos: int,
    bonus: torch.Tensor,
    gen: torch.Generator,
    us: dict[str, list[float]],
    max_steps: int = 200,
) -> list[int] | None:
    """One biased random walk; the tokens before EOS, or None if it did not end in max_steps.
    Records, per step, the microseconds of the fill and of both applies of that real mask."""
    from chatkv.engine.constraints import apply_bitmask

    m = lib.matcher(compiled)
    bm = lib.bitmask(vocab)
    out = []
    for _ in range(max_steps):
        t0 = time.perf_counter()
        lib.fill(m, bm)
        us["fill"].append((time.perf_counter() - t0) * 1e6)
        logits = torch.randn(1, vocab, generator=gen) + bonus
        theirs = logits.clone()
        t0 = time.perf_counter()
        lib.apply(theirs, bm)
        us["apply_lib"].append((time.perf_counter() - t0) * 1e6)
        t0 = time.perf_counter()
        apply_bitmask(logits[0], bm[0])
        us["apply_own"].append((time.perf_counter() - t0) * 1e6)
        assert torch.equal(theirs, logits), f"{lib.name}'s apply and chatkv's differ"
        tok = int(torch.argmax(logits))
        if not lib.accept(m, tok):
            raise AssertionError(f"{lib.name} refused the token {tok} its own mask allowed")
        if tok == eos:
            return out
        out.append(tok)
        if lib.done(m):  # the grammar can only end: the walk would take EOS next
            return out
    return None


def check(kind: str, spec, text: str) -> bool:
    import jsonschema

    if kind in ("json_schema", "json_object"):
        try:
            value = json.loads(text)
        except ValueError:
            return False
        if kind == "json_object":
            return isinstance(value, dict)
        try:
            jsonschema.validate(value, spec)
            return True
        except jsonschema.ValidationError:
            return False
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    if kind == "choice":
        return text in spec
    return re.fullmatch(GRAMMAR_RE, text) is not None


def run(lib_cls, tok, vocab: int, eos: int, threads: int, walks: int, bonus: torch.Tensor) -> dict:
    lib = lib_cls(tok, vocab, eos, threads)
    cases = [("json_schema", name, s) for name, s in SCHEMAS.items()]
    cases += [
        ("json_object", "json_object", None),
        ("regex", "regex", REGEX),
        ("choice", "choice", CHOICE),
        ("grammar", "grammar", GRAMMAR_GBNF if lib.name == "xgrammar" else GRAMMAR_LARK),
    ]
    gen = torch.Generator().manual_seed(0)
    us: dict[str, list[float]] = {"fill": [], "apply_lib": [], "apply_own": []}
    rows = []
    for kind, name, spec in cases:
        t0 = time.perf_counter()
        try:
            compiled = lib.compile(kind, spec)
        except Exception as err:  # a feature the library lacks: coverage says so
            rows.append((name, None, f"does not compile: {str(err)[:60]}"))
            continue
        compile_s = time.perf_counter() - t0
        ended = valid = 0
        for _ in range(walks):
            ids = walk(lib, compiled, vocab, eos, bonus, gen, us)
            if ids is None:
                continue
            ended += 1
            valid += check(kind, spec, tok.decode(ids))
        rows.append((name, compile_s, f"{valid}/{ended} ended walks valid ({walks - ended} hit the step limit)"))
    ordered = sorted(us["fill"])
    return dict(
        rows=rows,
        fill_median=statistics.median(ordered),
        fill_p99=ordered[int(0.99 * (len(ordered) - 1))],
        fill_mean=statistics.mean(ordered),
        steps=len(ordered),
        apply_lib=statistics.median(us["apply_lib"]),
        apply_own=statistics.median(us["apply_own"]),
    )


def chatkv_cost(tok, bonus: torch.Tensor, walks: int) -> dict:
    """What a decode step pays through chatkv's own path: Matcher.mask_into (fill + apply) and
    advance per constrained token, over walks of every schema; mask_rows on a batch of 8 free rows."""
    from chatkv.engine.constraints import ConstraintCompiler, constraint_of
    from chatkv.engine.sampling import SamplingParams, mask_rows

    compiler = ConstraintCompiler(tok)
    vocab, eos = len(tok), tok.eos_token_id
    gen = torch.Generator().manual_seed(1)
    mask_us, advance_us = [], []
    for name, schema in SCHEMAS.items():
        try:
            params = SamplingParams(json_schema=schema)
            params.validate()
        except ValueError:  # refused: nothing to walk
            continue
        for _ in range(walks):
            m = compiler.matcher(constraint_of(params))
            for _ in range(200):
                logits = torch.randn(vocab, generator=gen) + bonus
                t0 = time.perf_counter()
                m.mask_into(logits)
                mask_us.append((time.perf_counter() - t0) * 1e6)
                t = int(torch.argmax(logits))
                t0 = time.perf_counter()
                assert m.advance(t)
                advance_us.append((time.perf_counter() - t0) * 1e6)
                if t == eos or m.is_done():
                    break
    free = torch.randn(8, vocab)
    t0 = time.perf_counter()
    for _ in range(1000):
        mask_rows(free, [None] * 8)
    free_us = (time.perf_counter() - t0) * 1e3  # per call, in us
    return dict(
        mask_mean=statistics.mean(mask_us),
        mask_median=statistics.median(mask_us),
        advance_mean=statistics.mean(advance_us),
        steps=len(mask_us),
        free_us=free_us,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--walks", type=int, default=5, help="random walks per constraint")
    p.add_argument("--threads", type=int, default=1, help="torch threads and the libraries' compile threads")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(cpu_line())
    print(f"load average at start: {load_average()}")
    tok = load_default_tokenizer()
    vocab, eos = len(tok), tok.eos_token_id
    print(f"tokenizer: {type(tok).__name__}, vocabulary {vocab}, EOS {eos}")
    from importlib.metadata import version

    bonus = closing_bonus(tok, vocab, eos)
    results = {}
    for cls in (XGrammar, LLGuidance):
        results[cls.name] = run(cls, tok, vocab, eos, a.threads, a.walks, bonus)
        r = results[cls.name]
        print(f"\n{cls.name} {version(cls.name)}")
        print(f"  {'constraint':<18} {'compile':>9}  coverage")
        for name, secs, cov in r["rows"]:
            shown = f"{secs * 1000:7.1f}ms" if secs is not None else "      -  "
            print(f"  {name:<18} {shown:>9}  {cov}")
        print(
            f"  mask fill per token: median {r['fill_median']:.0f} us, mean {r['fill_mean']:.0f} us, "
            f"p99 {r['fill_p99']:.0f} us ({r['steps']} steps)"
        )
        print(
            f"  apply each step's mask to a {vocab}-float row, median: the library's {r['apply_lib']:.0f} us, "
            f"chatkv's {r['apply_own']:.0f} us"
        )
    c = chatkv_cost(tok, bonus, a.walks)
    print(
        f"\nchatkv (llguidance) per constrained token: Matcher.mask_into median {c['mask_median']:.0f} us, "
        f"mean {c['mask_mean']:.0f} us; advance mean {c['advance_mean']:.0f} us ({c['steps']} steps)"
    )
    print(
        f"a batch of 8 unconstrained rows: mask_rows {c['free_us']:.2f} us per step (no mask computed, no row touched)"
    )
    print(f"\nload average at end: {load_average()}")


if __name__ == "__main__":
    main()
