"""Branches of a conversation on disk: their write-behind segments share the
common prefix's files.

SegmentStore: a branch keeps the prefix segments of any branch holding its tokens and appends
after them; a file goes only when no branch lists it (dropped branches, the branch cap); a
damaged segment cuts only the branches listing it; a manifest of branches reads back; a writer
killed (SIGKILL) at any moment while appending branches leaves a manifest whose every branch
loads. Through the engine (a small random llama, real store, restarts): switching back to a
branch after a restart restores its KV from disk, a damaged segment of one branch loses nothing
of the other, and the disk budget counts shared files once. Replies are checked against
transformers' greedy output on the branch's own prompt.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch

from chatkv.errors import SnapshotInvalid
from chatkv.storage.kv_segments import Diverged, Manifest, SegmentStore, shared_run
from tests.sessions.test_branches import QUESTIONS, SYSTEM, check, engine_at, model  # noqa: F401  (the fixture)

ROOT = Path(__file__).resolve().parents[2]
GEOM = dict(model_fingerprint="m", kv_dtype="float32")


def branch_tokens(fork: int, tag: int = 1, n: int = 64) -> list[int]:
    """Tokens of a branch that shares [0, fork) with the trunk (tokens 0, 1, 2, ...)."""
    return [i if i < fork else 1000 * tag + i for i in range(n)]


def kv_of(tokens, start: int, end: int):
    """KV whose values are the tokens themselves: a load shows which branch's data it holds."""
    t = torch.tensor(tokens[start:end], dtype=torch.float32).view(-1, 1, 1).expand(-1, 2, 4).contiguous()
    return [t, t + 0.5], [-t, -t - 0.5]


def put(seg, tokens, start, end, *, base=False, epoch="0000000a", fence=1):
    k, v = kv_of(tokens, start, end)
    return seg.append("c", tokens[:end], start, k, v, epoch=epoch, base=base, fence=fence, **GEOM)[0]


def loads_as(seg, view: Manifest, tokens) -> None:
    k, _, good, why = seg.load(view, tokens)
    assert why == "" and good.segments == view.segments, why
    assert torch.equal(k[0][:, 0, 0], torch.tensor(tokens[: view.end], dtype=torch.float32))


def on_disk(seg) -> set[str]:
    return {p.name for p in seg.root.glob("c_*")}


def test_a_branch_shares_the_common_prefix_files_and_appends_after_them(tmp_path):
    seg = SegmentStore(tmp_path / "kv")
    trunk, other = branch_tokens(64), branch_tokens(24)
    for a, b in ((0, 8), (8, 24), (24, 40)):
        man = put(seg, trunk, a, b, base=a == 0)
    trunk_segs = man.segments
    # the caller knew only [0, 8) was shared: the writer keeps [0, 24) and writes from there
    man = put(seg, other, 8, 48, epoch="0000000b")
    assert man.segments[:2] == trunk_segs[:2] and (man.segments[2].start, man.end) == (24, 48)
    assert man.branches == (trunk_segs,)
    assert on_disk(seg) == man.files() and len(on_disk(seg)) == 4  # no shared file copied
    assert man.nbytes == sum((seg.root / f).stat().st_size for f in man.files())
    assert seg.read_manifest("c") == man  # the branches survive a read back
    # a restore picks the branch sharing most with its prompt
    assert seg.best(man, trunk).segments == trunk_segs and seg.best(man, other).segments == man.segments
    loads_as(seg, seg.best(man, trunk), trunk)
    loads_as(seg, seg.best(man, other), other)
    # switched back to the trunk: it goes on after its own segments, the other branch stays
    back = put(seg, trunk, 40, 56, epoch="0000000c")
    assert back.segments == trunk_segs + back.segments[3:] and back.branches == (man.segments,)
    loads_as(seg, seg.best(back, other), other)
    # a write whose KV starts past what any branch holds cannot be placed: refused, nothing changes
    with pytest.raises(Diverged, match="no branch on disk"):
        put(seg, branch_tokens(30, tag=2), 32, 40)
    assert seg.read_manifest("c") == back
    # a branch the disk holds whole becomes current without a write
    files = on_disk(seg)
    again = put(seg, other, 48, 48)
    assert again.segments == man.segments and again.branches == (back.segments,) and on_disk(seg) == files
    # a base write (nothing shared) replaces every branch
    fresh = put(seg, branch_tokens(0, tag=3), 0, 16, base=True, epoch="0000000d")
    assert fresh.branches == () and on_disk(seg) == fresh.files()


