"""A GGUF file's tokenizer, written as Hugging Face tokenizer files beside its converted weights,
splitting text into the same token ids as llama.cpp's own tokenizer (src/llama-vocab.cpp).

The tokenizer is built here with the ``tokenizers`` library from the file's ``tokenizer.*``
metadata, not by transformers' GGUF reader: that reader picks a pre-tokenizer for only some
``tokenizer.ggml.pre`` names (SmolLM2's ``smollm`` splits digits one by one in llama.cpp and not
there; llama.cpp's ``default`` is four regexes in a row), and not llama.cpp's other choices (Llama
3's whole-word vocabulary look-up before merges, its BOS). Two kinds:

- byte-level BPE (``tokenizer.ggml.model == "gpt2"``): the regexes llama.cpp uses for the file's
  ``tokenizer.ggml.pre`` (``_BPE_PRES``), each a ``Split`` that keeps the text between matches, then
  GPT-2's byte-to-character map; the vocabulary and merges as the file lists them;
- SentencePiece (``"llama"``: Llama 2, Mistral v0.1): spaces become ``▁`` and one is put before the
  text and after every special token (``tokenizer.ggml.add_space_prefix``, on unless the file says
  otherwise); pieces merge best score first (BPE merges ranked by the merged piece's score), and a
  character the vocabulary lacks becomes its UTF-8 bytes' ``<0xXX>`` tokens.

Special tokens follow llama.cpp: control and unknown ones (``token_type`` 3 and 2, and the
end-of-generation names llama.cpp treats as control whatever their type) are matched whole in the
text unless special tokens are split, user-defined ones (4) always. BOS/EOS are added as
``tokenizer.ggml.add_bos_token``/``add_eos_token`` say, else as llama.cpp's default for the kind.
What is written: ``tokenizer.json``, ``tokenizer_config.json`` (special tokens, BOS/EOS flags, the
chat template), ``chat_template.jinja``. tests/weights/test_gguf_tokenizer.py checks every kind
against llama.cpp's ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from chatkv.errors import UnsupportedModel

__all__ = ["save_tokenizer", "build_backend", "tokenizer_fields", "BPE_PRE_NAMES"]

# llama.cpp's llm_tokenizer_bpe regexes, in the Oniguruma spelling Hugging Face's tokenizer.json files
# use (llama.cpp rewrites the case-insensitive group by hand: the same matches)
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")

# pre-tokenizer family: (regexes applied one after another, whole pre-token looked up before merging, BOS by default)
_FAMILIES = {
    "llama3": ((_LLAMA3,), True, True),
    "qwen2": ((_QWEN2,), False, False),
    "smollm": ((r"\p{N}", _GPT2), False, False),
    "gpt2": ((_GPT2,), False, False),
    "default": (_DEFAULT, False, False),
}
# tokenizer.ggml.pre -> family, as llama_vocab::impl::load maps the names (those it maps to the same
# regexes and flags); a file without the key gets llama.cpp's "default"
_BPE_PRES = {
    **dict.fromkeys(("default",), "default"),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
        "llama3",
    ),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"), "qwen2"
    ),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"), "smollm"
    ),
    **dict.fromkeys(
        ("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4", "gigachat", "mellum"),
        "gpt2",
    ),
}
BPE_PRE_NAMES = tuple(sorted(_BPE_PRES))

# names llama.cpp makes control tokens (its end-of-generation list) whatever type the file gives them
_EOG_NAMES = frozenset(
    (
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",
        "[e~[",
    )
)
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4


# GGUF value types (gguf.GGUFValueType): numpy dtype of each fixed-size one; 8 is a string, 9 an array
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1"}
_SCALARS.update({10: "<u8", 11: "<i8", 12: "<f8"})


def tokenizer_fields(gguf_path: Path) -> dict[str, Any]:
    """The file's ``tokenizer.*`` metadata, arrays in full (chatkv.weights.gguf keeps only their lengths).

    Read from the key-value section directly: gguf.GGUFReader makes an object per array element of
    every field, about 5 s for a 49152-token vocabulary; this takes about a tenth of a second.
    """
    import mmap
    import struct

    import numpy as np

    out: dict[str, Any] = {}
    with open(gguf_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            magic, version, _, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
            if magic != b"GGUF" or not 2 <= version <= 3:
                raise UnsupportedModel(f"'{gguf_path}' is not a GGUF file of version 2 or 3 (little-endian)")
            pos = 24

            def string(pos: int) -> tuple[str, int]:
                (n,) = struct.unpack_from("<Q", buf, pos)
                return buf[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace"), pos + 8 + n

            def value(kind: int, pos: int, keep: bool) -> tuple[Any, int]:
                if kind == 8:
                    return string(pos)
                if kind in _SCALARS:
                    dtype = np.dtype(_SCALARS[kind])
                    item = np.frombuffer(buf, dtype, 1, pos).tolist()[0] if keep else None
                    return (bool(item) if kind == 7 else item), pos + dtype.itemsize
                if kind != 9:
                    raise UnsupportedModel(f"GGUF '{gguf_path}' has a metadata value of unknown type {kind}")
                elem, count = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                if elem in _SCALARS:
                    dtype = np.dtype(_SCALARS[elem])
                    items = np.frombuffer(buf, dtype, count, pos).tolist() if keep else None
                    return items, pos + count * dtype.itemsize
                items = []
                for _ in range(count):
                    item, pos = value(elem, pos, keep)
                    items.append(item)
                return items, pos

            for _ in range(n_kv):
                key, pos = string(pos)
                (kind,) = struct.unpack_from("<I", buf, pos)
                keep = key.startswith("tokenizer.")
                item, pos = value(kind, pos + 4, keep)
                if keep:
                    out[key] = item
        except (struct.error, ValueError, IndexError) as e:
            raise UnsupportedModel(f"GGUF '{gguf_path}' has a truncated or damaged metadata section ({e})") from e
    return out


# tokenizer_config.json's name -> (GGUF key under tokenizer.ggml., llama.cpp's id when the file has none)
_SPECIAL_IDS = {
    "bos_token": ("bos_token_id", 1),
    "eos_token": ("eos_token_id", 2),
    "unk_token": ("unknown_token_id", 0),
    "pad_token": ("padding_token_id", None),
}


def _special_id(meta: dict[str, Any], key: str, default: int | None, n_tokens: int) -> int | None:
    """The id llama.cpp gives a special token: the file's, else its default; None when out of the vocabulary."""
    value = meta.get(f"tokenizer.ggml.{key}", default)
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    return value if 0 <= value < n_tokens else None


