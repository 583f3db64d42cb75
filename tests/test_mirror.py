"""The Numba twins mirror the CUDA C, checked on the source text and the registry (no numba, no GPU).

- Every ``cuda/*.cu`` / ``*.cuh`` file with section anchors (``// ---- [stem:name] ... ----``) has a twin module
  ``rawflash/numba_kernels/<stem>.py`` whose anchors (``# ---- [stem:name] ... ----``) are the same names in the
  same order, or the registry declares the file twin-less: a form whose ``source`` or one of whose ``mainloops``
  is that file has ``twin=None`` and says why (``no_twin``). Twin modules of headers without anchors carry none
  either.
- Every form and helper of the registry with a twin names a module that exists and has its factory
  ``make_<kernel>``.
- Every ``# MIRROR:`` comment that marks an intended difference says what differs.
"""
from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

import pytest

from rawflash.kernels import registry

ROOT = Path(__file__).resolve().parents[1]
CUDA = ROOT / "cuda"
TWINS = ROOT / "rawflash" / "numba_kernels"
ANCHOR = re.compile(r"---- \[([A-Za-z0-9_]+):([A-Za-z0-9_]+)\]")
MIRROR = re.compile(r"#\s*MIRROR:(.*)$")
CUDA_FILES = sorted(p for p in CUDA.iterdir() if p.suffix in (".cu", ".cuh"))
ANCHORED = [p for p in CUDA_FILES if ANCHOR.search(p.read_text())]
TWIN_FILES = sorted(p for p in TWINS.glob("*.py") if not p.name.startswith("_"))


def _anchors(path: Path) -> list[str]:
    return [f"{a}:{b}" for a, b in ANCHOR.findall(path.read_text())]


def _diff(cu: Path, py: Path, a: list[str], b: list[str]) -> str:
    return "\n".join(difflib.unified_diff(a, b, fromfile=str(cu.relative_to(ROOT)), tofile=str(py.relative_to(ROOT)),
                                          lineterm=""))


def _cuda_of(twin: Path) -> Path | None:
    for suffix in (".cu", ".cuh"):
        if (CUDA / f"{twin.stem}{suffix}").is_file():
            return CUDA / f"{twin.stem}{suffix}"
    return None


def _declared_twinless(cu: Path) -> list[registry.Form]:
    return [f for v in registry.REGISTRY.values() for f in v.forms if cu.name in (f.source, *f.mainloops)]


def test_the_cuda_tree_has_anchored_files():
    assert len(ANCHORED) >= 8, [p.name for p in ANCHORED]


@pytest.mark.parametrize("cu", ANCHORED, ids=lambda p: p.name)
def test_every_anchored_cuda_file_has_a_twin_or_is_declared_twinless(cu):
    py = TWINS / f"{cu.stem}.py"
    expected = _anchors(cu)
    if py.is_file():
        found = _anchors(py)
        assert found == expected, f"section anchors of the twin differ from the CUDA C (- CUDA C, + twin):\n" \
                                  f"{_diff(cu, py, expected, found)}"
        return
    forms = _declared_twinless(cu)
    assert forms, (f"{cu.relative_to(ROOT)} has section anchors but neither a twin rawflash/numba_kernels/{cu.stem}.py "
                   "nor a form in the registry whose source or mainloop it is")
    for f in forms:
        assert f.twin is None and f.no_twin.strip(), (
            f"{cu.relative_to(ROOT)} has no twin module, but the registry's form {f.kernel!r} (source {f.source}, "
            f"mainloops {f.mainloops}) names twin {f.twin!r} and no reason for having none")


@pytest.mark.parametrize("py", TWIN_FILES, ids=lambda p: p.name)
def test_twin_modules_mirror_a_cuda_file(py):
    """A twin module's anchors are those of the CUDA file of the same stem (none for headers without anchors, and
    none at all where no CUDA file has its stem, as for common.py)."""
    cu = _cuda_of(py)
    found = _anchors(py)
    if cu is None:
        assert not found, f"{py.relative_to(ROOT)} has anchors {found} but no cuda/{py.stem}.cu(h) to mirror"
    else:
        assert found == _anchors(cu), _diff(cu, py, _anchors(cu), found)


@pytest.mark.parametrize("path", ANCHORED + TWIN_FILES, ids=lambda p: p.name)
def test_anchors_are_comments_naming_their_file(path):
    comment = "#" if path.suffix == ".py" else "//"
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = ANCHOR.search(line)
        if match:
            where = f"{path.relative_to(ROOT)}:{number}"
            assert line.strip().startswith(f"{comment} ---- ["), f"{where}: anchor outside a comment: {line}"
            assert match.group(1).startswith(path.stem), f"{where}: anchor {match.group(1)} names another file"


def _kernels_with_twins():
    for variant in registry.REGISTRY.values():
        for k in (*variant.forms, *variant.helpers):
            if k.twin is not None:
                yield pytest.param(k, id=f"{variant.name}:{k.kernel}")


def _functions(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("k", list(_kernels_with_twins()))
def test_every_twin_the_registry_names_exists_with_its_factory(k):
    py = TWINS / f"{k.twin}.py"
    assert py.is_file(), f"the registry names {k.twin!r} as the twin of {k.kernel!r}: {py.relative_to(ROOT)} is missing"
    assert f"make_{k.kernel}" in _functions(py), f"{py.relative_to(ROOT)} has no factory make_{k.kernel}(...)"


def test_twin_less_forms_say_why():
    for variant in registry.REGISTRY.values():
        for f in variant.forms:
            if f.twin is None:
                assert len(f.no_twin.split()) >= 3, f"form {f.kernel!r} has no twin and no reason"


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