def test_dropping_a_branch_removes_only_files_no_other_branch_lists(tmp_path):
    seg = SegmentStore(tmp_path / "kv")
    trunk = branch_tokens(64)
    put(seg, trunk, 0, 8, base=True)
    man = put(seg, trunk, 8, 16)
    shared = man.segments
    for j in range(1, SegmentStore.MAX_BRANCHES + 3):  # more branches than a manifest keeps
        man = put(seg, branch_tokens(16, tag=j), 16, 24 + j, epoch=f"{j:08x}", fence=j)
        assert len(man.all_branches()) == min(j, SegmentStore.MAX_BRANCHES)
        assert on_disk(seg) == man.files(), "a dropped branch's own file stayed, or a listed one went"
        assert set(shared) <= set(man.segments)  # the prefix files every branch lists stay
    for view in man.views():  # every branch kept still loads
        j = (view.end - 24) if view.end > 16 else 0
        loads_as(seg, view, branch_tokens(16, tag=j))


def test_a_damaged_segment_cuts_only_the_branches_listing_it(tmp_path):
    seg = SegmentStore(tmp_path / "kv")
    trunk, other = branch_tokens(64), branch_tokens(16)
    put(seg, trunk, 0, 8, base=True)
    put(seg, trunk, 8, 16)
    a = put(seg, trunk, 16, 32)
    b = put(seg, other, 16, 40, epoch="0000000b")
    own = b.segments[-1]
    path = seg.root / own.file
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x10
    path.write_bytes(bytes(data))
    view = seg.best(b, other)
    _, _, good, why = seg.load(view, other)
    assert why and good.segments == b.segments[:2]
    fixed = b.cut(own.file, good)
    assert fixed.segments == good.segments and fixed.branches == (a.segments,)  # the trunk loses nothing
    seg.write_manifest(fixed)
    seg.remove("c", keep=fixed)
    assert not path.exists() and on_disk(seg) == fixed.files()
    loads_as(seg, seg.best(seg.read_manifest("c"), trunk), trunk)
    # a damaged shared segment: every branch ends before it
    assert b.cut(b.segments[0].file, seg.best(b, other).truncated(0, "")) is None


def test_a_manifest_of_branches_is_checked_when_read(tmp_path):
    seg = SegmentStore(tmp_path / "kv")
    trunk = branch_tokens(64)
    put(seg, trunk, 0, 8, base=True)
    put(seg, trunk, 8, 16)
    man = put(seg, branch_tokens(8), 8, 20, epoch="0000000b")
    body = json.loads(man.to_json())
    assert body["format_version"] == 1 and len(body["branches"]) == 1
    one = json.loads(put(seg, branch_tokens(0, tag=5), 0, 8, base=True, epoch="0000000c").to_json())
    assert "branches" not in one  # one branch: the manifest reads as before branches existed
    broken = Manifest(**{**man.__dict__, "branches": ((man.branches[0][1],),)})  # a branch not from token 0
    with pytest.raises(SnapshotInvalid, match="out of order"):
        Manifest.from_json(broken.to_json(), "c")
    body = json.loads(man.to_json())
    del body["checksum"]
    body["branches"] = [[]]  # an empty branch
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    body["checksum"] = f"crc32:{zlib.crc32(text.encode()):08x}"
    with pytest.raises(SnapshotInvalid, match="lacks a field"):
        Manifest.from_json(json.dumps(body), "c")


