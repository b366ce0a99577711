"""A warm start's tokenizer without transformers: its own backend and chat template, proved equal at the cold load.

(Past ~400 lines on purpose: what the cold load keeps, how a warm start checks it and the
tokenizer it then is form one contract, read in one place.)

``import transformers`` is about a third of a warm one-shot's CPU time, and
what a fast tokenizer does for chatkv is the ``tokenizers`` library's backend plus a Jinja
template. So the first (cold) load, through transformers, keeps in the cache directory:

- the backend exactly as transformers set it up: ``backend_tokenizer.to_str()`` (tokens added
  from ``tokenizer_config.json``, the post-processor for BOS/EOS included), in a file named by
  its SHA-256, checked when read back;
- the few facts chatkv reads of the tokenizer object: the special tokens (``special_tokens_map``,
  ``all_special_ids``, each named one and its id), the chat template, ``name_or_path``, and the
  versions of ``tokenizers`` and ``jinja2`` it was proved with (another version proves it again;
  transformers' and huggingface_hub's are in the entry's key, chatkv.weights.load_cache).

A later start builds a ``DirectTokenizer`` from these: ``tokenizers`` and ``jinja2`` only. It
does natively what transformers' ``TokenizersBackend`` does on the calls chatkv makes (one string
encoded, with or without special tokens, special tokens split or not, offsets; one sequence
decoded; ``apply_chat_template(..., tokenize=False)`` rendered in the same sandboxed environment
with the same globals and ``tojson`` filter and the same preparation of messages, tools and
special tokens). Anything else (another argument, a batch, an attribute it does not have) goes to
the transformers tokenizer, loaded then: ``transformers_tokenizer``.

Only a tokenizer whose class changes none of those methods, which cleans up no spaces, splits no
special tokens by default and has one template string is kept; and before it is kept, the
``DirectTokenizer`` built from it must give transformers' own results on a set of probes (``verify``).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from datetime import datetime
from functools import lru_cache

log = logging.getLogger("chatkv.weights")

# what a class must take unchanged from transformers' TokenizersBackend / PreTrainedTokenizerBase
_METHODS = (
    "__call__",
    "encode",
    "_encode_plus",
    "decode",
    "_decode",
    "apply_chat_template",
    "get_chat_template",
    "convert_ids_to_tokens",
    "get_vocab",
    "__len__",
    "_convert_encoding",
    "set_truncation_and_padding",
)
_TEMPLATE_ONLY = {
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    "sanitize_control_tokens",
}
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class _Unsupported(Exception):
    """An input the direct path does not handle: transformers' tokenizer answers it."""


