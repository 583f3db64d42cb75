"""FA3's forward under its three grids, on the FA2 paper's sweep (16k tokens, hidden 2048), beside cuDNN in the same
process: one CTA per tile, the persistent grid with the static schedule, and with the dynamic one (CTAs take tiles
from a counter). Each persistent output is first checked bitwise against the one-tile-per-CTA output (the same
tiles computed the same way), then every grid is timed with rawflash bench's timer (kernels alone:
``Bound.launch``). A contributor runs it after a change to the scheduler (cuda/scheduler.cuh) or to the rule that
picks a grid (forms.py), to see which grid each case should take. Example:

    python tools/bench_schedule.py --head-dims 128 --seqlens 1024,16384 [--dtype bfloat16] [--repeats 10]
        [--no-peer] [--out FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GRIDS = {"one tile per CTA": dict(persistent=False), "static": dict(persistent=True, dynamic=False),
         "dynamic": dict(persistent=True, dynamic=True)}


def main() -> None:
    import cupy

    from rawflash import settings, validation
    from rawflash.cli import bench
    from rawflash.kernels import cupy_backend, forms

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--head-dims", default="64,128,256", help="comma-separated head dims")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384", help="comma-separated sequence lengths")
    ap.add_argument("--repeats", type=int, default=10, help="timed repeats per case (the median)")
    ap.add_argument("--no-peer", action="store_true", help="skip torch-cudnn")
    ap.add_argument("--out", help="also write the rows as JSON here")
    args = ap.parse_args()
    env = settings.load()
    rows = []
    for case in bench.sweep_cases(["rawflash-fa2"], ["fwd"], [args.dtype], [int(x) for x in args.head_dims.split(",")],
                                  [int(x) for x in args.seqlens.split(",")], [False, True]):
        d, n, causal = case.head_dim, case.seqlen, case.causal
        q, k, v, dout = bench.make_inputs(case)
        c = validation.check_forward(q, k, v, causal, None)
        row = dict(head_dim=d, seqlen=n, causal=causal)
        ref = None
        for name, sw in GRIDS.items():
            bound = cupy_backend.bind_forward(c.problem, q, k, v, c.scale, "fa2", forms.Switches(**sw),
                                              c.extras, env)
            bound.launch()
            out = bound.result()[0]
            if ref is None:
                ref = out.copy()
            elif not cupy.array_equal(out, ref):
                row[f"{name}_error"] = "output differs from the one-tile-per-CTA grid"
                continue
            row[name] = case.flops / bench.time_ms(bound.launch, args.repeats) / 1e9
        if not args.no_peer:
            try:
                peer = dataclasses.replace(case, impl="torch-cudnn")
                row["torch-cudnn"] = case.flops / bench.time_ms(bench.runner(peer, q, k, v, dout),
                                                                 args.repeats) / 1e9
            except Exception as err:  # no PyTorch, or no cuDNN attention here
                row["torch-cudnn"] = f"unavailable: {type(err).__name__}"
        rows.append(row)
        print(json.dumps({k: (round(x, 1) if isinstance(x, float) else x) for k, x in row.items()}),
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"{'d':>4} {'N':>6} {'causal':>6} " + " ".join(f"{g:>16}" for g in (*GRIDS, "torch-cudnn")))
    for r in rows:
        cells = [f"{r[g]:16.1f}" if isinstance(r.get(g), float) else f"{str(r.get(g, '-'))[:16]:>16}"
                 for g in (*GRIDS, "torch-cudnn")]
        print(f"{r['head_dim']:>4} {r['seqlen']:>6} {str(r['causal']):>6} " + " ".join(cells))


if __name__ == "__main__":
    main()
