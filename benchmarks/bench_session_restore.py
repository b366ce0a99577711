"""Turn-10 time to first token of a long chat: in memory, after a restart (KV restored from disk), and baselines.

A 10-turn conversation (long user paragraphs of varied text, replies cut to 4 tokens with
max_tokens so the history length is controlled) builds ~2.0k tokens of history; turn 10
adds ~35 tokens. All in one process, same weights, dtype and threads, every case on the
exact token ids of chatkv's turn-10 prompt; the first token of every case is printed
(they should agree):

  (a) chatkv, history cached in memory (same engine, consecutive turns)
  (b) transformers re-prefilling the whole turn-10 prompt (one forward + the first token)
  (c) transformers with a DynamicCache of the history (forward over the new tokens only)
  (d) chatkv after a restart: close the engine (spill), new Engine on the same data_dir,
      resume, send turn 10: the KV comes back from the safetensors snapshot (each repeat
      restarts from a fresh copy of the closed data dir, so every repeat restores)
  (e) chatkv recomputing the whole prompt (prefix caching off)
  (f) llama.cpp: its sequence state saved to a file, loaded in a fresh Llama, then the
      new tokens (packaged GGUF, Q4_1 weights: an engine comparison, not identical math)
  (g) the snapshot's bytes on disk (every segment file its manifest lists, and the manifest)
      vs tokens x KV bytes per token

``--snapshot-only`` builds the history, spills it and prints (g) alone (no timings, no
transformers), which takes seconds.

chatkv's TTFT is measured two ways: ``usage.ttft_s`` (the engine's own, from request
admission; it does NOT include the restore, which happens before the request is queued)
and ``wall`` (from the ``stream()`` call to the first yielded piece, what a user sees,
restore and database commit included). The goals use ``wall``.

On a 2-core machine any other busy process makes every parallel region wait for a time
slice and inflates latencies several-fold; the run prints the share of CPU time other
processes took and warns above 10%. ``--profile`` adds a cProfile of one restored turn.

    CHATKV_HOME=/tmp/ckhome .venv/bin/python benchmarks/bench_session_restore.py [--repeats 3] [--history 2100]
                                                                                [--profile] [--snapshot-only]
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import os
import random
import shutil
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SYSTEM = "You are a concise assistant. Answer every question in one short sentence."

# A bank of varied sentences; each user message is a paragraph drawn from it.
TOPICS = {
    "history": [
        "The printing press spread through Europe within a few decades of its invention in Mainz.",
        "Roman roads were built in layers of gravel, sand and fitted stone, and many are still walkable today.",
        (
            "The Silk Road was never a single road but a shifting web of caravan routes "
            "between China and the Mediterranean."
        ),
        (
            "Medieval guilds controlled prices, training and quality, and apprentices often worked seven years "
            "before becoming masters."
        ),
        "The Hanseatic League linked trading towns around the Baltic and North Sea for almost four centuries.",
    ],
    "cooking": [
        (
            "Bread dough rises because yeast ferments sugars and releases carbon dioxide, "
            "which gluten traps in small pockets."
        ),
        "A good stock simmers slowly for hours; boiling it hard makes the fat emulsify and the liquid turn cloudy.",
        "Salt draws moisture out of vegetables, which is why cucumbers are salted before they go into a salad.",
        "Caramelisation begins around one hundred and sixty degrees, when sugar molecules break apart and recombine.",
        "Resting a roast lets the juices settle back into the meat instead of running onto the cutting board.",
    ],
    "astronomy": [
        (
            "Light from the Sun takes a little over eight minutes to reach the Earth, "
            "so we always see it slightly in the past."
        ),
        (
            "Jupiter's Great Red Spot is a storm wider than the Earth that has been observed "
            "for more than three hundred years."
        ),
        "Neutron stars are so dense that a teaspoon of their material would weigh about as much as a mountain.",
        "The Moon is slowly drifting away from the Earth, by roughly four centimetres every year.",
        "Comets grow their tails only near the Sun, when its heat turns their ice directly into gas.",
    ],
    "gardening": [
        "Tomatoes need warm nights to set fruit, and they sulk when the temperature drops below ten degrees.",
        (
            "Compost works best with a mix of green material, such as grass clippings, "
            "and brown material, such as dry leaves."
        ),
        "Mulch keeps the soil moist, suppresses weeds and slowly feeds the worms that aerate the ground.",
        "Many herbs, like rosemary and thyme, prefer poor, well-drained soil and lose flavour when overwatered.",
        "Crop rotation stops soil diseases from building up and balances the nutrients each plant family takes.",
    ],
    "programming": [
        "A hash table gives constant average lookup time, but a bad hash function can make every key collide.",
        "Version control lets a team work on the same files at once and merge their changes later.",
        "Unit tests catch regressions early, while integration tests check that the parts really work together.",
        "Premature optimisation wastes effort; measuring first shows where the time actually goes.",
        "A memory leak in a long-running service grows slowly until the process is killed by the operating system.",
    ],
    "music": [
        "A piano has eighty-eight keys, and its strings together pull on the frame with a force of many tonnes.",
        "Equal temperament divides the octave into twelve equal steps, a compromise that lets music move between keys.",
        "Jazz musicians often improvise over a fixed chord progression, trading solos around the band.",
        "The violin's tone depends on the varnish, the wood and the exact shape of its arched top plate.",
        "Orchestras tune to the oboe because its pitch is steady and its sound cuts through the other instruments.",
    ],
    "geology": [
        "Granite forms when magma cools slowly deep underground, giving its crystals time to grow large.",
        "Mountains rise where tectonic plates collide, and erosion starts wearing them down as soon as they appear.",
        "Limestone caves are carved by rainwater that has absorbed carbon dioxide and become slightly acidic.",
        "Earthquakes release stress that builds up over years along faults where rocks are locked together.",
        "Sand on many beaches is mostly quartz, one of the hardest common minerals and the last to wear away.",
    ],
    "sailing": [
        "A sailboat can move against the wind by tacking, zigzagging at an angle to the direction it comes from.",
        "The keel keeps a boat from sliding sideways and its weight stops the wind from tipping it over.",
        "Sailors read the clouds and the swell to guess the weather a day ahead, long before forecasts existed.",
        "Knots are measured in nautical miles per hour, and a nautical mile is one minute of latitude.",
        "Tides are driven mostly by the Moon, and their range depends on the shape of the coast and the sea floor.",
    ],
    "economics": [
        "Inflation erodes the value of savings, which is why central banks try to keep it low and predictable.",
        "Comparative advantage explains why two countries both gain from trade even if one is better at everything.",
        "A market with a single seller can raise prices well above cost, which is why regulators watch monopolies.",
        "Interest rates are the price of money over time, and they shape decisions to save, borrow and invest.",
        "Supply chains that span many countries are efficient in calm times and fragile when something breaks.",
    ],
}
QUESTIONS = [
    "Which of these facts surprised you the most?",
    "Can you pick the single most useful idea here?",
    "What would you tell a child about this?",
    "Which detail would you check first?",
    "What is the common thread in these notes?",
    "Which of these would make a good quiz question?",
    "What is one thing missing from this list?",
    "Which sentence is the easiest to remember?",
    "What would you like to read more about?",
]


def turn10_message(i: int) -> str:
    """Turn 10's message of repeat ``i``: same length for every i (one digit differs), never cached across repeats."""
    return f"({i % 10}) Thanks. To finish, tell me in one short sentence which topic we discussed was the most fun."


