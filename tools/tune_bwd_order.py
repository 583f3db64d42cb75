"""The default FA3 backward's schedule gates on the GPU at hand: 64 or 80 query rows a step under a causal mask, and
key tiles in key order or longest first (configs.Gates), beside PyTorch's cuDNN backend in the same process: the
numbers behind configs.GATES. A contributor runs it on each tuned GPU after a change to the backward's tiles or its
scheduler (cuda/scheduler.cuh), to see where each GPU's gates should sit. Each candidate replaces the GPU's entry in
configs.GATES while it is bound (nothing is left changed); its dQ, dK, dV are checked against the first candidate's
(the same products, summed in another order), then its kernels alone are timed (``bench.time_kernels_ms``: a CUDA
graph replayed back to back), and after them cuDNN's backward as a user calls it (``bench.time_calls_ms``), twice,
the faster kept: one process's cuDNN figure for a shape moved by up to 12 % against another's. The GPU's own gates
are the rows marked "(gates)". The shapes: the FA2 paper's (16k tokens) causal at d = 64 and 128, MHA and GQA 4:1,
and a few with fewer (batch, kv head) pairs. Example:

    python3 tools/tune_bwd_order.py [--head-dims 128] [--seqlens 2048,4096] [--repeats 10] [--out FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NEVER = 1 << 30
# name -> (long_causal_bwd_seqlen, longest_first_ctas): 0 rows = the 80-row tile at every length; 1 CTA = longest
# first wherever the pairs fit the SMs at once
CANDIDATES = {"64 rows, key order": (NEVER, NEVER), "64 rows, longest first": (NEVER, 1),
              "80 rows, key order": (0, NEVER), "80 rows, longest first": (0, 1)}
# (head_dim, seqlen, batch, query heads per kv head): the FA2 sweep's causal shapes, then fewer pairs
SHAPES = [(d, n, 16384 // n, 1) for d in (128, 64) for n in (2048, 4096, 8192, 16384)] + [
    (128, 4096, 4, 4), (128, 2048, 8, 4), (128, 2048, 4, 4), (128, 4096, 2, 1), (128, 4096, 4, 8),
    (128, 8192, 2, 4), (64, 4096, 4, 4), (64, 2048, 8, 4), (64, 8192, 2, 4)]
AGREE = 1e-2  # max |candidate - first| / max |first| of each gradient: the dQ additions' order is all that differs


@contextlib.contextmanager
def gates_of(gpu: str, gates):
    """configs.GATES[gpu] replaced by ``gates`` inside the block."""
    from rawflash.kernels import configs

    saved = configs.GATES[gpu]
    configs.GATES[gpu] = gates
    try:
        yield
    finally:
        configs.GATES[gpu] = saved


def cudnn_tflops(case, inputs: tuple, repeats: int):
    """PyTorch's cuDNN backend on ``case``'s backward, TFLOP/s of its calls back to back; why not, where it fails."""
    from rawflash.cli import bench

    try:
        peer = dataclasses.replace(case, impl="torch-cudnn")
        return case.flops / bench.time_calls_ms(bench.runner(peer, *inputs), repeats) / 1e9
    except Exception as err:  # no PyTorch, or no cuDNN kernel for the case
        return f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"


def main() -> None:
    import cupy
    import numpy as np

    from rawflash import settings
    from rawflash.cli import bench
    from rawflash.kernels import configs, cupy_backend

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", default="64,128", help="comma-separated head dims (of SHAPES)")
    ap.add_argument("--seqlens", default="", help="comma-separated sequence lengths (of SHAPES; default all)")
    ap.add_argument("--repeats", type=int, default=10, help="timed repeats per candidate (the median)")
    ap.add_argument("--out", help="also write the rows as JSON here")
    args = ap.parse_args()
    dims = {int(x) for x in args.head_dims.split(",")}
    lens = {int(x) for x in args.seqlens.split(",")} if args.seqlens else None
    gpu = cupy_backend.device_gpu(settings.load())
    own = configs.gates(gpu)
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}: the {gpu}'s gates, {own.why}")
    rows = []
    for d, n, batch, group in SHAPES:
        if d not in dims or (lens and n not in lens):
            continue
        heads = 2048 // d
        case = bench.Case("rawflash-fa2", "bwd", "bfloat16", batch, heads, heads // group, n, d, True)
        q, k, v, dout = bench.make_inputs(case)
        row = {"head_dim": d, "seqlen": n, "batch": batch, "heads": heads, "kv_heads": heads // group,
               "pairs": batch * heads // group}
        first = None
        candidates = {**{name: dataclasses.replace(own, long_causal_bwd_seqlen=rows_from, longest_first_ctas=ctas)
                         for name, (rows_from, ctas) in CANDIDATES.items()}, "(gates)": own}
        for name, gates in candidates.items():
            with gates_of(gpu, gates):
                bound = bench.bound_call(case, q, k, v, dout)
            bound.launch()
            got = [cupy.asnumpy(g.astype(cupy.float32)) for g in bound.result()]
            if first is None:
                first = got
            worst = max(float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6)) for a, b in zip(got, first))
            if worst > AGREE:
                row[name] = f"disagrees with {next(iter(candidates))!r}: {worst:.2g}"
                continue
            row[name] = case.flops / bench.time_kernels_ms(bound.launch, args.repeats) / 1e9
            del bound
        peer = [cudnn_tflops(case, (q, k, v, dout), args.repeats) for _ in range(2)]
        row["torch-cudnn"] = max(peer, key=lambda x: x if isinstance(x, float) else 0.0)
        cupy.get_default_memory_pool().free_all_blocks()
        rows.append(row)
        peer_tf = row["torch-cudnn"]
        cells = [f"{name} {v:.0f}" + (f" ({v / peer_tf:.3f}x)" if isinstance(peer_tf, float) else "")
                 if isinstance(v, float) else f"{name} {v}" for name, v in row.items() if name in candidates]
        print(f"d {d:3d} N {n:5d} b {batch:2d} {heads:2d}/{heads // group:<2d} ({row['pairs']:3d} pairs) "
              f"cuDNN {peer_tf if isinstance(peer_tf, str) else f'{peer_tf:.0f}'} | " + " | ".join(cells), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": gpu, "gates": dataclasses.asdict(own), "rows": rows},
                                             indent=1))


if __name__ == "__main__":
    main()
