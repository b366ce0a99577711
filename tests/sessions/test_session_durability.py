"""Damage never means a wrong answer, and nothing committed is lost.

1. The damaged-snapshot matrix: a conversation of 3 greedy turns is written
   behind (one segment per turn, and a manifest) and the engine closed; a segment
   or the manifest is then damaged (or mismatched) on disk; a new Engine resumes
   it and sends turn 4. The reply must equal the reply of an uninterrupted run,
   of an uncached run of the same prompt, and transformers' greedy. Damage to the
   first segment or the manifest: the KV is recomputed (nothing restored) and the
   bad snapshot is gone (files and row). Damage to a later segment: the segments
   before it are restored, the rest recomputed, the manifest repaired. The
   engine's invariants hold, and the next write and restore work again.
2. kill -9 during spill: a worker process sends turns and spills in a loop and is
   SIGKILLed at random moments, many of them inside a spill. After each kill every
   message the worker reported committed is in the DB, and the next turn's reply
   equals transformers' greedy (a snapshot either restores correctly or is
   discarded; a complete one is never lost).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import struct
import time
import zlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from chatkv.config import EngineConfig
from chatkv.engine.core import Engine
from chatkv.engine.sampling import SamplingParams
from chatkv.storage import kv_store
from chatkv.storage.kv_segments import Manifest
from chatkv.storage.repository import Store
from chatkv.weights import model_fingerprint
from tests.support import session_kill_child as child
from tests.support.fork_server import ForkServer
from tests.support.processes import one_torch_thread
from tests.support.tiny import make_model

GREEDY = dict(max_tokens=6, temperature=0.0)
SYSTEM = "You are a helpful assistant."
QUESTIONS_A = [
    "Hello, how are you today?",
    "What is the capital of France?",
    "The quick brown fox jumps over the lazy dog.",
    "Key-value caches keep attention state.",
    "Paris is the capital of France.",
]
QUESTIONS_B = ["Key-value caches keep attention state between turns.", "What is the quick brown fox?"]


def engine_at(model_dir, data_dir, **kw) -> Engine:
    kw.setdefault("num_blocks", 96)  # 1536 tokens; the default 512 MiB pool costs more to allocate than a turn
    return Engine(model_dir, EngineConfig(data_dir=str(data_dir), **kw))


def hf_greedy(ref, ids: list[int], n: int) -> list[int]:
    out = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=2, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def turn_tokens(session, reply) -> tuple[list[int], list[int]]:
    """(prompt, generated) token ids of the session's last turn."""
    p, g = reply.usage.prompt_tokens, reply.usage.generated_tokens
    return session.tokens[:p], session.tokens[p : p + g]


def snap_path(engine, conv_id) -> Path:
    """The conversation's manifest."""
    m = engine.session_manager
    return m.snapshots.path(conv_id)


def snap_files(kv: Path, conv_id: str) -> dict[str, bytes]:
    """Every file of the conversation's snapshot (manifest and segments): name -> bytes."""
    return {p.name: p.read_bytes() for p in sorted(kv.iterdir()) if p.name.startswith(conv_id + "-")}


def header_end(blob: bytes) -> int:
    return 8 + struct.unpack("<Q", blob[:8])[0]


def flip(blob: bytes, positions, mask=0x10) -> bytes:
    b = bytearray(blob)
    for p in positions:
        b[p] ^= mask
    return bytes(b)


# --------------------------------------------------------------------- fixtures


# 4 layers of 8 KV heads of 64 (16 KiB of KV per token, so a spill writes megabytes
# and takes about as long as a turn), hidden 128: unlike the smallest tiny models its
# greedy replies depend on the history, so KV of the wrong tokens would show
MODEL = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=4096,
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("model") / "model"
    return make_model(d, "llama", seed=7, **MODEL), d


