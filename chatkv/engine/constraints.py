"""Constrained decoding: token masks that keep a request's output inside a JSON schema, a regex,
a list of choices or a grammar, built on llguidance.

A request's constraint (``SamplingParams.json_schema`` / ``regex`` / ``choice`` / ``grammar`` /
``json_object``) is checked without a tokenizer when the params are validated (``check``), then
compiled once per (tokenizer, constraint) by that tokenizer's ``ConstraintCompiler`` (an LRU of
compiled grammars, bounded). Each request gets its own ``Matcher``: ``mask_into`` sets the
logits of the tokens the constraint forbids to -inf in place before sampling, ``advance`` takes
the sampled token, ``is_done`` says the constraint can only end now (the request finishes with
"stop"), ``rollback``/``reset``/``validate`` serve speculative proposals. An unconstrained
request has no matcher and costs nothing: no mask is computed, no row touched.

JSON is generated compact (", " and ": ", no free whitespace), so a model cannot run away in
whitespace; a schema may override that with llguidance's ``x-guidance`` options. Numbers are
bounded (16 integer digits, 10 after the point) and a schema with no finite instance (a ``$ref``
loop with no way out) is refused up front: ``schema_bounds.py``; the same holds for the
``%json`` schemas of a lark grammar (a forced tool call's).

Why llguidance, not xgrammar (benchmarks/bench_constraints.py compares them on the default
model's tokenizer): xgrammar's masks are cheaper to compute, but the guarantee that matters is
"valid when it ends by stop". xgrammar compiles schemas whose keywords it does not enforce and
then emits output that fails them (allOf and not ignored; an overlapping oneOf treated as anyOf;
uniqueItems, propertyNames, if/then dropped), so chatkv would need its own keyword allowlist and
could still be wrong where the converter is partial. llguidance enforces a keyword or refuses
the schema with a message naming it ("Unimplemented keys: ["uniqueItems"]"), which becomes the
request's InvalidRequest. A constrained token costs a few percent of a decode step; an
unconstrained row in a batch costs one look at its matcher (None). llguidance's API is also the
cleaner one for this engine: the matcher never raises (an error state to query), a grammar is
validated without a tokenizer (so SamplingParams.validate checks a schema before any model is
involved), ``validate_tokens`` and ``rollback`` serve speculative proposals, lark and GBNF are
both read, and it has no dependencies (xgrammar brings apache-tvm-ffi, pydantic, triton and
transformers). Its fill drops the GIL, so a later step can overlap it with the forward pass.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterable

import numpy as np
import torch

from chatkv.engine.schema_bounds import ANY_OBJECT, bounded, no_finite_instance
from chatkv.errors import InvalidRequest

KINDS = ("json_schema", "regex", "choice", "grammar", "json_object")
# compact JSON; a schema's own "x-guidance" options come after these and win
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DEFAULT_CAPACITY = 128  # compiled grammars kept per tokenizer
_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)


class ConstraintError(RuntimeError):
    """A matcher reached a state it cannot leave (the grammar's error, or a token it refused
    was forced on it); the request it belongs to fails, the rest of the batch goes on."""


@dataclass(frozen=True)
class Constraint:
    """One request's constraint: its kind and its canonical text (the cache key)."""

    kind: str  # one of KINDS
    text: str  # the schema as compact JSON (its key order kept), the regex, the choices as JSON, the grammar


def constraint_of(params: Any) -> Constraint | None:
    """The constraint a SamplingParams asks for, or None. Assumes it passed ``validate``."""
    if getattr(params, "json_schema", None) is not None:
        schema = params.json_schema
        if isinstance(schema, str):
            schema = json.loads(schema)
        # key order kept: llguidance writes properties in the schema's order (as OpenAI does), so
        # the same keys in another order are another constraint, with another output
        return Constraint("json_schema", json.dumps(schema, separators=(",", ":")))
    if getattr(params, "regex", None) is not None:
        return Constraint("regex", params.regex)
    if getattr(params, "choice", None) is not None:
        return Constraint("choice", json.dumps(list(params.choice)))
    if getattr(params, "grammar", None) is not None:
        return Constraint("grammar", params.grammar)
    if getattr(params, "json_object", False):
        return Constraint("json_object", '{"type":"object"}')
    return None


