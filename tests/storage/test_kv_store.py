"""KVStore: safetensors KV snapshots, checked field by field, written atomically."""

from __future__ import annotations

import logging
import os
import random
import signal
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from chatkv.errors import SnapshotInvalid
from chatkv.storage import kv_store
from chatkv.storage.kv_store import FORMAT_VERSION, KVStore, SnapshotMeta, token_hash
from tests.support.fork_server import ForkServer

FP = "model-fp-1"
LAYERS, HEADS, HEAD_DIM = 3, 2, 16


def make_kv(n, dtype=torch.bfloat16, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype in (torch.int8, torch.uint8):
        lo, hi = (-128, 128) if dtype == torch.int8 else (0, 256)
        mk = lambda: torch.randint(lo, hi, (n, heads, head_dim), generator=g, dtype=dtype)  # noqa: E731
    else:
        mk = lambda: torch.randn(n, heads, head_dim, generator=g).to(dtype)  # noqa: E731
    return [mk() for _ in range(layers)], [mk() for _ in range(layers)]


def tokens(n, seed=0):
    return random.Random(seed).sample(range(100_000), n)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def load_args(ids, **over):
    args = dict(
        token_ids=ids,
        model_fingerprint=FP,
        kv_dtype="bfloat16",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
    )
    args.update(over)
    return args


@pytest.fixture
def store(tmp_path):
    return KVStore(tmp_path / "kv")


@pytest.fixture
def saved(store):
    """A saved bf16 snapshot of 40 tokens: (store, ids, k, v, original file bytes)."""
    ids = tokens(40)
    k, v = make_kv(40)
    store.save("abc", ids, k, v, model_fingerprint=FP, kv_dtype="bfloat16")
    return store, ids, k, v, store.path("abc").read_bytes()


def header(store, key) -> SnapshotMeta:
    """The snapshot's header as written, read straight from the file."""
    path = store.path(key)
    return KVStore._meta_from(store_meta_dict(path), path, path.stat().st_size)


def header_end(blob: bytes) -> int:
    return 8 + struct.unpack("<Q", blob[:8])[0]


def expect_invalid(store, key, ids, match=None, **over):
    with pytest.raises(SnapshotInvalid, match=match) as exc:
        store.load(key, **load_args(ids, **over))
    assert not store.path(key).exists(), "a snapshot that failed to load must be deleted"
    assert key in str(exc.value)
    return exc.value


# ----------------------------------------------------------------- round trip


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float16"])
def test_round_trip_bit_exact(store, kv_dtype):
    dtype = getattr(torch, kv_dtype)
    ids = tokens(37)
    k, v = make_kv(37, dtype, layers=5)
    meta = store.save("conv-1", ids, k, v, model_fingerprint=FP, kv_dtype=kv_dtype)
    assert isinstance(meta, SnapshotMeta)
    assert (meta.format_version, meta.model_fingerprint, meta.kv_dtype) == (FORMAT_VERSION, FP, kv_dtype)
    assert (meta.token_count, meta.num_layers, meta.num_kv_heads, meta.head_dim) == (37, 5, HEADS, HEAD_DIM)
    assert meta.token_hash == token_hash(ids)
    assert meta.file == str(store.path("conv-1")) and meta.nbytes == store.path("conv-1").stat().st_size
    assert meta.checksum.startswith("crc32:")
    assert header(store, "conv-1") == meta  # the file's header says what save() returned

    k2, v2, n = store.load("conv-1", **load_args(ids, kv_dtype=kv_dtype, num_layers=5))
    assert n == 37
    assert len(k2) == len(v2) == 5
    assert all(same_bits(a, b) for a, b in zip(k + v, k2 + v2))


def test_prefix_load_returns_stored_count(store):
    ids = tokens(70)
    k, v = make_kv(50)
    store.save("p", ids[:50], k, v, model_fingerprint=FP, kv_dtype="bfloat16")
    k2, v2, n = store.load("p", **load_args(ids))
    assert n == 50
    assert all(same_bits(a, b) for a, b in zip(k + v, k2 + v2))
    # the exact token list works too, and the file is kept after a good load
    assert store.load("p", **load_args(ids[:50]))[2] == 50
    assert store.keys() == {"p"}


def test_token_hash_is_sha256_of_int64_le():
    import hashlib

    ids = [1, 2, 300000, 7]
    assert token_hash(ids) == hashlib.sha256(struct.pack("<4q", *ids)).hexdigest()
    assert token_hash(torch.tensor(ids)) == token_hash(ids) != token_hash(ids[:3])


def test_non_contiguous_input_is_saved_by_token(store):
    ids = tokens(12)
    base = torch.randn(HEADS, 12, HEAD_DIM).to(torch.bfloat16)
    k = [base.transpose(0, 1)] * LAYERS  # [T, H, D] view, not contiguous
    store.save("nc", ids, k, k, model_fingerprint=FP, kv_dtype="bfloat16")
    k2, _, _ = store.load("nc", **load_args(ids))
    assert same_bits(k2[0], k[0].contiguous())


def test_shared_and_sliced_inputs(store):
    """The same tensor as k and v, and layers sliced from one gathered tensor."""
    ids = tokens(10)
    t = torch.randn(10, HEADS, HEAD_DIM).to(torch.bfloat16)
    store.save("same", ids, [t] * LAYERS, [t] * LAYERS, model_fingerprint=FP, kv_dtype="bfloat16")
    k2, v2, _ = store.load("same", **load_args(ids))
    assert all(same_bits(x, t) for x in k2 + v2)
    big = torch.randn(2, LAYERS, 10, HEADS, HEAD_DIM).to(torch.bfloat16)  # [k/v, layer, T, H, D]
    store.save("sliced", ids, list(big[0]), list(big[1]), model_fingerprint=FP, kv_dtype="bfloat16")
    k2, v2, _ = store.load("sliced", **load_args(ids))
    assert same_bits(torch.stack(k2), big[0]) and same_bits(torch.stack(v2), big[1])


@pytest.mark.parametrize("kv_dtype", ["int8@float32", "fp8_e4m3@bfloat16"])
def test_quantised_rows_round_trip(store, kv_dtype):
    """Quantised KV is stored as its uint8 rows (values, then the row's scale bytes)."""
    ids = tokens(20)
    k, v = make_kv(20, torch.uint8)
    meta = store.save("q", ids, k, v, model_fingerprint=FP, kv_dtype=kv_dtype)
    assert meta.extra_tensors == () and meta.kv_dtype == kv_dtype
    k2, v2, n = store.load("q", **load_args(ids, kv_dtype=kv_dtype))
    assert n == 20 and all(same_bits(a, b) for a, b in zip(k + v, k2 + v2))
    with pytest.raises(ValueError, match="expected torch.uint8"):
        store.save("q", ids, *make_kv(20, torch.int8), model_fingerprint=FP, kv_dtype=kv_dtype)
    with pytest.raises(ValueError, match="unknown kv dtype"):
        store.save("q", ids, k, v, model_fingerprint=FP, kv_dtype="int8@nonsense")


def test_extra_tensors_are_refused_and_kept(saved):
    """A well-formed snapshot with tensors this build does not write (e.g. KV scales of
    a build with quantised KV): load() would silently drop them, so it refuses, and the
    file is kept."""
    store, ids, *_ = saved
    path = store.path("abc")
    tensors = {n: t.clone() for n, t in load_file(path).items()}
    tensors["k_scale.0"] = torch.rand(40, HEADS)
    meta = dict(store_meta_dict(path), extra_tensors="k_scale.0", checksum=kv_store._checksum(tensors))
    save_file(tensors, path, metadata=meta)
    with pytest.raises(ValueError, match="extra tensors k_scale.0"):
        store.load("abc", **load_args(ids))
    assert path.exists()


def test_resave_replaces_and_bookkeeping(store):
    k, v = make_kv(10)
    store.save("a", tokens(10), k, v, model_fingerprint=FP, kv_dtype="bfloat16")
    k3, v3 = make_kv(30, seed=3)
    store.save("a", tokens(30, seed=3), k3, v3, model_fingerprint=FP, kv_dtype="bfloat16")
    store.save("b", tokens(10), k, v, model_fingerprint=FP, kv_dtype="bfloat16")
    assert store.keys() == {"a", "b"}
    assert header(store, "a").token_count == 30
    k2, _, n = store.load("a", **load_args(tokens(30, seed=3)))
    assert n == 30 and same_bits(k2[1], k3[1])
    store.delete("a")
    store.delete("a")  # deleting a missing snapshot is fine
    assert store.keys() == {"b"}
    assert store.path("a") == store.root / "a.safetensors"
    assert not [p for p in store.root.iterdir() if p.name.endswith(".tmp")]


def test_reopen_sees_existing_snapshots(saved, tmp_path):
    store, ids, k, v, _ = saved
    again = KVStore(store.root)
    assert again.keys() == {"abc"}
    assert again.load("abc", **load_args(ids))[2] == 40


@pytest.mark.parametrize("case", ["shape", "dtype", "token_count", "layers", "empty", "dtype_name"])
def test_save_rejects_bad_arguments(store, case):
    ids = tokens(8)
    k, v = make_kv(8)
    kw = dict(model_fingerprint=FP, kv_dtype="bfloat16")
    if case == "shape":
        k[1] = torch.zeros(8, HEADS, HEAD_DIM + 1, dtype=torch.bfloat16)
    elif case == "dtype":
        v[0] = v[0].float()
    elif case == "token_count":
        ids = ids[:7]
    elif case == "layers":
        v = v[:-1]
    elif case == "empty":
        ids, k, v = [], [t[:0] for t in k], [t[:0] for t in v]
    elif case == "dtype_name":
        kw["kv_dtype"] = "float33"
    with pytest.raises(ValueError):
        store.save("bad", ids, k, v, **kw)
    assert list(store.root.iterdir()) == []


def test_snapshot_size_is_kv_bytes_plus_small_header(store):
    T, L, H, D = 300, 6, 4, 32
    k, v = make_kv(T, layers=L, heads=H, head_dim=D)
    meta = store.save("s", tokens(T), k, v, model_fingerprint=FP, kv_dtype="bfloat16")
    raw = 2 * L * T * H * D * 2
    assert raw + 8 * T < meta.nbytes < raw + 8 * T + 4096


# ---------------------------------------------------------------- damage matrix


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(model_fingerprint="other-model"), "model fingerprint differs"),
        (dict(kv_dtype="float16"), "kv dtype differs"),
        (dict(num_layers=LAYERS + 1), "geometry differs"),
        (dict(num_kv_heads=HEADS * 2), "geometry differs"),
        (dict(head_dim=HEAD_DIM // 2), "geometry differs"),
    ],
)
def test_mismatch_discards(saved, over, match, caplog):
    store, ids, *_ = saved
    with caplog.at_level(logging.WARNING, logger="chatkv.storage"):
        expect_invalid(store, "abc", ids, match=match, **over)
    assert any("abc" in r.getMessage() for r in caplog.records)