@pytest.fixture(scope="module")
def world(model, tmp_path_factory):
    """A base data dir (conversation A: 3 turns, B: 2 turns, both spilled by closing
    the engine) and the references for A's 4th turn."""
    root = tmp_path_factory.mktemp("durability")
    ref, model_dir = model

    # the uninterrupted run: 4 turns in one engine, never spilled
    with engine_at(model_dir, root / "straight") as e:
        s = e.session(system=SYSTEM, params=GREEDY)
        straight = [s.send(q) for q in QUESTIONS_A[:4]]
        prompt4, gen4 = turn_tokens(s, straight[3])
    # an uncached run of turn 4's prompt: one request, nothing in memory or on disk
    with engine_at(model_dir, root / "uncached") as e:
        uncached = e.generate(prompt4, SamplingParams(**GREEDY))
    assert uncached.usage.cached_tokens == 0
    assert uncached.token_ids[: len(gen4)] == gen4 and uncached.text == straight[3].text
    assert gen4 == hf_greedy(ref, prompt4, GREEDY["max_tokens"])[: len(gen4)]

    base = root / "base"
    with engine_at(model_dir, base) as e:
        a = e.session(system=SYSTEM, params=GREEDY)
        first3 = [a.send(q) for q in QUESTIONS_A[:3]]
        b = e.session(params=GREEDY)
        for q in QUESTIONS_B:
            b.send(q)
        a_id, b_id = a.id, b.id
        a_path, b_path = snap_path(e, a_id), snap_path(e, b_id)
        e.session_manager.snapshots.flush()  # the background writer is done
        a_segs = e.session_manager.snapshots.segment_paths(a_id)
        b_segs = e.session_manager.snapshots.segment_paths(b_id)
        a_history, b_history = list(a.tokens), list(b.tokens)
        last = first3[-1].usage
        history_kv = last.prompt_tokens + last.generated_tokens - 1
        a_ends = [int(p.stem.rsplit("_", 1)[1]) for p in a_segs]
    assert [r.text for r in first3] == [r.text for r in straight[:3]]
    assert a_path.exists() and b_path.exists()  # written behind each turn
    assert len(a_segs) == 3 and len(b_segs) == 2, "one segment per turn"
    assert a_ends[-1] == history_kv
    # the test can see wrong KV: turn 4's reply changes if the history's KV were B's,
    # or shifted by a block
    assert prompt4[: len(a_history)] == a_history
    delta = prompt4[len(a_history) :]
    assert hf_greedy(ref, b_history + delta, GREEDY["max_tokens"])[: len(gen4)] != gen4
    assert hf_greedy(ref, prompt4[16:], GREEDY["max_tokens"])[: len(gen4)] != gen4
    return dict(
        ref=ref,
        model_dir=model_dir,
        base=base,
        a=a_id,
        b=b_id,
        a_file=a_path.name,
        b_file=b_path.name,
        a_segs=[p.name for p in a_segs],
        b_segs=[p.name for p in b_segs],
        a_files=snap_files(base / "kv", a_id),
        b_files=snap_files(base / "kv", b_id),
        a_ends=a_ends,
        history_kv=history_kv,
        straight=straight,
        prompt4=prompt4,
        gen4=gen4,
    )


@pytest.fixture(scope="module")
def other_model_dir(model, tmp_path_factory):
    """The same weights and tokenizer; the chat template file differs by a comment, so the
    fingerprint differs while every rendered token is the same."""
    d = tmp_path_factory.mktemp("other_model") / "model"
    shutil.copytree(model[1], d)
    tpl = d / "chat_template.jinja"
    if tpl.exists():
        tpl.write_text("{# revised #}" + tpl.read_text())
    else:  # an older transformers keeps the template in tokenizer_config.json
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg["chat_template"] = "{# revised #}" + cfg["chat_template"]
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert model_fingerprint(d) != model_fingerprint(model[1])
    assert (d / "model.safetensors").read_bytes() == (model[1] / "model.safetensors").read_bytes()
    return d