def _grammar(c: Constraint) -> str:
    """llguidance's grammar for ``c``; ValueError naming the problem if it cannot be built."""
    from llguidance import LLMatcher, grammar_from

    if c.kind == "json_schema":  # numbers bounded to what a small model can close (schema_bounds.py)
        return LLMatcher.grammar_from_json_schema(json.dumps(bounded(json.loads(c.text))), defaults=_JSON_OPTIONS)
    if c.kind == "json_object":
        return LLMatcher.grammar_from_json_schema(json.dumps(ANY_OBJECT), defaults=_JSON_OPTIONS)
    if c.kind == "regex":
        return LLMatcher.grammar_from_regex(c.text)
    if c.kind == "choice":
        return grammar_from("choice", c.text)
    return grammar_from("grammar", _bound_lark_json(c.text))  # lark, or GBNF (converted to lark)


def _lark_json(text: str) -> list[tuple[int, int, Any]]:
    """(start, end, schema) of each ``%json {...}`` of a lark grammar (a forced tool call's)."""
    found, at, dec = [], 0, json.JSONDecoder()
    while (at := text.find("%json", at)) >= 0:
        start = at + len("%json")
        while start < len(text) and text[start] in " \t":
            start += 1
        try:
            schema, end = dec.raw_decode(text, start)
        except ValueError:  # not JSON: llguidance names the problem
            at = start
            continue
        found.append((start, end, schema))
        at = end
    return found


def _bound_lark_json(text: str) -> str:
    """``text`` with each ``%json`` schema's numbers bounded as a json_schema's are."""
    out, pos = [], 0
    for start, end, schema in _lark_json(text):
        out += [text[pos:start], json.dumps(bounded(schema))]
        pos = end
    return "".join(out) + text[pos:]


_WHAT = {
    "json_schema": "json_schema is not a JSON schema chatkv can enforce",
    "json_object": "json_object cannot be enforced",
    "regex": "regex is not a valid regular expression",
    "choice": "choice cannot be compiled",
    "grammar": "grammar is not a valid lark or GBNF grammar",
}


def _refused(c: Constraint, why: str) -> InvalidRequest:
    why = why.strip().split("\n", 1)[0]  # the first line: what follows is llguidance's parser state
    if len(why) > 400:
        why = why[:397] + "..."
    return InvalidRequest(f"{_WHAT[c.kind]}: {why}")


@lru_cache(maxsize=256)
def _check(c: Constraint) -> str:
    """The error llguidance reports for ``c`` without a tokenizer ("" if none)."""
    from llguidance import LLMatcher

    schemas = [json.loads(c.text)] if c.kind == "json_schema" else []
    if c.kind == "grammar":
        schemas = [schema for _, _, schema in _lark_json(c.text)]
    for schema in schemas:
        why = no_finite_instance(schema)
        if why:
            return why
    try:
        g = _grammar(c)
    except ValueError as err:
        return str(err)
    return LLMatcher.validate_grammar(g, None)