def _special_kinds(tokens: list[str], types: list[int]) -> tuple[list[int], list[int]]:
    """(ids matched whole unless special tokens are split, ids always matched whole), as llama.cpp sorts them."""
    special, user = [], []
    for i, token in enumerate(tokens):
        kind = types[i] if i < len(types) else 1
        if kind in (_UNKNOWN, _CONTROL) or token in _EOG_NAMES:
            special.append(i)
        elif kind == _USER_DEFINED:
            user.append(i)
    return special, user


def _bpe_model(gguf_path: Path, tokens: list[str], merges: list[str] | None, ignore_merges: bool):
    from tokenizers import models

    if merges is None:
        raise UnsupportedModel(f"GGUF '{gguf_path}' has a byte-level BPE vocabulary but no tokenizer.ggml.merges")
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise UnsupportedModel(f"GGUF '{gguf_path}' has a malformed merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((left, right))
    vocab = {token: i for i, token in enumerate(tokens)}
    return models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges, fuse_unk=False, byte_fallback=False)


def _spm_model(gguf_path: Path, tokens: list[str], scores: list[float] | None, unk_token: str | None):
    """SentencePiece's best-score-first merging as BPE: a merge for every way a piece splits into two
    pieces, ranked by the merged piece's score (higher first), as llama.cpp's llm_tokenizer_spm merges."""
    from tokenizers import models

    if scores is None or len(scores) < len(tokens):
        raise UnsupportedModel(f"GGUF '{gguf_path}' has a SentencePiece vocabulary without tokenizer.ggml.scores")
    vocab = {token: i for i, token in enumerate(tokens)}
    ranked = []
    for token, i in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return models.BPE(
        vocab=vocab,
        merges=[(left, right) for _, _, _, left, right in ranked],
        unk_token=unk_token,
        fuse_unk=True,
        byte_fallback=True,
    )