def spec_of(tok) -> dict | None:
    """What a ``DirectTokenizer`` needs of transformers' ``tok`` (with ``"backend"``: its JSON), or None."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    if not isinstance(tok, TokenizersBackend) or getattr(tok, "clean_up_tokenization_spaces", True):
        return None
    if getattr(tok, "split_special_tokens", True) or getattr(tok, "chat_control_tokens", None) is not None:
        return None
    for name in _METHODS:
        ref = getattr(TokenizersBackend, name, None) or getattr(PreTrainedTokenizerBase, name, None)
        if getattr(type(tok), name, None) is not ref:
            return None
    template = tok.chat_template
    if template is not None and (not isinstance(template, str) or re.search(r"\{%-?\s*generation\s*-?%\}", template)):
        return None
    stm = tok.special_tokens_map
    if not all(
        isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)) for v in stm.values()
    ):
        return None
    special = {n: getattr(tok, n) for n in _SPECIAL if isinstance(getattr(tok, n, None), str)}
    return {
        "backend": tok.backend_tokenizer.to_str(),
        "special_tokens_map": dict(stm),
        "all_special_ids": list(tok.all_special_ids),
        "chat_template": template,
        "name_or_path": str(tok.name_or_path),
        "special": special,
        "special_ids": {n: getattr(tok, n + "_id") for n in special},
        "versions": library_versions(),
    }


def library_versions() -> dict:
    """The versions a kept spec was proved with (transformers' and huggingface_hub's are in its key)."""
    from importlib import metadata

    out = {}
    for package in ("tokenizers", "jinja2"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "none"
    return out


class DirectTokenizer:
    """The subset of a transformers fast tokenizer that chatkv calls, on the ``tokenizers`` backend."""

    is_fast = True

    def __init__(self, spec: dict, fallback):
        self._split = None  # a second backend that splits special tokens, made when first asked
        self._lock = threading.RLock()  # the fallback's load may happen under it
        self._fallback, self._hf = fallback, None
        self.special_tokens_map = dict(spec["special_tokens_map"])
        self.all_special_ids = list(spec["all_special_ids"])
        self.chat_template = spec["chat_template"]
        self.name_or_path = spec["name_or_path"]
        for name in _SPECIAL:
            setattr(self, name, spec["special"].get(name))
            setattr(self, name + "_id", spec["special_ids"].get(name))
        self.model_max_length = int(1e30)
        # parsed here, not on a second thread beside the model's load: tokenizers holds the GIL
        # while it parses, so the load would only wait (measured: the caller blocked 0.6 s)
        self._tokenizer = _backend_of(spec["backend"])

    @property
    def transformers_tokenizer(self):
        """transformers' tokenizer of the same directory (loaded on first use)."""
        with self._lock:
            if self._hf is None:
                log.debug("the direct tokenizer loads transformers' for a call it does not make itself")
                self._hf = self._fallback()
                self._hf.model_max_length = self.model_max_length
            return self._hf

    def __getattr__(self, name: str):
        if (
            name.startswith("__")
            or name.startswith("_chatkv")
            or name in ("_hf", "_fallback", "_lock", "_tokenizer", "_split")
        ):
            raise AttributeError(name)
        return getattr(self.transformers_tokenizer, name)

    @property
    def backend_tokenizer(self):
        return self._tokenizer

    @property
    def added_tokens_decoder(self) -> dict:
        return self._tokenizer.get_added_tokens_decoder()

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def __bool__(self) -> bool:
        return True

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def _backend(self, split: bool):
        if not split:
            return self._tokenizer
        with self._lock:
            if self._split is None:
                self._split = _backend_of(self._tokenizer.to_str())
                self._split.encode_special_tokens = True
            return self._split

    def __call__(
        self,
        text=None,
        add_special_tokens: bool = True,
        split_special_tokens: bool = False,
        return_offsets_mapping: bool = False,
        **kwargs,
    ):
        if not isinstance(text, str) or kwargs:
            return self.transformers_tokenizer(
                text,
                add_special_tokens=add_special_tokens,
                split_special_tokens=split_special_tokens,
                return_offsets_mapping=return_offsets_mapping,
                **kwargs,
            )
        enc = self._backend(bool(split_special_tokens)).encode(text, add_special_tokens=add_special_tokens)
        out = {"input_ids": list(enc.ids), "attention_mask": list(enc.attention_mask)}
        if return_offsets_mapping:
            out["offset_mapping"] = list(enc.offsets)
        return out

    def encode(self, text, add_special_tokens: bool = True, split_special_tokens: bool = False, **kwargs) -> list[int]:
        kwargs.pop("verbose", None)
        if not isinstance(text, str) or kwargs:
            return self.transformers_tokenizer.encode(
                text, add_special_tokens=add_special_tokens, split_special_tokens=split_special_tokens, **kwargs
            )
        return self(text, add_special_tokens=add_special_tokens, split_special_tokens=split_special_tokens)["input_ids"]

    def decode(self, token_ids, skip_special_tokens: bool = False, **kwargs) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if kwargs or not isinstance(token_ids, (list, tuple)) or not all(type(t) is int for t in token_ids):
            return self.transformers_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        conversation,
        tools=None,
        documents=None,
        chat_template=None,
        add_generation_prompt: bool = False,
        continue_final_message=False,
        tokenize: bool = True,
        **kwargs,
    ):
        try:
            if tokenize or documents is not None or chat_template is not None or continue_final_message:
                raise _Unsupported
            if self.chat_template is None or _TEMPLATE_ONLY & set(kwargs):
                raise _Unsupported
            return _render(
                self.chat_template, conversation, tools, add_generation_prompt, {**self.special_tokens_map, **kwargs}
            )
        except _Unsupported:
            return self.transformers_tokenizer.apply_chat_template(
                conversation,
                tools=tools,
                documents=documents,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=tokenize,
                **kwargs,
            )


PROBE_TEXTS = (
    "",
    "a",
    "What is the capital of France?",
    " \n\t x  y\n\n",
    "h\u00e9llo w\u00f6rld \u65e5\u672c\u8a9e \U0001f642",
    "def f(x):\n    return x**2  # ok",
    "  leading and trailing  ",
)
PROBE_CHATS = (
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> there"}],
    [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
    ],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "tool_calls": None}],
)
PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": 'The weather "now" <b>',
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "Gen\u00e8ve"}},
                "required": ["city"],
            },
        },
    }
]


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - the same error is part of the same behaviour
        return ("error", type(e).__name__, str(e))


