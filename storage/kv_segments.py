"""A conversation's KV on disk as append-only segments plus a manifest (write-behind snapshots).

(Past 400 lines: the manifest's format, the branches it lists and the append that changes
them are checked together, so the writer and the checks on read cannot drift apart.)

Layout, in one flat directory (``kv/``), for a conversation key ``K`` (``[A-Za-z0-9_-]``):

    K.json                              the manifest: the only authority for what is on disk
    K_<epoch>_<start>_<end>.safetensors a segment: the KV of tokens start:end of the conversation

A segment is a ``KVStore`` snapshot (same format, checksum and checks) of its own tokens,
with two more header fields, ``segment_start`` and ``epoch``, that a load requires. The
manifest (JSON, never pickle) records the model fingerprint, kv dtype, geometry, the epoch,
the hash of all its tokens, and per segment: file, start, end, token hash, checksum, size;
plus a crc32 of its own text. A segment's epoch is the one in its file name (and header).

Branches. A conversation is a tree: ``segments`` is the branch written last (the current
one) and ``branches`` the others (most recently current first, at most ``MAX_BRANCHES`` in
all), each a run of segments contiguous from token 0. Branches share the segment files of
their common prefix: an append whose tokens leave the current branch keeps the longest run
of whole leading segments, of any branch, whose recorded token hashes are its tokens', and
writes only what follows (``matching`` picks the same run for a restore). A file is deleted
only once no branch of the manifest lists it, and ``nbytes`` counts a shared file once. A
history that replaced the one stored (truncated, a moved attention-sink window) is, by the
caller's choice, a ``base`` write: one fresh segment of a new epoch, every older file
removed; a non-base write sharing nothing starts at token 0 and keeps every branch.
Segment names never repeat within a manifest: a new segment's epoch is a fresh one
whenever its name is listed already.

Writing (``append``): the segment is written to a temp file, fsynced, renamed, the directory
fsynced; then the manifest is replaced the same way; only then are files it no longer lists
removed. A process killed at any moment leaves the old manifest or the new one, and every
segment a manifest lists is complete (it was in place before the manifest naming it).
Unlisted segments and temp files are leftovers, swept by the caller's reconcile on open.

Several processes, one directory. Every change of a key's files (append, remove) and the
sweep on open (``locked``) run under one exclusive ``flock`` on ``.lock`` in the directory, so
a process's sweep never removes a segment another process has written but not yet listed,
and an append's check of the manifest and its switch are one step. Each manifest carries a
``fence``: the id of the last stored message of the history it holds (message ids only
grow). An append whose fence is lower than the one on disk is refused (``Diverged``): a
process whose write-behind lands after another process stored newer turns of the same
conversation (its lease long given back) never replaces the newer snapshot with its older one.

Compaction (why this policy). A segment of at least ``SEAL_TOKENS`` tokens is *sealed*:
never rewritten. The trailing run of unsealed segments is merged with the new tokens into
one segment when it would otherwise exceed ``MAX_OPEN`` segments. So a token is rewritten
only while its segment is unsealed, once per ``MAX_OPEN`` turns: at most
``1 + ceil(SEAL_TOKENS / (MAX_OPEN * t))`` writes in all for turns of ``t`` tokens, a
constant that does not depend on the history's length; the bytes written per turn are
amortised O(new tokens), whereas "merge the smallest pair when there are more than N
segments" must keep rewriting ever larger segments as the history grows (O(history^(1/N))
per token). A restore reads at most ``history / SEAL_TOKENS`` sealed segments plus
``MAX_OPEN`` small ones (plus at most ``MAX_OPEN - 1`` small ones left before each turn
that was itself sealed on arrival). A merge reads its segments back and verifies them
first, so damage on disk is never laundered into a fresh checksum. A segment another branch
lists is never merged (it stays shared), so a branch may hold more small segments than
``MAX_OPEN``: at most those it shares with other branches.

Loading (``load``) verifies every segment in order (fingerprint, dtype, geometry, tokens,
checksum, its place in the manifest) and stops at the first bad one: the segments before it
are used, the bad one is deleted, and the caller repairs the manifest (``Manifest.cut``):
every branch listing the bad file ends before it, the others are kept as they are.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import threading
import zlib
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterator, Sequence

try:
    import fcntl
except ImportError:  # not POSIX: one process per directory
    fcntl = None  # type: ignore[assignment]

import torch

from chatkv.errors import SnapshotInvalid
from chatkv.storage.files import atomic_write, make_private_dir
from chatkv.storage.kv_store import _PROCESS_NONCE, KVStore, token_hash

__all__ = ["Segment", "Manifest", "SegmentStore", "Diverged", "new_epoch"]

log = logging.getLogger("chatkv.storage")

MANIFEST_FORMAT = "chatkv-kv-manifest"
MANIFEST_VERSION = 1
LOCK_NAME = ".lock"
SEGMENT_SUFFIX = ".safetensors"
MANIFEST_SUFFIX = ".json"
_SEGMENT_RE = re.compile(r"([A-Za-z0-9_-]+)_([0-9a-f]{8})_(\d+)_(\d+)\.safetensors")
_MANIFEST_RE = re.compile(r"([A-Za-z0-9_-]{1,128})\.json")
_LEGACY_RE = re.compile(r"([A-Za-z0-9_-]{1,128})\.safetensors")


def new_epoch() -> str:
    return secrets.token_hex(4)


def segment_epoch(file: str) -> str:
    """The epoch in a segment's file name (its header must say the same)."""
    return _SEGMENT_RE.fullmatch(file).group(2)


