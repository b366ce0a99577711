"""Write the tokenizer fixtures tests/weights/test_gguf_tokenizer.py reads: llama.cpp's own token ids for a
mixed corpus, for every kind of GGUF tokenizer chatkv converts, so that the tests need no llama.cpp.

    # the llama.cpp tree inside llama-cpp-python 0.3.36's sdist, libllama built (tests/support/kquant_fixtures.py);
    # sentencepiece (for the SentencePiece vocabulary) beside it:
    LLAMA_CPP_LIB_PATH=$TREE/build/bin PYTHONPATH=$SDIST:<dir with diskcache and sentencepiece> \\
        .venv/bin/python tests/support/tokenizer_fixtures.py

Rerunning it writes the same bytes (sentencepiece trains single-threaded here, on a fixed text).

The kinds (``KINDS``):

- byte-level BPE (``tokenizer.ggml.model == "gpt2"``): the packaged SmolLM2 GGUF's own vocabulary and
  merges, as the file is (``smollm``), and written again as a vocabulary-only GGUF with another
  ``tokenizer.ggml.pre`` (``bpe_gguf``): ``llama-bpe`` (Llama 3; written without ``add_bos_token``, so
  llama.cpp's own default for that pre, a BOS, applies), ``qwen2`` (Qwen2.5/Qwen3), ``gpt-2``, ``default``
  and none at all, each with a few tokens and merges added (``EXTRA_TOKENS``: multi-digit tokens and the
  like, so that the pre-tokenizers' differences show in the ids). These are written again at test time
  from the packaged GGUF (nothing of 49152 tokens is committed); the fixture keeps the vocabulary's
  SHA-256 to prove it is the same one; ``refused_pres``: pre names llama.cpp refuses to load;
- SentencePiece (``tokenizer.ggml.model == "llama"``, Llama 2 / Mistral v0.1): ``tiny-spm-vocab.gguf``
  under tests/data/, a vocabulary-only GGUF of a 1500-piece BPE model that sentencepiece trains here
  on Python's pydoc topics plus ``CORPUS`` (byte fallback on, so rare characters become ``<0xXX>``),
  written as llama.cpp's convert_hf_to_gguf.py writes one (pieces, scores, token types).

``gguf-tokenizer-llama-cpp.json`` (tests/data/) holds, per kind, llama.cpp's ids
(``llama_cpp.Llama(..., vocab_only=True).tokenize``) for every ``CORPUS`` text and for the kind's
chat template rendered on ``CHAT`` (the text kept too): with special tokens parsed (``special``),
without (``plain``), and with the model's BOS/EOS added (``added``, special parsed).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"
REFERENCE = DATA / "gguf-tokenizer-llama-cpp.json"
SPM_GGUF = DATA / "tiny-spm-vocab.gguf"

#: the kinds, each a GGUF ``tokenizer.ggml.pre`` on SmolLM2's vocabulary (None: the key left out), or "spm"
BPE_PRES = {"smollm": "smollm", "llama-bpe": "llama-bpe", "qwen2": "qwen2", "gpt-2": "gpt-2", "default": "default"}
BPE_PRES["no-pre"] = None
KINDS = (*BPE_PRES, "spm")
#: pre names llama.cpp refuses to load (``gpt2`` is no name of its: GPT-2's is ``gpt-2``)
REFUSED_PRES = ("gpt2", "no-such-pre")

CORPUS = (
    "Hello world! What's the capital of France? It's Paris, isn't it? We're sure they've said so; I'll check.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\nclass A:\n"
    "\tdef f(self):\n\t\treturn {'a': [1, 2, 3]}  # tab-indented\n",
    "Crème brûlée, naïve café, façade, Ångström, Straße, déjà vu, señor, Zürich, ŒUVRE.",
    "Привет, мир! Как дела? Съешь же ещё этих мягких французских булок.",
    "Γειά σου Κόσμε! Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.",
    "日本語のテキスト、東京タワー。中文文本：你好，世界！한국어 텍스트도 있습니다.",
    "مرحبا بالعالم! هذا نص عربي.",
    "नमस्ते दुनिया! यह हिन्दी पाठ है।",
    "สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "Emoji: 🙂 👍🏽 👨\u200d👩\u200d👧\u200d👦 🏳️\u200d🌈 ❤️\u200d🔥 🇫🇷 ✨🚀",
    "Numbers: 7 42 123 1234 12345 1234567890 3.14159 1,000,000 1999-12-31 0x1F 1e-5 ١٢٣ ५६",
    "   leading spaces, two  spaces,   three   spaces,\ttab\t\ttabs, trailing   ",
    "line one\nline two\n\nline four\r\nwindows line\n\n\n   \n  indented\n",
    "She's, he'll, they'd, I'm, we've, you're, it's: 'quoted' and SHE'S 'T 'RE 'VE upper.",
    "Mixed: café123 Привет42 日本2026 naïve_var = x**2 + y_1; // comment\n"
    "#include <stdio.h>\nint main(void) { return 0; }",
    "Markers typed in text: <|im_start|>user hi<|im_end|> <|endoftext|> <s> </s> [INST] <think>x</think>",
    "a",
    " ",
    "\n",
    "  \n\t ",
    "!!! ??? ... --- *** +++ === <<<>>> $$$ ^^^ ~~~ |||",
)

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Wie geht's? 12345 🙂"},
    {"role": "assistant", "content": "Gut, danke!\n- eins\n- zwei"},
    {"role": "user", "content": "def f():\n    return 1"},
]

#: Llama 2 / Mistral v0.1's shape of template: BOS and EOS written by the template itself
SPM_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'] + eos_token }}{% elif message['role'] == 'system' %}"
    "{{ '<<SYS>>\\n' + message['content'] + '\\n<</SYS>>\\n\\n' }}{% endif %}{% endfor %}"
)
SPM_VOCAB = 1500

#: appended to SmolLM2's vocabulary in the files ``bpe_gguf`` writes, so that the pre-tokenizers' differences
#: show in the ids: digit runs that merge (SmolLM2 has single digits only), a space merged with a digit, a
#: word reachable only by a whole-word look-up (no merges lead to it: Llama 3's rule), a user-defined token
EXTRA_TOKENS = [("12", 1), ("123", 1), ("45", 1), ("00", 1), ("000", 1), ("\u01201", 1), ("\u012012", 1)]
EXTRA_TOKENS += [("\u0120\u00c3\u0127ngstr\u00c3\u00b6m", 1), ("<think>", 4)]
EXTRA_MERGES = ["1 2", "12 3", "4 5", "0 0", "00 0", "\u0120 1", "\u01201 2"]


# --------------------------------------------------------------------------- GGUF files


def _fields(path: Path, keys: tuple[str, ...]) -> dict:
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(path))
    out = {}
    for key in keys:
        field = reader.fields.get(key)
        if field is None:
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            parts = [field.parts[i] for i in field.data]
            if field.types[-1] == GGUFValueType.STRING:
                out[key] = [bytes(p).decode("utf-8") for p in parts]
            else:
                out[key] = [p.tolist()[0] for p in parts]
        elif field.types[0] == GGUFValueType.STRING:
            out[key] = bytes(field.parts[field.data[0]]).decode("utf-8")
        else:
            out[key] = field.parts[field.data[0]].tolist()[0]
    return out


def packaged_vocab() -> dict:
    """The packaged SmolLM2 GGUF's ``tokenizer.*`` metadata: tokens, merges, token types, special ids, template."""
    from chatkv.weights.gguf import packaged_gguf_path
    from chatkv.weights.gguf_tokenizer import tokenizer_fields

    return tokenizer_fields(packaged_gguf_path())


