"""chatkv: local multi-turn chat and RAG with a KV-cache manager at its heart."""

from chatkv.errors import (
    ChatKVError,
    InvalidRequest,
    ModelNotFound,
    OutOfBlocks,
    SessionError,
    SnapshotInvalid,
    StorageError,
    UnsupportedModel,
)

__all__ = [
    "ChatKVError",
    "InvalidRequest",
    "ModelNotFound",
    "OutOfBlocks",
    "SessionError",
    "SnapshotInvalid",
    "StorageError",
    "UnsupportedModel",
]
