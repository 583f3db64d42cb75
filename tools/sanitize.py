"""Run every kernel once on small ragged shapes; meant to run under compute-sanitizer (see tools/gpu_run.sh).

CuPy's memory pool is switched off so that out-of-bounds accesses inside a pooled chunk are seen.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import cupy  # noqa: E402

cupy.cuda.set_allocator(None)
cupy.cuda.set_pinned_memory_allocator(None)

import numpy as np  # noqa: E402

import rawflash  # noqa: E402
from conftest import random_qkv  # noqa: E402

CASES = [(2, 37, 53, 4, 2, 64), (1, 70, 33, 2, 1, 128), (1, 17, 17, 2, 2, 40), (1, 33, 65, 2, 1, 256)]


def main() -> None:
    dtypes = sys.argv[1:] or ["float16", "bfloat16", "float32"]
    for dtype in dtypes:
        for b, sq, sk, h, hk, d in CASES:
            for causal in (False, True):
                q, k, v = (cupy.asarray(x) for x in random_qkv(b, sq, sk, h, hk, d, dtype))
                for kernel in ("fa2", "fa1", "naive"):
                    out, lse = rawflash.forward(q, k, v, causal=causal, kernel=kernel)
                if dtype != "float32":  # on an H200: the mma.sync forward, and the wgmma one without its overlap
                    rawflash.forward(q, k, v, causal=causal, wgmma=False)
                    rawflash.forward(q, k, v, causal=causal, overlap=False)
                if d in (64, 128):
                    for sw in ({"split_q": False}, {"seq_parallel": False, "defer_norm": False}):
                        rawflash.forward(q, k, v, causal=causal, **sw)
                dout = cupy.asarray(np.random.default_rng(0).standard_normal(q.shape).astype(q.dtype))
                for det in (False, True):
                    rawflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=det)
                cupy.cuda.Device().synchronize()
        print(f"sanitize workload done: {dtype}", flush=True)


if __name__ == "__main__":
    main()
