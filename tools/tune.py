"""Time candidate tile configurations of fa2_fwd / fa2_bwd on a GPU (the numbers behind rawflash/configs.py).

    python3 tools/tune.py [--seqlen 4096] [--dtype bfloat16] [--head-dims 64,128] [--which fwd,bwd,fwd_sm90,bwd_sm90]

Each candidate replaces its row of configs.TABLE for the run, is validated on a small problem by flash-attn's
rule, then timed on the FA2 paper's shape (B = 16384 / N, H = 2048 / d), causal off and on.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rawflash import bench, configs  # noqa: E402
from rawflash.configs import TileConfig  # noqa: E402

CANDIDATES = {
    ("fa2_fwd", 64): [TileConfig(128, 64, 4, kunroll=k) for k in (1, 2, 4)] + [TileConfig(128, 128, 4, kunroll=k) for k in (1, 2)]
    + [TileConfig(64, 64, 4, kunroll=2), TileConfig(128, 64, 4, min_blocks=2, kunroll=2)],
    ("fa2_fwd", 128): [TileConfig(128, 32, 4, kunroll=k) for k in (1, 2, 4)] + [TileConfig(128, 64, 4, kunroll=k) for k in (1, 2)]
    + [TileConfig(64, 64, 4, kunroll=2), TileConfig(64, 32, 4, kunroll=2)],
    ("fa2_bwd", 64): [TileConfig(64, 128, 8, kunroll=k) for k in (1, 2, 4)] + [TileConfig(32, 128, 8, kunroll=2),
                                                                             TileConfig(64, 64, 4, kunroll=2)],
    ("fa2_bwd", 128): [TileConfig(32, 128, 8, kunroll=k) for k in (1, 2, 4)] + [TileConfig(64, 128, 8, kunroll=1),
                                                                              TileConfig(32, 64, 4, kunroll=2)],
    ("fa2_fwd_sm90", 64): [TileConfig(64, 128, 4, min_blocks=2), TileConfig(64, 128, 4, min_blocks=3),
                           TileConfig(128, 128, 8), TileConfig(192, 128, 12)],
    ("fa2_fwd_sm90", 128): [TileConfig(128, 128, 8), TileConfig(192, 64, 12), TileConfig(64, 96, 4, min_blocks=2),
                            TileConfig(128, 96, 8)],
    ("fa2_fwd_sm90", 256): [TileConfig(128, 64, 8), TileConfig(64, 64, 4), TileConfig(128, 32, 8)],
    ("fa2_bwd_sm90", 64): [TileConfig(64, 128, 8)],
    ("fa2_bwd_sm90", 128): [TileConfig(64, 128, 8)],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", default="4096", help="one or more, comma-separated")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--which", default="fwd,bwd")
    args = ap.parse_args()
    dims = [int(x) for x in args.head_dims.split(",")]
    for which in args.which.split(","):
        kernel, direction = f"fa2_{which}", which.split("_")[0]
        os.environ["RAWFLASH_WGMMA"] = "1" if which.endswith("sm90") else "0"  # which kernel "rawflash-fa2" runs
        for d in dims:
            key = (kernel, d, args.dtype)
            default = configs.TABLE.get(key)
            if default is None:
                continue
            for cand in CANDIDATES.get((kernel, d), []):
                configs.TABLE[key] = cand
                for n, causal in itertools.product((int(x) for x in args.seqlen.split(",")), (False, True)):
                    case = bench.Case("rawflash-fa2", direction, args.dtype, 16384 // n, 2048 // d, 2048 // d, n, d,
                                      causal)
                    try:
                        rec = bench.run_case(case, repeats=10, validated={})
                        tf, status = rec.tflops, rec.status
                    except Exception as err:  # a candidate that does not compile or fit is reported, not fatal
                        tf, status = None, f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"
                    print(f"{direction} d={d} N={n} causal={causal!s:5} Br={cand.br} Bc={cand.bc} warps={cand.warps} "
                          f"minB={cand.min_blocks} ku={cand.kunroll}: "
                          f"{'%.0f TFLOP/s' % tf if tf else status}{'  (current)' if cand == default else ''}",
                          flush=True)
            configs.TABLE[key] = default


if __name__ == "__main__":
    main()
