"""Compile every kernel instantiation for this GPU into CuPy's disk cache, in parallel, and report each one that
fails or spills. A contributor runs it first on a fresh GPU machine (``tools/gpu_run.sh`` does), so that tests and
benchmarks do not compile in series at their first call; ``--cuda-dir`` compiles another source folder (as
``RAWFLASH_CUDA_DIR`` selects at run time) before an A/B with tools/ab_sources.py or tools/ab_rows.py. Example:

    python3 tools/precompile.py --filter 'fa3_fwd_sm90<__nv_bfloat16' --cuda-dir my/cuda [--jobs 8]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _compile(item):
    source, expr, target, root = item
    from rawflash.kernels import compile

    t = time.time()
    try:
        fn = compile.get_kernel(source, expr, target, root)
        return expr, fn.num_regs, fn.local_size_bytes, time.time() - t, None
    except Exception as err:  # report and go on: one broken instantiation must not hide the others
        return expr, 0, 0, time.time() - t, str(err)[:2000]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=max(1, mp.cpu_count() - 1), help="compiles side by side")
    ap.add_argument("--filter", default="", help="only the instantiations whose name contains this")
    ap.add_argument("--cuda-dir", default=None, help="another CUDA source folder (default: the installed one)")
    args = ap.parse_args()
    from rawflash.kernels import cupy_backend, forms

    arch = cupy_backend.device_arch()
    root = str(Path(args.cuda_dir).resolve()) if args.cuda_dir else None
    items = [(lau.source, lau.name_expression, lau.target, root) for lau in forms.all_instantiations(arch)
             if args.filter in lau.name_expression]
    t0 = time.time()
    failed = 0
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        for expr, regs, local, secs, err in pool.imap_unordered(_compile, items):
            if err:
                failed += 1
                print(f"FAILED {expr}\n{err}", flush=True)
            elif local:
                print(f"spills {local} B: {expr}", flush=True)
    print(f"precompiled {len(items) - failed}/{len(items)} instantiations in {time.time() - t0:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
