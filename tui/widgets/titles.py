"""Titles and the status line, made from stored text that ``chatkv.tui.terminal_text.safe_text`` cleans."""

from __future__ import annotations

from chatkv.tui.terminal_text import safe_text  # the one sanitiser, shared with the line mode

__all__ = ["one_line", "safe_text", "status_text"]


def one_line(s: str | None, width: int = 60) -> str:
    """A title for a list: safe, on one line, at most ``width`` characters."""
    text = " ".join(safe_text(s).split())
    return text if len(text) <= width else text[: width - 1] + "…"


def status_text(ctx_used: int, ctx_max: int, kv: dict | None, usage=None, mask: bool = False) -> str:
    """The status line: context used, KV pool usage, then this turn's cached/restored/computed (and
    with chunk KV reuse its sources' reused/recomputed tokens), TTFT, tok/s."""
    parts = [f"ctx {ctx_used}/{ctx_max} ({100 * ctx_used / max(ctx_max, 1):.0f}%)"]
    if kv:
        total, free = kv.get("blocks_total", 0), kv.get("blocks_free", 0)
        parts.append(f"KV {total - free}/{total} blk ({100 * (total - free) / max(total, 1):.0f}%)")
    if usage is not None:
        host = getattr(usage, "host_tokens", 0)
        tiers = [f"{usage.cached_tokens} cached"] + ([f"{host} host"] if host else [])
        reuse = []
        reused, recomputed = getattr(usage, "reused_tokens", 0), getattr(usage, "recomputed_tokens", 0)
        if reused or recomputed:  # chunk KV reuse (rag_kv_reuse): sources placed from their chunk KV
            reuse = [f"{reused} reused", f"{recomputed} recomputed"]
        parts.append(
            " · ".join(tiers + [f"{usage.restored_tokens} restored", f"{usage.computed_tokens} computed"] + reuse)
        )
        parts.append(
            "TTFT -- ms · -- tok/s" if mask else f"TTFT {usage.ttft_s * 1000:.0f} ms · {usage.tokens_per_s:.1f} tok/s"
        )
    return " │ ".join(parts)
