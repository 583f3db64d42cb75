"""Shared test set-up: GPU detection for the `gpu` marker, the run's selected tests, and input factories."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from rawflash.cli.sysinfo import gpu_available  # noqa: F401  (tests import it from here)

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


SELECTED = pytest.StashKey[list]()  # the run's selected tests: the collected list, which -k / -m trim in place


def pytest_collection_modifyitems(config, items):
    config.stash[SELECTED] = items
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (cupy.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def skip_unless_sm90(what: str) -> None:
    """Skip the calling test unless the GPU is sm_90 (Hopper): ``what`` says which sm_90a code it needs."""
    from rawflash.kernels import cupy_backend

    if cupy_backend.device_arch() != "sm_90":
        pytest.skip(f"{what} is sm_90a code")


def random_qkv(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype, seed=0, scale=1.0):
    """Host arrays drawn from N(0, scale^2), rounded to ``dtype`` (never zeros)."""
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
    q = (rng.standard_normal((batch, seqlen_q, heads, head_dim)) * scale).astype(dt)
    k = (rng.standard_normal((batch, seqlen_k, kv_heads, head_dim)) * scale).astype(dt)
    v = rng.standard_normal((batch, seqlen_k, kv_heads, head_dim)).astype(dt)
    return q, k, v
