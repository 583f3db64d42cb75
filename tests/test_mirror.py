"""The Numba twins mirror the CUDA C kernels (DESIGN.md section 4), checked on the source text (no numba, no GPU).

For every pair ``cuda/X.cu`` / ``rawflash/numba_kernels/X.py`` the section anchors (``// ---- [X:name] ... ----``
and ``# ---- [X:name] ... ----``) are the same names in the same order, and every ``# MIRROR:`` comment that marks
an intended difference says what differs.
"""
from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CUDA = ROOT / "cuda"
TWINS = ROOT / "rawflash" / "numba_kernels"
KERNELS = ("fa1_fwd", "fa2_fwd", "fa2_bwd")
ANCHOR = re.compile(r"---- \[([A-Za-z0-9_]+:[A-Za-z0-9_]+)\]")
MIRROR = re.compile(r"#\s*MIRROR:(.*)$")


def _anchors(path: Path) -> list[str]:
    return ANCHOR.findall(path.read_text())


def _diff(cu: Path, py: Path, a: list[str], b: list[str]) -> str:
    return "\n".join(difflib.unified_diff(a, b, fromfile=str(cu.relative_to(ROOT)), tofile=str(py.relative_to(ROOT)),
                                          lineterm=""))


@pytest.mark.parametrize("name", KERNELS)
def test_section_anchors_match(name):
    cu, py = CUDA / f"{name}.cu", TWINS / f"{name}.py"
    expected, found = _anchors(cu), _anchors(py)
    assert expected, f"{cu.relative_to(ROOT)} has no section anchors"
    assert found == expected, f"section anchors of the twin differ from the CUDA C (- CUDA C, + twin):\n" \
                              f"{_diff(cu, py, expected, found)}"


@pytest.mark.parametrize("name", KERNELS)
def test_anchors_are_comments_of_their_file(name):
    for path, comment in ((CUDA / f"{name}.cu", "//"), (TWINS / f"{name}.py", "#")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = ANCHOR.search(line)
            if match:
                where = f"{path.relative_to(ROOT)}:{number}"
                assert line.strip().startswith(f"{comment} ---- ["), f"{where}: anchor outside a comment: {line}"
                assert match.group(1).startswith(f"{name}:"), f"{where}: anchor {match.group(1)} names another kernel"


@pytest.mark.parametrize("name", KERNELS)
def test_factory_named_after_the_kernel(name):
    assert re.search(rf"^def make_{name}\(", (TWINS / f"{name}.py").read_text(), re.M), \
        f"rawflash/numba_kernels/{name}.py has no factory make_{name}(...)"


def test_mirror_comments_say_what_differs():
    empty, count = [], 0
    for path in sorted(TWINS.glob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = MIRROR.search(line)
            if match:
                count += 1
                if len(match.group(1).split()) < 3:
                    empty.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert count > 0, "no # MIRROR: comments found in rawflash/numba_kernels"
    assert not empty, "MIRROR comments must say where and why the twin differs:\n" + "\n".join(empty)