def test_other_tokens_discards(saved):
    store, ids, *_ = saved
    changed = list(ids) + [5, 6]
    changed[17] += 1  # the conversation no longer starts with the stored tokens
    expect_invalid(store, "abc", changed, match="token ids differ")


def test_shorter_conversation_discards(saved):
    store, ids, *_ = saved
    expect_invalid(store, "abc", ids[:39], match="only 39")


def test_too_short_for_min_tokens_is_kept(saved):
    store, ids, *_ = saved
    with pytest.raises(SnapshotInvalid, match="fewer than"):
        store.load("abc", **load_args(ids), min_tokens=41)
    assert store.path("abc").exists()
    assert store.load("abc", **load_args(ids), min_tokens=40)[2] == 40


def rewrite(store, key, meta_over=None, drop=(), tensors_over=None):
    """Rewrite a snapshot with changed header fields or tensors (keeping the checksum)."""
    path = store.path(key)
    tensors = {n: t.clone() for n, t in load_file(path).items()}
    meta = dict(store_meta_dict(path))
    meta.update(meta_over or {})
    for f in drop:
        meta.pop(f)
    tensors.update(tensors_over or {})
    save_file(tensors, path, metadata=meta)


def store_meta_dict(path):
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return f.metadata()


@pytest.mark.parametrize(
    "meta_over, drop, match",
    [
        ({"format_version": "2"}, (), "format version 2"),
        ({"format_version": "0"}, (), "format version 0"),
        ({"format_version": "one"}, (), "format_version"),
        ({"token_count": "-40"}, (), "token_count"),
        ({"token_count": "41"}, (), None),
        ({"token_count": "0"}, (), "no tokens"),
        ({"kv_dtype": "float16"}, (), "expected torch.float16"),  # header lies about the tensors
        ({"checksum": "crc32:00000000"}, (), "checksum"),
        ({"extra_tensors": "k_scale.0"}, (), "tensor names"),
        ({}, ("checksum",), "lacks checksum"),
        ({}, ("token_hash",), "lacks token_hash"),
    ],
)
def test_bad_header_fields(saved, meta_over, drop, match):
    store, ids, *_ = saved
    rewrite(store, "abc", meta_over, drop)
    kv_dtype = meta_over.get("kv_dtype", "bfloat16")
    expect_invalid(store, "abc", list(ids) + [1, 2], match=match, kv_dtype=kv_dtype)


