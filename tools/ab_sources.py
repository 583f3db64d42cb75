"""Time the same cases under several CUDA source folders in one process, beside cuDNN: the A/B test a contributor
runs on a GPU machine before a kernel change lands. Each folder is what ``RAWFLASH_CUDA_DIR`` would select (a copy
of ``cuda/`` with the change); the first is the baseline (default: the installed sources). Every source is
validated on a reduced case of each kind (``rawflash bench``'s rule against the float64 reference) before it is
timed, and the sources are timed back to back per case (kernels alone: ``Bound.launch``), so clock drift between
them stays small. Example:

    python tools/ab_sources.py --sources cuda,my/cuda [--direction fwd] [--dtype bfloat16]
        [--head-dims 64,128,256] [--seqlens 1024,4096,16384] [--causal both|true|false] [--repeats 5] [--kv-ratio 1]
        [--no-peer] [--out FILE]
    python tools/ab_sources.py --sources ... --decode [--repeats 10]   (rawflash bench --decode --quick's cases:
        ms of the kernels and their share of the device's copy bandwidth; the peer is torch-cudnn)

``--time-invalid`` times a source that fails validation too (its row says so): the ceiling of a change, from a copy
of ``cuda/`` with one part switched off, e.g. the backward's dQ additions (``if (p.scale < -1e30f)`` before them:
the work around them stays, the additions never run) to see what cutting their traffic could give.

Precompile the extra folders first on a GPU machine (``tools/precompile.py --cuda-dir DIR --filter ...``): a
folder's kernels otherwise compile on their first call, in series.

``--trees``: each source is a whole tree instead (a checkout or ``git archive`` with its own ``rawflash/`` and
``cuda/``), for a change to ``launch.py`` too (shared memory, grids: the folders of one process share this tree's
launch.py, and a kernel whose shared memory it sizes differently fails its compile-time check). Each tree is timed
in a process of its own with its ``rawflash`` on PYTHONPATH, cuDNN beside it in each (``torch-cudnn (TREE)``), and
the rows are merged by case: not interleaved case by case, so read each tree against its own cuDNN column. The
child runs the tree's own ``tools/ab_sources.py``; precompile with ``cd TREE && tools/precompile.py``.

    python tools/ab_sources.py --trees --sources my/old-tree,. --direction bwd --head-dims 192
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from rawflash.cli import bench

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sources", default="cuda", help="comma-separated CUDA source folders; the first is the base")
    ap.add_argument("--direction", default="fwd", choices=("fwd", "bwd"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--causal", default="both", choices=("both", "true", "false"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kv-ratio", type=int, default=1, help="query heads per kv head (4: GQA 32 on 8 at d = 64)")
    ap.add_argument("--no-peer", action="store_true", help="skip torch-cudnn")
    ap.add_argument("--out", help="also write the rows as JSON here")
    ap.add_argument("--decode", action="store_true", help="time decode's quick cases instead")
    ap.add_argument("--time-invalid", action="store_true",
                    help="time a source even when it fails validation (a ceiling: a copy with a part switched off; "
                         "not with --decode)")
    ap.add_argument("--trees", action="store_true",
                    help="each source is a whole tree (its own rawflash/ and cuda/), timed in a process of its own")
    args = ap.parse_args()
    sources = [str(Path(s).resolve()) for s in args.sources.split(",")]
    names = [os.path.relpath(s) for s in sources]
    if args.trees:
        if args.decode:
            ap.error("--trees times the FA2 sweep's cases (not --decode)")
        return trees_ab(sources, names, args)
    if args.decode:
        return decode_ab(sources, names, args)
    causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    cases = bench.sweep_cases(["rawflash-fa2"], [args.direction], [args.dtype],
                              [int(x) for x in args.head_dims.split(",")], [int(x) for x in args.seqlens.split(",")],
                              causals, kv_ratio=args.kv_ratio)
    validated: dict = {}
    rows = []
    for case in cases:
        row = dict(direction=case.direction, dtype=case.dtype, head_dim=case.head_dim, seqlen=case.seqlen,
                   causal=case.causal)
        q, k, v, dout = bench.make_inputs(case)
        for src, name in zip(sources, names):
            os.environ["RAWFLASH_CUDA_DIR"] = src  # read by every public call (rawflash.settings)
            key = (src, case.direction, case.dtype, case.head_dim, case.causal)
            if key not in validated:
                try:
                    validated[key] = bench.validate(case)
                except Exception as err:
                    validated[key] = (False, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}")
            ok, why = validated[key]
            if not ok:
                if not args.time_invalid:
                    row[name] = f"invalid: {why}"
                    continue
                row[f"{name} check"] = f"invalid, timed anyway: {why}"
            try:
                row[name] = case.flops / bench.time_ms(bench.bound_call(case, q, k, v, dout).launch,
                                                       args.repeats) / 1e9
            except Exception as err:
                row[name] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
        os.environ.pop("RAWFLASH_CUDA_DIR", None)
        if not args.no_peer and case.dtype != bench.FP8:
            row["torch-cudnn"] = peer_tflops(case, q, k, v, dout, args.repeats)
        del q, k, v, dout
        record_row(rows, row)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(sources=names, rows=rows), indent=1))
    print_table(rows, [*names, "torch-cudnn"], f"TFLOP/s ({args.direction}, {args.dtype})")


CASE_KEYS = ("direction", "dtype", "head_dim", "seqlen", "causal")


def merge_tree_rows(per_tree: dict[str, list[dict]], child_column: str = "cuda") -> list[dict]:
    """The rows of each tree's own process (``per_tree``: tree name -> that child's rows, whose source column is
    ``child_column``) merged by case: the tree's TFLOP/s under its name, its process's cuDNN as ``torch-cudnn
    (NAME)``, in the order the cases first appear."""
    merged: dict[tuple, dict] = {}
    for name, rows in per_tree.items():
        for r in rows:
            row = merged.setdefault(tuple(r[k] for k in CASE_KEYS), {k: r[k] for k in CASE_KEYS})
            row[name] = r.get(child_column, "missing")
            if f"{child_column} check" in r:
                row[f"{name} check"] = r[f"{child_column} check"]
            if "torch-cudnn" in r:
                row[f"torch-cudnn ({name})"] = r["torch-cudnn"]
    return list(merged.values())


def trees_ab(sources: list[str], names: list[str], args) -> None:
    """--trees: each tree's cases in a process of its own (that tree's tools/ab_sources.py on its own cuda/, its
    rawflash on PYTHONPATH), then one table of them all."""
    import subprocess
    import tempfile

    per_tree = {}
    for src, name in zip(sources, names):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            cmd = [sys.executable, str(Path(src) / "tools" / "ab_sources.py"), "--sources", "cuda",
                   "--direction", args.direction, "--dtype", args.dtype, "--head-dims", args.head_dims,
                   "--seqlens", args.seqlens, "--causal", args.causal, "--repeats", str(args.repeats),
                   "--out", str(out)] + (["--no-peer"] if args.no_peer else []) + \
                  (["--time-invalid"] if args.time_invalid else []) + \
                  (["--kv-ratio", str(args.kv_ratio)] if args.kv_ratio != 1 else [])  # (older trees lack it)
            env = {k: v for k, v in os.environ.items() if k != "RAWFLASH_CUDA_DIR"}
            env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            print(f"---- {name} (its own process) ----", flush=True)
            done = subprocess.run(cmd, cwd=src, env=env)
            per_tree[name] = json.loads(out.read_text())["rows"] if out.exists() else []
            if done.returncode:
                print(f"{name}: its process exited {done.returncode}", flush=True)
    rows = merge_tree_rows(per_tree)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(sources=names, trees=True, rows=rows), indent=1))
    peers = [] if args.no_peer else [f"torch-cudnn ({n})" for n in names]
    print_table(rows, [*names, *peers], f"TFLOP/s ({args.direction}, {args.dtype}), one process a tree")


def record_row(rows: list[dict], row: dict) -> None:
    """A case's row done: its inputs' memory back to the pool (the caller has dropped them), the row kept and
    printed as one JSON line."""
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    rows.append(row)
    print(json.dumps({k: (round(x, 1) if isinstance(x, float) else x) for k, x in row.items()}), flush=True)


def peer_tflops(case, q, k, v, dout, repeats: int):
    """torch-cudnn's TFLOP/s on ``case``'s inputs, or why it is unavailable (no PyTorch, no cuDNN attention)."""
    from rawflash.cli import bench

    try:
        peer = dataclasses.replace(case, impl="torch-cudnn")
        return case.flops / bench.time_ms(bench.runner(peer, q, k, v, dout), repeats) / 1e9
    except Exception as err:
        return f"unavailable: {type(err).__name__}"


def print_table(rows: list[dict], cols: list[str], title: str) -> None:
    """One line per case (head_dim, seqlen, causal): each column's TFLOP/s and its ratio to the first column's."""
    print(f"{title}; x: over {cols[0]}")
    print(f"{'d':>4} {'N':>6} {'causal':>6} " + " ".join(f"{c[-18:]:>18}" for c in cols))
    for r in rows:
        base = r.get(cols[0])
        cells = []
        for c in cols:
            x = r.get(c, "-")
            if isinstance(x, float):
                rel = f" {x / base:5.3f}x" if isinstance(base, float) and c != cols[0] else ""
                cells.append(f"{x:.1f}{rel}".rjust(18))
            else:
                cells.append(str(x)[:18].rjust(18))
        print(f"{r['head_dim']:>4} {r['seqlen']:>6} {str(r['causal']):>6} " + " ".join(cells))


def decode_ab(sources: list[str], names: list[str], args) -> None:
    """The A/B of decode: bench_decode's quick cases, each source validated once per kind of case, then its bound
    kernels timed; the share of the copy bandwidth measured in the same run."""
    import cupy

    from rawflash.cli import bench_decode
    from rawflash.cli.bench import time_ms

    roof = bench_decode.copy_bandwidth()
    rows, checked = [], {}
    for case in bench_decode.quick_cases():
        kind = (case.dtype, case.head_dim, case.heads // case.kv_heads, case.page, case.sq)
        row = {"case": case.name}
        inputs = bench_decode._inputs(case)
        for src, name in zip(sources, names):
            os.environ["RAWFLASH_CUDA_DIR"] = src
            if (src, kind) not in checked:
                checked[(src, kind)] = bench_decode.validate("rawflash", case)
            ok, why = checked[(src, kind)]
            if not ok:
                row[name] = f"invalid: {why}"
                continue
            bound, _ = bench_decode._rawflash(case, *inputs)
            row[name] = time_ms(bound.launch, repeats=args.repeats)
        os.environ.pop("RAWFLASH_CUDA_DIR", None)
        if not args.no_peer:
            try:
                q, kc, vc = inputs[:3]
                if case.page:
                    raise ValueError("paged")  # SDPA reads no pages
                row["torch-cudnn"] = time_ms(bench_decode._torch_call("torch-cudnn", case, q, kc, vc),
                                             repeats=args.repeats)
            except Exception as err:
                row["torch-cudnn"] = f"unavailable: {type(err).__name__}"
        del inputs
        cupy.get_default_memory_pool().free_all_blocks()
        row["of_copy"] = {n: case.bytes_moved() / (row[n] * 1e-3) / 1e9 / roof for n in names
                          if isinstance(row.get(n), float)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(sources=names, copy_GBps=roof, rows=rows), indent=1))
    cols = [*names, "torch-cudnn"]
    print(f"decode, ms (share of the copy bandwidth, {roof:.0f} GB/s); x: time of {names[0]} over it")
    print(f"{'case':>42} " + " ".join(f"{c[-22:]:>22}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            x = r.get(c, "-")
            if isinstance(x, float):
                share = f" {r['of_copy'][c]:.2f}" if c in r["of_copy"] else ""
                rel = f" {r[names[0]] / x:5.3f}x" if isinstance(r.get(names[0]), float) and c != names[0] else ""
                cells.append(f"{x:.3f}{share}{rel}".rjust(22))
            else:
                cells.append(str(x)[:22].rjust(22))
        print(f"{r['case']:>42} " + " ".join(cells))


if __name__ == "__main__":
    main()
