"""Time candidate tile rows of one kernel on a GPU: the numbers behind rawflash/kernels/configs.py's table. A
contributor runs it after a change to a kernel's tiling or shared memory, or on a new GPU, to see whether the
table's row is still the fastest. Each candidate is passed as a tile-row override (nothing in configs.TABLE
changes), validated on a small problem by flash-attn's rule, then its kernels alone are timed (bench.bound_call)
on the FA2 paper's shape (B = 16384 / N, H = 2048 / d), causal off and on. The row the GPU takes today
(configs.tile_config for the GPU at hand: configs.GPU_ROWS, else the table's) is timed too and marked "(current)";
``--features`` times the calls as they run today ("table rows") beside the candidates. The first line names the
GPU that measures (its name, arch, L2 size and the tuned GPU configs.gpu_name makes of them); the last lines give,
where a candidate beats today's row on every case's geometric mean, the configs.GPU_ROWS (or GPU_SITUATION_ROWS)
entry to paste, with the figures as its ``why``. ``--out FILE`` writes it all as JSON (tools/tune_record.py).

``--head-dim-v DV`` times the DV form's rows instead (configs.VALUE_ROWS: MLA's narrower v, read at its own
width): for each --head-dims value d, FA3's forward (fwd_fa3) or backward (bwd_sm90: Hopper's backward, whose DV
form is fa3_bwd_sm90) on DeepSeek-V3-like shapes, the FA2 sweep's B = 16384 / N and H = 2048 / d with v of DV
columns, under RAWFLASH_DV_FORM=1 (both DV forms). The candidates are VALUE_ROWS' row for the pair of head dims as
the kernel is compiled, marked "(current)", and VALUE_CANDIDATES' rows that fit sm_90's 232,448 B of shared memory
with v at its width, each validated as above and checked to run the DV form; where one beats the current row, the
last lines give the configs.VALUE_ROWS entry to paste (DV a multiple of 8, at most each d; --features is refused).
Example:

    python3 tools/tune.py --which fwd_fa3 --head-dims 128 --seqlen 2048,8192
    python3 tools/tune.py [--seqlen 4096] [--dtype bfloat16] [--head-dims 64,128] \\
        [--which fwd,bwd,fwd_sm90,fwd_fa3,bwd_sm90,fwd_fp8]
    python3 tools/tune.py --which fwd_fa3 --head-dims 128 --features window,dense   # bench --features' cases
    python3 tools/tune.py --which fwd_fp8 --head-dims 128 --features window,dense   # (the FP8 forward's ones)
    python3 tools/tune.py --which fwd_fa3 --head-dims 64,128,256 --seqlen 2048,8192 --out tune-fa3-h100.json
    python3 tools/tune.py --which fwd_fa3,bwd_sm90 --head-dims 192 --head-dim-v 128 --seqlen 4096,8192  # MLA
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tune_record as rec  # noqa: E402  (tools/, this script's folder)
from rawflash.cli import bench, occupancy  # noqa: E402
from rawflash.kernels import configs, forms, launch  # noqa: E402
from rawflash.kernels.configs import TileConfig  # noqa: E402
from rawflash.problem import Problem  # noqa: E402

CANDIDATES = {
    ("fa2_fwd", 64): [TileConfig(128, 64, 4, kunroll=k) for k in (1, 2, 4)]
    + [TileConfig(128, 128, 4, kunroll=k) for k in (1, 2)]
    + [TileConfig(64, 64, 4, kunroll=2), TileConfig(128, 64, 4, min_blocks=2, kunroll=2)],
    ("fa2_fwd", 128): [TileConfig(128, 32, 4, kunroll=k) for k in (1, 2, 4)]
    + [TileConfig(128, 64, 4, kunroll=k) for k in (1, 2)]
    + [TileConfig(64, 64, 4, kunroll=2), TileConfig(64, 32, 4, kunroll=2)],
    ("fa2_bwd", 64): [TileConfig(64, 128, 8, kunroll=k) for k in (1, 2, 4)] + [TileConfig(32, 128, 8, kunroll=2),
                                                                             TileConfig(64, 64, 4, kunroll=2)],
    ("fa2_bwd", 128): [TileConfig(32, 128, 8, kunroll=k) for k in (1, 2, 4)] + [TileConfig(64, 128, 8, kunroll=1),
                                                                              TileConfig(32, 64, 4, kunroll=2)],
    ("fa2_fwd_sm90", 64): [TileConfig(64, 128, 4, min_blocks=2), TileConfig(64, 128, 4, min_blocks=3),
                           TileConfig(128, 128, 8), TileConfig(192, 128, 12)],
    ("fa2_fwd_sm90", 128): [TileConfig(128, 128, 8), TileConfig(192, 64, 12), TileConfig(64, 96, 4, min_blocks=2),
                            TileConfig(128, 96, 8)],
    ("fa2_fwd_sm90", 256): [TileConfig(128, 64, 8), TileConfig(64, 64, 4), TileConfig(128, 32, 8)],
    ("fa3_fwd_sm90", 64): [TileConfig(128, 128, 12, stages=2), TileConfig(192, 128, 16, stages=2),
                           TileConfig(128, 176, 12, stages=2), TileConfig(192, 96, 16, stages=2),
                           TileConfig(128, 128, 12, stages=3), TileConfig(192, 128, 16, stages=3),
                           TileConfig(192, 128, 16, stages=2, q_stages=2)],
    ("fa3_fwd_sm90", 128): [TileConfig(128, 128, 12, stages=2), TileConfig(128, 176, 12, stages=2),
                            TileConfig(128, 160, 12, stages=2), TileConfig(128, 112, 12, stages=2),
                            TileConfig(128, 128, 12, stages=3), *forms.FA3_TILE_CANDIDATES[128]],
    ("fa3_fwd_sm90", 256): [TileConfig(128, 80, 12, stages=2), TileConfig(128, 64, 12, stages=2)],
    ("fa3_fwd_sm90", 512): [*forms.FA3_TILE_CANDIDATES[512]],  # beside the column split's 64 x 32 in two stages
    # FP8: a key block is whole 64- or 128-byte panels of V^T (Bc a multiple of 64: hopper.cuh's Sw64x8 / Sw128x8);
    # 128 x 256 and 192 x 128 are not candidates: they spill 288 B (offline compile).
    ("fa3_fwd_sm90_fp8", 128): [TileConfig(128, 128, 12, stages=3), *forms.FP8_TILE_CANDIDATES,
                                TileConfig(128, 192, 12, stages=3, q_stages=2)],
    ("fa3_fwd_sm90_fp8", 256): [TileConfig(128, 128, 12, stages=2), TileConfig(128, 128, 12, stages=2, q_stages=2)],
    # float32 (the FMA path): the rows with and without the 3 CTAs per SM that min_blocks asks for
    ("fa2_fwd", 64, "float32"): [TileConfig(64, 32, 4), TileConfig(64, 32, 4, min_blocks=3)],
    ("fa2_bwd", 32, "float32"): [TileConfig(32, 64, 4), TileConfig(32, 64, 4, min_blocks=3)],
    ("fa2_bwd_sm90", 64): [TileConfig(64, 128, 8)],
    ("fa2_bwd_sm90", 128): [TileConfig(64, 128, 8)],
}
# --which value -> (tile-row kernel, bench implementation that runs it)
WHICH = {"fwd": ("fa2_fwd", "rawflash-fa2-mma"), "bwd": ("fa2_bwd", "rawflash-fa2"),
         "fwd_sm90": ("fa2_fwd_sm90", "rawflash-fa2-wgmma"), "fwd_fa3": ("fa3_fwd_sm90", "rawflash-fa2"),
         "bwd_sm90": ("fa2_bwd_sm90", "rawflash-fa2"), "fwd_fp8": ("fa3_fwd_sm90_fp8", "rawflash-fa2")}
DTYPE_OF = {"fwd_fp8": configs.FP8}  # the rows' dtype where it is not --dtype

# --head-dim-v: --which value -> the kernel whose DV form's rows (configs.VALUE_ROWS) it times
VALUE_WHICH = {"fwd_fa3": "fa3_fwd_sm90", "bwd_sm90": "fa3_bwd_sm90"}
SMEM_LIMIT = occupancy.ARCHS["sm_90"].smem_per_block_optin  # 232,448 B: a CTA's shared memory on sm_90
# The DV form's candidate rows beside VALUE_ROWS' own, keyed (kernel, head_dim, head_dim_v) as the kernel is compiled;
# the bytes (launch.smem_fa3_fwd_sm90 / smem_fa3_bwd_sm90 with v at its width) follow each row. Each compiles
# offline (NVRTC 13.0, sm_90a, bfloat16, plain policy, full and causal) at 168 registers without a spill. Forward
# 192 / 128: 128 rows by 96 or 112 keys in 2 stages, and 96 keys with 2 Q_i buffers; 160 keys (255,072 B), 128 keys
# with 2 Q_i buffers (263,280 B) and 96 keys in 3 stages (234,624 B) do not fit. Forward 128 / 64: 128, 160 and
# 192 keys, and 160 or 176 with 2 Q_i buffers. Backward 192 / 128, the column split: 64 x 64 is its one tile (its
# static_assert) and `stages` counts its Q_i stages (dO_i has one of its own): 3 fit. Backward 128 / 64: 3 stages
# of Q_i and dO_i, and the 80-row tile (SWAP_DQ; the deterministic form keeps 64 rows: forms.ordered_dq_config).
VALUE_CANDIDATES: dict[tuple[str, int, int], list[TileConfig]] = {
    ("fa3_fwd_sm90", 192, 128): [TileConfig(128, 96, 12, stages=2),  # 173,152 B
                                 TileConfig(128, 112, 12, stages=2),  # 193,632 B
                                 TileConfig(128, 96, 12, stages=2, q_stages=2)],  # 222,320 B
    ("fa3_fwd_sm90", 128, 64): [TileConfig(128, 128, 12, stages=2),  # 132,192 B
                                TileConfig(128, 160, 12, stages=2),  # 156,768 B
                                TileConfig(128, 192, 12, stages=2),  # 181,344 B
                                TileConfig(128, 160, 12, stages=2, q_stages=2),  # 189,552 B
                                TileConfig(128, 176, 12, stages=2, q_stages=2)],  # 201,840 B
    ("fa3_bwd_sm90", 192, 128): [TileConfig(64, 64, 12, stages=3)],  # 232,040 B
    ("fa3_bwd_sm90", 128, 64): [TileConfig(64, 128, 12, stages=3),  # 223,800 B
                                TileConfig(80, 128, 12, stages=2)],  # 194,856 B
}


def value_key(kernel: str, head_dim: int, head_dim_v: int, dtype: str) -> tuple[str, int, int, str]:
    """configs.VALUE_ROWS' key for a call's head dims: the pair as the FA3 forms compile them (launch.tma_head_dim,
    tma_value_head_dim)."""
    p = Problem(1, 1, 1, 1, 1, head_dim, dtype, False, "sm_90", head_dim_v=head_dim_v)
    return kernel, launch.tma_head_dim(p), launch.tma_value_head_dim(p), dtype


def value_smem(kernel: str, cfg: TileConfig, head_dim: int, head_dim_v: int) -> int:
    """The shared memory of ``kernel``'s DV form with row ``cfg`` (compiled head dims)."""
    if kernel == "fa3_fwd_sm90":
        return launch.smem_fa3_fwd_sm90(cfg, head_dim, dv=head_dim_v)
    return launch.smem_fa3_bwd_sm90(cfg, head_dim, head_dim_v)


