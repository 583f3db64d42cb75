"""Numba twins vs CUDA C kernels on a GPU: max relative difference in float32, and the twins' error ratios.

    python3 tools/numba_parity.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import cupy  # noqa: E402
import numpy as np  # noqa: E402

import rawflash  # noqa: E402
from conftest import random_qkv  # noqa: E402


def rel(a, b) -> float:
    a, b = cupy.asnumpy(a).astype(np.float64), cupy.asnumpy(b).astype(np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def main() -> None:
    print("shape                      causal  what      max |numba - cupy| / max |cupy|")
    for b, sq, sk, h, hk, d in ((2, 203, 113, 4, 2, 64), (1, 127, 129, 4, 1, 128), (1, 300, 300, 2, 2, 40)):
        for causal in (False, True):
            q, k, v = (cupy.asarray(x) for x in random_qkv(b, sq, sk, h, hk, d, "float32", seed=3))
            dout = cupy.asarray(np.random.default_rng(4).standard_normal(q.shape).astype(np.float32))
            for kernel in ("fa2", "fa1"):
                on, ln = rawflash.forward(q, k, v, causal=causal, kernel=kernel, backend="numba")
                oc, lc = rawflash.forward(q, k, v, causal=causal, kernel=kernel)
                fin = cupy.isfinite(lc)
                print(f"{(b, sq, sk, h, hk, d)!s:26} {causal!s:6}  {kernel} out  {rel(on, oc):.2e}   lse "
                      f"{rel(ln[fin], lc[fin]):.2e}")
            out, lse = rawflash.forward(q, k, v, causal=causal)
            gn = rawflash.backward(dout, q, k, v, out, lse, causal=causal, backend="numba")
            gc = rawflash.backward(dout, q, k, v, out, lse, causal=causal)
            print(f"{(b, sq, sk, h, hk, d)!s:26} {causal!s:6}  bwd      dq {rel(gn[0], gc[0]):.2e}  dk "
                  f"{rel(gn[1], gc[1]):.2e}  dv {rel(gn[2], gc[2]):.2e}")


if __name__ == "__main__":
    main()
