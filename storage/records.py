"""What the conversation store hands out and accepts: plain frozen records of
conversations, messages and snapshot rows (never ORM objects), and the checks every
value passes before it reaches the database. Used only by ``repository.Store``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Optional

from chatkv.errors import InvalidRequest, SessionError
from chatkv.storage.models import LOCAL_USER, Conversation, KVSnapshot, Message, message_hash

ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
ROLES = frozenset({"system", "user", "assistant", "tool"})
STATUSES = frozenset({"complete", "interrupted", "pending"})
STAT_FIELDS = (
    "prompt_tokens",
    "cached_tokens",
    "restored_tokens",
    "computed_tokens",
    "generated_tokens",
    "host_tokens",
    "proposed_tokens",
    "accepted_tokens",
    "reused_tokens",
    "recomputed_tokens",
    "ttft_ms",
    "tokens_per_s",
)
_INT_STATS = frozenset(STAT_FIELDS[:10])


# ---------------------------------------------------------------- plain data


@dataclass(frozen=True)
class ConversationInfo:
    id: str
    tenant: str
    title: str
    model: str
    system_prompt: str
    params: dict[str, Any]
    token_count: int
    # The canonical token history. None only in list_conversations() results,
    # which skip loading it; get_conversation() always fills it.
    token_ids: Optional[tuple[int, ...]]
    created_at: datetime
    updated_at: datetime
    archived: bool
    context: Optional[dict[str, Any]] = (
        None  # the KV window's state (chatkv.sessions.context_window), None: whole history
    )
    owner: str = LOCAL_USER  # the user it belongs to (migration 0005)
    current_leaf_id: Optional[int] = None  # the message whose branch it is now (migration 0006)


@dataclass(frozen=True)
class MessageInfo:
    id: int
    conversation_id: str
    role: str
    content: str
    status: str
    meta: Optional[dict[str, Any]]
    created_at: datetime
    prompt_tokens: Optional[int] = None
    cached_tokens: Optional[int] = None
    restored_tokens: Optional[int] = None
    computed_tokens: Optional[int] = None
    generated_tokens: Optional[int] = None
    host_tokens: Optional[int] = None
    proposed_tokens: Optional[int] = None  # speculative decoding (migration 0006)
    accepted_tokens: Optional[int] = None
    reused_tokens: Optional[int] = None  # chunk KV reuse (migration 0007)
    recomputed_tokens: Optional[int] = None
    ttft_ms: Optional[float] = None
    tokens_per_s: Optional[float] = None
    content_hash: Optional[str] = None  # message_hash(role, content) as written (None: not recorded)
    parent_id: Optional[int] = None  # the message it follows in its branch (None: a first message)

    @property
    def intact(self) -> bool:
        """Whether the text is the text the message was stored with (unknown counts as intact)."""
        return self.content_hash is None or self.content_hash == message_hash(self.role, self.content)


@dataclass(frozen=True)
class SnapshotInfo:
    conversation_id: str
    file: str
    model_fingerprint: str
    kv_dtype: str
    token_count: int
    token_hash: str
    nbytes: int
    created_at: datetime
    last_used_at: datetime


def conversation_info(c: Conversation, with_tokens: bool = True) -> ConversationInfo:
    return ConversationInfo(
        id=c.id,
        tenant=c.tenant,
        title=c.title,
        model=c.model,
        system_prompt=c.system_prompt,
        params=_copy_json(c.params) or {},
        token_count=c.token_count,
        token_ids=tuple(c.token_ids) if with_tokens else None,
        created_at=c.created_at,
        updated_at=c.updated_at,
        archived=bool(c.archived),
        context=_copy_json(c.context),
        owner=c.owner,
        current_leaf_id=c.current_leaf_id,
    )


def message_info(m: Message) -> MessageInfo:
    return MessageInfo(
        id=m.id,
        conversation_id=m.conversation_id,
        role=m.role,
        content=m.content,
        status=m.status,
        meta=_copy_json(m.meta),
        created_at=m.created_at,
        content_hash=m.content_hash,
        parent_id=m.parent_id,
        **{name: getattr(m, name) for name in STAT_FIELDS},
    )


def snapshot_info(s: KVSnapshot) -> SnapshotInfo:
    return SnapshotInfo(
        conversation_id=s.conversation_id,
        file=s.file,
        model_fingerprint=s.model_fingerprint,
        kv_dtype=s.kv_dtype,
        token_count=s.token_count,
        token_hash=s.token_hash,
        nbytes=s.nbytes,
        created_at=s.created_at,
        last_used_at=s.last_used_at,
    )


# ---------------------------------------------------------------- validation


def check_conversation_id(conv_id: object) -> str:
    """Return ``conv_id`` if it is 1-64 characters of ``[A-Za-z0-9_-]``, else raise SessionError."""
    if not isinstance(conv_id, str) or not ID_PATTERN.fullmatch(conv_id):
        raise SessionError(
            f"invalid conversation id {_shown(conv_id)}: it must be 1-64 characters of A-Z, a-z, 0-9, '_' or '-'"
        )
    return conv_id


def _shown(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to about ``limit`` characters (an id may be any size a client sends)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else type(value).__name__
    return f"{text[:limit]}... ({size})"


USER_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")


def check_owner(owner: object) -> str:
    """A conversation owner (a user name): 1-64 characters of ``[A-Za-z0-9_.@-]``, starting
    with a letter or digit."""
    if not isinstance(owner, str) or not USER_PATTERN.fullmatch(owner):
        raise InvalidRequest(
            f"invalid user name {_shown(owner)}: it must be 1-64 characters of A-Z, a-z, 0-9, "
            "'_', '.', '@' or '-', starting with a letter or digit"
        )
    return owner


def check_str(what: str, value: object, max_len: Optional[int] = None) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"{what} must be a string, got {type(value).__name__} {value!r}")
    if max_len is not None and len(value) > max_len:
        raise InvalidRequest(f"{what} is {len(value)} characters long; at most {max_len} allowed")
    return value


def check_json(what: str, value: object) -> Any:
    """Return a JSON round-tripped copy of ``value`` (so later mutation by the caller
    cannot leak in), raising InvalidRequest if it is not JSON-serialisable."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise InvalidRequest(f"{what} must be JSON-serialisable: {e}") from None


def _copy_json(value: Any) -> Any:
    return None if value is None else json.loads(json.dumps(value))


def check_file_name(file: object) -> str:
    name = check_str("snapshot file name", file, 255)
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise InvalidRequest(f"snapshot file name {file!r} must be a bare file name, not a path")
    return name


def check_stats(stats: dict[str, Any], caller: str) -> dict[str, Any]:
    unknown = set(stats) - set(STAT_FIELDS)
    if unknown:
        raise TypeError(f"{caller}() got unknown stats {sorted(unknown)}; known: {', '.join(STAT_FIELDS)}")
    for name, value in stats.items():
        if value is None:
            continue
        ok = isinstance(value, int) if name in _INT_STATS else isinstance(value, (int, float))
        if not ok or isinstance(value, bool):
            raise InvalidRequest(f"{name} must be a number, got {value!r}")
    return stats


def check_tokens(token_ids: object) -> list[int]:
    try:
        tokens = list(token_ids)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidRequest(f"token_ids must be a list of ints, got {type(token_ids).__name__}") from None
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**32:
            raise InvalidRequest(f"token_ids must hold ints in [0, 2**32), found {t!r}")
    return tokens