def differences(direct: DirectTokenizer, tok) -> list[str]:
    """Where ``direct`` gives other results than transformers' ``tok`` on the probes (empty: none)."""
    out = []

    def same(what, a, b):
        if a != b:
            out.append(what)

    for name in ("all_special_ids", "special_tokens_map", "chat_template") + tuple(n + "_id" for n in _SPECIAL):
        same(name, getattr(direct, name), getattr(tok, name, None))
    same("len", len(direct), len(tok))
    same(
        "added_tokens_decoder",
        {i: str(t) for i, t in direct.added_tokens_decoder.items()},
        {i: str(t) for i, t in tok.added_tokens_decoder.items()},
    )
    same("vocab", direct.get_vocab(), tok.get_vocab())
    added = [t.content for t in tok.added_tokens_decoder.values()]
    texts = PROBE_TEXTS + (" ".join(added), "x".join(added) + "y", "A" + "".join(added) + " z")
    for text in texts:
        for special in (True, False):
            for split in (False, True):
                a = direct(text, add_special_tokens=special, split_special_tokens=split, return_offsets_mapping=True)
                b = tok(text, add_special_tokens=special, split_special_tokens=split, return_offsets_mapping=True)
                same(
                    f"encode {text!r} {special} {split}",
                    (a["input_ids"], a["offset_mapping"]),
                    (list(b["input_ids"]), [tuple(o) for o in b["offset_mapping"]]),
                )
                ids = a["input_ids"]
                for skip in (False, True):
                    same(
                        f"decode {ids} {skip}",
                        direct.decode(ids, skip_special_tokens=skip),
                        tok.decode(ids, skip_special_tokens=skip),
                    )
                    for i in range(len(ids)):  # the windows chatkv.engine.detokenize decodes
                        same(
                            f"decode {ids[i : i + 3]}",
                            direct.decode(ids[i : i + 3], skip_special_tokens=skip),
                            tok.decode(ids[i : i + 3], skip_special_tokens=skip),
                        )
    tools = (None, PROBE_TOOLS) if direct.chat_template and "tools" in direct.chat_template else (None,)
    for chat in PROBE_CHATS:
        for gen in (False, True):
            for t in tools:
                same(
                    f"chat template {chat} {gen} {t is not None}",
                    _outcome(
                        lambda: direct.apply_chat_template(chat, tools=t, add_generation_prompt=gen, tokenize=False)
                    ),
                    _outcome(lambda: tok.apply_chat_template(chat, tools=t, add_generation_prompt=gen, tokenize=False)),
                )
    return out


def agrees(direct: DirectTokenizer, tok) -> bool:
    diff = differences(direct, tok)
    if diff:
        log.debug("direct tokenizer differs from transformers' (%s): not kept", "; ".join(diff[:3]))
    return not diff


def _backend_of(text: str):
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(text)
    backend.no_truncation()  # transformers' per-call set-up for no padding and no truncation
    backend.no_padding()
    backend.encode_special_tokens = False
    return backend


# -- the chat template, as transformers' chat_template_utils renders it (transformers 5) ----------

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _plain(value):
    """transformers' ``_plain_template_data`` for JSON-like values; anything else is not handled here."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict) and type(value) is dict:
        return {_plain(k): _plain(v) for k, v in value.items()}
    if type(value) is list:
        return [_plain(v) for v in value]
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    raise _Unsupported  # a dataclass, a pydantic model, numpy, a Mapping subclass: transformers converts those


def _render(template: str, conversation, tools, add_generation_prompt: bool, kwargs: dict) -> str:
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise _Unsupported  # transformers says what is wrong
    if any(not isinstance(m, dict) or type(m) is not dict for m in conversation):
        raise _Unsupported  # a batch, message objects
    if tools is not None and (not isinstance(tools, list) or any(type(t) is not dict for t in tools)):
        raise _Unsupported  # functions become schemas in transformers
    chat = [{k: v for k, v in m.items() if v is not None} for m in conversation]
    chat = _plain(chat)
    aliased = []
    for m in chat:
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        aliased.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return _compiled(template).render(
        messages=aliased,
        tools=_plain(tools),
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **_plain(kwargs),
    )


@lru_cache(maxsize=16)
def _compiled(template: str):
    import jinja2
    import jinja2.exceptions
    import jinja2.ext
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(x) for x in re.findall(r"\d+", jinja2.__version__)[:3]) < (3, 1, 6):
        raise _Unsupported  # transformers refuses older jinja2 (sandbox escapes): its error, its words

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                # the class's own static method, through the class: jinja2's Namespace.__getattribute__
                # serves only the stored attributes, so self._check_name would not find it
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)  # through the class, as in __init__
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute."
                )

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)
