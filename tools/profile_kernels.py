"""A workload for Nsight Compute: one kind of call at one shape, run a few times (the FA2 sweep's shapes:
B = 16384 / N, H = 2048 / d, bf16 unless --dtype says otherwise). A contributor profiles it to see where a
kernel's time goes (its roofline, stalls, occupancy); ``tools/gpu_run.sh profile`` runs ncu on it for each of
PROFILE_CASES. Cases: ``plain`` (forward and backward), ``softcap`` / ``alibi`` (forward and backward with that
feature, softcap 30, slopes 2^-1..2^-H), ``fp8`` (the FP8 forward, per-head descales), ``decode`` (one decode
step: batch --batch, 32 query heads on --kv-heads (8) kv heads, d 128, N cached keys), ``decode_fp8`` (the same
step on a float8_e4m3fn cache, per (sequence, kv head) descales), ``latent`` (MLA's absorbed decode: --batch
sequences, 128 query heads on one latent cache of 576 columns whose first 512 are the values, pages of 64),
``paged`` (``rawflash bench --paged``'s paged prefill in pages of --page rows, forward only). Example:

    ncu --clock-control none --kernel-name regex:'fa[23]_(fwd|bwd)' --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        python3 tools/profile_kernels.py --case softcap --head-dim 128 --seqlen 4096
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rawflash  # noqa: E402
from rawflash.cli import bench  # noqa: E402

CASES = ("plain", "softcap", "alibi", "fp8", "decode", "decode_fp8", "latent", "paged")


def feature_args(name: str, heads: int) -> dict:
    import cupy

    if name == "softcap":
        return {"softcap": 30.0}
    if name == "alibi":
        return {"alibi_slopes": cupy.asarray([2.0 ** -(i + 1) for i in range(heads)], dtype=cupy.float32)}
    return {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=CASES, default="plain")
    ap.add_argument("--head-dim", type=int, default=128, help="d (decode: always 128)")
    ap.add_argument("--seqlen", type=int, default=4096, help="N (decode: the cached keys)")
    ap.add_argument("--dtype", default="bfloat16", help="the inputs' dtype (fp8: always FP8)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--forward-only", action="store_true", help="no backward call")
    ap.add_argument("--batch", type=int, default=64, help="decode only: sequences in the batch")
    ap.add_argument("--kv-heads", type=int, default=8, help="decode only: kv heads under the 32 query heads")
    ap.add_argument("--page", type=int, default=16, help="paged only: the page size")
    args = ap.parse_args()
    import cupy

    if args.case == "paged":
        from rawflash.cli import bench_paged

        call = bench_paged._paged_call(bench_paged._inputs(bench_paged.paged_cases()[0].lengths, args.page))
        for _ in range(4):
            call()
        cupy.cuda.Device().synchronize()
        return

    batch, heads = 16384 // args.seqlen, 2048 // args.head_dim
    if args.case in ("decode", "decode_fp8", "latent"):
        from rawflash.cli import bench_decode

        if args.case == "latent":  # MLA's absorbed decode: 128 heads on one latent cache of 576 / 512, pages of 64
            case = bench_decode.DecodeCase(batch=args.batch, cache=args.seqlen, heads=128, kv_heads=1,
                                           head_dim=576, head_dim_v=512, page=64)
        else:
            case = bench_decode.DecodeCase(batch=args.batch, cache=args.seqlen, heads=32, kv_heads=args.kv_heads,
                                           head_dim=128, kv_dtype=bench.FP8 if args.case == "decode_fp8" else "")
        q, kc, vc, kn, vn, lens, table = bench_decode._inputs(case)
        kc, vc, descales = bench_decode._quantized(case, kc, vc)
        _, public = bench_decode._rawflash(case, q, kc, vc, kn, vn, lens, table, descales=descales)
        for _ in range(4):
            public()
        cupy.cuda.Device().synchronize()
        return
    dtype = bench.FP8 if args.case == "fp8" else args.dtype
    case = bench.Case("rawflash-fa2", "fwd" if args.case == "fp8" else "bwd", dtype, batch, heads, heads,
                      args.seqlen, args.head_dim, args.causal)
    q, k, v, dout = bench.make_inputs(case)
    for _ in range(4):
        if args.case == "fp8":
            rawflash.forward(q, k, v, causal=args.causal, **dout)
            continue
        extra = feature_args(args.case, heads)
        out, lse = rawflash.forward(q, k, v, causal=args.causal, **extra)
        if not args.forward_only:
            rawflash.backward(dout, q, k, v, out, lse, causal=args.causal, **extra)
    cupy.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
