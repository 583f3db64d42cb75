"""House style over the whole project, checked in CI without a GPU: no file the project tracks uses the word in
``WORD`` (or its plural) outside pytest's own API, since everywhere else it counts development rounds, which
belong in git's history and not in the tree; and no source line (``*.py``, ``*.cu``, ``*.cuh``, ``*.sh``,
``*.toml``) is longer than 120 characters. The files are those ``git ls-files`` lists, or every file under the
root (hidden folders and build output left out) where the tree is not a git checkout. A failure lists the first
offenders as path:line and counts them by top-level folder."""
from __future__ import annotations

import collections
import io
import os
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORD = "ses" + "sion"  # (spelt in two so this file does not name it)
WORD_RE = re.compile(rf"\b{WORD}s?\b", re.IGNORECASE)
# pytest's API where it shows in text: the widest fixture scope's name as a string, attributes of pytest's run
# object and the fixture request's attribute that names it. In Python code only comments and strings are read, so
# a hook's parameter and pytest's hook names (names, not prose) never count.
PYTEST_USE_RE = re.compile(rf"""scope\s*=\s*["']{WORD}["']|\b{WORD}\.\w|\.{WORD}\b""", re.IGNORECASE)
SOURCE_SUFFIXES = {".py", ".cu", ".cuh", ".sh", ".toml"}
MAX_LINE = 120
SHOWN = 30
WALK_SKIPS = {"__pycache__", "build", "dist", "gpu_logs", "node_modules"}


def _project_files() -> list[Path]:
    """The files git tracks under ROOT (those still in the working tree), else every file of a walk of ROOT."""
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        if top.returncode == 0 and Path(top.stdout.strip()).resolve() == ROOT:
            listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60,
                                    check=True).stdout.decode()
            return [p for p in (ROOT / name for name in listed.split("\0") if name) if p.is_file()]
    except (OSError, subprocess.SubprocessError):
        pass  # no git here: walk the tree
    files = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in WALK_SKIPS and not d.endswith(".egg-info")]
        files += [Path(folder) / n for n in names if not n.endswith((".pyc", ".pyo"))]
    return files


def _text(path: Path) -> str | None:
    """The file's text, or None for a binary file (one with a NUL byte)."""
    data = path.read_bytes()
    return None if b"\0" in data else data.decode("utf-8", errors="replace")


def _lines(text: str) -> list[tuple[int, str]]:
    return [(number, line.rstrip("\r")) for number, line in enumerate(text.split("\n"), 1)]


def _prose(path: Path, text: str) -> list[tuple[int, str]]:
    """(line number, text) of what the word check reads: a Python file's comments and strings (a string that is
    the word alone, as in a fixture's scope, left out), every line of any other file."""
    if path.suffix != ".py":
        return _lines(text)
    kinds = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in kinds and tok.string.strip("'\"").lower() != WORD:
                out += [(tok.start[0] + i, line) for i, line in enumerate(tok.string.split("\n"))]
    except (tokenize.TokenError, SyntaxError):  # not valid Python: read it as plain text
        return _lines(text)
    return out


def _report(offenders: list[tuple[str, int, str]], what: str) -> str:
    """The offenders (path, line, detail) counted by top-level folder, then the first SHOWN as path:line."""
    by_folder = collections.Counter(rel.split("/")[0] + "/" if "/" in rel else rel for rel, _, _ in offenders)
    counts = ", ".join(f"{folder} {n}" for folder, n in sorted(by_folder.items()))
    shown = [f"{rel}:{number}: {detail}" for rel, number, detail in offenders[:SHOWN]]
    if len(offenders) > SHOWN:
        shown.append(f"... and {len(offenders) - SHOWN} more")
    return f"{len(offenders)} {what} ({counts}):\n" + "\n".join(shown)


def test_no_file_counts_development_rounds():
    offenders = []
    for path in sorted(_project_files()):
        text = _text(path)
        if text is None:
            continue
        rel = path.relative_to(ROOT).as_posix()
        for number, line in _prose(path, text):
            if WORD_RE.search(PYTEST_USE_RE.sub("", line)):
                offenders.append((rel, number, line.strip()[:100]))
    if offenders:
        pytest.fail(_report(offenders, f"lines use the word '{WORD}' outside pytest's API"), pytrace=False)


def test_no_source_line_is_longer_than_120_characters():
    offenders = []
    for path in sorted(_project_files()):
        if path.suffix not in SOURCE_SUFFIXES:
            continue
        text = _text(path)
        if text is None:
            continue
        rel = path.relative_to(ROOT).as_posix()
        offenders += [(rel, number, f"{len(line)} characters") for number, line in _lines(text) if len(line) > MAX_LINE]
    if offenders:
        pytest.fail(_report(offenders, f"source lines are longer than {MAX_LINE} characters"), pytrace=False)