def vocab_sha256(vocab: dict) -> str:
    h = hashlib.sha256()
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        h.update(json.dumps(vocab[key], ensure_ascii=False).encode())
    return h.hexdigest()


def _writer(path: Path, n_vocab: int):
    """A GGUFWriter with the few llama hyperparameters llama.cpp reads before a vocabulary-only load."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("chatkv tokenizer fixture")
    w.add_block_count(1)
    w.add_context_length(2048)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    return w


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def bpe_gguf(path: Path, pre: str | None, vocab: dict | None = None) -> Path:
    """A vocabulary-only GGUF of SmolLM2's byte-level BPE with ``tokenizer.ggml.pre`` = ``pre`` (None: no key).

    ``llama-bpe`` is written without ``add_bos_token`` (llama.cpp then adds a BOS, its default for that
    pre); every other pre with ``add_bos_token`` false, as the packaged file has it.
    """
    vocab = packaged_vocab() if vocab is None else vocab
    tokens = vocab["tokenizer.ggml.tokens"] + [t for t, _ in EXTRA_TOKENS]
    w = _writer(path, len(tokens))
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(vocab["tokenizer.ggml.token_type"] + [k for _, k in EXTRA_TOKENS])
    w.add_token_merges(vocab["tokenizer.ggml.merges"] + EXTRA_MERGES)
    w.add_bos_token_id(vocab["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(vocab["tokenizer.ggml.eos_token_id"])
    w.add_unk_token_id(vocab["tokenizer.ggml.unknown_token_id"])
    w.add_pad_token_id(vocab["tokenizer.ggml.padding_token_id"])
    if pre != "llama-bpe":
        w.add_add_bos_token(False)
    w.add_chat_template(vocab["tokenizer.chat_template"])
    _finish(w)
    return path


def write_spm_gguf(path: Path) -> None:
    """Train the tiny SentencePiece BPE model and write it as convert_hf_to_gguf.py writes a Llama 2 vocabulary."""
    import io
    import tempfile
    from pydoc_data.topics import topics

    import sentencepiece as spm

    text = "\n".join(topics[k] for k in sorted(topics)) + "\n" + "\n".join(CORPUS * 3)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text(text, encoding="utf-8")
        model = io.BytesIO()
        spm.SentencePieceTrainer.train(
            input=str(corpus),
            model_writer=model,
            model_type="bpe",
            vocab_size=SPM_VOCAB,
            byte_fallback=True,
            character_coverage=0.995,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=True,
            split_digits=True,
            num_threads=1,
            max_sentence_length=1 << 20,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            minloglevel=2,
        )
        sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(2)
        elif sp.is_control(i):
            types.append(3)
        elif sp.is_unused(i):
            types.append(5)
        elif sp.is_byte(i):
            types.append(6)
        else:
            types.append(1)
    w = _writer(path, len(tokens))
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(SPM_TEMPLATE)
    _finish(w)


# --------------------------------------------------------------------------- the reference


def render(template: str, bos: str, eos: str) -> str:
    """``CHAT`` through ``template`` as transformers renders it (sandboxed Jinja, trim_blocks, lstrip_blocks)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=CHAT, add_generation_prompt=True, bos_token=bos, eos_token=eos)