@pytest.fixture(scope="module")
def other_weights_dir(model, tmp_path_factory):
    """The same files but other weights in the middle of model.safetensors, as after a
    partial fine-tune: every tensor lying wholly between the file's first and last MiB
    is redrawn; sizes, names, shapes and offsets stay the same."""
    d = tmp_path_factory.mktemp("other_weights") / "model"
    shutil.copytree(model[1], d)
    f = d / "model.safetensors"
    blob = f.read_bytes()
    he, mib = header_end(blob), 2**20
    header = json.loads(blob[8:he])
    middle = [
        n
        for n, info in header.items()
        if n != "__metadata__"
        and he + info["data_offsets"][0] >= mib
        and he + info["data_offsets"][1] <= len(blob) - mib
    ]
    assert middle, "the model is too small to have weights between its first and last MiB"
    tensors = load_file(f)
    g = torch.Generator().manual_seed(99)
    for n in middle:
        tensors[n] = 0.08 * torch.randn(tensors[n].shape, generator=g)
    save_file(tensors, f, metadata=header.get("__metadata__"))
    assert f.stat().st_size == len(blob)
    return d


# ---------------------------------------------------------------- the damage matrix


def _rewrite_header(path: Path, **meta_over) -> None:
    """Rewrite the snapshot with changed header fields; tensors and checksum kept."""
    tensors = {n: t.clone() for n, t in load_file(path).items()}
    with safe_open(path, framework="pt") as f:
        meta = dict(f.metadata())
    meta.update(meta_over)
    save_file(tensors, path, metadata=meta)


def _flip_header_value(blob: bytes, field: str) -> bytes:
    """Change one hex digit of a header field's value: the JSON stays valid, the value is wrong."""
    he = header_end(blob)
    head = blob[8:he]
    key = f'"{field}":"'.encode()
    at = head.index(key) + len(key)
    if field == "checksum":
        at += len("crc32:")
    old = head[at : at + 1]
    new = b"0" if old != b"0" else b"1"
    return blob[: 8 + at] + new + blob[8 + at + 1 :]


def _rewrite_manifest(path: Path, **over) -> None:
    """Rewrite a manifest with changed fields and a valid checksum of its own."""
    body = json.loads(path.read_text())
    body.pop("checksum")
    body.update(over)
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    body["checksum"] = f"crc32:{zlib.crc32(text.encode()):08x}"
    path.write_text(json.dumps(body))