def value_candidates(key: tuple[str, int, int, str]) -> list[TileConfig]:
    """The rows --head-dim-v times for ``key`` (``value_key``'s): VALUE_ROWS' row first, then VALUE_CANDIDATES'
    others that fit ``SMEM_LIMIT``."""
    kernel, d, dv, _ = key
    current = configs.value_row(*key)
    return [current] + [c for c in VALUE_CANDIDATES.get((kernel, d, dv), [])
                        if not rec.same_tile(c, current) and value_smem(kernel, c, d, dv) <= SMEM_LIMIT]


def value_args_error(which: list[str], dims: list[int], head_dim_v: int, dtype: str, features: str) -> str:
    """What is wrong with --head-dim-v's arguments ('' if nothing): v's columns a multiple of 8 and at most each
    head_dim, --which of VALUE_WHICH, no --features, and a configs.VALUE_ROWS row for every kernel and pair."""
    if head_dim_v <= 0 or head_dim_v % 8 or any(head_dim_v > d for d in dims):
        return (f"--head-dim-v must be a positive multiple of 8 and at most each --head-dims value; got {head_dim_v} "
                f"with --head-dims {','.join(map(str, dims))}")
    if any(w not in VALUE_WHICH for w in which):
        return f"--head-dim-v times the DV rows of --which {', '.join(VALUE_WHICH)} only; got {','.join(which)}"
    if features:
        return "--head-dim-v times the FA2 sweep's shapes; it takes no --features"
    for w, d in itertools.product(which, dims):
        try:
            key = value_key(VALUE_WHICH[w], d, head_dim_v, dtype)
        except ValueError as err:  # (a head_dim past the largest specialised one)
            return str(err)
        if configs.value_row(*key) is None:
            pairs = sorted({(k[1], k[2]) for k in configs.VALUE_ROWS if k[0] == key[0]}, reverse=True)
            dtypes = sorted({k[3] for k in configs.VALUE_ROWS if k[0] == key[0]})
            return (f"configs.VALUE_ROWS has no {key[0]} row for head_dim {d} / head_dim_v {head_dim_v} in {dtype} "
                    f"(compiled {key[1]} / {key[2]}); it has {', '.join(f'{a} / {b}' for a, b in pairs)} "
                    f"({', '.join(dtypes)})")
    return ""