# ------------------------------------------------------------------ kill -9 during branch writes

CHILD = r"""
import random, sys, torch
from pathlib import Path
from chatkv.storage.kv_segments import Diverged, SegmentStore
FORKS = %r
def branch_tokens(fork, tag, n=64):
    return [i if i < fork else 1000 * tag + i for i in range(n)]
def kv_of(tokens, start, end):
    t = torch.tensor(tokens[start:end], dtype=torch.float32).view(-1, 1, 1).expand(-1, 2, 4).contiguous()
    return [t, t + 0.5], [-t, -t - 0.5]
seg = SegmentStore(Path(sys.argv[1]))
rng = random.Random(int(sys.argv[2]))
print("ready", flush=True)
i = 0
while True:
    i += 1
    j = rng.randrange(len(FORKS))
    toks = branch_tokens(*FORKS[j])
    man = seg.read_manifest("c")
    at = 0 if man is None else seg.best(man, toks).end
    if at >= len(toks):
        man, at = None, 0  # full: start over
    end = min(at + rng.choice([3, 8, 13]), len(toks))
    k, v = kv_of(toks, at, end)
    try:
        seg.append("c", toks[:end], at, k, v, epoch=f"{i:08x}", base=man is None, fence=0,
                   model_fingerprint="m", kv_dtype="float32")
    except Diverged:
        pass
"""
FORKS = [(64, 1), (24, 2), (40, 3), (8, 4)]  # (fork point, tag): branches of one trunk
CHILD %= (FORKS,)


def test_kill_9_during_branch_writes_leaves_every_branch_loadable(tmp_path):
    """A writer appending to several branches of one conversation (shared prefixes, merges,
    new bases) is SIGKILLed at random moments; after each kill the manifest reads, every branch
    it lists loads bit-exact as one of the branches' tokens, and a sweep of the files no branch
    lists leaves them loadable."""
    root = tmp_path / "kv"
    rng = random.Random(22)
    seen_branches = 0
    for trial in range(10):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(root), str(trial)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout.readline().strip() == "ready", child.stderr.read()[-2000:]
            time.sleep(rng.uniform(0.05, 0.6))
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
        seg = SegmentStore(root)  # sweeps the dead writer's temp files
        with seg.locked():
            man = seg.read_manifest("c")
            if man is None:
                continue
            assert {s.file for b in man.all_branches() for s in b} <= on_disk(seg)
            seg.remove("c", keep=man)  # what the reconcile on open does: unlisted files go
            assert on_disk(seg) == man.files()
            for view in man.views():
                mine = [
                    branch_tokens(*f)
                    for f in FORKS
                    if shared_run(view.segments, branch_tokens(*f)) == len(view.segments)
                ]
                assert mine, f"trial {trial}: a branch holding no branch's tokens"
                loads_as(seg, view, mine[0])
            seen_branches = max(seen_branches, len(man.all_branches()))
    assert seen_branches >= 2, "the writer never had two branches on disk"


# ------------------------------------------------------------------ through the engine


def _two_branches(e):
    """Three turns (branch A), then message 2 edited and answered (branch B, current)."""
    s = e.session(system=SYSTEM, params=dict(max_tokens=6, temperature=0.0))
    replies = [s.send(q) for q in QUESTIONS]
    edited = s.edit(s.messages()[2].id, "What is the capital of Italy?")
    snaps = e.session_manager.snapshots
    snaps.flush()
    man = snaps.segments.read_manifest(snaps.key(s.id))
    return s, replies, edited, man


def kv_len(reply) -> int:
    return reply.usage.prompt_tokens + reply.usage.generated_tokens - 1


