"""Time candidate decode_split tile rows side by side on a GPU: the numbers behind decode's rows in
rawflash/kernels/configs.py. A contributor runs it after a change to the decode kernel or its split model, or on
another GPU, to see whether the row each shape takes today on the GPU at hand (configs.tile_config: a situation's
row, the GPU's configs.GPU_ROWS, else the table's; marked "(today)") is still the fastest; that row is timed even
where it is not a candidate. Each row is validated first (flash-attn's rule against the float64 reference on
reduced cases: contiguous and paged, one and two query rows); PyTorch SDPA's flash and cuDNN backends are timed on
the same contiguous shapes when PyTorch is importable. It prints the GPU that measures (tools/tune_record.py's
header), one table and, where a candidate beats the row the shapes take today (the geometric mean of the model's
split counts' times), the configs.GPU_ROWS (or GPU_SITUATION_ROWS) entry to paste; ``--out FILE`` writes the GPU,
the date, every row's verdict and time and the entries as JSON. ``--splits`` times each row at those split counts
too, beside forms.decode_splits's choice (marked "(model)"). Example:

    python3 tools/tune_decode.py --case h32/1 --br 32 --splits 16,32,64 [--repeats 10] [--dtype float8_e4m3fn]
    python3 tools/tune_decode.py --out tune-decode-h100.json
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tune_record as rec  # noqa: E402  (tools/, this script's folder)
from rawflash import settings, validation  # noqa: E402
from rawflash.cli import bench_decode as bd  # noqa: E402
from rawflash.cli.bench import _torch, time_ms  # noqa: E402
from rawflash.kernels import cupy_backend, forms  # noqa: E402
from rawflash.kernels.configs import FP8, TileConfig  # noqa: E402

CANDIDATES = {
    # the 3-stage rows keep two tiles in flight per warp (16 x 16 x 4 x 3: 100 KB, 2 CTAs per SM; x 2 warps: 52 KB,
    # 4 CTAs); the split count follows each row (forms.decode_splits models its stages and CTAs per SM)
    (128, "bfloat16"): [TileConfig(16, 16, 4, stages=2), TileConfig(16, 16, 4, stages=3),
                        TileConfig(16, 16, 2, stages=3), TileConfig(16, 16, 2, stages=4),
                        TileConfig(16, 32, 2, stages=3), TileConfig(16, 32, 4, stages=3),
                        TileConfig(16, 16, 2, stages=2), TileConfig(16, 16, 8, stages=2),
                        # 32 packed rows, so MQA 32/1 reads its cache once (one row group, and decode_split appends
                        # itself); 255 registers, 24 B spilled after the key loop (offline SASS)
                        TileConfig(32, 16, 4, stages=2), TileConfig(32, 16, 4, stages=3),
                        TileConfig(32, 16, 2, stages=3)],
    (64, "bfloat16"): [TileConfig(32, 32, 4, stages=3), TileConfig(16, 32, 4, stages=2),
                       TileConfig(16, 16, 4, stages=2), TileConfig(32, 16, 4, stages=2),
                       TileConfig(16, 32, 2, stages=3)],
    # FP8 caches (bf16 queries): e4m3 tiles are half the bytes; fewer stages leave room for more CTAs per SM (32 rows
    # need 4 stages: the CTA's merge reuses the ring's bytes)
    (128, FP8): [TileConfig(16, 16, 4, stages=3), TileConfig(16, 16, 4, stages=4), TileConfig(16, 16, 4, stages=6),
                 TileConfig(16, 16, 4, stages=2), TileConfig(16, 32, 4, stages=3), TileConfig(16, 32, 2, stages=4),
                 TileConfig(16, 16, 8, stages=3), TileConfig(32, 16, 4, stages=4)],
}
SHAPES = {128: [bd.DecodeCase(8, 32768), bd.DecodeCase(1, 32768), bd.DecodeCase(64, 4096),
                bd.DecodeCase(8, 32768, page=16), bd.DecodeCase(8, 32768, page=64), bd.DecodeCase(8, 32768, sq=4),
                bd.DecodeCase(8, 32768, 32, 1)],
          64: [bd.DecodeCase(8, 8192, heads=16, kv_heads=16, head_dim=64), bd.DecodeCase(8, 32768, head_dim=64)]}
FP8_SHAPES = [bd.DecodeCase(8, 8192, kv_dtype=FP8), bd.DecodeCase(8, 32768, kv_dtype=FP8),
              bd.DecodeCase(64, 8192, kv_dtype=FP8),
              bd.DecodeCase(1, 131072, kv_dtype=FP8), bd.DecodeCase(8, 32768, page=64, kv_dtype=FP8),
              bd.DecodeCase(8, 32768, 32, 1, kv_dtype=FP8)]


def _shapes(d: int, dtype: str) -> list:
    return FP8_SHAPES if dtype == FP8 else SHAPES[d]


def _key(case) -> tuple[str, int, str]:
    """The override key of a case's row (an FP8 cache's rows are keyed by the cache's dtype)."""
    return ("decode_split", case.head_dim, case.kv_dtype or case.dtype)


def _checked(case, arrays):
    q, kc, vc, kn, vn, lens, table, descales = arrays
    return validation.check_decode(q, kc, vc, lens, kn, vn, table, case.sq > 1, None, "cupy", validation.Features(),
                                   **descales)