def shared_run(segs: Sequence["Segment"], tokens: Sequence[int]) -> int:
    """How many leading segments of ``segs`` hold ``tokens``' own tokens (by their recorded hashes)."""
    n = 0
    for s in segs:
        if s.end > len(tokens) or token_hash(tokens[s.start : s.end]) != s.token_hash:
            break
        n += 1
    return n


def _others(current: tuple, branches: Sequence[tuple]) -> tuple:
    """``branches`` less the empty ones, duplicates and those whose files are a prefix of ``current``'s,
    at most MAX_BRANCHES - 1 of them (the first kept)."""
    out: list[tuple] = []
    for b in branches:
        if b and b != current[: len(b)] and b not in out:
            out.append(b)
    return tuple(out[: SegmentStore.MAX_BRANCHES - 1])


@dataclass(frozen=True)
class Segment:
    file: str
    start: int
    end: int
    token_hash: str  # of the segment's own tokens
    checksum: str  # the segment file's data checksum
    nbytes: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Manifest:
    key: str
    epoch: str
    model_fingerprint: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    token_hash: str  # of tokens[:end]
    segments: tuple[Segment, ...]
    fence: int = 0  # the id of the history's last stored message (0: unknown); see the module doc
    branches: tuple[tuple[Segment, ...], ...] = ()  # the other branches, most recently current first

    @property
    def end(self) -> int:
        return self.segments[-1].end if self.segments else 0

    @property
    def nbytes(self) -> int:
        """Bytes of every file it lists, a file shared by branches counted once."""
        return sum({s.file: s.nbytes for b in self.all_branches() for s in b}.values())

    def all_branches(self) -> tuple[tuple[Segment, ...], ...]:
        return (self.segments, *self.branches)

    def files(self) -> set[str]:
        return {s.file for b in self.all_branches() for s in b}

    def views(self) -> list["Manifest"]:
        """One single-branch manifest per branch, the current one first (token_hash "" unless current)."""
        return (
            [self]
            if not self.branches
            else [replace(self, branches=())]
            + [
                replace(self, segments=b, branches=(), token_hash="", epoch=segment_epoch(b[-1].file))
                for b in self.branches
            ]
        )

    def cut(self, bad: str, good: "Manifest") -> "Manifest | None":
        """Every branch ends before segment file ``bad`` (a damaged one); ``good``, a branch of this
        manifest already cut there, becomes current. None if no segment is left."""
        upto = lambda b: b[: [s.file for s in b].index(bad)] if any(s.file == bad for s in b) else b  # noqa: E731
        cut = [upto(b) for b in self.all_branches()]
        if good.segments:
            current, digest = good.segments, good.token_hash
        else:
            left = [b for b in cut if b]
            if not left:
                return None
            current = left[0]
            digest = self.token_hash if current == self.segments else ""
        others = _others(current, cut)
        return replace(
            self, segments=current, token_hash=digest, branches=others, epoch=segment_epoch(current[-1].file)
        )

    def geometry(self) -> tuple[int, int, int]:
        return self.num_layers, self.num_kv_heads, self.head_dim

    def to_json(self) -> str:
        body = asdict(self)
        body["segments"] = [asdict(s) for s in self.segments]
        if self.branches:
            body["branches"] = [[asdict(s) for s in b] for b in self.branches]
        else:  # a manifest of one branch reads as before branches existed
            del body["branches"]
        body = {"format": MANIFEST_FORMAT, "format_version": MANIFEST_VERSION, **body}
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return json.dumps({**body, "checksum": f"crc32:{zlib.crc32(text.encode()):08x}"}, sort_keys=True, indent=0)

    @classmethod
    def from_json(cls, text: str, key: str) -> "Manifest":
        """Parse and check a manifest; SnapshotInvalid naming what is wrong."""
        bad = lambda what: SnapshotInvalid(f"snapshot {key}: manifest {what}")  # noqa: E731
        try:
            body = json.loads(text)
        except ValueError as e:
            raise bad(f"is not JSON ({e})") from None
        if not isinstance(body, dict) or body.get("format") != MANIFEST_FORMAT:
            raise bad("is not a chatkv KV manifest")
        stored = body.pop("checksum", None)
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        if stored != f"crc32:{zlib.crc32(text.encode()):08x}":
            raise bad("checksum differs: the file is damaged")
        if body.get("format_version") != MANIFEST_VERSION:
            raise bad(f"format version {body.get('format_version')!r}, this build reads {MANIFEST_VERSION}")
        if body.get("key") != key:
            raise bad(f"belongs to {body.get('key')!r}")
        try:
            segs = tuple(Segment(**s) for s in body["segments"])
            others = body.get("branches", [])
            if not isinstance(others, list) or not all(isinstance(b, list) and b for b in others):
                raise TypeError("branches is not a list of segment lists")
            branches = tuple(tuple(Segment(**s) for s in b) for b in others)
            fields = {f: body[f] for f in cls.__dataclass_fields__ if f not in ("segments", "fence", "branches")}
            man = cls(**fields, segments=segs, fence=body.get("fence", 0), branches=branches)
        except (KeyError, TypeError) as e:
            raise bad(f"lacks a field or has an unknown one ({e})") from None
        for obj in (man, *(s for b in man.all_branches() for s in b)):
            for f in obj.__dataclass_fields__:
                value, want = getattr(obj, f), obj.__dataclass_fields__[f].type
                if f not in ("segments", "branches") and not (
                    type(value) is int if want == "int" else type(value) is str
                ):
                    raise bad(f"field {f} is {value!r}, not a {want}")
        seen: dict[str, Segment] = {}
        for b in man.all_branches():
            pos = 0
            for s in b:
                if (
                    s.start != pos
                    or s.end <= s.start
                    or not _SEGMENT_RE.fullmatch(s.file)
                    or not s.file.startswith(key + "_")
                ):
                    raise bad(f"lists segment {s.file!r} [{s.start}, {s.end}) out of order")
                if seen.setdefault(s.file, s) != s:
                    raise bad(f"lists segment {s.file!r} twice with different fields")
                pos = s.end
        return man

    def truncated(self, n_segments: int, prefix_hash: str) -> "Manifest":
        return replace(self, segments=self.segments[:n_segments], token_hash=prefix_hash)