def user_messages(tokenizer, per_message: int, seed: int = 0) -> list[str]:
    """Nine long paragraphs of varied text, each about ``per_message`` tokens."""
    rng = random.Random(seed)
    all_sentences = [s for ss in TOPICS.values() for s in ss]
    out = []
    for n, (topic, own) in enumerate(TOPICS.items()):
        pool = list(own)
        rng.shuffle(pool)
        others = [s for s in all_sentences if s not in own]
        rng.shuffle(others)
        pool += others
        parts = [f"Here are some notes about {topic}."]
        for s in pool:
            text = " ".join(parts + [s, QUESTIONS[n]])
            if len(tokenizer(text, add_special_tokens=False)["input_ids"]) > per_message:
                break
            parts.append(s)
        out.append(" ".join(parts + [QUESTIONS[n]]))
    return out


# ---------------------------------------------------------------------------- chatkv


def make_engine(model_dir, data_dir, dtype, **config):
    from chatkv.engine.core import Engine

    return Engine.from_pretrained(model_dir, data_dir=str(data_dir), dtype=dtype, **config)


def build_session(engine, messages, reply_tokens):
    s = engine.session(system=SYSTEM, params=dict(max_tokens=reply_tokens, temperature=0.0))
    for m in messages:
        s.send(m)
    return s


