"""The database side of KV snapshots: each conversation's row follows its manifest.

The manifest on disk (``storage.kv_segments``) is the authority for what a conversation's
snapshot holds; its ``kv_snapshots`` row is bookkeeping (LRU order, sizes) that may lag
behind it. ``reconcile`` runs when a snapshot directory is opened (before any writer runs):

- a manifest whose conversation exists gets its row written if the row differs (or is
  missing: a process killed between the manifest switch and the row);
- a manifest that is damaged, or whose conversation was deleted, is removed with its files;
- files no branch of a manifest lists (segments of an interrupted write, of a replaced
  epoch or of a dropped branch, snapshots of the old single-file format) are removed;
- a row whose manifest is missing is removed.

Only this tenant's files (keys ending in its salt) are touched. Nothing here raises for
the disk or a row: failures are logged and retried at the next open.
"""

from __future__ import annotations

import logging

from chatkv.errors import SessionError, SnapshotInvalid
from chatkv.storage.kv_segments import MANIFEST_SUFFIX, Manifest, SegmentStore
from chatkv.storage.repository import Store

log = logging.getLogger("chatkv.sessions")


def record(store: Store, conv_id: str, man: Manifest | None) -> None:
    """Make the conversation's row say what its manifest says (None: no row)."""
    if man is None:
        forget(store, conv_id)
        return
    try:
        store.put_snapshot(
            conv_id, man.key + MANIFEST_SUFFIX, man.model_fingerprint, man.kv_dtype, man.end, man.token_hash, man.nbytes
        )
    except SessionError:  # the conversation was deleted meanwhile: its files go with it
        pass
    except Exception as e:  # bookkeeping: reconciled at the next open
        log.warning("snapshot row of %s not recorded (%s: %s); fixed at the next open", conv_id, type(e).__name__, e)


def forget(store: Store, conv_id: str) -> None:
    try:
        store.delete_snapshot(conv_id)
    except Exception as e:  # bookkeeping: reconciled at the next open
        log.warning("snapshot row of %s not removed (%s: %s)", conv_id, type(e).__name__, e)


def remove_files(segments: SegmentStore, key: str) -> None:
    try:
        segments.remove(key)
    except OSError as e:
        log.warning("cannot remove snapshot %s (%s)", key, e)


def _unlink(segments: SegmentStore, name: str) -> None:
    try:
        (segments.root / name).unlink(missing_ok=True)
    except OSError as e:
        log.warning("cannot remove snapshot file %s (%s)", name, e)


def reconcile(segments: SegmentStore, store: Store, tenant: str, salt: str) -> dict[str, Manifest]:
    """Bring rows and files in line with the manifests; returns conversation id -> its manifest.
    Under the directory's lock: another process's write in progress is never taken for a leftover."""
    with segments.locked():
        return _reconcile(segments, store, tenant, salt)


def _reconcile(segments: SegmentStore, store: Store, tenant: str, salt: str) -> dict[str, Manifest]:
    try:
        manifests, files = segments.scan()
    except OSError as e:  # an unreadable directory: the sweep waits for the next open
        log.warning("snapshot directory %s cannot be listed (%s); orphans not swept", segments.root, e)
        return {}
    rows = {r.conversation_id: r for r in store.snapshots_lru()}
    convs = {c.id for c in store.list_conversations(include_archived=True, tenant=tenant)}
    suffix = "-" + salt
    kept: dict[str, Manifest] = {}
    gone = set()
    for key in sorted(k for k in manifests if k.endswith(suffix)):  # others are another tenant's
        conv = key[: -len(suffix)]
        try:
            man = segments.read_manifest(key) if conv in convs else None
        except (SnapshotInvalid, OSError) as e:
            log.warning("%s; removed", e)
            man = None
        if man is None:
            if conv not in convs:
                log.warning("snapshot %s belongs to no conversation; removed", key)
            remove_files(segments, key)
            gone.add(key)
            continue
        kept[conv] = man
        row = rows.get(conv)
        if row is None or (row.file, row.token_count, row.token_hash, row.nbytes) != (
            key + MANIFEST_SUFFIX,
            man.end,
            man.token_hash,
            man.nbytes,
        ):
            record(store, conv, man)
        for name in sorted(set(files.get(key, [])) - man.files()):  # a file of any of its branches stays
            log.info("snapshot file %s is listed by no manifest; removed", name)
            _unlink(segments, name)
    for key, names in files.items():
        if key.endswith(suffix) and key not in manifests:
            for name in names:
                log.warning("snapshot file %s has no manifest; removed", name)
                _unlink(segments, name)
    present = {k + MANIFEST_SUFFIX for k in manifests - gone}
    for conv, row in rows.items():
        if row.file not in present:
            log.warning("snapshot row of %s has no manifest; removed", conv)
            forget(store, conv)
    return kept
