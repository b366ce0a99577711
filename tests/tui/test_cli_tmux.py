"""The README's main command in a real terminal (tmux), as a new user would try it, on the default model.

About 35 s, most of it converting the default model into a fresh data directory. They run in
the suite wherever tmux and the installed ``chatkv`` (scripts/install.sh) are present:

    .venv/bin/python -m pytest -q tests/tui/test_cli_tmux.py
    .venv/bin/python tests/tui/test_cli_tmux.py        # the same, printing each screen

Start ``chatkv`` and type "What is the capital of France?" at once, before it has drawn: the
question waits in the message box while the model is converted (a percentage on the loading
bar), then is sent; see "Paris", quit; start ``chatkv --resume``,
see the history, ask again and see a turn whose KV was restored from disk. Then pipe mode
(``echo ... | chatkv``: the answer alone on stdout, exit 0) and a hostile first message whose
title must not retitle the terminal when ``chatkv --list`` prints it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHATKV = ROOT / ".venv" / "bin" / "chatkv"

pytestmark = pytest.mark.skipif(
    shutil.which("tmux") is None or not CHATKV.exists(),
    reason="needs tmux and the installed chatkv (bash scripts/install.sh) to drive the app in a real terminal",
)


class Tmux:
    def __init__(self, name: str, command: str, width: int = 120, height: int = 40):
        self.name = name
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)
        subprocess.run(
            ["tmux", "new-session", "-d", "-s", name, "-x", str(width), "-y", str(height), command], check=True
        )

    def screen(self) -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", self.name], capture_output=True, text=True).stdout

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def wait_for(self, pattern: str, timeout: float) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            s = self.screen()
            if re.search(pattern, s):
                return s
            time.sleep(0.3)
        raise AssertionError(f"{pattern!r} not on screen after {timeout} s:\n{self.screen()}")

    def title(self) -> str:
        return subprocess.run(
            ["tmux", "display", "-p", "-t", self.name, "#{pane_title}"], capture_output=True, text=True
        ).stdout

    def kill(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def _app_run(home: str, args: str) -> Tmux:
    return Tmux(
        f"chatkv-test-{os.getpid()}", f"cd {ROOT} && CHATKV_HOME={home} {CHATKV} {args}; echo EXIT=$?; sleep 60"
    )


def test_app_in_a_real_terminal_answers_quits_and_resumes(tmp_path=None, show=False):
    home = str(tmp_path or tempfile.mkdtemp(prefix="chatkv-tmux-"))
    t = _app_run(home, "")
    try:
        # typed at once, before the app has drawn: the keys wait in the terminal and land in the
        # message box (not the sidebar's filter, the first focusable widget)
        t.keys("What is the capital of France?")
        t.wait_for(r"\b\d{1,3}%", 120)  # cold: the default model is converted first, with a real percentage
        s = t.wait_for(r"ctx \d+", 180)
        box = [line for line in s.splitlines() if "capital of France" in line]
        assert box and all("Filter" not in line for line in box), s
        assert "Filter conversations" in s  # the filter is still empty (its placeholder shows)
        t.keys("Enter")
        s = t.wait_for(r"\d+ computed", 60)  # the status line after the reply (tok/s may be cut at 80 columns)
        show and print(s)
        assert "Paris" in s
        t.keys("C-q")
        t.wait_for(r"EXIT=0", 20)
    finally:
        t.kill()
    t = _app_run(home, "--resume")
    try:
        s = t.wait_for(r"capital of France", 60)  # the history is shown
        t.keys("And of Italy?")
        time.sleep(0.3)
        t.keys("Enter")
        s = t.wait_for(r"\d+ computed", 60)  # the status line after the reply (tok/s may be cut at 80 columns)
        show and print(s)
        restored = re.search(r"(\d+) restored", s)
        assert restored and int(restored.group(1)) > 0, s  # the KV came back from disk
        t.keys("C-q")
        t.wait_for(r"EXIT=0", 20)
    finally:
        t.kill()


def test_pipe_mode_and_a_hostile_title_in_a_real_terminal(tmp_path=None, show=False):
    home = str(tmp_path or tempfile.mkdtemp(prefix="chatkv-tmux-"))
    t = Tmux(f"chatkv-test2-{os.getpid()}", "bash --norc --noprofile")
    try:
        t.keys(f"cd {ROOT} && export CHATKV_HOME={home} PS1='$ ' && clear", "Enter")
        t.keys(f'echo "What is the capital of France?" | {CHATKV} 2>/dev/null; echo EXIT=$?', "Enter")
        s = t.wait_for(r"EXIT=\d+", 180)
        show and print(s)
        assert "EXIT=0" in s and "Paris" in s and "\n> " not in s
        before = t.title()
        t.keys("clear", "Enter")
        t.keys(
            rf'printf "\033]2;PWNED\007Hi \033[31mthere\n" | {CHATKV} --max-tokens 4 >/dev/null 2>&1; '
            rf"{CHATKV} --list; echo LISTED=$?",
            "Enter",
        )
        s = t.wait_for(r"LISTED=\d+", 60)
        show and print(s)
        assert "LISTED=0" in s and "Hi there" in s
        assert t.title() == before and "PWNED" not in t.title()  # the title did not retitle the terminal
    finally:
        t.kill()


if __name__ == "__main__":
    for test in (
        test_app_in_a_real_terminal_answers_quits_and_resumes,
        test_pipe_mode_and_a_hostile_title_in_a_real_terminal,
    ):
        t0 = time.monotonic()
        test(show=True)
        print(f"{test.__name__}: ok in {time.monotonic() - t0:.1f} s")
    sys.exit(0)
