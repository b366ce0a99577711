"""Helpers shared by the tests that drive child processes on a tiny model."""

from __future__ import annotations

import subprocess
from contextlib import contextmanager

import torch


@contextmanager
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine
    OpenMP threads spinning against other processes make every forward 10-50x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def quit_child(proc: subprocess.Popen, timeout: float) -> None:
    """Ask a line-driven child to quit; kill it if it has not within ``timeout`` seconds."""
    try:
        proc.stdin.write("quit\n")
        proc.stdin.flush()
    except OSError:
        pass
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
