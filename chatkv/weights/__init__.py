"""Model weights in one place: reading a Hugging Face directory, converting the
packaged GGUF into one, and the fingerprint that decides whether cached KV fits.

- :mod:`chatkv.weights.loading`: config, safetensors weights and tokenizer of a
  directory, every problem a ModelNotFound/UnsupportedModel naming the file;
- :mod:`chatkv.weights.gguf`: GGUF -> Hugging Face directory (the default model);
- :mod:`chatkv.weights.fingerprint`: a digest of everything that decides the KV.
"""

from chatkv.weights.fingerprint import model_fingerprint
from chatkv.weights.gguf import convert_gguf, ensure_default_model, packaged_gguf_path
from chatkv.weights.loading import load_config, load_tokenizer

__all__ = [
    "ensure_default_model",
    "packaged_gguf_path",
    "convert_gguf",
    "model_fingerprint",
    "load_config",
    "load_tokenizer",
]