def timed_turn(session, text):
    """Send ``text`` with max_tokens=1; return (wall seconds to the first yielded piece, Reply)."""
    from chatkv.engine.sampling import SamplingParams

    t0 = time.perf_counter()
    first = None
    reply = None
    for piece in session.stream(text, SamplingParams(max_tokens=1, temperature=0.0)):
        if first is None:
            first = time.perf_counter() - t0
        if not isinstance(piece, str):
            reply = piece
    return first, reply


class Timers:
    """Wrap instance methods of the session manager to time the restore path (benchmark-side only)."""

    def __init__(self, mgr):
        self.t: dict[str, float] = {}
        for obj, name, label in (
            (mgr.snapshots, "restore", "restore"),
            (mgr.snapshots.files, "load", "kv.load"),
            (mgr.kv, "import_kv", "import_kv"),
        ):
            self._wrap(obj, name, label)

    def _wrap(self, obj, name, label):
        fn = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[label] = self.t.get(label, 0.0) + time.perf_counter() - t0

        setattr(obj, name, timed)


# ---------------------------------------------------------------------------- transformers


def hf_ttft_full(model, ids):
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
        tok = int(logits.argmax())
        return time.perf_counter() - t0, tok


def hf_prefill_cache(model, ids):
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        model(torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def hf_ttft_cached(model, cache, new_ids):
    c = copy.deepcopy(cache)  # untimed: each repeat starts from the history's cache
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = model(torch.tensor([new_ids]), past_key_values=c, use_cache=True, logits_to_keep=1).logits[0, -1]
        tok = int(logits.argmax())
        return time.perf_counter() - t0, tok


# ---------------------------------------------------------------------------- llama.cpp


def llama_open(threads):
    from common import prepare_llama_cpp

    from chatkv.weights import packaged_gguf_path

    llama_cpp = prepare_llama_cpp()
    return llama_cpp.Llama(model_path=str(packaged_gguf_path()), n_ctx=4096, n_threads=threads, verbose=False)


def llama_first_token(llm) -> int:
    import llama_cpp
    import numpy as np

    n_vocab = llm.n_vocab()
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
    return int(logits.argmax())


def llama_save_seq(llm, ids, path) -> tuple[float, int]:
    import llama_cpp

    arr = (llama_cpp.llama_token * len(ids))(*ids)
    t0 = time.perf_counter()
    n = llama_cpp.llama_state_seq_save_file(llm.ctx, str(path).encode(), 0, arr, len(ids))
    dt = time.perf_counter() - t0
    assert n > 0, "llama_state_seq_save_file failed"
    return dt, os.path.getsize(path)


def llama_restore_ttft(llm, path, history_len, new_ids) -> tuple[float, float, int]:
    """Load the sequence file into a fresh context, evaluate the new tokens, pick the first one."""
    import llama_cpp

    cap = history_len + 16
    out = (llama_cpp.llama_token * cap)()
    n_out = ctypes.c_size_t(0)
    t0 = time.perf_counter()
    nbytes = llama_cpp.llama_state_seq_load_file(llm.ctx, str(path).encode(), 0, out, cap, ctypes.byref(n_out))
    t_load = time.perf_counter() - t0
    assert nbytes > 0 and n_out.value == history_len, (nbytes, n_out.value)
    llm.input_ids[:history_len] = out[:history_len]
    llm.n_tokens = history_len
    llm.eval(new_ids)
    tok = llama_first_token(llm)
    return time.perf_counter() - t0, t_load, tok


# ---------------------------------------------------------------------------- report


def fmt_ms(x):
    return "-" if x is None else f"{x * 1000:.1f}"


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def verdict(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


class CpuMeter:
    """Share of the machine's CPU time that other processes used while this one ran.

    On a 2-core box a second busy process makes every torch/llama.cpp parallel region wait
    for a descheduled thread, which inflates latencies several-fold; this says whether that happened.
    """

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample():
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:]]
        busy = sum(cpu) - cpu[3] - (cpu[4] if len(cpu) > 4 else 0)  # all but idle and iowait
        ours = sum(os.times()[:2])
        return busy / os.sysconf("SC_CLK_TCK"), ours, time.monotonic()

    def others_share(self) -> float:
        b0, o0, t0 = self.start
        b1, o1, t1 = self._sample()
        return max(0.0, ((b1 - b0) - (o1 - o0)) / ((t1 - t0) * (os.cpu_count() or 1)))