def damage(case: str, data: Path, w: dict) -> None:
    """Damage conversation A's snapshot in the (closed) data dir ``data``: its first segment,
    unless the case names the manifest or another segment."""
    kv = data / "kv"
    seg_name = (
        w["a_segs"][-1]
        if case.startswith("last_segment")
        else w["a_segs"][1]
        if case.startswith("middle_")
        else w["a_segs"][0]
    )
    path = kv / seg_name
    blob = w["a_files"][seg_name]
    he = header_end(blob)
    man = kv / w["a_file"]
    if case in ("intact", "other_model", "other_weights", "other_dtype"):
        return  # the files are fine; the engine reading them differs
    if case in ("data_flip", "last_segment_flip"):
        span = len(blob) - he
        path.write_bytes(flip(blob, [he + span // 4, he + span // 2, he + 3 * span // 4, len(blob) - 1]))
    elif case == "header_flip_json":
        path.write_bytes(flip(blob, [8 + (he - 8) // 2], mask=0x01))
    elif case == "header_flip_length":
        path.write_bytes(flip(blob, [1], mask=0x04))
    elif case == "header_flip_checksum":
        path.write_bytes(_flip_header_value(blob, "checksum"))
    elif case == "header_flip_token_hash":
        path.write_bytes(_flip_header_value(blob, "token_hash"))
    elif case in ("truncated", "middle_segment_truncated"):
        path.write_bytes(blob[: (he + len(blob)) // 2])
    elif case == "truncated_in_header":
        path.write_bytes(blob[: he // 2])
    elif case == "empty":
        path.write_bytes(b"")
    elif case in ("missing_segment", "last_segment_missing"):
        path.unlink()
    elif case == "missing_manifest":
        man.unlink()
    elif case == "file_without_row":
        with Store.open(None, data) as store:
            assert store.delete_snapshot(w["a"]) == w["a_file"]
    elif case == "orphans_beside":  # leftovers of killed writers: an unlisted segment and temp files
        (kv / seg_name.replace("_0_", "_7_")).write_bytes(blob)
        (kv / f".{w['a_file'][:-5]}.{2**22 + 17}.{'0' * 16}.{'0' * 8}.tmp").write_bytes(b"half a manifest")
    elif case == "other_tokens":
        path.write_bytes(w["b_files"][w["b_segs"][0]])  # conversation B's first segment under A's name
    elif case == "other_version":
        _rewrite_header(path, format_version="2")
    elif case == "other_epoch":  # a well-formed segment whose header names another epoch
        _rewrite_header(path, epoch="00000000")
    elif case == "extra_tensors":
        # a well-formed segment that also declares a tensor this build does not write
        # (e.g. from a build with quantised KV scales): checksum valid, names consistent
        tensors = {n: t.clone() for n, t in load_file(path).items()}
        tensors["k_scale.0"] = torch.ones(4)
        with safe_open(path, framework="pt") as f:
            meta = dict(f.metadata())
        meta.update(extra_tensors="k_scale.0", checksum=kv_store._checksum(tensors))
        save_file(tensors, path, metadata=meta)
    elif case == "manifest_flip":
        text = man.read_bytes()
        at = text.index(b'"end"') + 8  # a digit of the first segment's end
        man.write_bytes(flip(text, [at], mask=0x01))
    elif case == "manifest_truncated":
        man.write_bytes(man.read_bytes()[:100])
    elif case == "manifest_empty":
        man.write_bytes(b"")
    elif case == "manifest_other_version":
        _rewrite_manifest(man, format_version=2)
    elif case == "manifest_of_b":
        man.write_bytes(w["b_files"][w["b_file"]])  # B's manifest under A's name
    elif case == "manifest_out_of_order":  # checksum valid, segments not contiguous
        body = json.loads(man.read_text())
        segs = body["segments"]
        _rewrite_manifest(man, segments=[segs[1], segs[0], segs[2]])
    else:
        raise AssertionError(case)


CASES = [
    "intact",  # control: nothing damaged, the history is restored
    "data_flip",
    "header_flip_json",
    "header_flip_length",
    "header_flip_checksum",
    "header_flip_token_hash",
    "truncated",
    "truncated_in_header",
    "empty",
    "missing_segment",
    "missing_manifest",
    "file_without_row",
    "other_model",
    "other_tokens",
    "other_version",
    "other_epoch",
    "other_dtype",
    "extra_tensors",  # a layout this engine cannot use: discarded like damage
    "other_weights",  # weights changed between the first and last MiB: the fingerprint covers every byte
    "manifest_flip",
    "manifest_truncated",
    "manifest_empty",
    "manifest_other_version",
    "manifest_of_b",
    "manifest_out_of_order",
    # a later segment bad: the ones before it are used, the rest recomputed
    "last_segment_flip",
    "last_segment_missing",
    "middle_segment_truncated",
    "orphans_beside",  # leftovers are swept, the snapshot restores
]
FULL = ("intact", "file_without_row", "orphans_beside")  # the whole history restores


def partial_tokens(case: str, w: dict) -> int | None:
    """Tokens a partly damaged snapshot still restores (None: a case that restores nothing or all)."""
    if case.startswith("last_segment"):
        return w["a_ends"][-2]
    if case.startswith("middle_segment"):
        return w["a_ends"][0]
    return None


def resume_config(case: str, request, w: dict) -> tuple[Path, dict]:
    """The model dir and engine options that resume the conversation in ``case``."""
    if case == "other_model":
        return request.getfixturevalue("other_model_dir"), {}
    if case == "other_weights":
        return request.getfixturevalue("other_weights_dir"), {}
    if case == "other_dtype":
        return w["model_dir"], dict(dtype="bfloat16")
    return w["model_dir"], {}


def uncached(model_dir: Path, kw: dict, prompt: list[int], data: Path):
    """The reply of a fresh engine to ``prompt``: nothing in memory, nothing on disk."""
    with engine_at(model_dir, data, **kw) as e:
        want = e.generate(prompt, SamplingParams(**GREEDY))
    assert want.usage.cached_tokens == 0
    return want


@pytest.mark.parametrize("case", CASES)
def test_damaged_snapshot_is_recomputed_never_wrong(world, request, tmp_path, case, caplog):
    w = world
    data = tmp_path / "data"
    shutil.copytree(w["base"], data)
    damage(case, data, w)
    model_dir, kw = resume_config(case, request, w)
    own_reference = case in ("other_weights", "other_dtype")  # another model: the straight run does not apply
    partial = partial_tokens(case, w)

    caplog.set_level(logging.WARNING, logger="chatkv")
    e = engine_at(model_dir, data, **kw)
    m = e.session_manager  # opening the manager reconciles rows with manifests and sweeps leftovers
    a_path = m.snapshots.path(w["a"])
    kv = data / "kv"
    if case == "file_without_row":
        assert m.store.get_snapshot(w["a"]) is not None, "the manifest is the authority: its row is recorded on open"
    if case == "missing_manifest":
        assert m.store.get_snapshot(w["a"]) is None, "a snapshot row without a manifest must be removed on open"
        assert not snap_files(kv, w["a"]), "segments without a manifest must be removed on open"
    if case == "orphans_beside":
        assert set(snap_files(kv, w["a"])) == set(w["a_files"]), "unlisted files must be removed on open"
        assert not [p for p in kv.iterdir() if p.name.endswith(".tmp")]

    s = e.resume(w["a"])
    r = s.send(QUESTIONS_A[3])  # must not raise
    prompt, gen = turn_tokens(s, r)
    assert prompt == w["prompt4"], "the resumed history differs from the uninterrupted run's"
    warned = any(w["a"] in rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING)

    if case in FULL:
        assert r.usage.restored_tokens == w["history_kv"]
        assert a_path.exists() and m.store.get_snapshot(w["a"]) is not None
    elif partial is not None:
        assert r.usage.restored_tokens == partial, "the valid segments before the bad one are used"
        assert r.usage.computed_tokens == r.usage.prompt_tokens - partial
        assert warned, "the bad segment was not logged"
    else:
        assert r.usage.restored_tokens == 0, "a bad snapshot was used"
        assert r.usage.cached_tokens == 0 and r.usage.computed_tokens == r.usage.prompt_tokens
        assert warned, "the discarded snapshot was not logged"
    # turn 4 was written behind: the manifest lists the good old segments (all, the ones
    # before the bad one, or none: a new epoch) then the new ones; no other file is left
    m.snapshots.flush()
    listed = [p.name for p in m.snapshots.segment_paths(w["a"])]
    good = len(w["a_segs"]) if case in FULL else w["a_ends"].index(partial) + 1 if partial else 0
    assert [x for x in listed if x in w["a_files"]] == w["a_segs"][:good]
    assert set(snap_files(kv, w["a"])) == set(listed) | {w["a_file"]}, "a file no manifest lists is left"
    row = m.store.get_snapshot(w["a"])
    assert row.file == w["a_file"] and row.token_count == r.usage.prompt_tokens + r.usage.generated_tokens - 1

    if own_reference:  # an uncached run of the same prompt with the same model and dtype
        want = uncached(model_dir, kw, prompt, tmp_path / "ref4")
        assert gen == want.token_ids[: len(gen)] and r.text == want.text
    else:
        assert r.text == w["straight"][3].text and gen == w["gen4"]
        assert gen == hf_greedy(w["ref"], prompt, GREEDY["max_tokens"])[: len(gen)]

    # nothing lost: A has its 8 messages, B its 4 and its snapshot untouched
    assert [x.role for x in s.messages()] == ["user", "assistant"] * 4
    assert [x.content for x in s.messages()[::2]] == QUESTIONS_A[:4]
    assert len(e.resume(w["b"]).messages()) == 4
    assert snap_files(kv, w["b"]) == w["b_files"]
    e.check_integrity()
    e.close()  # spills A again

    # the conversation heals: the new snapshot restores on the next start
    e = engine_at(model_dir, data, **kw)
    s = e.resume(w["a"])
    r5 = s.send(QUESTIONS_A[4])
    assert r5.usage.restored_tokens == r.usage.prompt_tokens + r.usage.generated_tokens - 1
    prompt5, gen5 = turn_tokens(s, r5)
    if own_reference:
        assert gen5 == uncached(model_dir, kw, prompt5, tmp_path / "ref5").token_ids[: len(gen5)]
    else:
        assert gen5 == hf_greedy(w["ref"], prompt5, GREEDY["max_tokens"])[: len(gen5)]
    e.check_integrity()
    e.close()


# ---------------------------------------------------------------- kill -9 during spill

HELPER = Path(__file__).resolve().parents[1] / "support" / "session_kill_child.py"
KILL_TRIALS = 40
TRIALS_PER_DIR = 5  # a fresh data dir (and conversation) every few trials, so histories stay short
KILL_PARAMS = dict(max_tokens=4, temperature=0.0)
KILL_BLOCKS = 160  # 2560 tokens, above the worker's history cap


def _read_events(log: Path) -> list[dict]:
    out = []
    for line in log.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # cannot happen (one write per line), but never trust a killed writer
            pass
    return out


def _wait_for(log: Path, pred, timeout: float, what: str, err: Path) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        ev = _read_events(log) if log.exists() else []
        if pred(ev):
            return ev
        if time.monotonic() > deadline:
            raise AssertionError(f"worker never got to {what}; stderr:\n{err.read_text() if err.exists() else ''}")
        time.sleep(0.0005)


def _snapshot_on_disk(kv: Path) -> int | None:
    """Tokens the manifest on disk lists, after checking (reading only) that it parses and that
    every segment it lists is complete: its header readable and its token count the manifest's.
    None if there is no manifest; AssertionError naming a torn one."""
    mans = [p for p in kv.iterdir() if p.name.endswith(".json")] if kv.exists() else []
    assert len(mans) <= 1, mans
    if not mans:
        return None
    man = Manifest.from_json(mans[0].read_text(), mans[0].name[:-5])  # raises if torn
    for seg in man.segments:
        with safe_open(kv / seg.file, framework="pt") as f:
            assert int(f.metadata()["token_count"]) == seg.size, f"segment {seg.file} is torn"
    return man.end


class KillServer(ForkServer):
    """Client of tests/support/session_kill_child.py: forks workers that import nothing anew."""

    def __init__(self, model_dir: Path):
        super().__init__(HELPER, model_dir)

    def go(self, mode: str, model_dir: Path, data: Path, conv: str | None, log: Path, tag: str) -> int:
        return super().go(f"{mode} {model_dir} {data} {KILL_BLOCKS} {conv or 'new'} {log} {tag}")

    def kill(self, pid: int, err: Path) -> None:
        """SIGKILL the worker and reap it; it must not have died on its own."""
        os.kill(pid, signal.SIGKILL)
        status = self.reap(pid)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
            f"the worker died on its own (status {status}):\n{err.read_text() if err.exists() else ''}"
        )


@pytest.fixture(scope="module")
def fork_server(model):
    server = KillServer(model[1])
    yield server
    server.close(timeout=10)


def test_kill_9_during_spill_loses_nothing_and_never_loads_garbage(model, fork_server, tmp_path):
    ref, model_dir = model
    rng = random.Random(20240612)
    stats = {
        "in_turn": 0,
        "in_spill": 0,
        "between": 0,
        "mid_write_temp_file": 0,
        "file_ahead_of_row": 0,
        "restored": 0,
        "recomputed": 0,
        "turns_by_workers": 0,
    }
    started = time.monotonic()
    seconds = {"worker_start": 0.0, "worker_run": 0.0, "check": 0.0}
    spill_s: list[float] = []  # how long the workers' completed spills took
    conv = None
    for trial in range(KILL_TRIALS):
        if trial % TRIALS_PER_DIR == 0:
            data = tmp_path / f"data{trial // TRIALS_PER_DIR}"
            conv, had_snapshot = None, False
        log = tmp_path / f"worker{trial}.log"
        err = Path(str(log) + ".err")
        t0 = time.monotonic()
        pid = fork_server.go("loop", model_dir, data, conv, log, f"t{trial}")
        try:
            events = _wait_for(log, lambda ev: any(e["ev"] == "ready" for e in ev), 30, "ready", err)
            t1 = time.monotonic()
            if trial % 3 != 2:  # aim at a spill: kill at a random moment of the k-th one
                k = rng.randint(1, 3)
                _wait_for(log, lambda ev: sum(e["ev"] == "spill" for e in ev) >= k, 30, f"spill {k}", err)
                typical = sorted(spill_s)[len(spill_s) // 2] if spill_s else 0.02
                time.sleep(rng.uniform(0, 1.2 * typical))
            else:  # anywhere in the loop
                time.sleep(rng.uniform(0, 0.3))
        finally:
            fork_server.kill(pid, err)
        t2 = time.monotonic()
        events = _read_events(log)
        conv = events[0]["conv"]
        spill_s += [b["t"] - a["t"] for a, b in zip(events, events[1:]) if a["ev"] == "spill" and b["ev"] == "spilled"]
        last = events[-1]["ev"]
        phase = {"turn": "in_turn", "spill": "in_spill"}.get(last, "between")
        stats[phase] += 1
        stats["turns_by_workers"] += sum(e["ev"] == "committed" for e in events)
        had_snapshot = had_snapshot or any(e["ev"] == "spilled" and e["wrote"] for e in events)

        # what the kill left on disk, before anything cleans up
        kv = data / "kv"
        temps = [p.name for p in kv.iterdir() if p.name.endswith(".tmp")] if kv.exists() else []
        stats["mid_write_temp_file"] += bool(temps)
        with Store.open(None, data) as store:
            row = store.get_snapshot(conv)
        file_tokens = _snapshot_on_disk(kv)  # the old manifest or the new one, every segment complete
        if file_tokens is not None and (row is None or row.token_count != file_tokens):
            stats["file_ahead_of_row"] += 1  # killed between the manifest switch and the DB row

        # a new engine: nothing committed is lost, the next turn is exactly right
        e = engine_at(model_dir, data, num_blocks=KILL_BLOCKS)
        m = e.session_manager
        assert not [p.name for p in m.snapshots.files.root.iterdir() if p.name.endswith(".tmp")], "temp files left"
        s = e.resume(conv)
        msgs = s.messages()
        for ev in events:
            if ev["ev"] == "committed":
                n = ev["messages"]
                assert len(msgs) >= n, f"trial {trial}: committed message {n} lost"
                assert msgs[n - 1].id == ev["id"] and msgs[n - 1].role == "assistant"
                assert msgs[n - 1].content == ev["text"] and msgs[n - 1].status == "complete"
            elif ev["ev"] == "turn" and ev is not events[-1]:
                assert any(x.role == "user" and x.content == ev["q"] for x in msgs), f"trial {trial}: lost {ev['q']}"
        r = s.send(f"What is the capital of France? (check {trial})", SamplingParams(**KILL_PARAMS))
        prompt, gen = turn_tokens(s, r)
        assert gen == hf_greedy(ref, prompt, KILL_PARAMS["max_tokens"])[: len(gen)], (
            f"trial {trial}: wrong reply after a kill ({phase}, restored {r.usage.restored_tokens})"
        )
        if r.usage.restored_tokens:
            stats["restored"] += 1
            assert r.usage.restored_tokens == file_tokens, "restored something other than the manifest on disk"
        else:
            stats["recomputed"] += 1
        if had_snapshot:
            # a completed snapshot is never lost: the old one or the new one is always there
            assert r.usage.restored_tokens > 0, f"trial {trial}: a complete snapshot vanished ({phase})"
        e.check_integrity()
        e.close()  # spills: the next worker in this dir starts from a snapshot
        had_snapshot = True
        seconds["worker_start"] += t1 - t0
        seconds["worker_run"] += t2 - t1
        seconds["check"] += time.monotonic() - t2
    elapsed = time.monotonic() - started
    spill_s.sort()
    # kills inside a spill: before its temp file / in the write (temp file left) / after the
    # rename but before the DB row (file ahead of row) / after the row
    stats["in_spill_other"] = stats["in_spill"] - stats["mid_write_temp_file"] - stats["file_ahead_of_row"]
    median = spill_s[len(spill_s) // 2] if spill_s else float("nan")
    print(
        f"kill -9 over {KILL_TRIALS} trials in {elapsed:.1f}s: {stats}; seconds spent: "
        + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items())
        + f"; {len(spill_s)} spills completed, median {1000 * median:.1f} ms"
    )
    assert stats["in_spill"] >= KILL_TRIALS // 4, f"too few kills landed inside a spill: {stats}"
    assert stats["mid_write_temp_file"] >= 1, f"no kill landed inside a snapshot write: {stats}"


class DanglingTurn(AssertionError):
    pass


def test_crash_mid_reply_leaves_a_well_formed_history(model, fork_server, tmp_path):
    """kill -9 while a reply is being generated: the user message is kept, and the next
    turn's prompt is well formed (the interrupted turn is closed, as an in-process
    interruption closes it), and its reply is transformers' greedy."""
    ref, model_dir = model
    data, log = tmp_path / "data", tmp_path / "worker.log"
    err = Path(str(log) + ".err")
    pid = fork_server.go("midreply", model_dir, data, None, log, "mid")
    try:
        events = _wait_for(log, lambda ev: any(e["ev"] == "generating" for e in ev), 30, "generating", err)
    finally:
        fork_server.kill(pid, err)
    conv = events[0]["conv"]
    e = engine_at(model_dir, data, num_blocks=KILL_BLOCKS)
    s = e.resume(conv)
    msgs = s.messages()
    assert [(x.role, x.content, x.status) for x in msgs[:3]] == [
        ("user", child.QUESTIONS[0], "complete"),
        ("assistant", events[1]["text"], "complete"),
        ("user", events[-1]["q"], "complete"),
    ]
    r = s.send("What is the capital of France?")
    prompt, gen = turn_tokens(s, r)
    assert gen == hf_greedy(ref, prompt, KILL_PARAMS["max_tokens"])[: len(gen)]
    text = e.tokenizer.decode(prompt)
    e.close()
    # every new turn starts after a closed one: no assistant header left open
    if "<|im_start|>assistant\n<|im_start|>" in text or text.count("<|im_start|>") != text.count("<|im_end|>") + 1:
        raise DanglingTurn(f"the prompt after a crash mid-reply holds an unclosed turn: ...{text[-160:]!r}")
