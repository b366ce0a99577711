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
    UnsupportedModel,
    WeightCheckFailed,
)

__all__ = [
    "Engine",
    "SamplingParams",
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
    "UnsupportedModel",
    "WeightCheckFailed",
]


def __getattr__(name: str):
    """``from chatkv import Engine, SamplingParams``, imported on first use so that
    ``import chatkv.storage`` or ``chatkv.retrieval`` does not load torch and the model code."""
    if name == "Engine":
        from chatkv.engine import Engine

        return Engine
    if name == "SamplingParams":
        from chatkv.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'chatkv' has no attribute {name!r}")
