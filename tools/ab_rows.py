"""The A/B of CUDA source folders and FA3 tile rows on the FA2 sweep's forward or backward (bf16, kernels alone,
TFLOP/s), each combination validated first (tools/tune.py's rule on a small problem), cuDNN in the same run. A
contributor runs it on a GPU machine when a kernel change and a tile row go together (a change that frees
registers or shared memory for another row): tools/ab_sources.py compares folders on the table's rows, this also
takes a row per combination. A combination is NAME=DIR, optionally @BR,BC,STAGES[,QSTAGES]: that fa3_fwd_sm90 row
(4 * (BR / 64 + 1) warps), or with --direction bwd that fa3_bwd_sm90 row (12 warps), for every case's head_dim (a
row that does not fit is reported, not timed). Precompile the folders first (tools/precompile.py --cuda-dir DIR
--filter 'fa3_fwd_sm90<__nv_bfloat16'); a row not in the table compiles at its first call. Example:

    python tools/ab_rows.py --combo base=old/cuda --combo new=cuda --combo q2=cuda@128,128,2,2 \\
        [--direction fwd] [--head-dims 64,128,256] [--seqlens 512,1024,2048,4096,16384] [--causal both] \\
        [--repeats 5] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--combo", action="append", required=True,
                    help="NAME=DIR[@BR,BC,STAGES[,QSTAGES]], once per combination; the first is the base")
    ap.add_argument("--direction", default="fwd", choices=("fwd", "bwd"))
    ap.add_argument("--head-dims", default="64,128,256", help="comma-separated head dims")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,16384", help="comma-separated sequence lengths")
    ap.add_argument("--causal", default="both", choices=("both", "true", "false"))
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per case (the median)")
    ap.add_argument("--out", help="also write the rows as JSON here")
    a = ap.parse_args()
    import tune  # tools/tune.py: the candidates' validation rule
    from ab_sources import peer_tflops, print_table, record_row
    from rawflash.cli import bench
    from rawflash.kernels.configs import TileConfig

    combos = []
    for c in a.combo:
        name, rest = c.split("=", 1)
        src, _, row = rest.partition("@")
        cfg = None
        if row:
            br, bc, st, *qst = (int(x) for x in row.split(","))
            warps = 4 * (br // 64 + 1) if a.direction == "fwd" else 12
            cfg = TileConfig(br, bc, warps, stages=st, q_stages=qst[0] if qst else 1)
        combos.append((name, str(Path(src).resolve()), cfg))
    causals = {"both": [False, True], "true": [True], "false": [False]}[a.causal]
    kernel = "fa3_fwd_sm90" if a.direction == "fwd" else "fa3_bwd_sm90"
    cases = bench.sweep_cases(["rawflash-fa2"], [a.direction], ["bfloat16"], [int(x) for x in a.head_dims.split(",")],
                              [int(x) for x in a.seqlens.split(",")], causals)
    rows = []
    for case in cases:
        row = dict(head_dim=case.head_dim, seqlen=case.seqlen, causal=case.causal)
        q, k, v, dout = bench.make_inputs(case)
        for name, src, cfg in combos:
            os.environ["RAWFLASH_CUDA_DIR"] = src
            ov = None if cfg is None else {(kernel, case.head_dim, "bfloat16"): cfg}
            try:
                st = tune.valid(case, ov)
                if st != "ok":
                    row[name] = st
                    continue
                launch = bench.bound_call(case, q, k, v, dout, ov).launch
                row[name] = case.flops / bench.time_ms(launch, a.repeats) / 1e9
            except Exception as e:
                row[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
        os.environ.pop("RAWFLASH_CUDA_DIR", None)
        row["torch-cudnn"] = peer_tflops(case, q, k, v, dout, a.repeats)
        del q, k, v, dout
        record_row(rows, row)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    print_table(rows, [c[0] for c in combos] + ["torch-cudnn"], f"TFLOP/s ({a.direction}, bfloat16)")


if __name__ == "__main__":
    main()