def _bound(case, cfg, arrays, splits=None):
    q, kc, vc, kn, vn, lens, table, descales = arrays
    c = _checked(case, arrays)
    override = {_key(case): cfg}
    return cupy_backend.bind_decode(c.problem, q, kc, vc, kn, vn, c.scale, splits, c.extras, settings.load(), override)


def _valid(case, cfg) -> str:
    """The candidate row by bench_decode's validation: contiguous with one query row, paged (16) with two."""
    override = {_key(case): cfg}
    for kind in (dataclasses.replace(case, page=0, sq=1), dataclasses.replace(case, page=16, sq=2)):
        ok, why = bd.validate("rawflash", kind, override)
        if not ok:
            return f"invalid ({kind.name}: {why})"
    return "ok"


def _model_splits(bound) -> str:
    """The split count a bound decode call runs (cupy_backend.bind_decode keeps its DecodePlan), '?' when unbound."""
    return "?" if bound is None else str(bound.plan_info.num_splits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10, help="timed repeats per row (the median)")
    ap.add_argument("--case", default="", help="only the shapes whose name contains this (e.g. 'h32/1': MQA)")
    ap.add_argument("--br", type=int, default=0, help="only the candidates of this many packed rows (and today's)")
    ap.add_argument("--splits", default="", help="comma-separated split counts to time beside the model's choice")
    ap.add_argument("--dtype", default="", help="only the candidates of this dtype (float8_e4m3fn: FP8 caches)")
    ap.add_argument("--out", help="also write the GPU, the date, every row's verdict and time and the entries as JSON")
    args = ap.parse_args()
    import cupy

    gpu_rec = rec.device_record()
    gpu = gpu_rec["gpu"]
    lines, rows = [], []
    groups: dict = {}  # (key, configs entry) -> (today's dict, row -> case -> ms at the model's splits)
    for (d, dtype), cands in CANDIDATES.items():
        if args.dtype and dtype != args.dtype:
            continue
        for case in (c for c in _shapes(d, dtype) if args.case in c.name):
            q, kc, vc, kn, vn, lens, table = bd._inputs(case)
            kc, vc, descales = bd._quantized(case, kc, vc)
            arrays = (q, kc, vc, kn, vn, lens, table, descales)
            today_of = rec.today(*_key(case), forms.situations(_checked(case, arrays).problem), gpu)
            current = today_of["row"]
            _, times = groups.setdefault((_key(case), today_of["entry"], current), (today_of, {}))
            timed = cands if any(rec.same_tile(c, current) for c in cands) else [current, *cands]
            if _torch() is not None and not case.page and not case.kv_dtype:
                for peer in ("torch-flash", "torch-cudnn"):
                    try:
                        ms = time_ms(bd._torch_call(peer, case, *arrays[:3]), repeats=args.repeats)
                        lines.append((case.name, peer, ms, case.bytes_moved() / ms / 1e6, "ok"))
                    except Exception as err:  # a backend PyTorch does not offer for this shape
                        lines.append((case.name, peer, float("nan"), float("nan"),
                                      f"unavailable: {type(err).__name__}"))
            for cfg in (c for c in timed if not args.br or c.br == args.br or rec.same_tile(c, current)):
                is_current = rec.same_tile(cfg, current)
                label = f"br{cfg.br} bc{cfg.bc} w{cfg.warps} s{cfg.stages}" + (" (today)" if is_current else "")
                try:
                    status = _valid(case, cfg)
                except Exception as err:  # a candidate that does not fit (shared memory) is reported
                    status = f"failed: {type(err).__name__}: {str(err)[:80]}"
                for splits in [None] + [int(x) for x in args.splits.split(",") if x]:
                    bound, ms, why = None, float("nan"), status
                    if status == "ok":
                        try:
                            bound = _bound(case, cfg, arrays, splits)
                            ms = time_ms(bound.launch, repeats=args.repeats)
                        except Exception as err:  # e.g. a split count whose grid or work buffers do not fit
                            why = f"failed: {type(err).__name__}: {str(err)[:80]}"
                    shown = f" splits={splits if splits else _model_splits(bound) + ' (model)'}"
                    lines.append((case.name, label + shown, ms, case.bytes_moved() / ms / 1e6, why))
                    value = None if why != "ok" else ms
                    rows.append({**rec.measurement(*_key(case), case.name, cfg, why, value, "ms", is_current),
                                 "splits": splits or _model_splits(bound)})
                    if splits is None:  # (the entry compares the model's split counts)
                        times.setdefault(cfg, {})[case.name] = value
            del arrays
            cupy.get_default_memory_pool().free_all_blocks()
    print(rec.header(gpu_rec))
    print(f"{'case':40s} {'row':46s} {'ms':>8s} {'GB/s':>8s}  status")
    for name, label, ms, gbs, status in lines:
        print(f"{name:40s} {label:46s} {ms:8.4f} {gbs:8.0f}  {status}")
    entries = []
    for (key, _, _), (today_of, times) in groups.items():
        names = _timed_cases(times)
        entries.append(rec.suggestion(key, {r: {n: t.get(n) for n in names} for r, t in times.items()}, today_of,
                                      "ms", gpu, ", ".join(names)))
    rec.finish(gpu_rec, "tools/tune_decode.py", sys.argv[1:], args.out, rows, entries)


def _timed_cases(times: dict) -> list[str]:
    """Every case any row of a group was timed on (a row missing one did not run it)."""
    return list(dict.fromkeys(n for t in times.values() for n in t))


if __name__ == "__main__":
    main()