def valid(case: bench.Case, override: dict) -> str:
    """flash-attn's rule on a small problem run with the candidate; for a DV form's row (a key of VALUE_ROWS' four
    parts) also that the call ran that kernel's DV form with it."""
    small = dataclasses.replace(case, batch=1, heads=2, kv_heads=2, seqlen=381)
    q, k, v, dout = bench.make_inputs(small, seed=3)
    bound = bench.bound_call(small, q, k, v, dout, override)
    for (kernel, *_), row in ((key, row) for key, row in override.items() if len(key) == 4):
        if not any(lau.kernel == kernel and forms.reads_value_head_dim(lau) and rec.same_tile(lau.config, row)
                   for lau, _ in bound.launches):
            return f"invalid: the call did not run {kernel}'s DV form with this row"
    bound.launch()
    got = bound.result()
    if case.dtype == configs.FP8:  # the FP8 bounds against the reference of the dequantised inputs
        ok, why = bench._validate_fp8(small, q, k, v, dout, got)
        return "ok" if ok else f"invalid: {why}"
    return _rule(case.direction, case.causal, got, q, k, v, dout, {})


def _rule(direction: str, causal: bool, got, q, k, v, dout, feats: dict) -> str:
    """``bench.rule_verdict`` for a bound call's result against the float64 reference of the same inputs and feature
    arguments."""
    host = {n: x.get() if hasattr(x, "get") else x for n, x in feats.items()}
    hq, hk, hv, hdo = (x.get() for x in (q, k, v, dout))
    fwd = direction == "fwd"
    ok, why = bench.rule_verdict(got[0] if fwd else got, hq, hk, hv, None if fwd else hdo, causal=causal, **host)
    return "ok" if ok else f"invalid: {why}"