@pytest.mark.parametrize("damaged", ["none", "a", "b"])
def test_a_branch_comes_back_from_disk_after_a_restart_and_damage_stays_in_its_branch(model, tmp_path, damaged):
    ref, d = model
    with engine_at(d, tmp_path) as e:
        s, replies, edited, man = _two_branches(e)
        sid, a_leaf = s.id, replies[-1].message_id
    a_segs, b_segs = man.branches[0], man.segments
    assert len(man.branches) == 1 and (a_segs[-1].end, b_segs[-1].end) == (kv_len(replies[-1]), kv_len(edited))
    shared = [x for x in b_segs if x in a_segs]
    assert shared and shared == list(b_segs[: len(shared)]), "the common prefix's segments are not shared"
    shared_end = shared[-1].end
    kv = tmp_path / "kv"
    if damaged != "none":
        own = (a_segs if damaged == "a" else b_segs)[len(shared)]  # the branch's first own segment
        data = bytearray((kv / own.file).read_bytes())
        data[-9] ^= 0x01
        (kv / own.file).write_bytes(bytes(data))
    e = engine_at(d, tmp_path)
    try:
        s = e.resume(sid)  # branch B is current
        rb = s.send("Is it far?")
        check(ref, s, rb)
        assert rb.usage.restored_tokens == (shared_end if damaged == "b" else kv_len(edited))
        s.switch(a_leaf)
        ra = s.send("Thanks!")
        check(ref, s, ra)
        u = ra.usage
        if damaged == "a":  # its own segments are lost: only the shared prefix is memory's or the disk's
            assert u.cached_tokens + u.restored_tokens == max(u.cached_tokens, shared_end)
        else:  # all of the branch's history beyond what memory holds (the prefix it shares with B) is restored
            assert u.restored_tokens > 0 and u.cached_tokens + u.restored_tokens == kv_len(replies[-1])
        assert u.cached_tokens + u.restored_tokens + u.computed_tokens == u.prompt_tokens
        snaps = e.session_manager.snapshots
        snaps.flush()
        now = snaps.segments.read_manifest(snaps.key(sid))
        assert {p.name for p in kv.glob(f"{snaps.key(sid)}_*")} == now.files(), "a file no branch lists is left"
        assert len(now.all_branches()) == 2
    finally:
        e.close()


def test_the_disk_budget_counts_shared_files_once(model, tmp_path):
    ref, d = model
    with engine_at(d, tmp_path) as e:
        s, _, _, man = _two_branches(e)
        snaps = e.session_manager.snapshots
        twice = sum(x.nbytes for b in man.all_branches() for x in b)
        assert man.nbytes < twice and snaps._sizes[s.id] == man.nbytes
        assert man.nbytes == sum(p.stat().st_size for p in (tmp_path / "kv").glob(f"{snaps.key(s.id)}_*"))
        snaps.budget = man.nbytes  # within it only when shared files count once
        snaps.flush()
        assert snaps.segments.read_manifest(snaps.key(s.id)) == man
        snaps.budget = man.nbytes - 1
        snaps.flush()
        assert snaps.segments.read_manifest(snaps.key(s.id)) is None
        assert not list((tmp_path / "kv").glob(f"{snaps.key(s.id)}_*"))


def test_a_branch_sharing_no_whole_segment_is_kept_beside_the_other(model, tmp_path):
    """Compaction merged the common prefix into one segment with the rest (MAX_OPEN 1: every
    write merges), so an edit shares no whole segment: the new branch is written whole from
    token 0 and the branch left stays on disk, restored after a restart."""
    ref, d = model
    with engine_at(d, tmp_path) as e:
        e.session_manager.snapshots.segments.MAX_OPEN = 1
        s, replies, edited, man = _two_branches(e)
        sid, a_leaf = s.id, replies[-1].message_id
    assert len(man.segments) == 1 and [len(b) for b in man.branches] == [1]
    assert (man.branches[0][0].end, man.end) == (kv_len(replies[-1]), kv_len(edited))
    e = engine_at(d, tmp_path)
    try:
        s = e.resume(sid)
        s.switch(a_leaf)
        ra = s.send("Thanks!")
        check(ref, s, ra)
        assert ra.usage.restored_tokens == kv_len(replies[-1])
    finally:
        e.close()
