"""Where the command line meets a world that fails, so that no traceback reaches a person.

- ``Stdout``: replies and listings on stdout, which may fail mid-way: a reader that left
  (``chatkv | head -c1``: quiet, exit 0) or a device that cannot be written (``> /dev/full``:
  one line, exit 2);
- ``check_data_dir``: a data directory that is a file or cannot be written is one
  StorageError naming it and the fix, before any model loads;
- ``error`` / ``note``: one line on stderr, which may itself be closed.
"""

from __future__ import annotations

import os
import sys
import tempfile

from chatkv.errors import StorageError
from chatkv.tui.terminal_text import safe_text


def error(message: object) -> None:
    """One error line on stderr; the message may echo user input, so it is made safe first."""
    try:
        print(f"chatkv: {safe_text(str(message), oneline=True)}", file=sys.stderr, flush=True)
    except (OSError, ValueError, AttributeError):  # stderr closed or failing: nowhere left to say it
        pass


def note(text: str) -> None:
    """A line for the person on stderr (never a reply); a stderr that cannot be written is ignored."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError, AttributeError):
        pass


class Stdout:
    """Replies on stdout, which may fail: its reader left (BrokenPipeError) or the device is full
    (OSError). The first failure is kept in ``failed`` and stdout is pointed at /dev/null, so
    nothing more (not even the interpreter's last flush) raises; later writes are dropped."""

    def __init__(self):
        self.failed: OSError | None = None

    def write(self, text: str, end: str = "") -> None:
        if self.failed is not None or sys.stdout is None:
            return
        try:
            print(text, end=end, flush=True)
        except OSError as e:
            self.failed = e
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)
            except (OSError, ValueError):
                pass

    def status(self, stored: str = "") -> int:
        """The exit status after a failure (0: none, or a reader that left), one line for the rest."""
        if self.failed is None or isinstance(self.failed, BrokenPipeError):
            return 0
        error(
            f"cannot write to standard output: {self.failed.strerror or self.failed}{stored}; "
            f"send it to a file or a terminal that can be written"
        )
        return 2


def check_data_dir(explicit: str | None) -> None:
    """StorageError, before any model loads, when the data directory cannot be created or written."""
    from chatkv import data_dir

    given = explicit if explicit is not None else os.environ.get("CHATKV_HOME")
    fix = "give --data-dir (or CHATKV_HOME) a directory chatkv can create and write"
    if given and os.path.exists(given) and not os.path.isdir(given):
        raise StorageError(f"the data directory '{given}' is a file, not a directory; {fix}")
    try:
        path = data_dir(explicit)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".chatkv-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        where = given or "the default data directory"
        raise StorageError(f"cannot use '{where}' as the data directory: {e.strerror or e}; {fix}") from e