def test_no_metadata_at_all(saved):
    store, ids, *_ = saved
    save_file(load_file(store.path("abc")), store.path("abc"))
    expect_invalid(store, "abc", ids, match="no metadata")


@pytest.mark.parametrize("what", ["token_ids", "wrong_shape", "extra_tensor", "missing_layer"])
def test_bad_tensors(saved, what):
    store, ids, k, *_ = saved
    path = store.path("abc")
    tensors = {n: t.clone() for n, t in load_file(path).items()}
    meta = store_meta_dict(path)
    if what == "token_ids":  # checksum recomputed, so only the token check can catch it
        tensors["token_ids"][3] += 1
        meta = dict(meta, checksum=kv_store._checksum(tensors))
    elif what == "wrong_shape":
        tensors["k.1"] = tensors["k.1"][:-1]
    elif what == "extra_tensor":
        tensors["junk"] = torch.zeros(3)
    elif what == "missing_layer":
        del tensors["v.2"]
    save_file(tensors, path, metadata=meta)
    expect_invalid(store, "abc", ids)


@pytest.mark.parametrize(
    "cut", ["empty", 1, 7, 8, 9, "mid_header", "header_end", "header_end+1", "token_ids", "middle", "last_byte"]
)
def test_truncated(saved, cut):
    store, ids, _, _, blob = saved
    he = header_end(blob)
    at = {
        "empty": 0,
        "mid_header": he // 2,
        "header_end": he,
        "header_end+1": he + 1,
        "token_ids": he + 100,
        "middle": (he + len(blob)) // 2,
        "last_byte": len(blob) - 1,
    }.get(cut, cut)
    store.path("abc").write_bytes(blob[:at])
    expect_invalid(store, "abc", ids)


