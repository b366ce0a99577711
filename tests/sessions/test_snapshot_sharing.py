"""One snapshot directory, several processes: the segment store's directory
lock and its fence.

- A write-behind that lands after another process stored a newer history of the same
  conversation (a higher fence: the id of the history's last message) is refused and leaves
  the newer snapshot whole; a manifest written before fences existed reads as fence 0.
- A child process appends segments (new epochs too, which remove the old files) as fast as
  it can while this process runs the real open-time sweep (``snapshot_rows.reconcile``) and
  restores: the sweep never removes a segment written but not listed yet, a read never
  meets a file removed under it, and the manifest left at the end loads without a failed
  check. (Without the lock this fails within a few hundred rounds: the sweep deletes the
  child's newest segment between its rename and its manifest switch.)

Real parts: safetensors files, a real SQLite store, a real second process.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch

from chatkv.sessions import manifest_rows as rows
from chatkv.storage.kv_segments import Diverged, SegmentStore
from chatkv.storage.repository import Store

ROOT = Path(__file__).resolve().parents[2]
GEOM = dict(model_fingerprint="m", kv_dtype="float32")


def kv(n: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return (
        [torch.randn(n, 2, 4, generator=g) for _ in range(2)],
        [torch.randn(n, 2, 4, generator=g) for _ in range(2)],
    )


def test_an_older_history_never_replaces_a_newer_snapshot(tmp_path):
    seg = SegmentStore(tmp_path / "kv")
    toks = list(range(40))
    seg.append("c", toks[:20], 0, *kv(20, 1), epoch="0000000a", base=True, fence=7, **GEOM)
    newer = seg.read_manifest("c")
    assert newer.fence == 7
    # the other process's late write: an older history (message 3), a new epoch or an append
    with pytest.raises(Diverged, match="newer history"):
        seg.append("c", toks[:30], 0, *kv(30, 2), epoch="0000000b", base=True, fence=3, **GEOM)
    with pytest.raises(Diverged, match="newer history"):
        seg.append("c", toks[:30], 20, *kv(10, 3), epoch="0000000a", base=False, fence=3, **GEOM)
    assert seg.read_manifest("c") == newer
    k, v, good, why = seg.load(newer, toks[:20])
    assert why == "" and good == newer and torch.equal(k[0], kv(20, 1)[0][0])
    # the same or a newer history goes on
    seg.append("c", toks[:30], 20, *kv(10, 4), epoch="0000000a", base=False, fence=7, **GEOM)
    man, _ = seg.append("c", toks[:40], 0, *kv(40, 5), epoch="0000000c", base=True, fence=9, **GEOM)
    assert (man.fence, man.end, seg.read_manifest("c")) == (9, 40, man)
    assert sorted(p.name for p in seg.root.glob("c_*")) == [man.segments[0].file]


def test_a_manifest_from_before_fences_reads_as_fence_zero(tmp_path):
    seg = SegmentStore(tmp_path / "kv")
    man, _ = seg.append("c", list(range(8)), 0, *kv(8, 1), epoch="0000000a", base=True, fence=4, **GEOM)
    body = json.loads(man.to_json())
    del body["checksum"], body["fence"]
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    body["checksum"] = f"crc32:{zlib.crc32(text.encode()):08x}"
    seg.manifest_path("c").write_text(json.dumps(body))
    old = seg.read_manifest("c")
    assert old.fence == 0 and old.segments == man.segments
    # and such a snapshot is replaced by any process's next write
    assert seg.append("c", list(range(8)), 0, *kv(8, 2), epoch="0000000b", base=True, fence=1, **GEOM)[0].fence == 1


CHILD = r"""
import sys, torch
from chatkv.storage.kv_segments import Diverged, SegmentStore
root, key, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
seg = SegmentStore(__import__("pathlib").Path(root))
end, epoch = 0, None
for i in range(rounds):
    if epoch is None or i % 5 == 0 or end > 200:
        epoch, end, base, n = f"{i:08x}", 0, True, 16
    else:
        base, n = False, 3
    k = [torch.full((n, 2, 4), float(i)) for _ in range(2)]
    try:
        man, _ = seg.append(key, list(range(end + n)), end, k, k, epoch=epoch, base=base, fence=i,
                            model_fingerprint="m", kv_dtype="float32")
        end = man.end
    except Diverged:
        epoch = None  # the sweep or the repair changed the disk: start over
print("done", flush=True)
"""


def test_a_sweep_and_restores_never_break_another_process_appending(tmp_path):
    data = tmp_path / "data"
    store = Store.open(None, data)
    try:
        conv = store.create_conversation("t", "m", "", {}).id
        salt = hashlib.sha256(b"").hexdigest()[:8]
        key = f"{conv}-{salt}"
        seg = SegmentStore(tmp_path / "kv")
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(seg.root), key, "400"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        sweeps = loads = 0
        deadline = time.monotonic() + 120
        while child.poll() is None and time.monotonic() < deadline:
            kept = rows.reconcile(seg, store, "", salt)
            sweeps += 1
            with seg.locked():  # how Snapshots.restore reads: manifest and segments in one step
                man = seg.read_manifest(key)
                if man is not None:
                    _, _, good, why = seg.load(man, list(range(man.end)))
                    assert why == "" and good == man, why
                    assert kept.get(conv) is None or kept[conv].key == key
                    loads += 1
        out, err = child.communicate(timeout=60)
        assert child.returncode == 0 and "done" in out, err[-2000:]
        man = seg.read_manifest(key)
        _, _, good, why = seg.load(man, list(range(man.end)))
        assert why == "" and good == man
        assert {s.file for s in man.segments} == {p.name for p in seg.root.glob(f"{key}_*")}
        assert sweeps > 20 and loads > 20, (sweeps, loads)  # the two really overlapped
    finally:
        store.close()
