"""What tools/tune.py and tools/tune_decode.py record of a run: the GPU that measured (its name, arch, L2 size and the
tuned GPU configs.gpu_name makes of them), each candidate row's verdict and time, the row each case takes today on
that GPU, and, where a candidate beats it, the configs.GPU_ROWS (or GPU_SITUATION_ROWS) entry to paste, with a
``why`` of the measured figures; for the DV form's rows (tools/tune.py --head-dim-v) the configs.VALUE_ROWS entry.
Everything but ``device_record`` runs without a GPU (tests/test_tune_record.py).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import textwrap
from pathlib import Path

from rawflash.kernels import configs
from rawflash.kernels.configs import TileConfig

DEFAULTS = {f.name: f.default for f in dataclasses.fields(TileConfig)}
SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", configs.FP8: "fp8"}


def gpu_record(device: str, arch: str, l2_bytes: int, rows_of: str) -> dict:
    """The GPU that measured: the device's name, arch and L2 size, the tuned GPU they make (configs.gpu_name: whose
    GPU_ROWS an entry goes into) and the tuned GPU whose rows its calls take (RAWFLASH_TILE_GPU may name another)."""
    return {"device": device, "arch": arch, "l2_bytes": l2_bytes, "gpu": configs.gpu_name(arch, l2_bytes),
            "rows of": rows_of}


def device_record() -> dict:
    """``gpu_record`` of the GPU at hand (CuPy's current device)."""
    from rawflash import settings
    from rawflash.cli import sysinfo
    from rawflash.kernels import cupy_backend

    here = sysinfo.current_gpu()
    return gpu_record(here.name, here.arch, cupy_backend._l2_bytes(here.index),
                      cupy_backend.device_gpu(settings.load()))


def header(gpu: dict) -> str:
    """The line a tool prints first: which GPU measures, and whose rows its calls take."""
    line = (f"{gpu['device']} ({gpu['arch']}, L2 {gpu['l2_bytes'] / 2 ** 20:.0f} MB): the {gpu['gpu']}, measuring "
            f"against the rows the {gpu['rows of']} takes today")
    if gpu["rows of"] != gpu["gpu"]:
        line += f" (RAWFLASH_TILE_GPU); entries below are for configs.GPU_ROWS['{gpu['gpu']}']"
    return line


def same_tile(a: TileConfig | None, b: TileConfig | None) -> bool:
    """Whether two rows are the same tile (their ``why`` aside)."""
    return a is not None and b is not None and dataclasses.replace(a, why="") == dataclasses.replace(b, why="")


def tile_label(cfg: TileConfig) -> str:
    """A row's fields other than their defaults, as TileConfig's arguments: '128, 160, 12, stages=2'."""
    named = [f"{k}={v!r}" for k, v in dataclasses.asdict(cfg).items()
             if k not in ("br", "bc", "warps", "why") and v != DEFAULTS[k]]
    return ", ".join([str(cfg.br), str(cfg.bc), str(cfg.warps), *named])


def today(kernel: str, head_dim: int, dtype: str, situations: tuple[str, ...], gpu: str) -> dict:
    """The row a call of ``situations`` takes on ``gpu`` today, and the configs entry a row of that GPU for it
    replaces: ``GPU_ROWS['h100']`` or ``GPU_SITUATION_ROWS['h100']['short_window']``."""
    row = configs.tile_config(kernel, head_dim, dtype, "sm_90", situations=situations, gpu=gpu)
    source, situation = configs.tile_source(kernel, head_dim, dtype, "sm_90", situations, gpu)
    where = f"GPU_SITUATION_ROWS[{gpu!r}][{situation!r}]" if situation else f"GPU_ROWS[{gpu!r}]"
    return {"row": row, "source": source, "situation": situation, "entry": where}


def value_today(key: tuple[str, int, int, str]) -> dict:
    """``today``'s dict for the DV form's row of ``key`` (kernel, head_dim, head_dim_v, dtype as the kernel is
    compiled): configs.VALUE_ROWS' row, which every GPU takes, and the entry a faster row replaces."""
    return {"row": configs.value_row(*key), "source": "VALUE_ROWS", "situation": "", "entry": "VALUE_ROWS"}


def measurement(kernel: str, head_dim: int, dtype: str, case: str, cfg: TileConfig, verdict: str,
                value: float | None, unit: str, today_row: bool, head_dim_v: int = 0) -> dict:
    """One candidate on one case, as the JSON keeps it (``value`` None where the candidate did not run;
    ``head_dim_v`` only for a DV form's row)."""
    return {"kernel": kernel, "head_dim": head_dim, **({"head_dim_v": head_dim_v} if head_dim_v else {}),
            "dtype": dtype, "case": case, "row": tile_label(cfg), "verdict": verdict, "value": value, "unit": unit,
            "today": today_row}


def _speedups(cand: dict, base: dict, unit: str) -> list[float] | None:
    """Per case, how many times faster ``cand`` runs than ``base`` (None unless both ran every case)."""
    if set(cand) != set(base) or any(x is None for x in (*cand.values(), *base.values())):
        return None
    return [cand[c] / base[c] if unit == "TFLOP/s" else base[c] / cand[c] for c in base]


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def best_change(times: dict[TileConfig, dict[str, float | None]], current: TileConfig, unit: str) -> TileConfig | None:
    """The fastest candidate (the geometric mean of its speed-ups over ``current`` on the cases) if it is not
    ``current``'s tile and beats it; None otherwise. ``times``: candidate -> case -> TFLOP/s or ms (None: did not
    run); a candidate that failed a case, or a ``current`` not timed on every case, gives nothing."""
    base = next((t for c, t in times.items() if same_tile(c, current)), None)
    if base is None:
        return None
    ranked = []
    for cand, t in times.items():
        ups = _speedups(t, base, unit)
        if ups is not None and not same_tile(cand, current):
            ranked.append((_geomean(ups), cand))
    best = max(ranked, key=lambda x: x[0], default=None)
    return best[1] if best and best[0] > 1 else None


def figures_why(cand: dict, base: dict, unit: str, gpu: str, dtype: str, cases: str = "") -> str:
    """The ``why`` of a measured entry: up to four cases (named by ``cases``) with their figures against today's
    row's, else the range and geometric mean of the speed-ups (the JSON keeps every figure)."""
    tag = f"({gpu.upper()} {SHORT_DTYPES.get(dtype, dtype)})"
    fmt = (lambda x: f"{x:.0f}") if unit == "TFLOP/s" else (lambda x: f"{x:.4f}")
    if len(base) <= 4:
        ours, theirs = ("/".join(fmt(t[c]) for c in base) for t in (cand, base))
        return f"{cases + ': ' if cases else ''}{ours} vs today's {theirs} {unit} {tag}"
    ups = _speedups(cand, base, unit)
    return f"{_geomean(ups):.2f}x today's row ({min(ups):.2f} - {max(ups):.2f}x) on {len(ups)} cases {tag}"


def entry(key: tuple, cfg: TileConfig, why: str, where: str) -> str:
    """The lines to paste into configs' ``where`` (e.g. GPU_ROWS['h100'], or VALUE_ROWS for a key of (kernel,
    head_dim, head_dim_v, dtype)), why wrapped to fit 120 columns."""
    head = f"    ({', '.join(map(json.dumps, key))}): TileConfig({tile_label(cfg)},"
    pieces = textwrap.wrap(why, 90, drop_whitespace=False) or [""]
    lines = [f"# configs.{where}:", head, f"        why={json.dumps(pieces[0])}"]
    lines += [f"            {json.dumps(p)}" for p in pieces[1:]]
    lines[-1] += "),"
    return "\n".join(lines)


def suggestion(key: tuple, times: dict, today_of: dict, unit: str, gpu: str, cases: str = "") -> dict:
    """The entry for the fastest candidate of ``key`` (configs' key, its dtype last) that differs from the row it
    takes today (``today_of``: ``today``'s or ``value_today``'s dict) and beats it, as {'entry', 'where', 'row',
    'why'}; {} where none does."""
    best = best_change(times, today_of["row"], unit)
    if best is None:
        return {}
    base = next(t for c, t in times.items() if same_tile(c, today_of["row"]))
    why = figures_why(times[best], base, unit, gpu, key[-1], cases)
    return {"where": today_of["entry"], "row": tile_label(best), "why": why,
            "entry": entry(key, best, why, today_of["entry"])}


def report(gpu: dict, tool: str, argv: list[str], rows: list[dict], entries: list[dict]) -> dict:
    """The JSON a tool writes with --out: the GPU, the date, the command, every measurement and the entries."""
    return {"tool": tool, "argv": argv, "date": datetime.date.today().isoformat(), "gpu": gpu, "rows": rows,
            "entries": entries}


def write(path: str, record: dict) -> None:
    Path(path).write_text(json.dumps(record, indent=1, default=str) + "\n")


def finish(gpu: dict, tool: str, argv: list[str], out: str | None, rows: list[dict], entries: list[dict],
           rows_of: str = "") -> None:
    """A tool's last lines: each entry to paste (``suggestion``'s, empty ones left out), or that none beats today's
    rows and the configs table (``rows_of``: the GPU's GPU_ROWS unless given) keeps what it has; and with ``out``,
    the JSON (``report``)."""
    entries = [e for e in entries if e]
    for e in entries:
        print(e["entry"])
    if not entries:
        print(f"no candidate beats the rows the {gpu['gpu']} takes today: "
              f"{rows_of or 'configs.GPU_ROWS[' + repr(gpu['gpu']) + ']'} keeps what it has")
    if out:
        write(out, report(gpu, tool, argv, rows, entries))
