"""The compute threads follow the cores that are free (chatkv.model.cpu_threads).

The decision rule on given figures, then the real thing: busy processes started beside a
governor reading the real /proc, which must step down to one thread while they run and come
back up once they are gone. No timing is asserted; only what the governor decided."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from chatkv.config import EngineConfig
from chatkv.errors import InvalidRequest
from chatkv.model import cpu_threads
from chatkv.model.cpu_threads import ThreadGovernor, allowed_cores, free_cores


def governor(allowed: int) -> ThreadGovernor:
    g = ThreadGovernor(max_threads=allowed)
    g.allowed = g.threads = allowed  # the rule alone, whatever this machine has
    return g


def test_free_cores_are_the_allowed_less_other_processes_load():
    hz = cpu_threads._HZ
    assert free_cores(busy_delta=2 * hz, own_delta=2 * hz, seconds=1.0, allowed=2) == 2.0  # all of it ours
    assert free_cores(busy_delta=2 * hz, own_delta=hz, seconds=1.0, allowed=2) == 1.0  # one core's worth is others'
    assert free_cores(busy_delta=4 * hz, own_delta=0, seconds=1.0, allowed=2) == 0.0  # never below 0
    assert free_cores(busy_delta=0, own_delta=hz, seconds=1.0, allowed=2) == 2.0  # our ticks never make cores free
    assert free_cores(busy_delta=10, own_delta=0, seconds=0.0, allowed=3) == 3.0


def test_threads_go_down_at_once_and_up_only_after_two_looks():
    g = governor(4)

    def look(free: float) -> int:
        g.threads = g.decide(free)  # what adjust() applies
        return g.threads

    assert look(1.0) == 1  # other processes took three cores: down now
    assert look(4.0) == 1  # a look with free cores: not yet
    assert look(0.6) == 1 and look(4.0) == 1  # the streak was broken
    assert look(4.0) == 4  # two looks in a row
    assert look(0.0) == 1  # never below one thread
    assert look(2.8) == 1 and look(2.8) == 3  # a core 75% free counts: 2.8 -> 3
    assert look(9.0) == 3 and look(9.0) == 4  # never above what is allowed


def test_the_threads_option_is_validated():
    for bad in (0, -1, True, 2.5, "2"):
        with pytest.raises(InvalidRequest, match="threads must be an int >= 1"):
            EngineConfig.from_kwargs(threads=bad)
    assert EngineConfig.from_kwargs(threads=1).threads == 1


def spin(n: int) -> list[subprocess.Popen]:
    return [
        subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 60\nwhile time.time() < end: pass"])
        for _ in range(n)
    ]


def looks(g: ThreadGovernor, n: int) -> list[int]:
    seen = []
    for _ in range(n):
        time.sleep(g.interval * 1.05)
        seen.append(g.adjust())
    return seen


@pytest.mark.skipif(allowed_cores() < 2, reason="one core: there is no thread count to choose")
def test_busy_processes_beside_it_bring_the_threads_down_and_their_end_brings_them_back():
    before = torch.get_num_threads()
    g = ThreadGovernor(max_threads=allowed_cores(), interval=0.3)
    assert g.enabled and g.threads == allowed_cores()
    g.adjust()  # the first look only records
    calm = looks(g, 3)[-1]  # what the machine allows before: all cores when it is quiet (CI)
    busy = spin(allowed_cores())  # every core taken by someone else
    try:
        seen = looks(g, 4)
        assert seen[-1] == 1 and torch.get_num_threads() == 1, seen
    finally:
        for p in busy:
            p.kill()
            p.wait()
    try:
        seen = looks(g, 6)
        assert seen[-1] >= calm and torch.get_num_threads() == seen[-1], (calm, seen)
    finally:
        torch.set_num_threads(before)


def test_a_pinned_count_without_adapting_is_applied_on_the_stepping_thread():
    before = torch.get_num_threads()
    try:
        g = ThreadGovernor(max_threads=1, enabled=False)
        assert g.adjust() == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_only_the_cpus_of_the_affinity_mask_are_counted():
    """In a container on a bigger host, /proc/stat lists the host's CPUs: their load is not ours."""
    cpus = cpu_threads.allowed_cpus()
    assert cpus, "sched_getaffinity is available on Linux"
    whole = cpu_threads._machine_busy_ticks()
    ours = cpu_threads._machine_busy_ticks(cpus)
    singles = sum(cpu_threads._machine_busy_ticks(frozenset({c})) for c in cpus)
    assert 0 < singles <= ours * 1.01 + 10 and ours <= whole * 1.01 + 10
    assert abs(singles - ours) <= 0.01 * ours + 10 * len(cpus)  # read at slightly different moments
    assert cpu_threads._machine_busy_ticks(frozenset({10**6})) == 0  # a CPU this machine lacks counts nothing


@pytest.mark.skipif(allowed_cores() < 2, reason="one core: there is no thread count to choose")
def test_a_new_governor_takes_torchs_count_not_the_one_an_earlier_engine_left():
    """An engine stepping on its caller's thread leaves its last count there; the next engine made
    on that thread (a restart in the same process) must not inherit one thread for its whole life."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        first = ThreadGovernor()
        assert first.allowed == 2 and first.enabled
        first._apply(1)  # what adjust() applies after a look that saw another process on a core
        assert torch.get_num_threads() == 1
        second = ThreadGovernor()
        assert second.allowed == 2 and second.enabled and second.threads == 2
        second._apply(2)
        assert torch.get_num_threads() == 2
        torch.set_num_threads(3)  # a count someone else set is taken as it is
        assert cpu_threads.torch_threads() == 3
        torch.set_num_threads(1)
        assert cpu_threads.torch_threads() == 1
        assert ThreadGovernor().allowed == 1
    finally:
        torch.set_num_threads(before)
