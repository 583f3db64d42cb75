"""Time candidate FA3 forward tile rows for paged keys against the same call on contiguous keys: the numbers behind
configs.PAGED_ROWS. A contributor runs it after a change to the paged producer (mainloop_fwd_sm90_ws.cuh's
produce_paged) to see whether the paged row is still the fastest. The case is ``rawflash bench --paged``'s (16
sequences of 256 - 8192 tokens, causal, GQA 32/8, d = 128, bf16) at each page size asked for; each row's paged
call is validated first by flash-attn's rule on the bench's reduced case, then the kernels alone are timed (a
CUDA graph of the bound launches). It prints one table and writes nothing. Example:

    python3 tools/tune_paged.py --pages 64,16 [--repeats 15]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rawflash.cli import bench_paged as bp  # noqa: E402
from rawflash.cli.bench import time_kernels_ms  # noqa: E402
from rawflash.kernels import configs  # noqa: E402
from rawflash.kernels.configs import TileConfig  # noqa: E402

KEY = ("fa3_fwd_sm90", bp.HEAD_DIM, "bfloat16")
CANDIDATES = {"table (128 x 176)": configs.TABLE[KEY],
              "128 x 128, 2 stages, 2 Q_i": TileConfig(128, 128, 12, stages=2, q_stages=2),
              "128 x 128, 3 stages": TileConfig(128, 128, 12, stages=3)}


def _valid(page: int, row: TileConfig) -> bool:
    """flash-attn's rule for the paged call with ``row`` on the bench's reduced case."""
    x = bp._inputs(bp.REDUCED, page, seed=3)
    bound = bp._bound(x, True, {KEY: row})
    bound.launch()
    return bp.check_out(x, bound.result()[0])[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", default="64,16", help="page sizes, comma-separated (powers of two: FA3's form)")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    import cupy

    lengths = bp.paged_cases()[0].lengths
    rows = []
    for page in (int(s) for s in args.pages.split(",")):
        x = bp._inputs(lengths, page)
        for name, row in CANDIDATES.items():
            ok = _valid(page, row)
            paged = time_kernels_ms(bp._bound(x, True, {KEY: row}).launch, repeats=args.repeats) if ok else None
            contiguous = time_kernels_ms(bp._bound(x, False, {KEY: row}).launch, repeats=args.repeats)
            rows.append((page, name, "ok" if ok else "INVALID", paged, contiguous))
        del x
        cupy.get_default_memory_pool().free_all_blocks()
    print(f"{'page':>4}  {'row':<28}  {'check':<7}  {'paged ms':>8}  {'contiguous ms':>13}")
    for page, name, check, paged, contiguous in rows:
        shown = f"{paged:8.3f}" if paged is not None else f"{'-':>8}"
        print(f"{page:>4}  {name:<28}  {check:<7}  {shown}  {contiguous:13.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
