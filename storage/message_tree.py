"""A conversation's messages as a tree (migration 0006): plain functions over its rows.

Each message names its parent (None: a first message). A **branch** is the chain from a first
message down to a leaf; the conversation's current branch ends at its ``current_leaf_id``.
Editing message k adds a sibling of k; regenerating a reply adds a sibling of that reply; the
old messages stay, so nothing is ever deleted by branching.

Token histories per branch, without re-tokenising: a message may carry its branch's canonical
token history as of that message, stored as a delta against its parent's history: ``base``
tokens of the parent's history are kept, then ``tail`` follows. An append (the usual turn) is
``base = len(parent's)``; a window that dropped old turns keeps a shorter common prefix. A
message that carried none (``tail`` None: every message from before 0006) leaves the parent's
history as it was. ``history`` replays a chain root to leaf.

Used only by ``chatkv.storage.repository.Store``; it knows nothing of the database.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence


@dataclass(frozen=True)
class Node:
    """What the tree needs of a message row."""

    id: int
    parent_id: Optional[int]
    token_base: Optional[int] = None
    token_tail: Optional[Sequence[int]] = None
    context: Optional[dict] = None


def delta(parent: Sequence[int], history: Sequence[int]) -> tuple[int, list[int]]:
    """``(base, tail)``: ``history`` as ``parent[:base] + tail``, with ``base`` the longest
    common prefix (an append keeps all of ``parent``)."""
    n = min(len(parent), len(history))
    base = 0
    if n and list(parent[:n]) == list(history[:n]):
        base = n
    else:
        while base < n and parent[base] == history[base]:
            base += 1
    return base, list(history[base:])


def chain(nodes: dict[int, Node], leaf_id: int) -> list[Node]:
    """The branch ending at ``leaf_id``, first message first. A cycle or a parent missing from
    ``nodes`` (a damaged row) ends the walk there, so the walk always ends."""
    out, seen = [], set()
    cur: Optional[int] = leaf_id
    while cur is not None and cur in nodes and cur not in seen:
        seen.add(cur)
        node = nodes[cur]
        out.append(node)
        cur = node.parent_id
    out.reverse()
    return out


def history(branch: Iterable[Node]) -> tuple[Optional[list[int]], Optional[dict]]:
    """The token history and the KV-window state as of the branch's last message; ``(None,
    None)`` when no message of it carried a history (a chain from before 0006)."""
    tokens: Optional[list[int]] = None
    context: Optional[dict] = None
    for node in branch:
        if node.token_tail is None:
            continue
        if tokens is None:
            tokens = []
        # in place: a chain of appends costs its length, not its length times its messages
        del tokens[max(0, min(node.token_base or 0, len(tokens))) :]
        tokens.extend(node.token_tail)
        context = node.context
    return tokens, context


def newest_leaf(nodes: dict[int, Node], message_id: int) -> int:
    """The most recent leaf under ``message_id`` (itself when it has no children): the newest
    message of its subtree, which has no children since ids only grow."""
    children: dict[Optional[int], list[int]] = {}
    for n in nodes.values():
        children.setdefault(n.parent_id, []).append(n.id)
    best, stack, seen = message_id, [message_id], set()
    while stack:
        cur = stack.pop()
        if cur in seen:
            continue
        seen.add(cur)
        best = max(best, cur)
        stack.extend(children.get(cur, ()))
    return best


def siblings(nodes: dict[int, Node], message_id: int) -> list[int]:
    """The ids of the messages sharing ``message_id``'s parent, itself included, oldest first."""
    parent = nodes[message_id].parent_id
    return sorted(n.id for n in nodes.values() if n.parent_id == parent)