class Diverged(Exception):
    """An append does not continue what is on disk (another epoch, a gap, a damaged tail);
    ``on_disk`` is the manifest there now (None: none)."""

    def __init__(self, msg: str, on_disk: Manifest | None):
        super().__init__(msg)
        self.on_disk = on_disk


class SegmentStore:
    """Manifests and segments under one directory. File I/O only; any thread, one writer per key."""

    SEAL_TOKENS = 512
    MAX_OPEN = 8
    MAX_BRANCHES = 8  # branches a manifest keeps (the current one included); older ones are dropped

    def __init__(self, root: Path):
        self.files = KVStore(root)  # never raises; it sweeps temp files of dead writers
        self.root = self.files.root
        self._held = threading.local()

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the directory's exclusive lock (every process, every thread); re-entrant per thread.
        Without a lock where none can be had (not POSIX; a read-only or missing medium, where
        nothing can be written either)."""
        depth = getattr(self._held, "depth", 0)
        fd = None
        if depth == 0 and fcntl is not None:
            try:
                make_private_dir(self.root)
                fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:
                log.debug("snapshot directory %s: no lock (%s)", self.root, e)
                if fd is not None:
                    os.close(fd)
                fd = None
        self._held.depth = depth + 1
        try:
            yield
        finally:
            self._held.depth = depth
            if fd is not None:
                os.close(fd)  # releases the lock

    # ------------------------------------------------------------- names
    def manifest_path(self, key: str) -> Path:
        return self.root / (key + MANIFEST_SUFFIX)

    def scan(self) -> tuple[set[str], dict[str, list[str]]]:
        """(keys that have a manifest, key -> every other file of it: segments, legacy snapshots)."""
        manifests, files = set(), {}
        for entry in self.files.dir_entries():
            name = entry.name
            m = _MANIFEST_RE.fullmatch(name)
            if m:
                manifests.add(m.group(1))
                continue
            m = _SEGMENT_RE.fullmatch(name) or _LEGACY_RE.fullmatch(name)
            if m:
                files.setdefault(m.group(1), []).append(name)
        return manifests, files

    # ------------------------------------------------------------- manifests
    def read_manifest(self, key: str) -> Manifest | None:
        """The manifest of ``key``; None if there is none. SnapshotInvalid if damaged, OSError if unreadable."""
        try:
            text = self.manifest_path(key).read_bytes().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return None
        return Manifest.from_json(text, key)

    def write_manifest(self, man: Manifest) -> None:
        make_private_dir(self.root)
        data = man.to_json().encode()
        # KVStore's temp-file pattern, so its sweep tells a dead writer's leftovers from a live one's
        tmp = self.root / f".{man.key}.{os.getpid()}.{_PROCESS_NONCE}.{secrets.token_hex(4)}.tmp"
        atomic_write(self.manifest_path(man.key), lambda p: p.write_bytes(data), tmp=tmp)

    def remove(self, key: str, keep: Manifest | None = None) -> None:
        """Remove the files of ``key`` not listed in ``keep`` (None: the manifest first, then all)."""
        with self.locked():
            self._remove(key, keep)

    def _remove(self, key: str, keep: Manifest | None) -> None:
        if keep is None:
            self.manifest_path(key).unlink(missing_ok=True)
        listed = keep.files() if keep is not None else set()
        for name in self.scan()[1].get(key, []):
            if name not in listed:
                (self.root / name).unlink(missing_ok=True)

    # ------------------------------------------------------------- write
    def append(
        self,
        key: str,
        tokens: Sequence[int],
        start: int,
        k: list[torch.Tensor],
        v: list[torch.Tensor],
        *,
        epoch: str,
        base: bool,
        model_fingerprint: str,
        kv_dtype: str,
        fence: int = 0,
    ) -> tuple[Manifest, int]:
        """Store the KV ``k``/``v`` of ``tokens[start:]`` after what ``key`` holds, or (``base``) as the
        first segment of epoch ``epoch`` (start must be 0), replacing every older file. Returns the new
        manifest and the bytes written. Diverged if it does not continue the manifest on disk, or if
        the disk holds a newer history's snapshot (a higher ``fence``).

        Not ``base``: ``tokens`` may leave the current branch (another branch of the conversation).
        The longest run of whole leading segments of any branch holding ``tokens``' own tokens is
        kept (it must reach ``start``: the KV given begins there) and only what follows is written;
        the branch left is kept beside it. Diverged if no branch reaches ``start``."""
        end = len(tokens)
        k, v = (
            [t.to("cpu") for t in k],
            [t.to("cpu") for t in v],
        )  # from a device pool: copied here, off the engine thread
        if k[0].shape[0] != end - start:
            raise ValueError(f"snapshot {key}: {k[0].shape[0]} tokens of KV for [{start}, {end})")
        with self.locked():
            return self._append(key, tokens, start, k, v, epoch, base, model_fingerprint, kv_dtype, fence)

    def _append(
        self, key, tokens, start, k, v, epoch, base, model_fingerprint, kv_dtype, fence
    ) -> tuple[Manifest, int]:
        end = len(tokens)
        old = self._readable_manifest(key)
        if old is not None and old.fence > fence:
            raise Diverged(
                f"snapshot {key}: the disk holds a newer history (message {old.fence} > {fence}); "
                "this write is dropped",
                old,
            )
        geometry = (len(k), k[0].shape[1], k[0].shape[2])
        if base:
            if start != 0:
                raise ValueError(f"snapshot {key}: a base segment must start at token 0, not {start}")
            keep: tuple[Segment, ...] = ()
            others: tuple[tuple[Segment, ...], ...] = ()
        else:
            if old is None:
                raise Diverged(f"snapshot {key}: append of epoch {epoch} at {start} but the disk holds nothing", old)
            if (old.model_fingerprint, old.kv_dtype, old.geometry()) != (model_fingerprint, kv_dtype, geometry):
                raise Diverged(f"snapshot {key}: the manifest is of another model, dtype or geometry", old)
            keep, others = self._shared(old, tokens, start)
            if keep and keep[-1].end > start:  # more is on disk already than the caller knew
                cut = keep[-1].end - start
                k, v, start = [t[cut:] for t in k], [t[cut:] for t in v], keep[-1].end
            referenced = {f.file for b in others for f in b}  # another branch's: shared, never merged away
            run = 0
            while run < len(keep) and keep[-1 - run].size < self.SEAL_TOKENS and keep[-1 - run].file not in referenced:
                run += 1
            if start < end and run + 1 > self.MAX_OPEN:  # merge the trailing unsealed run with the new tokens
                merged = keep[-run:]
                pk, pv = self._read_run(old, keep, run, tokens)
                k = [torch.cat([a, b]) for a, b in zip(pk, k)]
                v = [torch.cat([a, b]) for a, b in zip(pv, v)]
                start, keep = merged[0].start, keep[:-run]
        nbytes = 0
        if start < end:
            listed = old.files() if old is not None else set()
            if f"{key}_{epoch}_{start}_{end}{SEGMENT_SUFFIX}" in listed:  # another branch's name: never overwritten
                epoch = new_epoch()
            name = f"{key}_{epoch}_{start}_{end}"
            meta = self.files.save(
                name,
                tokens[start:end],
                k,
                v,
                model_fingerprint=model_fingerprint,
                kv_dtype=kv_dtype,
                extra_meta={"segment_start": str(start), "epoch": epoch},
            )
            keep += (Segment(name + SEGMENT_SUFFIX, start, end, meta.token_hash, meta.checksum, meta.nbytes),)
            nbytes = meta.nbytes
        else:  # the disk holds all of it already (a branch switched back to): it becomes current
            epoch = segment_epoch(keep[-1].file)
        man = Manifest(
            key,
            epoch,
            model_fingerprint,
            kv_dtype,
            *geometry,
            token_hash(tokens),
            keep,
            fence=max(fence, old.fence if old is not None else 0),
            branches=_others(keep, others),
        )
        if man == old:
            return man, 0
        self.write_manifest(man)
        try:  # after the switch: files no branch of the manifest lists any more
            if base:
                self._remove(key, man)
            else:
                for name in old.files() - man.files():
                    (self.root / name).unlink(missing_ok=True)
        except OSError as e:  # swept at the next open
            log.warning("snapshot %s: old segments not removed (%s)", key, e)
        return man, nbytes

    @staticmethod
    def _shared(old: Manifest, tokens: Sequence[int], start: int):
        """(the segments ``tokens`` keeps, the branches kept beside it) for a non-base append at ``start``."""
        current = old.segments
        if old.end == start and start <= len(tokens) and token_hash(tokens[:start]) == old.token_hash:
            best = current  # it continues the current branch (the common case: one hash)
        else:
            runs = [b[: shared_run(b, tokens)] for b in old.all_branches()]
            best = max(runs, key=lambda r: r[-1].end if r else 0)  # the first longest: the current one on a tie
            if (best[-1].end if best else 0) < start:
                raise Diverged(
                    f"snapshot {old.key}: append at {start} but no branch on disk holds its tokens "
                    f"[0, {start}) (the longest shares {best[-1].end if best else 0})",
                    old,
                )
        # the branches left (with the current one first) stay, less those the new branch holds whole
        return best, tuple(b for b in old.all_branches() if b != best[: len(b)])

    def _readable_manifest(self, key: str) -> Manifest | None:
        try:
            return self.read_manifest(key)
        except SnapshotInvalid as e:
            log.warning("%s; it will be replaced", e)
            return None

    def _read_run(self, man: Manifest, branch: tuple[Segment, ...], run: int, tokens: Sequence[int]):
        """The verified KV of the last ``run`` segments of ``branch`` (for a merge). A bad one: every
        branch is cut before it on disk (this one becomes current) and Diverged is raised."""
        ks, vs = [], []
        for i in range(len(branch) - run, len(branch)):
            s = branch[i]
            try:
                k, v, _ = self._load_segment(man, s, tokens)
            except (SnapshotInvalid, ValueError) as e:
                good = replace(man, segments=branch[:i], token_hash=token_hash(tokens[: s.start]), branches=())
                cut = man.cut(s.file, good)
                if cut is not None:
                    self.write_manifest(cut)
                    self.remove(man.key, keep=cut)
                else:
                    self.remove(man.key)
                    cut = None
                raise Diverged(f"{e}; the snapshot now ends at token {s.start}", cut) from e
            ks.append(k)
            vs.append(v)
        return [torch.cat(x) for x in zip(*ks)], [torch.cat(x) for x in zip(*vs)]

    # ------------------------------------------------------------- read
    def _load_segment(self, man: Manifest, s: Segment, tokens: Sequence[int]):
        stem = s.file[: -len(SEGMENT_SUFFIX)]
        try:
            return self.files.load(
                stem,
                token_ids=tokens[s.start : s.end],
                model_fingerprint=man.model_fingerprint,
                kv_dtype=man.kv_dtype,
                num_layers=man.num_layers,
                num_kv_heads=man.num_kv_heads,
                head_dim=man.head_dim,
                expect={
                    "token_count": str(s.size),
                    "segment_start": str(s.start),
                    "epoch": segment_epoch(s.file),
                    "checksum": s.checksum,
                    "token_hash": s.token_hash,
                },
            )
        except ValueError:  # a layout this build cannot use: discarded like damage
            (self.root / s.file).unlink(missing_ok=True)
            raise

    @staticmethod
    def matching(man: Manifest, tokens: Sequence[int]) -> Manifest:
        """The manifest of ``man``'s leading segments whose tokens are ``tokens``' own (by their
        recorded hashes; no file is read). A shorter one is no damage: the snapshot goes on past
        ``tokens`` (a reply regenerated) or holds another branch of the conversation from there."""
        n = shared_run(man.segments, tokens)
        if n == len(man.segments) and man.token_hash:
            return man
        return man.truncated(n, token_hash(tokens[: man.segments[n - 1].end if n else 0]))

    def best(self, man: Manifest, tokens: Sequence[int]) -> Manifest:
        """``matching`` of the branch of ``man`` that holds the longest prefix of ``tokens`` (the
        current one on a tie), as a manifest of that one branch."""
        return max((self.matching(view, tokens) for view in man.views()), key=lambda m: m.end)

    def load(
        self, man: Manifest, tokens: Sequence[int]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], Manifest, str]:
        """The KV of the longest run of valid segments from token 0 (checked against ``tokens``):
        ``(k, v, manifest of that run, why it stopped early or "")``. A bad segment is deleted;
        the caller repairs the manifest on disk. OSError (an unreadable disk) propagates."""
        ks, vs, why = [], [], ""
        for i, s in enumerate(man.segments):
            if s.end > len(tokens):
                why = f"segment {s.file} ends at token {s.end}, past the conversation's {len(tokens)}"
                break
            try:
                k, v, _ = self._load_segment(man, s, tokens)
            except (SnapshotInvalid, ValueError) as e:
                why = str(e)
                break
            ks.append(k)
            vs.append(v)
        n = len(ks)
        kept = man if n == len(man.segments) else man.truncated(n, token_hash(tokens[: man.segments[n].start]))
        if n == 0:
            return [], [], kept, why
        cat = lambda parts: [torch.cat(x) if len(x) > 1 else x[0] for x in zip(*parts)]  # noqa: E731
        return cat(ks), cat(vs), kept, why
