"""Plain-text rendering of the command line's reports: aligned tables and ``key: value`` lines.

A report is a dict. A value that is a list of dicts prints as a titled table, a list of scalars as indented lines,
a dict as an indented block (recursively), anything else as one ``key: value`` line. The same dict is
what ``--json`` prints, so the text and the JSON never disagree.
"""
from __future__ import annotations


def fmt(value) -> str:
    """A cell: floats to 4 significant digits (whole numbers from 1000 up), None as '-', bools as yes/no."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def table(rows: list[dict], columns: list[str] | None = None) -> str:
    """An aligned text table of dict rows (columns: every key, in first-seen order, unless given)."""
    if not rows:
        return "(nothing)"
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def _is_table(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(r, dict) for r in value)


def _block(key: str, value, indent: int, hide: tuple[str, ...]) -> list[str]:
    pad = " " * indent
    if _is_table(value):
        rows = [{k: v for k, v in r.items() if k not in hide and not isinstance(v, dict)} for r in value]
        body = table(rows).splitlines()
        return ["", f"{pad}{key}:"] + [pad + line for line in body]
    if isinstance(value, dict):
        lines = [f"{pad}{key}:"]
        for k, v in value.items():
            lines += _block(k, v, indent + 2, hide)
        return lines
    if isinstance(value, (list, tuple)):
        return [f"{pad}{key}:"] + [f"{pad}  {fmt(v)}" for v in value]
    return [f"{pad}{key}: {fmt(value)}"]


def render(report: dict, hide: tuple[str, ...] = ()) -> str:
    """The text form of ``report``; keys in ``hide`` (bulky JSON-only columns) are left out of tables."""
    lines = []
    for key, value in report.items():
        lines += _block(key, value, 0, hide)
    return "\n".join(lines).strip("\n")
