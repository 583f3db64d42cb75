"""The CUDA sources ship inside the wheel and are found from an installed package (marker `slow`)."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_contains_cuda_sources(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path),
                    str(ROOT)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("rawflash-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for src in sorted((ROOT / "cuda").iterdir()):
        if src.suffix in (".cu", ".cuh"):
            assert f"rawflash/cuda/{src.name}" in names, f"{src.name} is not in {wheel.name}"
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    found = subprocess.run([sys.executable, "-c", "from rawflash.kernels import compile; print(compile.cuda_dir())"],
                           cwd=tmp_path, env={"PYTHONPATH": str(target)}, check=True, capture_output=True, text=True)
    assert Path(found.stdout.strip()) == target / "rawflash" / "cuda"


def test_checkout_finds_its_cuda_folder():
    from rawflash.kernels import compile

    assert compile.cuda_dir() in (ROOT / "cuda", Path(compile.__file__).parents[1] / "cuda")
