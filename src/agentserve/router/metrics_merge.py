"""One Prometheus page from several replicas' pages: every sample gets a
`replica="..."` label, and each metric family appears once (one HELP and one
TYPE line, then its samples from every replica), as the text exposition
format requires. Pure text processing; no Ray, no prometheus-client."""

from __future__ import annotations

from collections.abc import Iterable


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def with_label(sample: str, name: str, value: str) -> str:
    """`sample` (one exposition line, `metric{labels} value [timestamp]`) with `name="value"` first among its labels."""
    label = f'{name}="{_escape(value)}"'
    brace = sample.find("{")
    space = sample.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        inner_start = brace + 1
        sep = "" if sample[inner_start] == "}" else ","
        return f"{sample[:inner_start]}{label}{sep}{sample[inner_start:]}"
    if space == -1:
        raise ValueError(f"not a Prometheus sample line: {sample[:80]!r}")
    return f"{sample[:space]}{{{label}}}{sample[space:]}"


class _Family:
    __slots__ = ("help", "type", "samples")

    def __init__(self) -> None:
        self.help: str | None = None
        self.type: str | None = None
        self.samples: list[str] = []


def merge_pages(pages: Iterable[tuple[str, str]], label: str = "replica") -> str:
    """The pages `(replica, text)` as one page, each sample labelled with its replica."""
    families: dict[str, _Family] = {}
    for replica, text in pages:
        current: _Family | None = None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    current = families.setdefault(parts[2], _Family())
                    rest = parts[3] if len(parts) > 3 else ""
                    if parts[1] == "HELP" and current.help is None:
                        current.help = rest
                    elif parts[1] == "TYPE" and current.type is None:
                        current.type = rest
                continue
            if current is None:  # a sample without a family header: its own untyped family
                current = families.setdefault(line.split("{", 1)[0].split(" ", 1)[0], _Family())
            current.samples.append(with_label(line, label, replica))
    out: list[str] = []
    for name, fam in families.items():
        if fam.help is not None:
            out.append(f"# HELP {name} {fam.help}")
        if fam.type is not None:
            out.append(f"# TYPE {name} {fam.type}")
        out.extend(fam.samples)
    return "\n".join(out) + "\n" if out else ""
