"""The exceptions chatkv raises. Every one names what was wrong."""


class ChatKVError(Exception):
    """Base class of every error chatkv raises on purpose."""


class InvalidRequest(ChatKVError, ValueError):
    """The request itself is unusable: empty prompt, too long, bad sampling values."""


class ContextOverflow(InvalidRequest):
    """A turn does not fit the context window under the session's overflow policy."""


class ModelNotFound(ChatKVError, FileNotFoundError):
    """The model path does not exist or holds no usable model."""


class UnsupportedModel(ChatKVError):
    """The model's architecture is not one chatkv's runner implements."""


class WeightCheckFailed(InvalidRequest):
    """A quantised weight mode asked for by name disagreed with the float path of the same
    weights on this CPU (chatkv.model.self_check); the message names the check that failed."""


class OutOfBlocks(ChatKVError, MemoryError):
    """The block pool cannot hold what was asked, even after eviction."""


class SessionError(ChatKVError):
    """A session id, state or operation is invalid (unknown id, closed session...)."""


class ConversationBusy(SessionError):
    """Another process (or this one) is generating a turn of the conversation: it holds the
    conversation's lease (``chatkv.storage.leases``). Nothing was stored; try again when
    that reply is done. ``conversation_id`` and ``holder`` (who, in words) say which."""

    def __init__(self, message: str, conversation_id: str = "", holder: str = ""):
        super().__init__(message)
        self.conversation_id = conversation_id
        self.holder = holder


class LeaseLost(SessionError):
    """This process's lease on a conversation was broken by another process (it was not renewed
    in time: the process was frozen or cut off from the database) before a write; the write was
    refused, so the conversation's history stays as the new holder left it."""


class SnapshotInvalid(ChatKVError):
    """A KV snapshot on disk is damaged or does not match; it is discarded and recomputed."""


class EngineClosed(ChatKVError):
    """The engine was closed (``engine.close()``): it admits no more requests, turns or sessions.

    Raised to every call made after ``close()`` began, and to the callers of requests that were
    still running when its grace period ended (they were interrupted). ``reply``: what such a
    request produced before it was cut: a session turn's stored ``Reply`` (its message marked
    ``interrupted``), a request's ``GenerationResult``; None when nothing had started."""

    def __init__(self, message: str = "the engine is closed", reply=None):
        super().__init__(message)
        self.reply = reply


class StorageError(ChatKVError):
    """The conversation database or the data directory cannot be used (damaged file, no permission...)."""


class ToolStepLimit(InvalidRequest):
    """``session.run_tools`` reached ``max_steps`` with the model still calling tools; ``reply``
    is the last reply."""

    def __init__(self, message: str, reply=None):
        super().__init__(message)
        self.reply = reply


class DocumentError(ChatKVError):
    """A file or text that cannot become a Document; ``.source`` and ``.reason`` say which and why."""

    def __init__(self, source: str, reason: str):
        super().__init__(f"{source}: {reason}")
        self.source = source
        self.reason = reason


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


def check_timeout(value: object, what: str = "timeout") -> float | None:
    """A wait's limit in seconds: ``None`` (and infinity, or more than the platform can wait,
    ``threading.TIMEOUT_MAX``) waits for ever, ``0`` not at all. nan, negative numbers, bools and
    anything not a real number are refused with InvalidRequest naming ``what``: nan would time
    out at once in one call and wait in another, and infinity would raise OverflowError from deep
    in ``threading``."""
    import numbers
    import threading

    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidRequest(f"{what} must be a number of seconds or None, got {value!r}")
    try:
        seconds = float(value)
    except OverflowError:  # an int beyond float's range
        return None
    if seconds != seconds or seconds < 0:
        raise InvalidRequest(f"{what} must be a number of seconds >= 0 or None, got {value!r}")
    return None if seconds > threading.TIMEOUT_MAX else seconds
