"""Soft-capping's forward on the FA3 form against its variants, beside plain attention: the table's row, the row
without ping-pong, without the intra-warpgroup overlap, and other tile rows (d = 128), the table's row with and
without ping-pong (d = 256); bf16, N = 4096, bench --features' cases, kernels alone. Each variant is validated by
flash-attn's rule on a small problem first (tools/tune.py's valid_feature). A contributor runs it on a GPU machine
after a change to soft-capping's softmax or to the FA3 forward's schedule, to see whether another tile or switch
now suits soft-capping better than the table's row (bench/README.md lists its last result). Example:

    python3 tools/probe_softcap.py --head-dims 128
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rawflash.cli import bench  # noqa: E402
from rawflash.kernels.configs import TileConfig  # noqa: E402
import tune  # noqa: E402

VARIANTS = {128: [("table", None, ()), ("no ping-pong", None, (("pingpong", False),)),
                  ("no overlap", None, (("overlap", False),)),
                  ("192x80", TileConfig(192, 80, 16, stages=2), ()),
                  ("128x128", TileConfig(128, 128, 12, stages=2), ()),
                  ("128x128 qst2", TileConfig(128, 128, 12, stages=2, q_stages=2), ())],
            256: [("table", None, ()), ("no ping-pong", None, (("pingpong", False),))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", default="128,256", help=f"comma-separated, of {', '.join(map(str, VARIANTS))}")
    dims = [int(x) for x in ap.parse_args().head_dims.split(",")]
    if set(dims) - set(VARIANTS):
        ap.error(f"variants are listed for head dims {', '.join(map(str, VARIANTS))} only")
    rows = []
    for d, variants in ((d, VARIANTS[d]) for d in dims):
        cases = [c for c in bench.feature_cases(d) if c.direction == "fwd" and c.name.startswith(("plain", "softcap"))]
        inputs = {}
        for label, cand, sw in variants:
            override = None if cand is None else {("fa3_fwd_sm90", d, "bfloat16"): cand}
            for case in cases:
                if case.name.startswith("plain") and label not in ("table", "no ping-pong"):
                    continue
                case = dataclasses.replace(case, switches=sw)
                try:
                    status = tune.valid_feature(case, override)
                    if status == "ok":
                        if case.name not in inputs:  # each case's arrays once, for all the variants
                            inputs[case.name] = bench._feature_inputs(case)
                        bound = bench.feature_bound(case, *inputs[case.name], override)
                        ms = min(bench.time_ms(bound.launch, repeats=10) for _ in range(2))
                        status = f"{case.flops / (ms * 1e-3) / 1e12:.1f} TFLOP/s ({ms:.4f} ms)"
                except Exception as err:
                    status = f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"
                rows.append(f"d={d} {case.name:16s} {label:14s} {status}")
                print(rows[-1], flush=True)
    print("\n".join(["-- softcap probe --"] + rows))


if __name__ == "__main__":
    main()
