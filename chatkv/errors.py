"""The exceptions chatkv raises. Every one names what was wrong."""


class ChatKVError(Exception):
    """Base class of every error chatkv raises on purpose."""


class InvalidRequest(ChatKVError, ValueError):
    """The request itself is unusable: empty prompt, too long, bad sampling values."""


class ModelNotFound(ChatKVError, FileNotFoundError):
    """The model path does not exist or holds no usable model."""


class UnsupportedModel(ChatKVError):
    """The model's architecture is not one chatkv's runner implements."""


class OutOfBlocks(ChatKVError, MemoryError):
    """The block pool cannot hold what was asked, even after eviction."""


class SessionError(ChatKVError):
    """A session id, state or operation is invalid (unknown id, closed session...)."""


class SnapshotInvalid(ChatKVError):
    """A KV snapshot on disk is damaged or does not match; it is discarded and recomputed."""


class StorageError(ChatKVError):
    """The conversation database or the data directory cannot be used (damaged file, no permission...)."""


def check_text(what: str, value: object) -> str:
    """``value`` if it is a str that can be encoded as UTF-8, else InvalidRequest naming ``what``."""
    if not isinstance(value, str):
        raise InvalidRequest(f"{what} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(
            f"{what} is not valid Unicode: a lone surrogate {value[e.start]!r} at character {e.start}"
        ) from None
    return value
