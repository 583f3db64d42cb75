"""The wheel that ``pip wheel`` builds from a clone: py.typed, the license, ``python -m rawflash`` (marker `slow`)."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(ROOT)], check=True,
                   capture_output=True)
    return next(out.glob("rawflash-*.whl"))


def test_wheel_ships_py_typed_license_and_main(wheel):
    z = zipfile.ZipFile(wheel)
    names = set(z.namelist())
    assert {"rawflash/py.typed", "rawflash/__main__.py", "rawflash/cli/__main__.py"} <= names
    for folder in ("rawflash", "rawflash/kernels", "rawflash/cli", "rawflash/numba_kernels", "rawflash/distributed",
                   "rawflash/jax"):
        modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / folder).glob("*.py")}
        assert f"{folder}/__init__.py" in modules and modules <= names, f"{folder}: {sorted(modules - names)} missing"
    licenses = [n for n in names if n.endswith("/licenses/LICENSE")]
    assert licenses and z.read(licenses[0]).decode() == (ROOT / "LICENSE").read_text()
    metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: BSD-3-Clause" in metadata and "License-File: LICENSE" in metadata
    assert "BSD 3-Clause License" in (ROOT / "LICENSE").read_text()
    entry = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "rawflash = rawflash.cli:main" in entry


def test_installed_wheel_runs_python_m_rawflash(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    env = {"PYTHONPATH": str(target) + ":" + ":".join(p for p in sys.path if p.endswith("site-packages"))}
    done = subprocess.run([sys.executable, "-m", "rawflash", "list", "--json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert '"variants"' in done.stdout
    for module in ("rawflash", "rawflash.cli"):  # the console script's own module too: rawflash.cli:main
        done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=tmp_path, env=env, capture_output=True,
                              text=True)
        assert done.returncode == 0 and "Usage:" in done.stdout, (module, done.stderr)
    where = subprocess.run([sys.executable, "-c", "import rawflash; print(rawflash.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True)
    assert Path(where.stdout.strip()).parent == target / "rawflash", "the wheel's copy ran, not the checkout"
    assert (target / "rawflash" / "py.typed").is_file()