def check(c: Constraint) -> None:
    """Raise InvalidRequest naming the problem if ``c`` cannot be compiled (an invalid schema,
    an unsupported keyword, a bad regex or grammar). No tokenizer needed; cached."""
    why = _check(c)
    if why:
        raise _refused(c, why)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits[i] = -inf`` in place for every token ``i`` whose bit in ``bitmask`` is 0.

    ``logits``: a float row ``[vocab]``; ``bitmask``: int32 ``[ceil(n / 32)]``, bit ``i % 32`` of
    word ``i // 32`` for token ``i`` (the layout of both xgrammar and llguidance). Tokens past the
    mask's ``32 * len(bitmask)`` (a model vocabulary padded past its tokenizer's) are disallowed."""
    words = bitmask.numpy().view(np.uint8)
    allowed = np.unpackbits(words, bitorder="little").view(np.bool_)
    n = min(logits.shape[-1], allowed.shape[0])
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_FLOATS and logits.is_contiguous():
        np.copyto(logits.numpy()[:n], -np.inf, where=~allowed[:n])  # in place, 3-5x torch's masked_fill_
    else:
        logits[:n].masked_fill_(~torch.from_numpy(allowed[:n]).to(logits.device), float("-inf"))
    if logits.shape[-1] > n:
        logits[n:] = float("-inf")


class Matcher:
    """One request's position in its constraint. Used by one thread at a time (the loop's)."""

    def __init__(self, inner: Any, vocab_size: int, eos_id: int, stop_ids: Iterable[int] = ()):
        self._m = inner
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        # the request's other stop tokens (generation_config's EOS list, stop_token_ids): allowed,
        # like the tokenizer's EOS, exactly when the constraint may end
        self._extra_stops = sorted({int(t) for t in stop_ids if int(t) != eos_id and 0 <= int(t)})
        self._ended = False  # it took a stop token the grammar does not know
        self._bitmask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)

    def _raise_if_error(self) -> None:
        if self._m.is_error():
            raise ConstraintError(f"constraint matcher failed: {self._m.get_error()}")

    def mask_into(self, logits: torch.Tensor) -> None:
        """Set the logits of every token the constraint does not allow next to -inf, in place
        (``logits``: one float row; its length may exceed the tokenizer's vocabulary)."""
        self._raise_if_error()
        stopped = self._ended or self._m.is_stopped()  # nothing but a stop token can follow
        if not stopped:
            bm = self._bitmask[0]
            self._m.unsafe_compute_mask_ptr(bm.data_ptr(), bm.numel() * bm.element_size())
            self._raise_if_error()
        may_end = stopped or (bool(self._extra_stops) and self._m.is_accepting())
        keep = [t for t in (self.eos_id, *self._extra_stops) if t < logits.shape[-1]] if may_end else []
        saved = logits[keep].clone() if keep else None
        if stopped:
            logits.fill_(float("-inf"))
        else:
            apply_bitmask(logits, self._bitmask[0])
        if keep:
            logits[keep] = saved

    def advance(self, token_id: int) -> bool:
        """Take the sampled ``token_id``. False (the matcher unchanged) if the constraint does
        not allow it here."""
        token_id = int(token_id)
        if token_id in self._extra_stops:
            if self._ended or not self._m.is_accepting():
                return False
            self._ended = True
            return True
        if not 0 <= token_id < self.vocab_size:
            return False
        return self._m.try_consume_tokens([token_id]) == 1

    def validate(self, token_ids: list[int]) -> int:
        """How many of ``token_ids``, in order, the constraint would accept from here (a
        speculative proposal's acceptable prefix); nothing is consumed."""
        ids = [int(t) for t in token_ids]
        n = 0  # the grammar's own tokens come first; a stop token the grammar does not know ends the run
        while n < len(ids) and 0 <= ids[n] < self.vocab_size and ids[n] not in self._extra_stops:
            n += 1
        ok = self._m.validate_tokens(ids[:n]) if n else 0
        if ok < n or n == len(ids) or self._ended:
            return ok
        probe = self._m.deep_copy()  # ids[n] is another stop token: allowed where the grammar may end
        return ok + 1 if probe.consume_tokens(ids[:n]) and probe.is_accepting() else ok

    def is_done(self) -> bool:
        """True when the constraint can only end: the request should finish with "stop"."""
        return self._ended or self._m.is_stopped()

    def eos_allowed(self) -> bool:
        """True when the output so far satisfies the constraint (ending now would be valid)."""
        return self._ended or self._m.is_accepting()

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` tokens taken (rejected speculative tokens)."""
        if n <= 0:
            return
        if self._ended:
            self._ended = False
            n -= 1
        if n and not self._m.rollback(n):
            raise ConstraintError(f"cannot roll back {n} tokens: {self._m.get_error()}")

    def reset(self) -> None:
        """Back to the constraint's start (as new)."""
        self._ended = False
        self._m.reset()


class ConstraintCompiler:
    """Compiles constraints for one tokenizer, keeping the last ``capacity`` compiled (LRU).

    ``vocab_size``: the length of the mask (default: the tokenizer's length); logits rows
    longer than it have their extra tokens disallowed. Thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.vocab_size = int(vocab_size or len(tokenizer))
        self.eos_id = tokenizer.eos_token_id
        if self.eos_id is None:
            raise InvalidRequest("constrained decoding needs a tokenizer with an EOS token; this one has none")
        self._tok = _ll_tokenizer(tokenizer, self.vocab_size, self.eos_id)
        self.capacity = capacity
        self._compiled: OrderedDict[Constraint, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # how many constraints were compiled (not found in the cache)

    def __len__(self) -> int:
        return len(self._compiled)

    def compile(self, c: Constraint) -> Any:
        """``c``'s compiled template (a matcher at its start, warmed); InvalidRequest if it cannot be."""
        with self._lock:
            hit = self._compiled.get(c)
            if hit is not None:
                self._compiled.move_to_end(c)
                return hit
        from llguidance import LLMatcher

        check(c)
        template = LLMatcher(self._tok, _grammar(c), log_level=0)
        if template.is_error():
            raise _refused(c, template.get_error())
        warm = torch.empty((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        template.unsafe_compute_mask_ptr(warm.data_ptr(), warm.numel() * warm.element_size())  # the lexer's start
        if template.is_error():
            raise _refused(c, template.get_error())
        with self._lock:
            self.compiles += 1
            self._compiled[c] = template
            self._compiled.move_to_end(c)
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return template

    def matcher(self, c: Constraint, stop_ids: Iterable[int] = ()) -> Matcher:
        """A new request's matcher for ``c`` (compiled once, then copied)."""
        return Matcher(self.compile(c).deep_copy(), self.vocab_size, self.eos_id, stop_ids)


_compilers: "weakref.WeakKeyDictionary[Any, dict[int, ConstraintCompiler]]" = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()
_ll_tokenizers: "weakref.WeakKeyDictionary[Any, dict[tuple[int, int], Any]]" = weakref.WeakKeyDictionary()
_ll_lock = threading.Lock()  # not _compilers_lock: compiler_for holds that while a compiler is made


def _ll_tokenizer(tokenizer: Any, n_vocab: int, eos_id: int) -> Any:
    """llguidance's view of ``tokenizer`` (built once per tokenizer object: ~2.5 s for 49,152 tokens)."""
    import llguidance.hf

    key = (n_vocab, eos_id)
    with _ll_lock:
        hit = _ll_tokenizers.get(tokenizer, {}).get(key)
    if hit is None:
        # llguidance reads a transformers tokenizer; a warm start's DirectTokenizer hands over its own
        hf = getattr(tokenizer, "transformers_tokenizer", tokenizer)
        hit = llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=eos_id)
        with _ll_lock:
            _ll_tokenizers.setdefault(tokenizer, {})[key] = hit
    return hit


def compiler_for(tokenizer: Any, vocab_size: int | None = None) -> ConstraintCompiler:
    """The shared ConstraintCompiler of ``tokenizer`` (one per tokenizer object and mask length)."""
    n = int(vocab_size or len(tokenizer))
    with _compilers_lock:
        per = _compilers.setdefault(tokenizer, {})
        if n not in per:
            per[n] = ConstraintCompiler(tokenizer, n)
        return per[n]
