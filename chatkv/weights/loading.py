"""Reading a Hugging Face model directory: config, safetensors weights, tokenizer.

Contracts: every function takes the directory, reads only local files (chatkv
never downloads) and turns anything unusable into a chatkv error naming the
directory, the file and what is wrong:

- :class:`ModelNotFound`: the directory, ``config.json``, the weights or the
  tokenizer are missing, unreadable or malformed;
- :class:`UnsupportedModel`: the files are fine but the architecture is not one
  chatkv's runner implements.

The cause (a JSON, safetensors or transformers error) is chained, never shown
raw.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, MutableMapping
from pathlib import Path

import torch

from chatkv.errors import ModelNotFound, UnsupportedModel
from chatkv.weights import load_cache

log = logging.getLogger("chatkv.weights")

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "load_config",
    "read_weights",
    "load_tokenizer",
    "release_freed_memory",
    "transformers_model",
]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "qwen3_5_text")

# What a tokenizer is made of, for the message when none loads: any one of these, plus
# tokenizer_config.json (special tokens, chat template).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
_TOKENIZER_EXTRAS = (
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def _why(e: BaseException) -> str:
    """An exception as one short line (transformers' messages span several)."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


def _model_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelNotFound(f"model path '{model_dir}' is not a directory (chatkv never downloads weights)")
    return path


def load_config(model_dir: str | Path):
    """The directory's transformers config, validated (at a later start with the same file,
    the ``ResolvedConfig`` transformers made of it: chatkv.weights.load_cache).

    Raises ModelNotFound when ``config.json`` is missing, unreadable, not a JSON
    object, or rejected by transformers; UnsupportedModel when its
    ``model_type`` is missing or not one of :data:`SUPPORTED_MODEL_TYPES`.
    """
    path = _model_dir(model_dir)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelNotFound(f"no model at '{model_dir}': expected a Hugging Face directory with config.json")
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelNotFound(f"'{cfg_file}' is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from e
    except (OSError, UnicodeDecodeError) as e:
        raise ModelNotFound(f"cannot read '{cfg_file}': {e}") from e
    if not isinstance(raw, dict):
        raise ModelNotFound(f"'{cfg_file}' holds a JSON {type(raw).__name__}, not an object of config fields")
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    if "model_type" not in raw:
        raise UnsupportedModel(
            f"'{cfg_file}' has no model_type, so its architecture is unknown; chatkv runs {supported}"
        )
    model_type = raw["model_type"]
    if model_type == "gemma3":  # Gemma3ForConditionalGeneration: text_config plus a vision tower
        raise UnsupportedModel(
            f"model_type 'gemma3' in '{cfg_file}' is Gemma 3's multimodal (image and text) model; chatkv runs "
            "its text-only form, model_type 'gemma3_text' (Gemma3ForCausalLM: gemma-3-1b, or a text-only export)"
        )
    if model_type == "qwen3_5":  # Qwen3_5ForConditionalGeneration: text_config plus a vision tower
        raise UnsupportedModel(
            f"model_type 'qwen3_5' in '{cfg_file}' is Qwen3.5's multimodal (image and text) model; chatkv runs "
            "its text-only form, model_type 'qwen3_5_text' (Qwen3_5ForCausalLM, or a text-only export)"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(f"model_type '{model_type}' is not supported; chatkv runs {supported}")
    from chatkv.weights.gptq_awq import quant_config

    # a quantization_config chatkv cannot run (not 4-bit GPTQ/AWQ) fails here, naming its field;
    # transformers keeps the section as a plain dict (no optimum/gptqmodel import)
    quant_config(path, raw)

    key = load_cache.key("config", cfg_file)
    known = load_cache.config(key)  # what transformers made of these bytes at an earlier start
    if known is not None:
        return known
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as e:  # transformers' own validation: wrong field types, bad values
        raise ModelNotFound(f"'{cfg_file}' is not a usable {model_type} config: {_why(e)}") from e
    load_cache.remember_config(key, config)
    return config


def read_weights(model_dir: str | Path) -> MutableMapping[str, torch.Tensor]:
    """Every tensor of the directory's ``*.safetensors`` files, names without the ``model.`` prefix.

    A converted GGUF's quantised tensors (chatkv.weights.gguf_tensors) are among them, decoded to
    the directory's float dtype when read; so are a GPTQ/AWQ checkpoint's quantised projections
    (chatkv.weights.gptq_awq), as float32 ``...weight``s in place of their packed parts.

    Each tensor is read when first asked for, copied out of the file's mapping, which is closed
    again (``_FileWeights``): a tensor of safetensors' own is a view of the mapped file, so one
    kept as it is (the embeddings, every norm) would hold the whole file resident (256 MiB of the
    default model's one-shot peak) after everything else was converted and dropped.

    Raises ModelNotFound when there is no such file or one cannot be read (its header at once,
    a tensor's bytes when it is read).
    """
    from safetensors import safe_open

    from chatkv.weights.gguf_tensors import decoded_weights

    path = _model_dir(model_dir)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFound(f"no *.safetensors weights in '{model_dir}'")
    where: dict[str, tuple[Path, str] | Callable[[], torch.Tensor]] = dict(decoded_weights(path))
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:  # the header and the file's size, checked here
                for name in st.keys():
                    where[name.removeprefix("model.")] = (f, name)
        except Exception as e:  # SafetensorError, OSError: truncated, not safetensors, unreadable
            raise ModelNotFound(f"weights file '{f}' is unreadable: {_why(e)}") from e
    from chatkv.weights.gptq_awq import read_checkpoint_q4

    checkpoint = read_checkpoint_q4(path)  # a GPTQ/AWQ checkpoint: its 4-bit parts are not float weights
    if checkpoint is not None:
        where = checkpoint.float_sources(where)  # each projection dequantised to float32 when it is read
    return _FileWeights(where)


def transformers_model(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    """transformers' own model of the directory's weights, in ``dtype`` (the oracle chatkv's forward
    is tested against, and the baseline benchmarks compare with). A converted GGUF keeps its
    quantised tensors in its own files (chatkv.weights.gguf_tensors), which transformers does not
    read: their decoded float weights are given to it here, exactly as ``read_weights`` gives them
    to chatkv."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = _model_dir(model_dir)
    if not (path / "quantized").is_dir():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights

    with no_init_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)), dtype=dtype)
    weights = read_weights(path)
    state = {(n if n.startswith("lm_head.") else "model." + n): weights.read(n).to(dtype) for n in list(weights)}
    result = model.load_state_dict(state, strict=False)
    missing = set(result.missing_keys) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    if missing or result.unexpected_keys:
        raise ModelNotFound(
            f"the weights in '{model_dir}' do not fit transformers' model: "
            f"missing {sorted(missing)[:3]}, unexpected {sorted(result.unexpected_keys)[:3]}"
        )
    model.tie_weights()
    return model.eval()


class _FileWeights(MutableMapping):
    """A model's tensors by name, each read from its file on first access and kept until deleted."""

    def __init__(self, where: dict[str, tuple[Path, str] | Callable[[], torch.Tensor]]):
        self._where = where
        self._read: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._read.get(name)
        if t is None:
            t = self.read(name)
            self._read[name] = t
        return t

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """``name`` read from its file again, not kept (a caller that holds one tensor at a time);
        ``rows=(a, b)``: only its rows ``a:b``, read or decoded alone where the source allows it."""
        t = self._read.get(name)
        if t is not None:
            return t if rows is None else t[rows[0] : rows[1]]
        source = self._where[name]  # KeyError for a name the files do not have, as a dict
        if callable(source):  # a quantised tensor, decoded (chatkv.weights.gguf_tensors, gptq_awq)
            if rows is not None and getattr(source, "takes_rows", False):
                return source(rows)
            t = source()
            return t if rows is None else t[rows[0] : rows[1]].clone()
        f, key = source
        from safetensors import safe_open

        try:
            with safe_open(str(f), framework="pt") as st:  # copies out of the mapping, which closes with the view
                return st.get_tensor(key).clone() if rows is None else st.get_slice(key)[rows[0] : rows[1]].clone()
        except Exception as e:  # noqa: BLE001 - changed or damaged since it was opened
            raise ModelNotFound(f"weights file '{f}' is unreadable: {_why(e)}") from e

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self._read[name] = value
        self._where.setdefault(name, (Path(), name))

    def __delitem__(self, name: str) -> None:
        del self._where[name]
        self._read.pop(name, None)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name) -> bool:
        return name in self._where


def _transformers_tokenizer(path: Path, key: str | None):
    cls = load_cache.tokenizer_class(key)  # the class AutoTokenizer chose for these files before
    if cls is not None:
        try:
            return cls.from_pretrained(str(path), _from_auto=True)  # as AutoTokenizer ends, without its config load
        except Exception:  # noqa: BLE001 - AutoTokenizer below says what is wrong
            pass
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    load_cache.remember_tokenizer(key, tok)
    return tok


def _direct_enabled() -> bool:
    return os.environ.get("CHATKV_DIRECT_TOKENIZER", "1") != "0"


def _direct_tokenizer(path: Path, key: str | None):
    """The DirectTokenizer remembered for these files (chatkv.weights.direct_tokenizer), or None."""
    spec = load_cache.direct_spec(key) if _direct_enabled() else None
    if spec is None:
        return None
    from chatkv.weights.direct_tokenizer import DirectTokenizer

    try:
        return DirectTokenizer(spec, lambda: _transformers_tokenizer(path, key))
    except Exception as e:  # noqa: BLE001 - a spec this tokenizers version cannot read: transformers' path
        log.debug("direct tokenizer not usable (%s)", e)
        return None


def _remember_direct(key: str | None, tok) -> None:
    """Keep what a DirectTokenizer needs of ``tok``, if it is a plain one and a DirectTokenizer built from it agrees."""
    if key is None or not _direct_enabled() or load_cache.direct_spec(key) is not None:
        return
    from chatkv.weights import direct_tokenizer

    try:
        spec = direct_tokenizer.spec_of(tok)
        if spec is not None and direct_tokenizer.agrees(direct_tokenizer.DirectTokenizer(spec, lambda: tok), tok):
            load_cache.remember_direct(key, spec)
    except Exception as e:  # noqa: BLE001 - best effort: the next start asks transformers again
        log.debug("direct tokenizer not kept (%s)", e)


def load_tokenizer(model_dir: str | Path):
    """The directory's tokenizer (``AutoTokenizer.from_pretrained`` of the local directory; at a
    later start with the same config files, the class it chose, directly: chatkv.weights.load_cache).

    Raises ModelNotFound naming the directory and what is missing (no tokenizer
    file at all, for every family: transformers would build an empty tokenizer for
    some) or broken (files present that transformers cannot load, or that make a
    tokenizer of fewer than two tokens that turns text into nothing).
    """
    path = _model_dir(model_dir)
    # keyed by every file a tokenizer is read from, not only the two AutoTokenizer chooses the
    # class by: any edit, damage or removal asks AutoTokenizer again (and its errors are the ones raised)
    key = load_cache.key(
        "tokenizer",
        *(path / n for n in ("config.json", "tokenizer_config.json") + _TOKENIZER_FILES + _TOKENIZER_EXTRAS),
    )
    try:
        tok = _direct_tokenizer(path, key)  # a plain tokenizer.json one seen before: no transformers import
        direct = tok is not None
        if not direct:
            tok = _transformers_tokenizer(path, key)
        # the engine checks prompt lengths against the model's context itself (one clear error);
        # the tokenizer's own "Token indices sequence length is longer than..." warning would
        # only add lines on the user's terminal
        tok.model_max_length = int(1e30)
    except Exception as e:  # OSError, ValueError, JSONDecodeError, ...: the files, not the caller
        present = [n for n in _TOKENIZER_FILES if (path / n).is_file()]
        if not present:
            raise ModelNotFound(_no_tokenizer(model_dir)) from e
        raise ModelNotFound(f"the tokenizer in '{model_dir}' ({', '.join(present)}) cannot be loaded: {_why(e)}") from e
    if not any((path / n).is_file() for n in _TOKENIZER_FILES):
        # for some families (qwen2) transformers builds an empty tokenizer (one token: every
        # prompt "empty") instead of failing
        raise ModelNotFound(_no_tokenizer(model_dir))
    if direct:  # kept only after the check below passed on transformers' tokenizer of the same bytes
        return tok
    if len(tok) < 2 or not tok("a", add_special_tokens=False)["input_ids"]:
        present = [n for n in _TOKENIZER_FILES + ("merges.txt", "tokenizer_config.json") if (path / n).is_file()]
        raise ModelNotFound(
            f"the tokenizer in '{model_dir}' ({', '.join(present)}) has {len(tok)} token(s) and makes no tokens "
            f"of text; its vocabulary files are missing or empty: copy the model's tokenizer files into it"
        )
    _remember_direct(key, tok)
    return tok


# The chat template a model without one is given: ChatML, as llama-server falls back to. Its
# markers are the model's special tokens where the vocabulary has them (Qwen, SmolLM2); elsewhere
# they are plain text, and then a message that types them reads as markup to the model.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def with_chat_template(tokenizer, model_dir) -> bool:
    """Give ``tokenizer`` ChatML (``DEFAULT_CHAT_TEMPLATE``) when the model has no chat template,
    with one warning naming the model; True if it was given."""
    if getattr(tokenizer, "chat_template", None):
        return False
    log.warning(
        "the model in '%s' has no chat template; chatkv renders its conversations as ChatML "
        "(<|im_start|>role ... <|im_end|>), as llama-server does",
        model_dir,
    )
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    return True


def _no_tokenizer(model_dir) -> str:
    return (
        f"no tokenizer in '{model_dir}': it has none of {', '.join(_TOKENIZER_FILES)}; "
        f"copy the model's tokenizer files (e.g. tokenizer.json and tokenizer_config.json) into it"
    )


def release_freed_memory() -> None:
    """Hand the memory freed while a model loaded back to the system (glibc's ``malloc_trim``).

    Loading frees as much as it keeps (each projection's source tensors once it is stored), in
    pieces below glibc's mmap threshold that land on its heaps between live ones: freed, but
    still resident until trimmed (measured on the default model in int4: 485-614 MiB resident
    after loading, 465 after a trim). A no-op where there is no glibc."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        pass
