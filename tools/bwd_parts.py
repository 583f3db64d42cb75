"""Where a backward call's time goes: each launch of a bound backward (``cupy_backend.Bound``) timed alone, then
the whole ``launch()``, beside torch-cudnn's whole backward in the same process (FA2 sweep shapes: B = 16384 / N,
H = 2048 / d). A contributor runs it on a GPU machine when the backward's side passes (the D pass, the dQ cast,
the zeroing) or its main kernel change, to see each one's share of the call. Times are ``rawflash bench``'s (CUDA
events, L2 flushed, median); a launch timed alone repeats into buffers it already wrote, which changes no
kernel's time. One line per case: the whole call in ms and TFLOP/s, each launch in ms (``zero`` is launch()'s
zeroing of the buffers it resets), the side passes' share of the call (everything but the main kernel), the main
kernel alone in TFLOP/s, and cuDNN's call; with ``--peer-kernels`` also the kernels cuDNN's call is made of
(torch.profiler), to set beside ours. Example:

    python3 tools/bwd_parts.py --head-dims 64,128,256 [--seqlens 1024,2048,4096,16384] [--causal both|true|false]
        [--dtype bfloat16] [--repeats 7] [--no-peer] [--peer-kernels]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", default="64,128", help="comma-separated head dims")
    ap.add_argument("--seqlens", default="1024,2048,4096,16384", help="comma-separated sequence lengths")
    ap.add_argument("--causal", default="both", choices=("both", "true", "false"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=7, help="timed repeats per launch (the median)")
    ap.add_argument("--no-peer", action="store_true", help="skip torch-cudnn")
    ap.add_argument("--peer-kernels", action="store_true",
                    help="also list the kernels torch-cudnn's backward launches, each with its mean time")
    args = ap.parse_args()
    import cupy

    from rawflash.cli import bench
    from rawflash.kernels import cupy_backend

    causals = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    for d in (int(x) for x in args.head_dims.split(",")):
        for n in (int(x) for x in args.seqlens.split(",")):
            for causal in causals:
                case = bench.Case("rawflash-fa2", "bwd", args.dtype, 16384 // n, 2048 // d, 2048 // d, n, d, causal)
                q, k, v, dout = bench.make_inputs(case)
                bound = bench.bound_call(case, q, k, v, dout)
                ok, why = bench.validate(case)
                parts = [("zero", lambda: [x.fill(0) for x in bound.reset])] if bound.reset else []
                parts += [(lau.kernel, lambda lau=lau, a=a: cupy_backend.run(lau, a, bound.env))
                          for lau, a in bound.launches]
                ms = {name: bench.time_ms(fn, args.repeats) for name, fn in parts}
                whole = bench.time_ms(bound.launch, args.repeats)
                main_ms = max(ms.values())
                peer = "-"
                if not args.no_peer:
                    try:
                        pc = bench.Case("torch-cudnn", "bwd", args.dtype, case.batch, case.heads, case.kv_heads, n, d,
                                        causal)
                        cud = bench.time_ms(bench.runner(pc, q, k, v, dout), args.repeats)
                        peer = f"{cud:.3f} ms ({case.flops / cud / 1e9:.0f} TF, ours {cud / whole:.2f}x)"
                        if args.peer_kernels:
                            peer += "\n    cudnn's kernels: " + peer_kernels(bench.runner(pc, q, k, v, dout))
                    except Exception as err:  # noqa: BLE001 (no torch, or no cuDNN backend: say so)
                        peer = f"unavailable ({type(err).__name__})"
                print(f"d={d} N={n} causal={causal}{'' if ok else ' NOT VALIDATED: ' + why}: whole {whole:.3f} ms "
                      f"({case.flops / whole / 1e9:.0f} TF) | " + " ".join(f"{k}={t:.3f}" for k, t in ms.items())
                      + f" | side share {(whole - main_ms) / whole:.1%}"
                      f" | main alone {case.flops / main_ms / 1e9:.0f} TF | cudnn {peer}", flush=True)
                del q, k, v, dout, bound
                cupy.get_default_memory_pool().free_all_blocks()


def peer_kernels(fn, calls: int = 5) -> str:
    """The kernels one call of ``fn`` (a PyTorch peer's backward) launches: name, launches a call and mean time a
    call, longest first, from torch.profiler's CUDA activity (no L2 flush between the calls, unlike time_ms)."""
    import torch
    from torch.profiler import DeviceType, ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels: dict[str, list] = {}  # name -> [launches, microseconds] over all the calls
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:  # device-side activity only (kernels, copies, memsets)
            k = kernels.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.time_range.elapsed_us()
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    return "; ".join(f"{name[:70]} x{n / calls:g} {us / calls / 1000:.3f} ms" for name, (n, us) in rows)


if __name__ == "__main__":
    main()
