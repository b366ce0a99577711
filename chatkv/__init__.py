"""chatkv: local multi-turn chat and RAG with a KV-cache manager at its heart."""

# every error a caller can catch, defined in chatkv.errors
from chatkv.errors import (
    ChatKVError,
    ContextOverflow,
    ConversationBusy,
    DocumentError,
    EngineClosed,
    InvalidRequest,
    LeaseLost,
    ModelNotFound,
    OutOfBlocks,
    SessionError,
    SnapshotInvalid,
    StorageError,
    ToolStepLimit,
    UnsupportedModel,
    WeightCheckFailed,
)

__all__ = [
    "Engine",
    "SamplingParams",
    "Conversations",
    # what the faces (chatkv serve, the app) need besides, each imported on first use
    "TurnRenderer",
    "LOCAL_USER",
    "data_dir",
    "ensure_default_model",
    "ensure_gguf_model",
    "ChatKVError",
    "ContextOverflow",
    "ConversationBusy",
    "DocumentError",
    "EngineClosed",
    "InvalidRequest",
    "LeaseLost",
    "ModelNotFound",
    "OutOfBlocks",
    "SessionError",
    "SnapshotInvalid",
    "StorageError",
    "ToolStepLimit",
    "UnsupportedModel",
    "WeightCheckFailed",
]


def __getattr__(name: str):
    """``from chatkv import Engine, SamplingParams`` (and the rest of ``__all__`` past the errors),
    imported on first use so that ``import chatkv.storage`` or ``chatkv.retrieval`` does not load
    torch, the model code or the database schema."""
    if name == "Engine":
        from chatkv.engine.core import Engine

        return Engine
    if name == "SamplingParams":
        from chatkv.engine.sampling import SamplingParams

        return SamplingParams
    if name == "Conversations":  # the saved conversations, listed and searched without a model
        from chatkv.conversations import Conversations

        return Conversations
    if name == "TurnRenderer":  # the chat template's token deltas (a reply's closing tokens, a prompt's continuation)
        from chatkv.sessions.template import TurnRenderer

        return TurnRenderer
    if name == "LOCAL_USER":  # the owner of conversations made without a user (the app's, the SDK's)
        from chatkv.storage.models import LOCAL_USER

        return LOCAL_USER
    if name == "data_dir":  # data_dir(path=None): the data directory chatkv uses, created private if missing
        from chatkv.storage.paths import data_dir

        return data_dir
    if name == "ensure_default_model":  # the packaged default model, converted once into a data directory
        from chatkv.weights import ensure_default_model

        return ensure_default_model
    if name == "ensure_gguf_model":  # a GGUF file given as the model, prepared once into a data directory
        from chatkv.weights.prepared import ensure_gguf_model

        return ensure_gguf_model
    raise AttributeError(f"module 'chatkv' has no attribute {name!r}")