def llama_cpp_ids(path: Path, texts: list[str]) -> dict:
    """llama.cpp's ids for ``texts``: special parsed, not parsed, and with BOS/EOS added."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    out = {
        "special": [llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts],
        "plain": [llm.tokenize(t.encode(), add_bos=False, special=False) for t in texts],
        "added": [llm.tokenize(t.encode(), add_bos=True, special=True) for t in texts],
    }
    del llm
    return out


def loads(path: Path) -> bool:
    """Whether llama.cpp loads the file's vocabulary."""
    import llama_cpp

    try:
        llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    except ValueError:
        return False
    return True


def main() -> None:
    import tempfile

    from chatkv.weights.gguf import packaged_gguf_path

    DATA.mkdir(exist_ok=True)
    write_spm_gguf(SPM_GGUF)
    vocab = packaged_vocab()
    # the fast reader the tests use agrees with gguf's own reader on the packaged file
    assert all(vocab[k] == v for k, v in _fields(packaged_gguf_path(), tuple(vocab)).items())
    ref: dict = {"corpus": list(CORPUS), "chat": CHAT, "vocab_sha256": vocab_sha256(vocab), "kinds": {}}
    bpe_chat = render(vocab["tokenizer.chat_template"], "<|im_start|>", "<|im_end|>")
    with tempfile.TemporaryDirectory() as tmp:
        for kind, pre in BPE_PRES.items():
            path = packaged_gguf_path() if kind == "smollm" else bpe_gguf(Path(tmp) / f"{kind}.gguf", pre, vocab)
            ref["kinds"][kind] = {"chat_text": bpe_chat, **llama_cpp_ids(path, [*CORPUS, bpe_chat])}
        ref["refused_pres"] = {pre: not loads(bpe_gguf(Path(tmp) / "refused.gguf", pre, vocab)) for pre in REFUSED_PRES}
    spm_chat = render(SPM_TEMPLATE, "<s>", "</s>")
    ref["kinds"]["spm"] = {"chat_text": spm_chat, **llama_cpp_ids(SPM_GGUF, [*CORPUS, spm_chat])}
    REFERENCE.write_text(json.dumps(ref, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    print("wrote", REFERENCE, REFERENCE.stat().st_size, SPM_GGUF, SPM_GGUF.stat().st_size)


if __name__ == "__main__":
    main()
