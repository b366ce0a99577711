"""The tokenizer chatkv writes for a GGUF splits text into the ids llama.cpp's own tokenizer gives.

llama.cpp's ids (``Llama(vocab_only=True).tokenize``) for a mixed corpus are in
tests/data/gguf-tokenizer-llama-cpp.json, written by tests/support/tokenizer_fixtures.py (its docstring
says how to rerun it), so no llama.cpp is needed here. The kinds: the packaged SmolLM2 GGUF as it is
(byte-level BPE, pre ``smollm``); SmolLM2's vocabulary (plus a few tokens and merges that make the
pre-tokenizers' differences show) rewritten with ``tokenizer.ggml.pre`` ``llama-bpe``, ``qwen2``,
``gpt-2``, ``default`` and none, written here from the packaged file; a tiny SentencePiece vocabulary
(tests/data/tiny-spm-vocab.gguf, Llama 2 / Mistral v0.1's kind).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chatkv.errors import UnsupportedModel
from chatkv.weights.gguf import packaged_gguf_path
from chatkv.weights.gguf_tokenizer import save_tokenizer, tokenizer_fields
from tests.support.tokenizer_fixtures import (
    BPE_PRES,
    KINDS,
    REFERENCE,
    REFUSED_PRES,
    SPM_GGUF,
    bpe_gguf,
    packaged_vocab,
    vocab_sha256,
)

REF = json.loads(REFERENCE.read_text(encoding="utf-8"))
CORPUS = REF["corpus"]


def _meta(path: Path) -> dict:
    """What chatkv.weights.gguf passes save_tokenizer: the file's metadata (its arrays too, here)."""
    return {**tokenizer_fields(path), "general.architecture": "llama", "llama.context_length": 2048}


@pytest.fixture(scope="module")
def vocab() -> dict:
    return packaged_vocab()


@pytest.fixture(scope="module")
def converted(tmp_path_factory, vocab):
    """``converted(kind)``: the directory save_tokenizer wrote for the kind's GGUF (made once per module)."""
    root = tmp_path_factory.mktemp("gguf-tokenizers")
    dirs: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in dirs:
            if kind == "smollm":
                path = packaged_gguf_path()
            elif kind == "spm":
                path = SPM_GGUF
            else:
                path = bpe_gguf(root / f"{kind}.gguf", BPE_PRES[kind], vocab)
            out = root / kind
            out.mkdir()
            save_tokenizer(path, _meta(path), out)
            dirs[kind] = out
        return dirs[kind]

    return get


