"""Tables as the command line prints them and as the Markdown reports hold them."""

from __future__ import annotations


def aligned(lines: list[list[str]], left: int = 1, rule: bool = True) -> str:
    """A header row and rows as columns: the first `left` flush left, the rest right, a rule under the header."""
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    out = []
    for j, row in enumerate(lines):
        out.append("  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0 and rule:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def markdown(head: list[str], rows: list[list[str]]) -> str:
    """A Markdown table: the first column flush left, the rest right."""
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])
