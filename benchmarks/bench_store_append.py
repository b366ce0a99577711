"""A plain turn's message writes as a conversation grows: ``Store.add_message`` on an append.

Every stored message records its branch's token history as a delta (storage.message_tree), and
an append replays the parent's branch to compute it: ``message_tree.history`` over every
message of the branch. Before the in-place replay each message's step copied the whole history
so far, so a replay cost (messages x history) and a turn's two writes grew quadratically.

One conversation in a fresh SQLite store, grown by appends of ``--tokens`` tokens a message; at
each of ``--at`` messages, ``--repeats`` appends timed with the shipped replay and with the
earlier copying one (kept below as the baseline), interleaved, medians; and the replay alone
(no database) on that branch. Prints the ratios, the CPU model and the other processes' load
(the message writes include SQLite's commit: noisy on a busy machine; the replay alone is not).

    .venv/bin/python benchmarks/bench_store_append.py [--at 50 200 400] [--tokens 50] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import OtherLoad, cpu_line, load_average, median, print_table  # noqa: E402
from chatkv.storage import message_tree as tree  # noqa: E402
from chatkv.storage.repository import Store  # noqa: E402


def copying_history(branch: Iterable[tree.Node]) -> tuple[Optional[list[int]], Optional[dict]]:
    """The replay before it worked in place (the baseline): a new list per message."""
    tokens: Optional[list[int]] = None
    context: Optional[dict] = None
    for node in branch:
        if node.token_tail is None:
            continue
        base = tokens or []
        tokens = list(base[: max(0, min(node.token_base or 0, len(base)))]) + list(node.token_tail)
        context = node.context
    return tokens, context


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--at", type=int, nargs="+", default=[50, 200, 400])
    ap.add_argument("--tokens", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(cpu_line())
    other = OtherLoad()
    shipped = tree.history
    store = Store.open(data_dir=Path(tempfile.mkdtemp(prefix="bench_store_append.")))
    cid = store.create_conversation("bench", "model", "", {}).id
    tokens: list[int] = []
    count, rows = 0, []

    def append(replay) -> float:
        nonlocal tokens, count
        tree.history = replay
        try:
            tokens = tokens + [count % 1000] * args.tokens
            t0 = time.perf_counter()
            store.add_message(cid, "user" if count % 2 == 0 else "assistant", f"message {count}", token_ids=tokens)
            count += 1
            return time.perf_counter() - t0
        finally:
            tree.history = shipped

    for at in sorted(args.at):
        while count < at:
            append(shipped)
        new, old = [], []
        for _ in range(args.repeats):
            new.append(append(shipped))
            old.append(append(copying_history))
        with store._reading() as s:  # the branch as add_message reads it
            conv = store._conversation(s, cid)
            chain = tree.chain(store._nodes(s, cid, contexts=False), conv.current_leaf_id)
        assert shipped(chain)[0] == copying_history(chain)[0] == tokens, "the two replays disagree"
        r_new, r_old = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            shipped(chain)
            r_new.append(time.perf_counter() - t0)  # noqa: E702
            t0 = time.perf_counter()
            copying_history(chain)
            r_old.append(time.perf_counter() - t0)  # noqa: E702
        a, b, c, d = median(new), median(old), median(r_new), median(r_old)
        rows.append(
            [
                str(count),
                str(len(tokens)),
                f"{a * 1e3:.2f}",
                f"{b * 1e3:.2f}",
                f"{b / a:.2f}x",
                f"{c * 1e3:.3f}",
                f"{d * 1e3:.3f}",
                f"{d / c:.1f}x",
            ]
        )
    store.close()
    print_table(
        "add_message on an append (ms, medians), shipped replay vs the copying one",
        ["messages", "history tokens", "add_message", "copying", "ratio", "replay alone", "copying", "ratio"],
        rows,
    )
    print(f"\nload average {load_average()}; {other}")


if __name__ == "__main__":
    main()
