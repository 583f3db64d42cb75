"""The README tells the truth: its no-GPU examples run, its supported matrix is the code's, its install table
names every extra of pyproject.toml, and its command-line section names every command."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from rawflash.cli import commands, introspect, occupancy, sysinfo

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(marker: str) -> list[str]:
    return [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if b.startswith(marker)]


def test_the_no_gpu_examples_run():
    blocks = _blocks("# runs without a GPU")
    assert len(blocks) == 2, "the reference example and the simulator example"
    for code in blocks:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                              env=sysinfo.child_env(), cwd=ROOT)
        assert done.returncode == 0, f"{code}\n{done.stderr}"


def test_the_supported_matrix_is_the_code():
    for arch, limits in occupancy.ARCHS.items():
        row = next((line for line in README.splitlines() if line.startswith(f"| {arch} |")), None)
        assert row is not None, f"no row for {arch}"
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2] == f"{limits.smem_per_block_optin / 1024:.0f} KB", row
        assert cells[4] == introspect.unfit_summary(arch), (
            f"README's 'no tile fits' for {arch} is out of date; it is now:\n{introspect.unfit_summary(arch)}")


def test_install_table_names_every_extra():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in set(extras) - {"dev"}:
        assert f"| `{name}` |" in README, name
    assert "pip wheel" in README and "not on PyPI" in README


def test_command_line_section_names_every_command_and_gpu_model():
    section = README[README.index("## Command line"):README.index("## GPU tests and benchmark")]
    for name in commands.main.commands:
        assert name in section, name
    for model in ("H200", "A100-80GB-SXM", "L4", "RTX-4090"):
        assert model in section and model in introspect.MODELS
