"""A workload for Nsight Compute: fa2 forward and backward at one shape, a few times each.

    ncu --clock-control none --kernel-name regex:'fa2_(fwd|bwd)(_sm90)?<' --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
        python3 tools/profile_kernels.py --head-dim 128 --seqlen 4096
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rawflash  # noqa: E402
from rawflash import bench  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    case = bench.Case("rawflash-fa2", "bwd", args.dtype, 16384 // args.seqlen, 2048 // args.head_dim,
                      2048 // args.head_dim, args.seqlen, args.head_dim, args.causal)
    q, k, v, dout = bench.make_inputs(case)
    for _ in range(4):
        out, lse = rawflash.forward(q, k, v, causal=args.causal)
        rawflash.backward(dout, q, k, v, out, lse, causal=args.causal)
    import cupy

    cupy.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