def library_version() -> str:
    """git HEAD of the checkout, plus the library files with uncommitted changes (results depend on them)."""
    import subprocess

    repo = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "chatkv", "kernels", "storage"],
            cwd=repo,
            capture_output=True,
            text=True,
        ).stdout.split("\n")
        dirty = [line[3:] for line in dirty if line.strip()]
    except OSError:
        return "unknown"
    return head + (f" + uncommitted changes in {', '.join(dirty)}" if dirty else "")


def snapshot_layout(snapshots, conv_id: str) -> dict:
    """A conversation's snapshot as it lies on disk (chatkv.sessions.snapshots: append-only safetensors
    segments listed by a JSON manifest, storage.kv_segments): its tokens (the manifest's end),
    the manifest's bytes, and over every segment file the manifest lists (any branch, a shared
    file once) their count, bytes and safetensors header bytes (with the 8-byte length prefix)."""
    key = snapshots.key(conv_id)
    man = snapshots.segments.read_manifest(key)
    assert man is not None, f"no snapshot manifest for conversation {conv_id}"
    files = sorted(man.files())
    seg_bytes = header_bytes = 0
    for name in files:
        path = snapshots.segments.root / name
        with open(path, "rb") as f:
            (hlen,) = struct.unpack("<Q", f.read(8))
        seg_bytes += path.stat().st_size
        header_bytes += 8 + hlen
    manifest = snapshots.segments.manifest_path(key)
    return dict(
        tokens=man.end,
        files=len(files),
        seg_bytes=seg_bytes,
        header_bytes=header_bytes,
        manifest=manifest.name,
        manifest_bytes=manifest.stat().st_size,
        listed_bytes=man.nbytes,
    )


