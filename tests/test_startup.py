"""Start-up (issue 19): what a warm start no longer does, and that it gives the same objects.

- ``load_config``/``load_tokenizer`` remember what transformers decided about a directory
  (chatkv.weights.load_cache): the second load gives a config with the same attributes and a
  tokenizer of the same class with the same state, encodings and chat template, and imports
  none of transformers' config classes (whose import pulls ``torch.distributed.tensor``);
- an edited file asks transformers again; a damaged cache is ignored.

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

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the capital of France? <|im_start|>assistant"}]


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
    assert (a.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
            == b.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False))
    assert a.eos_token_id == b.eos_token_id and len(a) == len(b)


def same_config(a, b) -> None:
    want = a.to_dict()
    assert b.to_dict() == want
    for k, v in vars(a).items():  # every attribute transformers' object has, as it has it
        if not k.startswith("_") and k not in ("transformers_version", "dtype"):
            assert getattr(b, k) == v, k
    assert str(getattr(b, "dtype")).removeprefix("torch.") == str(getattr(a, "dtype")).removeprefix("torch.")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_a_second_load_is_what_transformers_made_the_first_time(family, tmp_path, cache):
    from tests.tiny import make_model

    d = tmp_path / family
    make_model(d, family, seed=3)
    c1, t1 = load_config(d), load_tokenizer(d)
    assert not isinstance(c1, load_cache.ResolvedConfig) and cache.is_file()
    c2, t2 = load_config(d), load_tokenizer(d)
    assert isinstance(c2, load_cache.ResolvedConfig)
    same_config(c1, c2)
    same_tokenizer(t1, t2)


def test_the_default_model_too(cache):
    d = ensure_default_model()
    c1, t1 = load_config(d), load_tokenizer(d)
    c2, t2 = load_config(d), load_tokenizer(d)
    assert isinstance(c2, load_cache.ResolvedConfig)
    same_config(c1, c2)
    same_tokenizer(t1, t2)


def test_an_edited_config_is_read_by_transformers_again(tmp_path, cache):
    from tests.tiny import make_model

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
    from tests.tiny import make_model

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
load_config(d); load_tokenizer(d)
print(sorted(m for m in sys.modules if m.startswith(("torch.distributed.tensor", "transformers.models.llama",
                                                      "transformers.utils.type_validators"))))
"""


def test_a_warm_start_imports_no_transformers_config_class(tmp_path):
    env = dict(os.environ, CHATKV_CACHE_DIR=str(tmp_path / "cache"))
    first = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "transformers.models.llama" in first.stdout  # the first start asks transformers
    second = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "[]", second.stdout