def valid_feature(case: bench.FeatureCase, override: dict) -> str:
    """flash-attn's rule on a small problem with ``case``'s features (one sequence of 381, 2 heads) run with the
    candidate; FP8 cases by the FP8 forward's bounds against the reference of the dequantised inputs."""
    small = bench.FeatureCase(case.name, case.direction, 1, 381, 2, case.head_dim, case.causal,
                              tuple((n, (64, 0) if n == "window" else x) for n, x in case.opts), switches=case.switches,
                              dtype=case.dtype)
    q, k, v, dout, feats = bench._feature_inputs(small)
    bound = bench.feature_bound(small, q, k, v, dout, feats, override)
    bound.launch()
    if case.dtype == configs.FP8:
        return _fp8_rule(small, bound.result(), q, k, v, feats)
    return _rule(case.direction, case.causal, bound.result(), q, k, v, dout, feats)


def _fp8_rule(case: bench.FeatureCase, got, q, k, v, feats: dict) -> str:
    """bench.fp8_rule with the case's window and sinks (per-tensor descales: no packed sequences here)."""
    host = {n: (feats[n].get() if hasattr(feats[n], "get") else feats[n]) for n in ("window", "sinks") if n in feats}
    ok, why = bench.fp8_rule(q, k, v, feats, got, causal=case.causal, **host)
    return "ok" if ok else f"invalid: {why}"