def test_every_header_byte_flip_is_caught(saved):
    """Flip one bit of each header byte (two different bits per byte, all 8 in
    the length prefix): every variant must be refused, none may load."""
    store, ids, _, _, blob = saved
    he = header_end(blob)
    path = store.path("abc")
    undetected = []
    flips = [(pos, 1 << (pos % 8)) for pos in range(he)] + [(pos, 1 << ((pos + 3) % 8)) for pos in range(he)]
    flips += [(pos, 1 << b) for pos in range(8) for b in range(8)]
    for pos, mask in flips:
        damaged = bytearray(blob)
        damaged[pos] ^= mask
        path.write_bytes(bytes(damaged))
        try:
            store.load("abc", **load_args(ids))
        except SnapshotInvalid:
            if path.exists():
                undetected.append((pos, mask, "not deleted"))
        else:
            undetected.append((pos, mask, blob[max(0, pos - 20) : pos + 20]))
    assert not undetected, undetected[:5]


def test_data_byte_flips_are_caught(saved):
    store, ids, _, _, blob = saved
    he = header_end(blob)
    path = store.path("abc")
    rng = random.Random(7)
    positions = [he, he + 1, len(blob) - 1] + rng.sample(range(he, len(blob)), 150)
    for pos in positions:
        damaged = bytearray(blob)
        damaged[pos] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(damaged))
        with pytest.raises(SnapshotInvalid, match="checksum|token"):
            store.load("abc", **load_args(ids))
        assert not path.exists()


