"""Time the FP8 forward beside rawflash's bf16 forward on the FA2 paper's sweep (16k tokens, hidden 2048), with
its parts apart: the whole FP8 call (``Bound.launch``: the V^T pre-pass included, the quantisation of 16-bit
inputs not), the V^T pre-pass's share of it, and the quantisation (``fp8.quantize``) timed on its own. CUDA events,
median of --repeats after a warm-up, L2 flushed between repeats; GPU (sm_90) only. A contributor runs it after a
change to the FP8 forward or its pre-passes. It does not validate: ``rawflash bench --dtype float8_e4m3fn``
(``tools/gpu_run.sh fp8``) validates and times the whole call; this says where the time outside the main kernel
goes. One JSON line per case. Example:

    python tools/bench_fp8.py --head-dims 128,256 --seqlens 4096,16384 [--repeats 20]
"""
from __future__ import annotations

import argparse
import json


def _time(fn, repeats: int) -> float:
    """rawflash bench's timer (CUDA events, L2 flushed before each repeat, the median)."""
    from rawflash.cli.bench import time_ms

    return time_ms(fn, repeats=repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", default="64,128,256", help="comma-separated head dims")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384", help="comma-separated sequence lengths")
    ap.add_argument("--repeats", type=int, default=20, help="timed repeats per case (the median)")
    args = ap.parse_args()
    import cupy
    import ml_dtypes

    from rawflash import fp8, settings, validation
    from rawflash.kernels import cupy_backend

    env = settings.load()
    rows = []
    for d in map(int, args.head_dims.split(",")):
        for n in map(int, args.seqlens.split(",")):
            for causal in (False, True):
                b, h = 16384 // n, 2048 // d
                rng = cupy.random.default_rng(0)
                q, k, v = (rng.standard_normal((b, n, h, d), dtype=cupy.float32).astype(ml_dtypes.bfloat16)
                           for _ in range(3))
                c = validation.check_forward(q, k, v, causal, None)
                bf16 = cupy_backend.bind_forward(c.problem, q, k, v, c.scale, extras=c.extras, env=env)
                quant = [fp8.quantize(x, "head") for x in (q, k, v)]
                t_quant = _time(lambda: [fp8.quantize(x, "head", incoherent=x is not v) for x in (q, k, v)], 3)
                c8 = validation.check_forward(*(x for x, _ in quant), causal, None)
                descales = dict(zip(("q_descale", "k_descale", "v_descale"), (d_ for _, d_ in quant)))
                c8, ds = validation.check_fp8(c8, "fa2", "cupy", validation.Features(), descales, None, False)
                f8 = cupy_backend.bind_forward_fp8(c8.problem, *(x for x, _ in quant), c8.scale, ds, env=env)
                vt_only = cupy_backend.Bound(f8.plan[:1], f8.launches[:1], (), env)
                flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
                t16, t8 = _time(bf16.launch, args.repeats), _time(f8.launch, args.repeats)
                tvt = _time(vt_only.launch, args.repeats)
                row = dict(head_dim=d, seqlen=n, causal=causal, bf16_tflops=flops / t16 / 1e9,
                           fp8_tflops=flops / t8 / 1e9, speedup=t16 / t8, vt_prepass_share=tvt / t8,
                           quantize_incoherent_ms=t_quant)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("published: cuDNN 9.19 FP8 forward 1062 TFLOP/s (H200, d=128, 16k); FA3 FP8 1171 (H100, d=256)")


if __name__ == "__main__":
    main()