def _failure(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"


def tune_features(kernel: str, dims: list[int], prefixes: list[str], direction: str, gpu: str, rows: list[dict],
                  entries: list[dict]) -> None:
    """Each candidate row on bench --features' cases whose names start with one of ``prefixes`` (bfloat16, or the
    FP8 forward's cases for its kernel; kernels alone), validated first on a small problem with the same
    features, beside the calls as they run today; measurements go to ``rows``, the entries that beat today's rows
    on ``gpu`` (one per row the cases take today: the table's, or a situation's) to ``entries``."""
    dtype = configs.FP8 if kernel == WHICH["fwd_fp8"][0] else "bfloat16"
    for d in dims:
        key = (kernel, d, dtype)
        cases = [c for c in bench.feature_cases(d, dtype) if c.name.startswith(tuple(prefixes))
                 and c.direction == direction]
        inputs = {}  # each case's arrays, made once for all the candidates
        times: dict = {}  # row -> case -> TFLOP/s
        todays = {}  # case -> tune_record.today's dict
        for cand in [None] + CANDIDATES.get(key, CANDIDATES.get((kernel, d), [])):
            override = None if cand is None else {key: cand}
            label = "table rows" if cand is None else (f"Br={cand.br} Bc={cand.bc} warps={cand.warps} "
                                                       f"st={cand.stages} qst={cand.q_stages}")
            for case in cases:
                tf = None
                try:
                    status = valid_feature(case, override)
                    if status == "ok":
                        if case.name not in inputs:
                            inputs[case.name] = bench._feature_inputs(case)
                        bound = bench.feature_bound(case, *inputs[case.name], override)
                        if cand is None:
                            todays[case.name] = rec.today(kernel, d, dtype, forms.situations(bound.problem), gpu)
                        ms = bench.time_ms(bound.launch, repeats=10)
                        tf = case.flops / (ms * 1e-3) / 1e12
                        status = f"{tf:.0f} TFLOP/s ({ms:.4f} ms)"
                except Exception as err:  # a candidate that does not compile or fit is reported, not fatal
                    status = _failure(err)
                row = todays[case.name]["row"] if cand is None and case.name in todays else cand
                if row is not None:
                    times.setdefault(row, {})[case.name] = tf
                    rows.append(rec.measurement(kernel, d, dtype, case.name, row, "ok" if tf else status, tf,
                                                "TFLOP/s", cand is None))
                print(f"{case.direction} d={d} {case.name}: {label}: {status}", flush=True)
        for where in {t["entry"] for t in todays.values()}:  # one entry per row the cases take today
            names = [n for n, t in todays.items() if t["entry"] == where]
            today_of = todays[names[0]]
            if any(not rec.same_tile(todays[n]["row"], today_of["row"]) for n in names):
                continue  # (one entry serves one row)
            sub = {r: {n: t.get(n) for n in names} for r, t in times.items()}
            entries.append(rec.suggestion(key, sub, today_of, "TFLOP/s", gpu, ", ".join(names)))


def _n(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", default="4096", help="one or more, comma-separated")
    ap.add_argument("--dtype", default="bfloat16", help="the rows' dtype (fwd_fp8 always times FP8 rows)")
    ap.add_argument("--head-dims", default="64,128", help="comma-separated head dims")
    ap.add_argument("--head-dim-v", type=int, help="v's head_dim (MLA; a multiple of 8, at most each "
                    "head dim): time the DV form's rows (configs.VALUE_ROWS) of --which fwd_fa3,bwd_sm90")
    ap.add_argument("--which", default="fwd,bwd", help=f"comma-separated, of {', '.join(WHICH)}")
    ap.add_argument("--features", default="", help="comma-separated prefixes of bench --features' case names "
                    "(e.g. window,dense): time the candidates on those cases instead of the FA2 sweep's shapes")
    ap.add_argument("--out", help="also write the GPU, the date, every measurement and the entries as JSON here")
    args = ap.parse_args()
    dims = [int(x) for x in args.head_dims.split(",")]
    if args.head_dim_v is not None:
        why = value_args_error(args.which.split(","), dims, args.head_dim_v, args.dtype, args.features)
        if why:
            ap.error(why)
        os.environ["RAWFLASH_DV_FORM"] = "1"  # (both DV forms; the forward's alone by default)
    gpu_rec = rec.device_record()
    gpu = gpu_rec["gpu"]
    print(rec.header(gpu_rec), flush=True)
    rows: list[dict] = []
    entries: list[dict] = []
    if args.head_dim_v is not None:
        tune_values(args, dims, gpu, rows, entries)
    elif args.features:
        for which in args.which.split(","):
            tune_features(WHICH[which][0], dims, args.features.split(","), which.split("_")[0], gpu, rows, entries)
    else:
        tune_sweep(args, dims, gpu, rows, entries)
    rec.finish(gpu_rec, "tools/tune.py", sys.argv[1:], args.out, rows, entries,
               "" if args.head_dim_v is None else "configs.VALUE_ROWS")


def time_rows(key: tuple, cands: list[TileConfig], current: TileConfig, lengths: list[int], case_of,
              rows: list[dict]) -> dict:
    """Each of ``cands`` (as the override {key: candidate}) on ``case_of(n, causal)`` for each n of ``lengths``,
    full and causal, validated first, then its kernels alone timed (bench.run_case); measurements go to ``rows``.
    Returns candidate -> case -> TFLOP/s (None: did not run)."""
    kernel, d, dtype, dv = key[0], key[1], key[-1], key[2] if len(key) == 4 else 0
    times: dict = {}
    for cand in cands:
        override = {key: cand}
        for n, causal in itertools.product(lengths, (False, True)):
            case = case_of(n, causal)
            try:
                status = valid(case, override)
                run = bench.run_case(case, 10, {}, override, check=lambda _: (True, "ok")) \
                    if status == "ok" else None  # (valid() checked the candidate)
                tf = run.kernel_tflops if run else None
                status = run.status if run else status
            except Exception as err:  # a candidate that does not compile or fit is reported, not fatal
                tf, status = None, _failure(err)
            is_current = rec.same_tile(cand, current)
            times.setdefault(cand, {})[f"N={n} causal={causal}"] = tf
            rows.append(rec.measurement(kernel, d, dtype, f"N={n} causal={causal}", cand, "ok" if tf else status, tf,
                                        "TFLOP/s", is_current, dv))
            dims = f"d={case.head_dim}{f' dv={case.dv}' if dv else ''}"
            print(f"{case.direction} {dims} N={n} causal={causal!s:5} Br={cand.br} "
                  f"Bc={cand.bc} warps={cand.warps} minB={cand.min_blocks} ku={cand.kunroll} st={cand.stages} "
                  f"qst={cand.q_stages}: {'%.0f TFLOP/s' % tf if tf else status}{'  (current)' if is_current else ''}",
                  flush=True)
    return times


def tune_sweep(args, dims: list[int], gpu: str, rows: list[dict], entries: list[dict]) -> None:
    """Each candidate row (and the row ``gpu`` takes today) on the FA2 paper's shapes at ``args.seqlen``, full and
    causal, validated first; measurements go to ``rows``, an entry that beats today's row to ``entries``."""
    lengths = [int(x) for x in args.seqlen.split(",")]
    for which in args.which.split(","):
        (kernel, impl), direction = WHICH[which], which.split("_")[0]
        dtype = DTYPE_OF.get(which, args.dtype)
        for d in dims:
            key = (kernel, d, dtype)
            if configs.TABLE.get(key) is None:
                continue
            today_of = rec.today(kernel, d, dtype, (), gpu)
            current = today_of["row"]
            cands = CANDIDATES.get((kernel, d, dtype), CANDIDATES.get((kernel, d), []))
            if not any(rec.same_tile(c, current) for c in cands):
                cands = [current, *cands]
            times = time_rows(key, cands, current, lengths, lambda n, causal: bench.Case(
                impl, direction, dtype, 16384 // n, 2048 // d, 2048 // d, n, d, causal), rows)
            cases = f"N {'/'.join(map(_n, lengths))} full/causal"
            entries.append(rec.suggestion(key, times, today_of, "TFLOP/s", gpu, cases))


def tune_values(args, dims: list[int], gpu: str, rows: list[dict], entries: list[dict]) -> None:
    """The DV form's rows (``value_candidates``, VALUE_ROWS' row marked current) on DeepSeek-V3-like shapes at
    ``args.seqlen``: the FA2 sweep's B = 16384 / N and H = 2048 / d, v of ``args.head_dim_v`` columns, full and
    causal, validated first; measurements go to ``rows``, a VALUE_ROWS entry that beats the current row to
    ``entries``."""
    lengths, dv = [int(x) for x in args.seqlen.split(",")], args.head_dim_v
    for which in args.which.split(","):
        kernel, direction = VALUE_WHICH[which], which.split("_")[0]
        for d in dims:
            key = value_key(kernel, d, dv, args.dtype)
            today_of = rec.value_today(key)
            times = time_rows(key, value_candidates(key), today_of["row"], lengths, lambda n, causal: bench.Case(
                "rawflash-fa2", direction, args.dtype, 16384 // n, 2048 // d, 2048 // d, n, d, causal,
                head_dim_v=dv), rows)
            cases = f"N {'/'.join(map(_n, lengths))} full/causal"
            entries.append(rec.suggestion(key, times, today_of, "TFLOP/s", gpu, cases))


if __name__ == "__main__":
    main()
