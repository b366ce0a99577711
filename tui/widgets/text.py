"""Stored text made safe for a terminal, and the figures the status line shows."""

from __future__ import annotations

import re

# ESC-introduced sequences: CSI, OSC (ended by BEL or ST), DCS/SOS/PM/APC strings, and two-byte escapes;
# then their 8-bit C1 forms (CSI 0x9b, OSC 0x9d, DCS 0x90, SOS 0x98, PM 0x9e, APC 0x9f).
_SEQUENCES = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]?"
    r"|\x1b\][^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
    r"|\x1b[PX^_][^\x1b\x9c]*(?:\x1b\\|\x9c)?"
    r"|\x1b[ -/]*[0-~]?"
    r"|\x9b[0-?]*[ -/]*[@-~]?"
    r"|[\x9d\x90\x98\x9e\x9f][^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
)
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def safe_text(s: str | None) -> str:
    """``s`` without terminal control sequences (ESC/CSI/OSC/DCS ...) or C0/C1 controls; keeps \\n and \\t."""
    if not s:
        return ""
    return _CONTROLS.sub("", _SEQUENCES.sub("", s))


def one_line(s: str | None, width: int = 60) -> str:
    """A title for a list: safe, on one line, at most ``width`` characters."""
    text = " ".join(safe_text(s).split())
    return text if len(text) <= width else text[: width - 1] + "…"


def status_text(ctx_used: int, ctx_max: int, kv: dict | None, usage=None, mask: bool = False) -> str:
    """The status line: context used, KV pool usage, then this turn's cached/restored/computed, TTFT, tok/s."""
    parts = [f"ctx {ctx_used}/{ctx_max} ({100 * ctx_used / max(ctx_max, 1):.0f}%)"]
    if kv:
        total, free = kv.get("blocks_total", 0), kv.get("blocks_free", 0)
        parts.append(f"KV {total - free}/{total} blk ({100 * (total - free) / max(total, 1):.0f}%)")
    if usage is not None:
        parts.append(f"{usage.cached_tokens} cached · {usage.restored_tokens} restored · {usage.computed_tokens} computed")
        parts.append("TTFT -- ms · -- tok/s" if mask else f"TTFT {usage.ttft_s * 1000:.0f} ms · {usage.tokens_per_s:.1f} tok/s")
    return " │ ".join(parts)
