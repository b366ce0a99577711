"""One Prometheus text exposition out of several replicas' ``/metrics``: every sample gets a
``replica="<id>"`` label, and each family's ``# HELP``/``# TYPE`` lines appear once, before
all of its samples (the text format requires a family's samples to be contiguous)."""

from __future__ import annotations


def _labelled(line: str, replica: str) -> str:
    value = replica.replace("\\", "\\\\").replace('"', '\\"')
    brace, space = line.find("{"), line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        close = line.index("}", brace)
        inner = line[brace + 1 : close]
        sep = "," if inner.strip() else ""
        return f'{line[:brace]}{{replica="{value}"{sep}{inner}}}{line[close + 1 :]}'
    return f'{line[:space]}{{replica="{value}"}}{line[space:]}'


def merge(texts: dict[str, str], extra: str = "") -> str:
    """``texts``: replica id -> its exposition. ``extra``: unlabelled text appended as is."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for replica, text in texts.items():
        current = families.setdefault("", ([], []))
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                name = line.split(" ", 3)[2]
                current = families.setdefault(name, ([], []))
                if line not in current[0]:
                    current[0].append(line)
            elif line.strip() and not line.startswith("#"):
                current[1].append(_labelled(line, replica))
    out = [line for meta, samples in families.values() for line in meta + samples]
    return "\n".join(out) + "\n" + extra
