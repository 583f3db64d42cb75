"""The on-disk kernel cache (CuPy's, keyed by the assembled source) follows every byte of every header (GPU)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rawflash.kernels import compile

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
PROGRAM = """
import numpy as np, cupy, rawflash
rng = np.random.default_rng(0)
q, k, v = (cupy.asarray(rng.standard_normal((1, 40, 2, 64)).astype(np.float16)) for _ in range(3))
print(float(rawflash.forward(q, k, v)[1].sum()))
"""


def _lse_sum(cuda_dir: Path, cache: Path) -> float:
    env = dict(os.environ, RAWFLASH_CUDA_DIR=str(cuda_dir), CUPY_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", PROGRAM], env=env, check=True, capture_output=True, text=True)
    return float(done.stdout.strip().splitlines()[-1])


def test_header_change_is_compiled_not_served_from_cache(tmp_path):
    cuda, cache = tmp_path / "cuda", tmp_path / "cache"
    shutil.copytree(compile.cuda_dir(), cuda)
    first = _lse_sum(cuda, cache)
    files = sorted(p.name for p in cache.rglob("*") if p.is_file())
    assert files, "the first process must have written the compiled kernel to the disk cache"
    assert _lse_sum(cuda, cache) == first
    assert sorted(p.name for p in cache.rglob("*") if p.is_file()) == files, "a second process reuses the cache"
    header = cuda / "core.cuh"
    text = header.read_text()
    assert "0.6931471805599453f" in text
    header.write_text(text.replace("0.6931471805599453f", "0.5f"))   # ln 2 in lse = m ln 2 + log l
    changed = _lse_sum(cuda, cache)
    assert changed != first, "a changed header must give a newly compiled kernel"
    header.write_text(text)
    assert _lse_sum(cuda, cache) == first