def _auto(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _texts(kind: str) -> list[str]:
    return [*CORPUS, REF["kinds"][kind]["chat_text"]]


def test_packaged_vocabulary_is_the_one_the_fixture_was_made_with(vocab) -> None:
    assert vocab_sha256(vocab) == REF["vocab_sha256"]
    assert vocab["tokenizer.ggml.pre"] == "smollm"
    assert set(REF["kinds"]) == set(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_ids_equal_llama_cpp(kind: str, converted) -> None:
    """Every corpus text and the rendered chat: special tokens parsed, not parsed, and BOS/EOS added."""
    tok = _auto(converted(kind))
    ref = REF["kinds"][kind]
    wrong = []
    for i, text in enumerate(_texts(kind)):
        got = {
            "special": tok(text, add_special_tokens=False)["input_ids"],
            "plain": tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"],
            "added": tok(text)["input_ids"],
        }
        wrong += [(mode, text[:40], ids, ref[mode][i]) for mode, ids in got.items() if ids != ref[mode][i]]
    assert wrong == []
    assert sum(map(len, ref["special"])) > 700  # the corpus is not trivially short for any kind


@pytest.mark.parametrize("kind", KINDS)
def test_llama_cpp_ids_decode_to_the_text(kind: str, converted) -> None:
    tok = _auto(converted(kind))
    ref = REF["kinds"][kind]
    if kind == "spm":
        # SentencePiece puts a space before the text after every special token, which decoding
        # keeps: the round trip holds for the ids of text whose markers are not parsed
        decoded = [tok.decode(ids) for ids in ref["plain"]]
    else:
        decoded = [tok.decode(ids) for ids in ref["special"]]
    assert decoded == _texts(kind)


@pytest.mark.parametrize("kind", KINDS)
def test_chat_template_renders_and_its_markers_are_single_tokens(kind: str, converted) -> None:
    tok = _auto(converted(kind))
    ref = REF["kinds"][kind]
    text = tok.apply_chat_template(REF["chat"], add_generation_prompt=True, tokenize=False)
    assert text == ref["chat_text"]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == ref["special"][-1]
    if kind == "spm":
        assert (ids[0], ids.count(1), ids.count(2)) == (1, 1, 1)  # <s> once, </s> after the one answer
    else:
        start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
        assert ids[0] == start
        assert (ids.count(start), ids.count(end)) == (len(REF["chat"]) + 1, len(REF["chat"]))


@pytest.mark.parametrize("kind", ["smollm", "llama-bpe", "spm"])
def test_load_tokenizer_and_its_warm_start_give_the_same_ids(kind: str, converted) -> None:
    """chatkv's loader: transformers' tokenizer first, then the direct one kept from it (load_cache)."""
    from chatkv.weights.direct_tokenizer import DirectTokenizer
    from chatkv.weights.loading import load_tokenizer

    path = converted(kind)
    ref = REF["kinds"][kind]
    for tok in (load_tokenizer(path), load_tokenizer(path)):
        assert [tok(t, add_special_tokens=False)["input_ids"] for t in _texts(kind)] == ref["special"]
        assert [tok(t)["input_ids"] for t in _texts(kind)] == ref["added"]
    assert isinstance(tok, DirectTokenizer)  # the second load is the warm start's


def test_bos_eos_flags_follow_the_file_else_llama_cpp(converted) -> None:
    flags = {}
    for kind in ("smollm", "llama-bpe", "spm"):
        cfg = json.loads((converted(kind) / "tokenizer_config.json").read_text())
        flags[kind] = (cfg["add_bos_token"], cfg["add_eos_token"], cfg["bos_token"], cfg["tokenizer_class"])
    assert flags == {
        "smollm": (False, False, "<|im_start|>", "PreTrainedTokenizerFast"),  # the file says no BOS
        "llama-bpe": (True, False, "<|im_start|>", "PreTrainedTokenizerFast"),  # no key: Llama 3's default
        "spm": (True, False, "<s>", "PreTrainedTokenizerFast"),  # the file says BOS, as SentencePiece's default
    }


@pytest.mark.parametrize("pre", REFUSED_PRES)
def test_a_pre_tokenizer_llama_cpp_does_not_know_is_refused(pre: str, tmp_path: Path, vocab) -> None:
    assert REF["refused_pres"][pre] is True  # llama.cpp would not load the file either
    path = bpe_gguf(tmp_path / "x.gguf", pre, vocab)
    with pytest.raises(UnsupportedModel, match=rf"{pre!r}.*tokenizer\.ggml\.pre"):
        save_tokenizer(path, _meta(path), tmp_path / "out")


def _tiny_gguf(path: Path, model: str, scores: bool) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_token_list(["<unk>", "<s>", "</s>", "\u2581a", "a"])
    w.add_token_types([2, 3, 3, 1, 1])
    if scores:
        w.add_token_scores([0.0, 0.0, 0.0, -1.0, -2.0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    ("model", "scores", "says"),
    [
        ("bert", True, r"kind 'bert' \(tokenizer\.ggml\.model\)"),
        ("llama", False, r"SentencePiece vocabulary without tokenizer\.ggml\.scores"),
        ("gpt2", True, r"no tokenizer\.ggml\.merges"),
    ],
)
def test_a_tokenizer_it_cannot_build_is_a_clear_error(model, scores, says, tmp_path: Path) -> None:
    path = _tiny_gguf(tmp_path / "t.gguf", model, scores)
    with pytest.raises(UnsupportedModel, match=says) as err:
        save_tokenizer(path, _meta(path), tmp_path / "out")
    assert str(path) in str(err.value)


def test_a_damaged_metadata_section_is_a_clear_error(tmp_path: Path) -> None:
    whole = _tiny_gguf(tmp_path / "t.gguf", "llama", True).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:60])
    with pytest.raises(UnsupportedModel, match="truncated or damaged"):
        tokenizer_fields(cut)