def build_backend(gguf_path: Path) -> tuple[Any, dict[str, Any]]:
    """The ``tokenizers.Tokenizer`` llama.cpp's tokenizer of the file is, and the facts tokenizer_config.json
    needs (special token strings, BOS/EOS flags). Raises UnsupportedModel for a kind it does not build."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors

    gguf_path = Path(gguf_path)
    meta = tokenizer_fields(gguf_path)
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens or not isinstance(tokens, list):
        raise UnsupportedModel(f"GGUF '{gguf_path}' has no tokenizer.ggml.tokens: no tokenizer can be built")
    types = meta.get("tokenizer.ggml.token_type") or []
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        pre = meta.get("tokenizer.ggml.pre") or "default"
        if pre not in _BPE_PRES:
            raise UnsupportedModel(
                f"GGUF '{gguf_path}' names the pre-tokenizer {pre!r} (tokenizer.ggml.pre), which chatkv does not "
                f"build; supported: {', '.join(BPE_PRE_NAMES)}"
            )
        regexes, ignore_merges, add_bos = _FAMILIES[_BPE_PRES[pre]]
        tok = Tokenizer(_bpe_model(gguf_path, tokens, meta.get("tokenizer.ggml.merges"), ignore_merges))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
        )
        tok.decoder = decoders.ByteLevel()
    elif kind == "llama":
        add_bos = True
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        unk = _special_id(meta, "unknown_token_id", 0, len(tokens))
        unk_token = None if unk is None else tokens[unk]
        tok = Tokenizer(_spm_model(gguf_path, tokens, meta.get("tokenizer.ggml.scores"), unk_token))
        steps = [normalizers.Prepend("\u2581")] if prefix else []
        tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    else:
        raise UnsupportedModel(
            f"GGUF '{gguf_path}' has a tokenizer of kind {kind!r} (tokenizer.ggml.model); chatkv builds "
            "'gpt2' (byte-level BPE) and 'llama' (SentencePiece)"
        )
    special, user = _special_kinds(tokens, types)
    tok.add_tokens([AddedToken(tokens[i], normalized=False, special=False) for i in user])
    tok.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True) for i in special])

    ids = {name: _special_id(meta, key, default, len(tokens)) for name, (key, default) in _SPECIAL_IDS.items()}
    names = {name: (tokens[i] if i is not None else None) for name, i in ids.items()}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos)) and names["bos_token"] is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and names["eos_token"] is not None
    used = [(names[n], ids[n]) for n, on in (("bos_token", add_bos), ("eos_token", add_eos)) if on]
    single = " ".join(
        ([f"{names['bos_token']}:0"] if add_bos else []) + ["$A:0"] + ([f"{names['eos_token']}:0"] if add_eos else [])
    )
    pair = single + " " + single.replace("$A", "$B").replace(":0", ":1")
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=used)
    return tok, {**names, "add_bos_token": add_bos, "add_eos_token": add_eos}


def save_tokenizer(gguf_path: Path, meta: dict[str, Any], out: Path) -> None:
    """Write the file's tokenizer into ``out`` (see the module docstring)."""
    from transformers import PreTrainedTokenizerFast

    backend, facts = build_backend(gguf_path)
    template = meta.get("tokenizer.chat_template")
    ctx = meta.get(f"{meta.get('general.architecture')}.context_length")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        clean_up_tokenization_spaces=False,
        model_max_length=int(ctx) if ctx else int(1e30),
        **{k: v for k, v in facts.items() if v is not None},
    )
    if template:
        tok.chat_template = template
    tok.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    if cfg_path.is_file():
        # transformers 5 names its fast tokenizer class "TokenizersBackend", which 4.x cannot
        # resolve; "PreTrainedTokenizerFast" is the same class in 5.x and exists in 4.x.
        tok_cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        # said again here, as tokenizer.json's post-processor already does: transformers 5 leaves them out
        tok_cfg["add_bos_token"], tok_cfg["add_eos_token"] = facts["add_bos_token"], facts["add_eos_token"]
        for junk in ("is_local", "local_files_only"):  # loading kwargs that 5.x echoes back
            tok_cfg.pop(junk, None)
        cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if template and not (out / "chat_template.jinja").exists():
        # Older transformers keep the template only inside tokenizer_config.json; write
        # the standalone file as well so every reader finds it.
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