def test_missing_file(store):
    with pytest.raises(SnapshotInvalid, match="no file"):
        store.load("nothing", **load_args(tokens(5)))


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"hello, this is not a snapshot\n" * 10,
        b'{"__metadata__": {"format_version": "1"}}',
        struct.pack("<Q", 10**12) + b"{}",
        struct.pack("<Q", 2) + b"{}",
        struct.pack("<Q", 2) + b"{}" + b"\0" * 64,
        bytes(random.Random(3).getrandbits(8) for _ in range(5000)),
    ],
)
def test_not_a_snapshot(store, content):
    store.path("junk").write_bytes(content)
    assert store.keys() == {"junk"}
    expect_invalid(store, "junk", tokens(5))
    assert store.keys() == set()


# ------------------------------------------------------------ keys and modes


@pytest.mark.parametrize("key", ["../x", "a/b", "", "..", ".", "a" * 129, "a.b", "a b", "x\0", "é", "/abs"])
def test_bad_keys_rejected(store, key, tmp_path):
    k, v = make_kv(3)
    with pytest.raises(ValueError, match="key"):
        store.save(key, tokens(3), k, v, model_fingerprint=FP, kv_dtype="bfloat16")
    with pytest.raises(ValueError, match="key"):
        store.load(key, **load_args(tokens(3)))
    with pytest.raises(ValueError, match="key"):
        store.path(key)
    with pytest.raises(ValueError, match="key"):
        store.delete(key)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv"]
    assert list(store.root.iterdir()) == []


def test_longest_key_accepted(store):
    k, v = make_kv(3)
    key = "A-z_9" * 25 + "abc"
    assert len(key) == 128
    store.save(key, tokens(3), k, v, model_fingerprint=FP, kv_dtype="bfloat16")
    assert store.keys() == {key}


@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_file_and_dir_modes(tmp_path, umask):
    old = os.umask(umask)
    try:
        s = KVStore(tmp_path / "deep" / "kv")
        k, v = make_kv(3)
        s.save("m", tokens(3), k, v, model_fingerprint=FP, kv_dtype="bfloat16")
        s.save("m", tokens(3), k, v, model_fingerprint=FP, kv_dtype="bfloat16")
    finally:
        os.umask(old)
    assert stat.S_IMODE(s.root.stat().st_mode) == 0o700
    assert stat.S_IMODE(s.path("m").stat().st_mode) == 0o600