def report_snapshot_size(lay: dict, kv_bpt: int, geometry) -> int:
    """Print (g); returns the bytes beyond tokens x KV bytes and the headers."""
    T, S, H = lay["tokens"], lay["seg_bytes"], lay["header_bytes"]
    kv_bytes = T * kv_bpt
    layers, kvh, hd, kvdt = geometry
    ids_bytes = T * 8
    files = f"{lay['files']} segment file{'s' if lay['files'] != 1 else ''}"
    print(
        f"\n(g) snapshot ({files} + manifest {lay['manifest']}): {S} bytes of segments "
        f"+ {lay['manifest_bytes']} of manifest = {S + lay['manifest_bytes']} bytes on disk for {T} tokens; "
        f"tokens x KV bytes = {T} x {kv_bpt} (2 x {layers} layers x {kvh} kv heads x {hd} x {kvdt}) = {kv_bytes}"
    )
    print(
        f"    segments' overhead {S - kv_bytes} bytes ({(S - kv_bytes) / kv_bytes * 100:.3f}%) = "
        f"headers {H} + token_ids tensors {ids_bytes} (int64) + {S - kv_bytes - H - ids_bytes} other"
        + ("" if lay["listed_bytes"] == S else f"; the manifest lists {lay['listed_bytes']} bytes")
    )
    return S - kv_bytes - H


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions of each case; medians reported")
    p.add_argument("--history", type=int, default=2100, help="target history tokens before turn 10")
    p.add_argument("--reply-tokens", type=int, default=4, help="max_tokens of the assistant replies of turns 1-9")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads and llama.cpp n_threads")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--model", default=None, help="Hugging Face model dir (default: packaged SmolLM2-135M-Instruct)")
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--profile", action="store_true", help="cProfile one extra restored turn and print the top entries")
    p.add_argument(
        "--snapshot-only",
        action="store_true",
        help="build the history, spill it and print (g), the snapshot's size on disk, alone (no timings)",
    )
    args = p.parse_args()
    R = args.repeats
    RC = max(R, 5)  # cheap cases (a forward over the new tokens only) get more repeats
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    meter = CpuMeter()

    from chatkv.engine.sampling import SamplingParams
    from chatkv.weights import ensure_default_model

    model_dir = Path(args.model) if args.model else ensure_default_model()
    prof_text = None
    root = Path(tempfile.mkdtemp(prefix="chatkv-bench-restore-"))
    data_dir = root / "data"
    try:
        from transformers import AutoModelForCausalLM

        if not args.snapshot_only:
            hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, args.dtype))
            hf.eval()

        # ------------------------------------------------ build the history (engine A)
        eng = make_engine(model_dir, data_dir, args.dtype)
        tok = eng.tokenizer
        if not args.snapshot_only:
            hf_ttft_full(hf, tok("Warm up the kernels, please.")["input_ids"])
        kv_bpt = eng.model.kv_bytes_per_token
        geometry = (eng.model.num_layers, eng.model.num_kv_heads, eng.model.head_dim, eng.kv_dtype)
        eng.generate(tok("Warm up the kernels, please.")["input_ids"], SamplingParams(max_tokens=2, temperature=0.0))

        sys_tokens = len(
            eng.session_manager.renderer.first(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}]
            )
        )
        per_turn_overhead = 8 + args.reply_tokens  # template tokens around a user message + the reply
        per_message = max(32, (args.history - sys_tokens) // 9 - per_turn_overhead)
        messages = user_messages(tok, per_message)

        if args.snapshot_only:
            s = build_session(eng, messages, args.reply_tokens)
            s.spill()
            lay = snapshot_layout(eng.session_manager.snapshots, s.id)
            eng.close()
            print(
                f"\nSession snapshot size of a {len(s.tokens)}-token chat  (model {model_dir.name}, {args.dtype}); "
                f"library: {library_version()}"
            )
            extra = report_snapshot_size(lay, kv_bpt, geometry)
            print(
                "  snapshot = tokens x KV bytes + headers + int64 token ids: "
                f"{extra - lay['tokens'] * 8} bytes beyond that"
            )
            return
        t0 = time.perf_counter()
        first = build_session(eng, messages, args.reply_tokens)
        build_s = time.perf_counter() - t0
        history = len(first.tokens)
        # R sessions for (a) and one for (d), identical turns 1-9: the radix cache makes the later ones cheap
        sess_a = [first] + [build_session(eng, messages, args.reply_tokens) for _ in range(R - 1)]
        sess_d = build_session(eng, messages, args.reply_tokens)
        assert all(s.tokens == first.tokens for s in sess_a + [sess_d]), "greedy replies differed between sessions"

        # (a) in memory: turn 10 on the engine that holds the history (a different message per repeat,
        # so no repeat finds another's turn 10 in the prefix cache)
        a_wall, a_ttft, a_usage, a_tok = [], [], [], []
        prompt10 = None
        for i, s in enumerate(sess_a):
            w, r = timed_turn(s, turn10_message(i))
            a_wall.append(w)
            a_ttft.append(r.usage.ttft_s)
            a_usage.append(r.usage)
            a_tok.append(s.tokens[r.usage.prompt_tokens])
            if i == 0:
                prompt10 = s.tokens[: r.usage.prompt_tokens]
        u0 = a_usage[0]
        cached = u0.cached_tokens  # tokens whose KV the history holds (the last reply token has none yet)
        new_ids = prompt10[cached:]
        # (c), (b) transformers on the same token ids, right after (a) so both see the same machine load,
        # on the threads asked for: (a)'s steps ran on this thread, whose count chatkv's thread governor
        # may have lowered (chatkv.model.cpu_threads) and which torch keeps per thread
        torch.set_num_threads(args.threads)
        cache = hf_prefill_cache(hf, prompt10[:cached])
        c_t, c_tok = zip(*[hf_ttft_cached(hf, cache, new_ids) for _ in range(RC)])
        b_t, b_tok = zip(*[hf_ttft_full(hf, prompt10) for _ in range(R)])
        del hf, cache

        for s in sess_a:
            s.delete()

        # spill the (d) session, timing the snapshot write (KV gather + safetensors + fsync + DB row)
        t0 = time.perf_counter()
        sess_d.spill()
        spill_s = time.perf_counter() - t0
        d_id = sess_d.id
        mgr = eng.session_manager
        lay = snapshot_layout(mgr.snapshots, d_id)
        t0 = time.perf_counter()
        eng.close()
        close_s = time.perf_counter() - t0
        del eng, first, sess_a, sess_d, mgr
        template = root / "template"
        shutil.copytree(data_dir, template)

        # (d) after a restart, once per repeat: a copy of the closed data dir, a new Engine, resume, turn 10
        d_wall, d_ttft, d_usage, d_tok, d_resume, d_timers, d_open, d_threads = [], [], [], [], [], [], [], []
        for i in range(R + (1 if args.profile else 0)):
            shutil.rmtree(data_dir)
            shutil.copytree(template, data_dir)
            t0 = time.perf_counter()
            e2 = make_engine(model_dir, data_dir, args.dtype)
            mgr = e2.session_manager
            opened = time.perf_counter() - t0
            if i == R:  # the extra, profiled run
                import cProfile
                import io
                import pstats

                s = e2.resume(d_id)
                pr = cProfile.Profile()
                pr.enable()
                timed_turn(s, turn10_message(0))
                pr.disable()
                buf = io.StringIO()
                pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(20)
                prof_text = buf.getvalue()
                e2.close()
                break
            timers = Timers(mgr)
            t0 = time.perf_counter()
            s = e2.resume(d_id)
            d_resume.append(time.perf_counter() - t0)
            w, r = timed_turn(s, turn10_message(i))
            d_open.append(opened)
            d_wall.append(w)
            d_ttft.append(r.usage.ttft_s)
            d_usage.append(r.usage)
            d_tok.append(s.tokens[r.usage.prompt_tokens])
            d_timers.append(timers.t)
            d_threads.append(f"{e2.threads.threads}{'*' if e2.threads.changes else ''}")
            assert s.tokens[:cached] == prompt10[:cached]
            e2.close()
            del e2, s, mgr

        # (e) recompute: prefix caching off, the same turn-10 prompt
        e3 = make_engine(model_dir, root / "nocache", args.dtype, enable_prefix_caching=False)
        e3.generate(prompt10[:64], SamplingParams(max_tokens=1, temperature=0.0))
        e_wall, e_ttft, e_tok = [], [], []
        for _ in range(R):
            t0 = time.perf_counter()
            w = None
            for piece in e3.stream(prompt10, SamplingParams(max_tokens=1, temperature=0.0)):
                if w is None:
                    w = time.perf_counter() - t0
                if not isinstance(piece, str):
                    e_ttft.append(piece.usage.ttft_s)
                    e_tok.append(piece.token_ids[0])
            e_wall.append(w)
        del e3

        # (f) llama.cpp
        f = None
        if not args.no_llama_cpp:
            try:
                import llama_cpp  # noqa: F401

                have_llama = True
            except ImportError:
                have_llama = False
            if have_llama:
                llm = llama_open(args.threads)
                text10 = tok.decode(prompt10)
                same_ids = llm.tokenize(text10.encode(), add_bos=False, special=True) == prompt10
                llm.eval(prompt10[:64])
                llm.reset()
                t0 = time.perf_counter()
                llm.eval(prompt10[:cached])
                f_prefill = time.perf_counter() - t0
                seq_path = root / "llama-seq.bin"
                f_save, f_bytes = llama_save_seq(llm, prompt10[:cached], seq_path)
                f_mem, f_mem_tok = [], []
                for _ in range(RC):  # llama.cpp in memory: history kept in its context
                    llm.n_tokens = cached
                    t0 = time.perf_counter()
                    llm.eval(new_ids)
                    f_mem_tok.append(llama_first_token(llm))
                    f_mem.append(time.perf_counter() - t0)
                del llm
                f_rest, f_load, f_tok = [], [], []
                for _ in range(RC):
                    llm2 = llama_open(args.threads)
                    llm2.eval(prompt10[:8])  # warm its kernels like every other engine here, then drop that state
                    llm2.reset()
                    llm2._ctx.kv_cache_seq_rm(-1, 0, -1)
                    total, load, t = llama_restore_ttft(llm2, seq_path, cached, new_ids)
                    f_rest.append(total)
                    f_load.append(load)
                    f_tok.append(t)
                    del llm2
                f = dict(
                    same_ids=same_ids,
                    prefill=f_prefill,
                    save=f_save,
                    bytes=f_bytes,
                    mem=f_mem,
                    mem_tok=f_mem_tok,
                    rest=f_rest,
                    load=f_load,
                    tok=f_tok,
                )

    finally:
        shutil.rmtree(root, ignore_errors=True)

    # ------------------------------------------------------------------ report
    A, D, E = med(a_wall), med(d_wall), med(e_wall)
    B, C = med(b_t), med(c_t)
    du = d_usage[0]
    load_avg = " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" (at start {load_start})"
    print(
        f"\nSession restore: turn-10 TTFT of a {history}-token chat  (model {model_dir.name}, {args.dtype}, "
        f"{args.threads} threads, {R} repeats ({RC} for the cheap ones), medians; load average {load_avg})"
    )
    print(f"library: {library_version()}")
    others = meter.others_share()
    print(
        f"other processes used {others * 100:.0f}% of the machine's CPU time during this run"
        + (
            "  WARNING: CPUs were contended, timings are inflated and noisy; rerun on a quiet machine"
            if others > 0.1
            else ""
        )
    )
    print(
        f"history before turn 10: {history} tokens ({cached} with KV, built in {build_s:.1f} s); "
        f"turn 10 prompt {u0.prompt_tokens} tokens, of which new {len(new_ids)}"
    )
    print(
        f"chatkv usage (a): cached {u0.cached_tokens} restored {u0.restored_tokens} computed {u0.computed_tokens}; "
        f"(d): cached {du.cached_tokens} restored {du.restored_tokens} computed {du.computed_tokens}"
    )

    rows = [
        ("(a) chatkv, history in memory", A, med(a_ttft), A),
        ("(b) transformers, re-prefill whole prompt", B, None, A),
        ("(c) transformers, DynamicCache of the history", C, None, A),
        ("(d) chatkv after restart (restore from disk)", D, med(d_ttft), A),
        ("(e) chatkv recompute (prefix caching off)", E, med(e_ttft), A),
    ]
    if f:
        rows += [
            ("(f) llama.cpp, history in its context", med(f["mem"]), None, A),
            ("(f) llama.cpp, seq state file restore + new", med(f["rest"]), None, A),
            ("    llama.cpp, prefill of the history", f["prefill"], None, A),
        ]
    w = max(len(r[0]) for r in rows)
    print(f"\n{'case'.ljust(w)}  {'TTFT ms':>9}  {'usage.ttft ms':>13}  {'x (a)':>7}")
    print(f"{'-' * w}  {'-' * 9}  {'-' * 13}  {'-' * 7}")
    for name, t, ut, ref in rows:
        print(f"{name.ljust(w)}  {fmt_ms(t):>9}  {fmt_ms(ut):>13}  {t / ref:>7.2f}")

    ms = lambda xs: "[" + " ".join(f"{x * 1000:.0f}" for x in xs) + "]"  # noqa: E731
    print(
        f"\nsamples ms: (a) {ms(a_wall)} (b) {ms(b_t)} (c) {ms(c_t)} (d) {ms(d_wall)} (e) {ms(e_wall)}"
        + (f" (f) mem {ms(f['mem'])} restore {ms(f['rest'])}" if f else "")
    )
    print(
        f"            (d) restore {ms([t.get('restore', 0) for t in d_timers])} "
        f"kv.load {ms([t.get('kv.load', 0) for t in d_timers])} "
        f"import_kv {ms([t.get('import_kv', 0) for t in d_timers])}"
    )
    rt = {k: med([t.get(k) for t in d_timers]) for k in ("restore", "kv.load", "import_kv")}
    print(
        "\nrestart breakdown (medians): "
        f"new Engine {med(d_open) * 1000:.0f} ms (not in TTFT); resume() {fmt_ms(med(d_resume))} ms; "
        f"restore {fmt_ms(rt['restore'])} ms = kv.load {fmt_ms(rt['kv.load'])} + import_kv {fmt_ms(rt['import_kv'])} "
        f"+ rest; then prefill of {du.computed_tokens} tokens (usage.ttft) {fmt_ms(med(d_ttft))} ms"
    )
    print(
        f"(d) compute threads after the turn, per repeat (* = the governor changed them during it, "
        f"chatkv.model.cpu_threads): {' '.join(d_threads)}"
    )
    print(f"spill (snapshot write + fsync) {fmt_ms(spill_s)} ms; engine close {close_s * 1000:.0f} ms")
    if f:
        print(
            f"llama.cpp: seq file {f['bytes'] / 1e6:.2f} MB, save {f['save'] * 1000:.1f} ms, "
            f"load alone {fmt_ms(med(f['load']))} ms; GGUF tokenizer gives the same ids as chatkv: {f['same_ids']}"
        )

    # (g) snapshot size
    extra = report_snapshot_size(lay, kv_bpt, geometry)

    # first tokens agree?
    toks = {"(a)": a_tok[0], "(b)": b_tok[0], "(c)": c_tok[0], "(d)": d_tok[0], "(e)": e_tok[0]}
    if f:
        toks["(f) mem"] = f["mem_tok"][0]
        toks["(f) restore"] = f["tok"][0]
    print("first token of turn 10 (repeat 0): " + ", ".join(f"{k} {v}" for k, v in toks.items()))

    # goals
    print("\ngoals")
    print(f"  chatkv cached vs re-prefill: {B / A:.1f}x (goal >= 30x)  {verdict(B / A >= 30)}")
    print(f"  chatkv cached vs DynamicCache loop: {C / A:.2f}x (goal >= 1x, no slower)  {verdict(A <= C)}")
    print(f"  chatkv restored vs recompute: {E / D:.1f}x (goal >= 25x)  {verdict(E / D >= 25)}")
    if f:
        F = med(f["rest"])
        print(f"  chatkv restored vs llama.cpp restore: {F / D:.2f}x (goal >= 1x, no slower)  {verdict(D <= F)}")
    print(f"  chatkv restored / in memory: {D / A:.2f}x (goal <= 1.3x)  {verdict(D / A <= 1.3)}")
    print(
        f"  restored_tokens == history with KV: {du.restored_tokens} vs {cached}  "
        f"{verdict(du.restored_tokens == cached)}"
    )
    ids_bytes, kv_bytes = lay["tokens"] * 8, lay["tokens"] * kv_bpt
    other = extra - ids_bytes
    note = (
        ""
        if extra == 0
        else (
            f" (the int64 token_ids tensors the format stores, {ids_bytes / kv_bytes * 100:.3f}%; nothing else)"
            if other == 0
            else ""
        )
    )
    print(f"  snapshot = tokens x KV bytes + header only: {extra} bytes beyond that{note}  {verdict(extra == 0)}")
    print(f"\ntotal bench time {time.perf_counter() - t_start:.0f} s")
    if prof_text:
        print("\ncProfile of one restored turn (by own time):")
        print(prof_text)


if __name__ == "__main__":
    main()
