"""How many CPU threads a step computes with: the cores that are free now.

torch splits each op of a step over its intra-op threads (OpenMP) and waits for the last of
them. When another process keeps one of two cores busy, the thread that shares that core
runs only in the time slices the kernel gives it, so every one of a decode step's ~600 small
ops waits for it: decode fell to 0.23x of its quiet speed with one busy core beside it
(llama.cpp, which has the same problem, to 0.32x). With as many threads as there are free
cores, the step runs at the speed of the cores it has.

``ThreadGovernor.adjust()`` is called before each step; at most every ``interval`` seconds it
reads the CPU time the CPUs of this process's affinity mask spent (``/proc/stat``'s ``cpuN``
lines) and this process spent (``/proc/self/stat``) since its last look. Other processes'
load is the difference, the free cores are ``allowed - load`` (``allowed``: the affinity
mask's size, at most the configured threads), and the thread count follows them: down at once,
up after two looks in a row (a burst of another process must not make the step oscillate).
Reading both files takes ~30 us.
Where /proc is not there (not Linux), nothing changes. The first look is made when the
governor is made (the engine makes it before it loads the model), so the first step decides.

The count a governor sets stays on the thread that stepped after its engine is gone (OpenMP
keeps it per thread), and an engine that steps on its caller's thread (not ``start()``ed) sets
it on the caller's. A new governor on that thread takes torch's count as it was before a
governor changed it (``torch_threads``), not what an earlier engine left there: else an engine
made after one whose last look saw a busy core would be allowed one thread for its whole life
(bench_session_restore's restart case).

``one_thread()`` runs a model's load on one thread (see there).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import torch

log = logging.getLogger("chatkv.threads")

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# per thread: (torch's count before a governor first changed it, the count a governor set last)
_changed = threading.local()


def torch_threads() -> int:
    """torch's intra-op threads on this thread, as they were before a governor changed them (a
    count set since by someone else is taken as it is)."""
    n = torch.get_num_threads()
    was = getattr(_changed, "counts", None)
    return was[0] if was is not None and was[1] == n else n


def _set_threads(n: int) -> None:
    _changed.counts = (torch_threads(), n)
    torch.set_num_threads(n)


def _machine_busy_ticks(cpus: frozenset[int] | None = None) -> int | None:
    """Ticks spent not idle since boot: all CPUs (the first line of /proc/stat), or only the
    CPUs in ``cpus`` (their ``cpuN`` lines: in a container on a bigger host, the host's other
    CPUs and their load are not ours to count)."""
    try:
        with open("/proc/stat", "rb") as f:
            lines = f.read().split(b"\n")
    except OSError:
        return None
    total = 0
    for line in lines:
        if not line.startswith(b"cpu"):
            break
        name, *fields = line.split()
        if cpus is None:
            if name != b"cpu":
                continue
        elif name == b"cpu" or int(name[3:]) not in cpus:
            continue
        ticks = [int(x) for x in fields[:8]]
        total += sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)  # less idle and iowait
        if cpus is None:
            break
    return total


def _own_ticks() -> int | None:
    """Ticks this process (all its threads) spent on a CPU: utime + stime of /proc/self/stat."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # after "pid (comm) "
    return int(fields[11]) + int(fields[12])


def allowed_cpus() -> frozenset[int] | None:
    """The CPUs this process may run on (its affinity mask), None where that is unknown."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def allowed_cores() -> int:
    cpus = allowed_cpus()
    return len(cpus) if cpus else os.cpu_count() or 1


def free_cores(busy_delta: int, own_delta: int, seconds: float, allowed: int) -> float:
    """Cores not used by other processes over an interval: ``allowed`` less their load."""
    if seconds <= 0:
        return float(allowed)
    others = max(0, busy_delta - own_delta) / (_HZ * seconds)
    return max(0.0, allowed - others)


class ThreadGovernor:
    """Sets torch's intra-op threads of the stepping thread to the cores free now."""

    def __init__(self, max_threads: int | None = None, interval: float = 0.5, enabled: bool = True):
        self.allowed = min(allowed_cores(), max_threads or torch_threads())
        self.cpus = allowed_cpus()
        self.interval = interval
        self.enabled = enabled and self.allowed > 1 and _machine_busy_ticks(self.cpus) is not None
        self.threads = self.allowed
        self._want_up = 0
        self._last: tuple[float, int, int] | None = None
        self.changes = 0  # how often the count changed (the app's /stats, tests)
        self._pinned = max_threads is not None  # a count asked for: applied on the stepping thread
        if self.enabled:  # the first look, now: made before the model loads, the first step can decide
            busy, own = _machine_busy_ticks(self.cpus), _own_ticks()
            if busy is not None and own is not None:
                self._last = (time.monotonic(), busy, own)

    def _apply(self, n: int) -> None:
        if torch.get_num_threads() != n:  # per thread (OpenMP): set on the thread that steps
            log.debug("compute threads %d -> %d", torch.get_num_threads(), n)
            _set_threads(n)
        self.threads = n

    def decide(self, free: float) -> int:
        """The next thread count for ``free`` cores: down at once, up after two looks."""
        target = min(self.allowed, max(1, int(free + 0.25)))  # a core 75% free counts
        if target < self.threads:
            self._want_up = 0
            return target
        if target > self.threads:
            self._want_up += 1
            if self._want_up >= 2:
                self._want_up = 0
                return target
            return self.threads
        self._want_up = 0
        return self.threads

    def adjust(self) -> int:
        """Look at the load if ``interval`` has passed; set the threads if they should change."""
        if not self.enabled:
            if self._pinned:
                self._apply(self.threads)
            return self.threads
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.interval:
            return self.threads
        busy, own = _machine_busy_ticks(self.cpus), _own_ticks()
        if busy is None or own is None:
            return self.threads
        if self._last is not None:
            t0, busy0, own0 = self._last
            # the step's own threads count as ours; a core we leave idle counts as free
            target = self.decide(free_cores(busy - busy0, own - own0, now - t0, self.allowed))
            self.changes += target != self.threads
            self._apply(target)
        self._last = (now, busy, own)
        return self.threads


@contextlib.contextmanager
def one_thread():
    """torch computes on one intra-op thread inside (the caller's thread), then as before.

    For loading a model: its ops are copies and repackings of each weight once, bound by memory,
    where a second thread gains little on a quiet machine and costs most of the time on a busy
    one (each op waits for the thread that shares a core with another process: loading the
    default int4 model took 4.7 s of CPU on two threads beside a busy core, 0.35 s on one)."""
    before = torch.get_num_threads()
    if before != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before != 1:
            torch.set_num_threads(before)