def test_existing_dir_is_left_alone(tmp_path):
    """Only a directory the store creates is made 0700 (an existing, possibly
    shared, directory is never chmod-ed); the snapshot files are 0600 either way."""
    d = tmp_path / "kv"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    s = KVStore(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o755
    k, v = make_kv(3)
    s.save("m", tokens(3), k, v, model_fingerprint=FP, kv_dtype="bfloat16")
    assert stat.S_IMODE(s.path("m").stat().st_mode) == 0o600


def test_cleanup_temp(tmp_path):
    root = tmp_path / "kv"
    s = KVStore(root)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    nonce = kv_store._PROCESS_NONCE
    other_nonce = "0" * 16 if nonce != "0" * 16 else "1" * 16
    names = {
        f".abc.{dead.pid}.{nonce}.00000001.tmp": "removed",  # writer is gone
        f".abc.{os.getpid()}.{other_nonce}.00000002.tmp": "removed",  # an earlier process with our pid
        f".abc.{os.getpid()}.{nonce}.00000003.tmp": "kept",  # our own write in flight
        f".abc.{os.getppid()}.{nonce}.00000004.tmp": "kept",  # a live writer
        f".abc.{os.getppid()}.{nonce}.00000005.tmp": "old",  # a live pid, but an hour old
        "notes.txt": "kept",
        ".abc.tmp": "kept",
    }
    for name, fate in names.items():
        (root / name).write_bytes(b"partial")
        if fate == "old":
            past = time.time() - 2 * 3600
            os.utime(root / name, (past, past))
    assert s.cleanup_temp() == 3
    left = {p.name for p in root.iterdir()}
    assert left == {n for n, fate in names.items() if fate == "kept"}
    assert s.keys() == set()
    # a new store cleans on start: our own pid's file is now another "process"'s
    for n in list(left):
        if n.endswith(".tmp") and f".{os.getpid()}." in n:
            (root / n).unlink()
    (root / f".abc.{dead.pid}.{nonce}.00000009.tmp").write_bytes(b"x")
    KVStore(root)
    assert f".abc.{dead.pid}.{nonce}.00000009.tmp" not in {p.name for p in root.iterdir()}


def test_failed_save_leaves_no_temp(store, monkeypatch):
    k, v = make_kv(5)
    store.save("f", tokens(5), k, v, model_fingerprint=FP, kv_dtype="bfloat16")

    def boom(*a, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(kv_store, "save_file", boom)
    k2, v2 = make_kv(5, seed=9)
    with pytest.raises(OSError, match="disk full"):
        store.save("f", tokens(5), k2, v2, model_fingerprint=FP, kv_dtype="bfloat16")
    assert {p.name for p in store.root.iterdir()} == {"f.safetensors"}
    k3, _, _ = store.load("f", **load_args(tokens(5)))
    assert same_bits(k3[0], k[0])  # the old snapshot is intact


# ---------------------------------------------------------------- kill -9

HELPER = Path(__file__).resolve().parents[1] / "support" / "kv_store_kill_child.py"


def test_kill_9_never_leaves_a_partial_snapshot(tmp_path):
    """A writer saving the same key in a loop (versions A and B alternately) is
    SIGKILLed at random moments. Afterwards the snapshot is absent (only if no
    save into that directory ever finished), or loads bit-exact as A or B;
    temp files are removed by the next KVStore()."""
    from tests.support import kv_store_kill_child as child

    data = child.versions()
    ids_b = data["B"][0]
    server = ForkServer(HELPER)
    rng = random.Random(20240611)
    seen = {"absent": 0, "A": 0, "B": 0}
    temps_removed = 0
    trials = 40
    deadline = time.monotonic() + 60
    try:
        root = None
        for trial in range(trials):
            assert time.monotonic() < deadline, "kill test is too slow"
            if trial % 4 == 0:  # a fresh directory now and then, so kills before the first save count
                root = tmp_path / f"kv{trial}"
                had_snapshot = False
            delay = rng.choice([0.0, rng.uniform(0, 0.005), rng.uniform(0, 0.08)])
            pid = server.go(str(root))
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
            server.reap(pid)
            if not root.exists():  # killed before the writer even made its directory
                seen["absent"] += 1
                continue

            temps_removed += sum(p.name.endswith(".tmp") for p in root.iterdir())
            store = KVStore(root)  # its init removes the dead writer's temp file
            assert not [p.name for p in root.iterdir() if p.name.endswith(".tmp")]
            exists = store.path(child.KEY).exists()
            args = dict(
                token_ids=ids_b,
                model_fingerprint=child.FINGERPRINT,
                kv_dtype=child.KV_DTYPE,
                num_layers=child.LAYERS,
                num_kv_heads=child.HEADS,
                head_dim=child.HEAD_DIM,
            )
            if not exists:
                assert not had_snapshot, f"trial {trial}: a complete snapshot vanished"
                with pytest.raises(SnapshotInvalid, match="no file"):
                    store.load(child.KEY, **args)
                seen["absent"] += 1
                continue
            k, v, n = store.load(child.KEY, **args)  # must not raise: a complete version is there
            name = {child.TOKENS_A: "A", child.TOKENS_B: "B"}[n]
            _, k_want, v_want = data[name]
            assert all(same_bits(a, b) for a, b in zip(k + v, k_want + v_want)), f"trial {trial}: mixed {name}"
            seen[name] += 1
            had_snapshot = True
    finally:
        server.close(10)
    print(f"kill -9 outcomes over {trials} trials: {seen}, killed mid-write {temps_removed}x")
    assert seen["A"] + seen["B"] >= trials // 5, seen
    assert temps_removed >= 1, "no kill landed inside a write: the test did not test atomicity"
