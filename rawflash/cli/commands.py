"""The ``rawflash`` command line: what every launch does, and how fast it is.

Commands stay short: the numbers come from ``introspect`` (targets, launches, occupancy, bytes, dry runs),
``sysinfo``, ``variants``, ``accuracy``, ``ablation``, ``demo`` and ``bench``; every report is a dict that prints
either as text (``report.render``) or, with ``--json``, as JSON.

One vocabulary: ``--gpu`` names the target everywhere a target matters (an arch, or a GPU model that implies its
arch, SM count, shared memory and peaks), the shape options are the same on every command that takes a shape,
``--causal/--no-causal`` is the mask everywhere, and every command takes ``--json``.

Exit status: 0 done; 1 it ran but failed (a grade failed, the driver disagreed) or cannot run here (no GPU, a
backend or tool missing); 2 invalid input (a bad option, or a call the API would refuse). Messages name the
option, never show a traceback (``RAWFLASH_DEBUG=1`` shows the traceback of an unexpected error), and with
``--json`` errors are JSON too: ``{"error": ..., "exit_code": ...}`` on stdout.
"""
from __future__ import annotations

import csv
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path

import click

from .. import settings, validation
from ..kernels import compile, configs, registry
from ..problem import Problem
from . import accuracy, introspect, sysinfo
from . import bench as bench_mod
from . import report as report_mod

DIRECTIONS = click.Choice(["fwd", "bwd", "both"])
EXIT_FAILED = 1
EXIT_INVALID = 2  # what click gives a bad option (click.UsageError.exit_code)
SIMULATOR_SHAPE = dict(batch=1, seqlen_q=32, heads=2, head_dim=32)
"""``check --backend numba`` without a GPU: a shape Numba's CPU simulator finishes in seconds."""
SIMULATOR_WARN_S = 30.0
"""Warn (with the estimate) before a simulator run estimated to take longer than this."""


class _Group(click.Group):
    """Turns an unexpected exception into a one-line error (exit 1) unless RAWFLASH_DEBUG is set, and prints
    every error as JSON when the command line has ``--json``."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as err:
            if settings.load().debug:
                raise
            raise click.ClickException(f"{type(err).__name__}: {err}\n(set RAWFLASH_DEBUG=1 for the traceback)")

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        argv = list(sys.argv[1:] if args is None else args)
        if not standalone_mode or "--json" not in argv:
            return super().main(args=argv, prog_name=prog_name, complete_var=complete_var,
                                standalone_mode=standalone_mode, **extra)
        try:
            code = super().main(args=argv, prog_name=prog_name, complete_var=complete_var, standalone_mode=False,
                                **extra)
        except click.ClickException as err:
            command = next((a for a in argv if not a.startswith("-")), "")
            click.echo(json.dumps({"error": err.format_message(), "exit_code": err.exit_code, "command": command},
                                  indent=1))
            sys.exit(err.exit_code)
        except click.Abort:
            click.echo(json.dumps({"error": "aborted", "exit_code": EXIT_FAILED}))
            sys.exit(EXIT_FAILED)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]},
             epilog="Exit status: 0 done, 1 failed or cannot run here, 2 invalid input. Every command takes --json "
                    "(errors too); --gpu names the target (an arch or a GPU model) wherever one matters.")
@click.version_option(package_name="rawflash")
def main():
    """rawflash: FlashAttention as raw CUDA C kernels, with the numbers that explain them."""
    compile.progress = _step  # slow compiles say so on stderr


# ---------------------------------------------------------------- shared options and helpers
SHAPE_NAMES = ("batch", "seqlen_q", "seqlen_k", "heads", "kv_heads", "head_dim", "dtype", "causal", "window",
               "softcap", "alibi", "sinks", "varlen", "head_dim_v")


def _csv_lengths(ctx, param, text):
    """``--varlen 256,1024,...`` as a tuple of ints >= 0 (None when not given)."""
    if not text:
        return None
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise click.BadParameter(f"a comma-separated list of lengths, got {text!r}") from None
    if any(v < 0 for v in values):
        raise click.BadParameter(f"lengths must be >= 0, got {text!r}")
    return values


def shape_options(batch=4, seqlen=2048, heads=16, head_dim=128, dtype="bfloat16", causal=False, kernel=False,
                  backend=False, min_size=1, simulator=None):
    """The shape of a call as options; the command receives them as one ``spec`` (an ``introspect.ShapeSpec``).

    ``simulator``: other defaults for batch, seqlen_q, heads and head_dim when the command runs ``--backend numba``
    on Numba's CPU simulator (no GPU); options the user gives always win.
    """
    size = click.IntRange(min=min_size)
    defaults = dict(batch=batch, seqlen_q=seqlen, heads=heads, head_dim=head_dim)

    def shown(name):
        if simulator:
            return dict(default=None, help=f"[default: {defaults[name]}; {simulator[name]} with --backend numba and "
                                           "no GPU]")
        return dict(default=defaults[name], show_default=True)

    options = [
        click.option("--batch", type=size, **shown("batch")),
        click.option("--seqlen-q", type=size, **shown("seqlen_q")),
        click.option("--seqlen-k", type=size, default=None, help="Key length  [default: --seqlen-q]"),
        click.option("--heads", type=size, **shown("heads")),
        click.option("--kv-heads", type=size, default=None, help="Key/value heads (GQA/MQA)  [default: --heads]"),
        click.option("--head-dim", type=click.IntRange(min=1), **shown("head_dim")),
        click.option("--head-dim-v", type=click.IntRange(min=1), default=None,
                     help="v's head_dim (MLA's head_dim_v, at most --head-dim)  [default: --head-dim]"),
        click.option("--dtype", type=click.Choice(configs.DTYPES), default=dtype, show_default=True),
        click.option("--causal/--no-causal", default=causal, show_default=True,
                     help="Bottom-right aligned causal mask."),
        click.option("--window", type=(int, int), default=(-1, -1), show_default=True, metavar="LEFT RIGHT",
                     help="Sliding window: keys within LEFT before and RIGHT after the diagonal (-1: unbounded)."),
        click.option("--softcap", type=click.FloatRange(min=0), default=0.0, show_default=True,
                     help="Soft-capping c: scores become c * tanh(s / c) (0: off)."),
        click.option("--alibi/--no-alibi", default=False, help="ALiBi slopes, one per head."),
        click.option("--sinks/--no-sinks", default=False, help="Attention sinks, one logit per head."),
        click.option("--varlen", callback=_csv_lengths, default=None, metavar="N1,N2,...",
                     help="Packed variable-length sequences of these lengths (queries and keys alike); --batch, "
                          "--seqlen-q and --seqlen-k then do not apply."),
    ]
    if kernel:
        options.append(click.option("--kernel", type=click.Choice(validation.KERNELS), default="fa2",
                                    show_default=True, help="Forward kernel (the backward is always fa2)."))
    if backend:
        options.append(click.option("--backend", type=click.Choice(validation.BACKENDS), default="cupy",
                                    show_default=True))

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(**kw):
            values = {n: kw.pop(n) for n in SHAPE_NAMES}
            if simulator:
                on_simulator = kw.get("backend") == "numba" and not sysinfo.gpu_available()
                for name, value in (simulator if on_simulator else defaults).items():
                    if values[name] is None:
                        values[name] = value
            return fn(spec=introspect.ShapeSpec(**values), **kw)

        for option in reversed(options):
            wrapper = option(wrapper)
        return wrapper

    return decorate


json_option = click.option("--json", "as_json", is_flag=True, help="Print the report (or the error) as JSON.")


def target_options(sms: bool = False):
    """--gpu (the target: an arch or a GPU model), the hidden deprecated --arch, and --sms where waves are counted."""

    def decorate(fn):
        if sms:
            fn = click.option("--sms", type=click.IntRange(min=1), default=None,
                              help="SMs for wave counts  [default: the target's]")(fn)
        else:
            fn = _no_sms(fn)
        fn = click.option("--arch", type=click.Choice(sorted(introspect.occupancy.ARCHS)), default=None, hidden=True,
                          help="Deprecated: use --gpu.")(fn)
        return click.option("--gpu", type=click.Choice(introspect.target_names(), case_sensitive=False),
                            default=None, metavar="GPU",
                            help="Target: an arch (" + ", ".join(sorted(introspect.occupancy.ARCHS)) + ") or a model ("
                                 + ", ".join(introspect.MODELS) + "), which sets its arch, SMs, shared memory and "
                                 "peaks  [default: the GPU here, else H200]")(fn)

    return decorate


def _no_sms(fn):
    @functools.wraps(fn)
    def wrapper(**kw):
        return fn(sms=None, **kw)

    return wrapper


def _target(gpu: str | None, arch: str | None, sms: int | None) -> introspect.Target:
    if arch is not None:
        _step("warning: --arch is deprecated; use --gpu (it takes an arch or a GPU model)")
        if gpu is not None and gpu != arch:
            raise click.UsageError(f"--arch {arch} and --gpu {gpu} disagree: give --gpu only")
        gpu = arch
    return introspect.target(gpu, sms)


def _emit(report: dict, as_json: bool, hide: tuple[str, ...] = ()) -> None:
    if as_json:
        click.echo(json.dumps(report, indent=1, default=str))
    else:
        click.echo(report_mod.render(_blank_notes(report), hide))


def _blank_notes(value):
    """For text: a table row without a note prints an empty note cell, not '-' (which means 'no value, see note')."""
    if isinstance(value, dict):
        return {k: _blank_notes(v) for k, v in value.items()}
    if isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
        if any("note" in r for r in value):
            return [{**r, "note": r.get("note", "")} for r in value]
    return value


def _enable_simulator() -> None:
    """The command line's own process runs the Numba twins on the CPU simulator (read once, at numba's import)."""
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


def _step(message: str) -> None:
    click.echo(message, err=True)


def _problem(spec: introspect.ShapeSpec, tgt: introspect.Target | None = None, **call) -> Problem:
    """The validated problem (for the target's tile rows, gates and kernels when given), or the API's own error
    message as a usage error (exit 2)."""
    try:
        p = introspect.validate(spec, **call).problem
    except (TypeError, ValueError) as err:
        raise click.UsageError(f"rawflash would refuse this call: {err}")
    return dataclasses.replace(p, arch=tgt.arch, gpu=tgt.tuning) if tgt else p


def _require_gpu(command: str, instead: str) -> None:
    if not sysinfo.gpu_available():
        raise click.ClickException(f"{command} needs a CUDA GPU and none is visible (cupy.cuda.is_available() is "
                                   f"False); {instead}")


def _rows_with_progress(items: list, fn, label: str, show=None) -> list:
    if len(items) <= 3:
        return [fn(x) for x in items]
    with click.progressbar(items, label=label, file=sys.stderr, item_show_func=show) as bar:
        return [fn(x) for x in bar]


def _shape_text(p: Problem) -> str:
    return (f"batch {p.batch}, seqlen_q {p.seqlen_q}, seqlen_k {p.seqlen_k}, heads {p.heads}, kv_heads {p.kv_heads}, "
            f"head_dim {p.head_dim}{f', head_dim_v {p.head_dim_v}' if p.head_dim_v else ''}, {p.dtype}, "
            f"{'causal' if p.causal else 'non-causal'}")


def _csv_ints(ctx, param, text: str) -> list[int]:
    """Click callback: comma-separated positive integers."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise click.BadParameter(f"expected comma-separated positive integers, got {text!r}")
    return values


def _causal_modes(causal: bool | None) -> list[bool]:
    return [False, True] if causal is None else [causal]


def _grade_notes(rows: list[dict]) -> list[dict]:
    for r in rows:
        if r.get("ratio") is None:
            introspect.add_note(r, "ratio: the same-precision baseline's error is 0")
    return rows


# ---------------------------------------------------------------- info, list
@main.command()
@json_option
def info(as_json):
    """GPUs, CUDA driver / runtime / NVRTC, library versions, the kernel cache and the compile-report cache."""
    _emit(sysinfo.summary(), as_json)


@main.command("list")
@target_options()
@json_option
def list_(gpu, arch, sms, as_json):
    """The variant registry, the tile rows and gates the target uses, and which calls have no tile that fits it. On
    a Hopper target each row says which tuned GPU's measurement chose it: the GPU's own rows (configs.GPU_ROWS) are
    marked, the rest are the table's."""
    tgt = _target(gpu, arch, sms)
    hopper = tgt.arch == "sm_90"
    _emit({"target": tgt.description,
           "variants": {v.name: _variant_entry(v) for v in registry.REGISTRY.values()},
           "tiles": _tile_rows(tgt.arch, tgt.tuning),
           **({f"tiles of the {tgt.tuning}": _own_rows_summary(tgt.tuning)} if hopper else {}),
           **({f"tiles of situations on the {tgt.tuning}": _situation_rows(tgt.tuning)}
              if hopper and configs.GPU_SITUATION_ROWS[tgt.tuning] else {}),
           **({"tiles of MLA's narrower v (head_dim / head_dim_v)": _value_rows()} if hopper else {}),
           **({f"gates of the {tgt.tuning}": _gates(tgt.tuning),
               f"gates of the {tgt.tuning}, chosen by": configs.gates(tgt.tuning).why} if hopper else {}),
           f"no tile fits {tgt.arch}'s shared memory for": introspect.unfit_summary(tgt.arch)
           if tgt.arch in introspect.occupancy.ARCHS else "unknown (no occupancy rules for this arch)"}, as_json)


def _form_key(v: registry.Variant, f: registry.Form) -> str:
    """A form's name in the report: its template, and its mainloop where the variant has two forms of one template
    (decode_split's latent cache on wgmma)."""
    return f.kernel if [x.kernel for x in v.forms].count(f.kernel) == 1 else f"{f.kernel} ({f.mainloop})"


def _variant_entry(v: registry.Variant) -> dict:
    return {"source": f"cuda/{v.source}", "direction": v.direction, "api": f"kernel={v.api_kernel!r}",
            "paper algorithm": v.paper_algorithm, "warp partition": v.warp_partition,
            "forms": {_form_key(v, f): f"{f.arch}+, cuda/{f.source} with "
                      + " or ".join(f"cuda/{m}" for m in f.mainloops) for f in v.forms},
            "helpers": [h.kernel for h in v.helpers],
            "supports": list(v.supports),
            "numba twin": f"{v.numba_factory} in {v.numba_module}" + ("" if v.has_numba_twin() else " (absent)")}


def _gates(gpu: str) -> list[dict]:
    """configs.GATES' entry for ``gpu`` as rows: each gate, its value and what it gates."""
    g = configs.gates(gpu)
    what = {"long_bwd_seqlen": "query rows from which the backward takes the 80-row tile (no mask)",
            "long_causal_bwd_seqlen": "... causal",
            "longest_first_ctas": "CTAs per (batch, kv head) at once for the backward's key tiles longest first"}
    return [{"gate": name, "value": getattr(g, name), "gates": text} for name, text in what.items()]


def _tile_rows(arch: str, gpu: str = configs.DEFAULT_GPU) -> list[dict]:
    """The rows of configs.TABLE as ``arch`` and the tuned GPU ``gpu`` read them (configs.tile_config; the wgmma
    rows on sm_90 only), with rows that differ only in head_dim or dtype merged. Each says which of configs' tables
    gave it ("from") and, on sm_90, which tuned GPU's measurement chose it (configs.chosen_on)."""
    merged: dict = {}
    for (kernel, d, dtype) in configs.TABLE:
        if kernel.endswith("_sm90") and arch != "sm_90":
            continue
        cfg = configs.tile_config(kernel, d, dtype, arch, gpu=gpu)
        origin = (configs.tile_source(kernel, d, dtype, arch, gpu=gpu)[0],
                  configs.chosen_on(kernel, d, dtype, gpu) if arch == "sm_90" else "")
        merged.setdefault((kernel, cfg, origin, dtype), []).append(d)
    rows: dict = {}
    for (kernel, cfg, origin, dtype), dims in merged.items():
        rows.setdefault((kernel, cfg, origin, tuple(dims)), []).append(dtype)
    return [_tile_entry(kernel, ",".join(map(str, dims)), ",".join(dtypes), cfg, origin)
            for (kernel, cfg, origin, dims), dtypes in rows.items()]


def _tile_entry(kernel: str, head_dims: str, dtypes: str, cfg: configs.TileConfig, origin: tuple[str, str]) -> dict:
    """One row of ``rawflash list``'s tiles: the TileConfig's fields, where it comes from and what chose it."""
    source, chosen_on = origin
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("br", "bc", "why")}
    return {"kernel": kernel, "head_dims": head_dims, "dtypes": dtypes, "Br": cfg.br, "Bc": cfg.bc, **fields,
            "threads": cfg.threads, "from": source, **({"chosen on": f"the {chosen_on}"} if chosen_on else {}),
            "why": cfg.why}


def _own_rows_summary(gpu: str) -> str:
    """How many of ``gpu``'s rows are its own (configs.GPU_ROWS, GPU_SITUATION_ROWS) and where the rest come from."""
    own = len(configs.GPU_ROWS[gpu]) + sum(map(len, configs.GPU_SITUATION_ROWS[gpu].values()))
    return (f"{own} row(s) of its own (configs.GPU_ROWS / GPU_SITUATION_ROWS['{gpu}'], chosen on the {gpu}); the "
            f"rest are the table's, chosen on the {configs.DEFAULT_GPU} unless a row's 'chosen on' says otherwise")


def _situation_rows(gpu: str) -> list[dict]:
    """configs.GPU_SITUATION_ROWS[gpu], one entry per (situation, row)."""
    return [{"situation": name, **_tile_entry(kernel, str(d), dtype, cfg, ("GPU_SITUATION_ROWS", gpu))}
            for name, rows in configs.GPU_SITUATION_ROWS[gpu].items() for (kernel, d, dtype), cfg in rows.items()]


def _value_rows() -> list[dict]:
    """configs.VALUE_ROWS (FA3's DV form), dtypes merged."""
    rows: dict = {}
    for (kernel, d, dv, dtype), cfg in configs.VALUE_ROWS.items():
        rows.setdefault((kernel, d, dv, cfg), []).append(dtype)
    return [_tile_entry(kernel, f"{d} / {dv}", ",".join(dtypes), cfg, ("VALUE_ROWS", ""))
            for (kernel, d, dv, cfg), dtypes in rows.items()]


# ---------------------------------------------------------------- launch-config, occupancy
@main.command("launch-config")
@shape_options(kernel=True)
@click.option("--direction", type=DIRECTIONS, default="fwd", show_default=True)
@click.option("--deterministic", is_flag=True, help="Backward without atomics (adds the fa2_bwd_dq pass).")
@target_options(sms=True)
@json_option
def launch_config(spec, kernel, direction, deterministic, gpu, arch, sms, as_json):
    """Every launch of a call on the target: instantiation, tiles, grid, block, shared memory, CTAs, skipped tiles
    and waves."""
    tgt = _target(gpu, arch, sms)
    p = _problem(spec, tgt, kernel=kernel, direction=direction, deterministic=deterministic)
    launches = introspect.launches(p, kernel, direction, deterministic)
    rows = _rows_with_progress(launches, lambda dl: introspect.launch_config_row(p, *dl, tgt), "compiling",
                               lambda dl: dl and dl[1].kernel)
    _emit({"shape": _shape_text(p), "target": tgt.description, "launches": rows,
           "notes": ["tiles, skipped: (Q block, K block) tiles over all (batch, head), causal skipping from iomodel",
                     "ctas_per_sm: rawflash.cli.occupancy with the compiled register count; "
                     "waves = CTAs / (ctas_per_sm * SMs)"]
           + (["naive: the two cuBLAS products are not listed"] if kernel == "naive" else [])},
          as_json)


@main.command("occupancy")
@shape_options(kernel=True)
@click.option("--direction", type=DIRECTIONS, default="fwd", show_default=True)
@click.option("--deterministic", is_flag=True, help="Backward without atomics (adds the fa2_bwd_dq pass).")
@click.option("--all", "every", is_flag=True,
              help="Every instantiation of the target's tile rows for --dtype and --causal/--no-causal (shape "
                   "ignored).")
@target_options()
@json_option
@click.pass_context
def occupancy_cmd(ctx, spec, kernel, direction, deterministic, every, gpu, arch, sms, as_json):
    """Registers, shared memory, spills and resident CTAs per SM on the target; on a GPU, the driver's count beside
    ours."""
    tgt = _target(gpu, arch, sms)
    if every:
        launches = introspect.instantiations(spec.dtype, spec.causal, tgt.arch)
        what = f"every {spec.dtype} {'causal' if spec.causal else 'non-causal'} instantiation"
    else:
        p = _problem(spec, tgt, kernel=kernel, direction=direction, deterministic=deterministic)
        launches = [lau for _, lau in introspect.launches(p, kernel, direction, deterministic)]
        what = _shape_text(p)
    rows = _rows_with_progress(launches, lambda lau: introspect.occupancy_row(lau, tgt), "compiling",
                               lambda lau: lau and lau.kernel)
    checks = introspect.occupancy_checks(rows, tgt)
    _emit({"for": what, "target": tgt.description, "occupancy": rows, "checks": checks}, as_json)
    if checks.get("calculator != driver", "none") != "none":
        ctx.exit(EXIT_FAILED)


# ---------------------------------------------------------------- io, explain
@main.command("io")
@shape_options()
@target_options()
@click.option("--measure", is_flag=True, help="Also measure DRAM bytes with ncu (GPU and ncu needed).")
@click.option("--breakdown", is_flag=True, help="Print each term of the byte counts.")
@json_option
@click.pass_context
def io_cmd(ctx, spec, gpu, arch, sms, measure, breakdown, as_json):
    """Predicted HBM bytes, FLOPs, intensity and roofline bound of naive, fa1 and fa2, forward and backward, with
    the tiles they run with on the target."""
    tgt = _target(gpu, arch, sms)
    p = _problem(spec, tgt)
    rows = introspect.io_rows(p, tgt)
    problem = _measure(p, rows) if measure else None
    report = {"shape": _shape_text(p), "target": tgt.description, "io": rows, "roofline": introspect.roofline_note(tgt)}
    if tgt.peaks is not None:
        report["peaks"] = (f"{tgt.peaks.tensor_tflops:g} TFLOP/s tensor, {tgt.peaks.fp32_tflops:g} float32, "
                           f"{tgt.peaks.hbm_tbps:g} TB/s")
    if breakdown:
        report["breakdown (bytes)"] = {f"{r['kernel']} {r['dir']}": r["breakdown_bytes"] for r in rows}
    if problem:
        report["measure"] = f"not measured: {problem}"
    _emit(report, as_json, hide=("breakdown_bytes",))
    if problem:
        ctx.exit(EXIT_FAILED)


def _measure(p: Problem, rows: list[dict]) -> str | None:
    """Add ncu's DRAM bytes to the rows that rawflash runs; returns why it could not, if it could not."""
    from . import ncu

    try:
        ncu.require()
    except ncu.Unavailable as err:
        return str(err)
    for row in rows:
        if not row["runs"].startswith("rawflash"):
            continue
        _step(f"ncu: {row['kernel']} {row['dir']}")
        got = ncu.measure(p, row["kernel"], row["dir"])
        row.update(measured_read_MB=got["read_bytes"] / 1e6, measured_write_MB=got["write_bytes"] / 1e6,
                   measured_over_predicted=(got["read_bytes"] + got["write_bytes"]) /
                   ((row["read_MB"] + row["write_MB"]) * 1e6))
    for row in rows:
        if "measured_read_MB" not in row:
            introspect.add_note(row, "not measured: rawflash does not run it")
    return None


@main.command()
@shape_options(kernel=True, backend=True, min_size=0)
@click.option("--scale", type=float, default=None, help="Softmax scale  [default: 1/sqrt(head_dim)]")
@click.option("--direction", type=DIRECTIONS, default="both", show_default=True)
@click.option("--deterministic", is_flag=True)
@click.option("--decode", is_flag=True,
              help="Explain rawflash.decode instead: --seqlen-q query rows per sequence against caches of --seqlen-k "
                   "keys each (its num_splits and split plan included).")
@click.option("--page-size", type=click.IntRange(min=0), default=0, show_default=True,
              help="With --decode: a paged cache of this page size (0: contiguous). With --varlen and --direction "
                   "fwd: a paged forward (block_table), each sequence's keys in pages of this size.")
@click.option("--new-keys", type=click.IntRange(min=0), default=1, show_default=True,
              help="With --decode: keys appended before attending (k_new / v_new rows).")
@click.option("--num-splits", type=click.IntRange(min=1), default=None,
              help="With --decode: the split count asked for  [default: the heuristic's]")
@click.option("--fp8-cache", is_flag=True,
              help="With --decode: a float8_e4m3fn cache (read as K8 * k_descale, V8 * v_descale) for the 16-bit q.")
@target_options(sms=True)
@json_option
@click.pass_context
def explain(ctx, spec, kernel, backend, scale, direction, deterministic, decode, page_size, new_keys, num_splits,
            fp8_cache, gpu, arch, sms, as_json):
    """Dry run of a call on the target: the API's verdict (or its exact error), variant, launches (the CUDA C
    kernels', the Numba twins' with --backend numba, none with --backend reference), bytes, time bound. With
    --decode: rawflash.decode's launches and split plan (num_splits).

    Nothing is launched and no GPU is needed. Exits 2 when the API would refuse the call.
    """
    tgt = _target(gpu, arch, sms)
    if decode:
        report = introspect.explain_decode(spec, page_size=page_size, new_keys=new_keys, num_splits=num_splits,
                                           backend=backend, scale=scale, tgt=tgt, fp8_cache=fp8_cache)
    else:
        if num_splits is not None or fp8_cache:
            raise click.UsageError("--num-splits and --fp8-cache go with --decode")
        if page_size:
            if not spec.varlen or direction != "fwd":
                raise click.UsageError("--page-size without --decode is a paged forward: it goes with --varlen and "
                                       "--direction fwd (backward takes no paged keys)")
            spec = dataclasses.replace(spec, page_size=page_size)
        report = introspect.explain(spec, kernel=kernel, backend=backend, scale=scale, direction=direction,
                                    deterministic=deterministic, tgt=tgt)
    _emit(report, as_json)
    if not report["valid"]:
        ctx.exit(EXIT_INVALID)


# ---------------------------------------------------------------- check, ablate, demo
@main.command()
@shape_options(batch=1, seqlen=256, heads=4, head_dim=64, kernel=True, backend=True, simulator=SIMULATOR_SHAPE)
@click.option("--scale", type=float, default=None, help="Softmax scale  [default: 1/sqrt(head_dim)]")
@click.option("--deterministic", is_flag=True)
@click.option("--seed", type=int, default=0, show_default=True)
@json_option
@click.pass_context
def check(ctx, spec, kernel, backend, scale, deterministic, seed, as_json):
    """Run forward and backward on this shape and grade out, lse, dq, dk, dv against the float64 reference.

    Without a GPU, --backend reference runs NumPy and --backend numba the Numba twins on Numba's CPU simulator (a
    smaller default shape; a larger one is estimated and warned about first).
    """
    p = _problem(spec, kernel=kernel, backend=backend, scale=scale, direction="both", deterministic=deterministic)
    if accuracy.reference_bytes(p) > accuracy.REFERENCE_BUDGET:
        raise click.UsageError(f"the float64 reference of this shape needs about "
                               f"{accuracy.reference_bytes(p) / 2**30:.0f} GiB; pick a smaller shape")
    try:
        where = accuracy.prepare_backend(backend, _enable_simulator)
    except accuracy.Unavailable as err:
        raise click.ClickException(str(err))
    _step(where)
    simulated = backend == "numba" and not sysinfo.gpu_available()
    estimate = _simulator_preflight(p, kernel, deterministic) if simulated else None
    try:
        rows = accuracy.check(p, kernel=kernel, backend=backend, scale=scale, deterministic=deterministic, seed=seed,
                              step=_step)
    except ImportError as err:
        raise click.ClickException(f"backend {backend!r} could not be loaded: {err}; install it with "
                                   "pip install 'rawflash[numba]' (from a clone: pip install -e '.[numba]')")
    finally:
        if simulated:
            _simulator_progress(None)
    ok = all(r["ok"] for r in rows)
    report = {"ran": where, "shape": _shape_text(p), "forward kernel": kernel, "backward": "fa2",
              "grades": _grade_notes(rows),
              "rule": "max|ours - ref| <= factor * max|base - ref| + floor (flash-attn's; base = naive attention in "
                      "the input precision)", "verdict": "passed" if ok else "FAILED"}
    if estimate is not None:
        report["simulator estimate"] = f"{estimate:.0f} s"
    _emit(report, as_json, hide=("ok",))
    if not ok:
        ctx.exit(EXIT_FAILED)


def _simulator_preflight(p: Problem, kernel: str, deterministic: bool) -> float | None:
    """Estimate the simulator's time (warn when long) and switch its per-launch progress lines on."""
    try:
        estimate = introspect.simulator_seconds(p, kernel, deterministic)
    except ImportError:  # numba missing: accuracy.check says so
        return None
    if estimate > SIMULATOR_WARN_S:
        default = introspect.ShapeSpec(**SIMULATOR_SHAPE, seqlen_k=None, kv_heads=None, dtype=p.dtype,
                                       causal=p.causal)
        base = introspect.simulator_seconds(_problem(default), kernel, deterministic)
        _step(f"warning: Numba's CPU simulator needs about {_duration(estimate)} for this shape (estimated from its "
              f"threads and products; the default --backend numba shape takes about {_duration(base)}); Ctrl-C "
              "stops it")
    else:
        _step(f"simulator: about {_duration(estimate)} (estimate)")
    _simulator_progress(_SimulatorProgress())
    return estimate


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _simulator_progress(callback) -> None:
    """Set (or clear) the Numba backend's progress callback; nothing to do when it could not be imported."""
    try:
        from ..kernels import numba_backend
    except ImportError:
        return
    numba_backend.simulator_progress = callback


class _SimulatorProgress:
    """Lines on stderr while the simulator runs: each launch, its CTAs every few seconds, and its time."""

    EVERY_S = 5.0

    def __init__(self):
        self.last = 0.0

    def __call__(self, event: str, info: dict) -> None:
        now = time.perf_counter()
        if event == "start":
            self.last = now
            _step(f"  simulating {info['kernel']}: {info['ctas']} CTA(s) of {info['threads']} threads")
        elif event == "cta" and now - self.last >= self.EVERY_S and info["done"] < info["ctas"]:
            self.last = now
            _step(f"    {info['kernel']}: {info['done']}/{info['ctas']} CTAs after {info['elapsed_s']:.0f} s")
        elif event == "done":
            _step(f"    {info['kernel']}: {info['elapsed_s']:.1f} s")


@main.command()
@click.option("--dtype", type=click.Choice(configs.DTYPES), default="bfloat16", show_default=True)
@click.option("--head-dims", default="64,128", show_default=True, callback=_csv_ints)
@click.option("--seqlens", default="1024,4096", show_default=True, callback=_csv_ints)
@click.option("--causal/--no-causal", default=False, show_default=True, help="Bottom-right aligned causal mask.")
@click.option("--repeats", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--ladder", is_flag=True, help="The climb from standard attention to FlashAttention-3 instead: naive, "
                                             "fa1, FA2's ideas one at a time, wgmma, FA3's ideas (ladder.json, "
                                             "ladder.png).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="bench/results", show_default=True)
@json_option
@click.pass_context
def ablate(ctx, dtype, head_dims, seqlens, causal, repeats, ladder, out_dir, as_json):
    """FA2 forward with each of its three ideas off alone, and all three off (B = 16384/N, H = 2048/d). GPU only.

    --ladder: every rung of rawflash.cli.ablation.LADDER on the same shapes, each validated, then timed, with its
    speedup over the rung below and the HBM bytes 'rawflash io' predicts for it. Without a GPU it prints the rungs and
    the predicted bytes, writes nothing and exits 1 (timing needs a GPU).
    """
    from . import ablation

    if ladder:
        _ladder(ctx, ablation, dtype, head_dims, seqlens, causal, repeats, Path(out_dir), as_json)
        return
    cases = ablation.cases(dtype, head_dims, seqlens, causal)
    _require_gpu("ablate", "'rawflash launch-config' and 'rawflash io' show the launches and bytes without one")
    with click.progressbar(length=len(cases), label=f"{len(cases)} cases", file=sys.stderr) as bar:
        rows = ablation.run(cases, repeats, step=lambda _: bar.update(1))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablation.json").write_text(json.dumps(rows, indent=1))
    plot = ablation.plot(rows, out / "ablation.png")
    for r in rows:
        if r["ms"] is None:
            introspect.add_note(r, f"not timed: {r['status']}")
        elif r["x_fa2"] is None:
            introspect.add_note(r, "x_fa2: full fa2 was not timed at this shape")
    _emit({"ablation": rows, "wrote": [str(out / "ablation.json"),
                                        str(plot) if plot else "no plot: matplotlib is not installed"]}, as_json)


def _ladder(ctx, ablation, dtype, head_dims, seqlens, causal, repeats, out: Path, as_json) -> None:
    """ablate --ladder: predictions everywhere; validation, timing, ladder.json and ladder.png on a GPU."""
    cases = ablation.ladder_cases(dtype, head_dims, seqlens, causal)
    rungs = {r.name: {"runs": r.call, "changes": r.changes, "paper": r.claim} for r in ablation.LADDER}
    gpu = sysinfo.gpu_available()
    if gpu:
        with click.progressbar(length=len(cases), label=f"{len(cases)} rungs x shapes", file=sys.stderr) as bar:
            rows = ablation.run_ladder(cases, repeats, step=lambda _: bar.update(1))
    else:
        rows = ablation.run_ladder(cases, None)
    for r in rows:
        if r["ms"] is None:
            introspect.add_note(r, r["status"])
        elif r["x_below"] is None:
            introspect.add_note(r, "x_below: no rung below was timed at this shape")
        if r["hbm_MB"] is not None and r["kernel"] == "naive_softmax" and dtype == "bfloat16":
            introspect.add_note(r, "hbm_MB leaves out the float32 copies of its bfloat16 products")
    report = {"rungs": rungs, "ladder": rows}
    if not gpu:
        report["timing"] = ("not timed: needs a CUDA GPU and none is visible (cupy.cuda.is_available() is False); "
                            "the bytes are rawflash io's predictions for each rung's own tiles")
        _emit(report, as_json, hide=("status",))
        ctx.exit(EXIT_FAILED)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ladder.json").write_text(json.dumps(rows, indent=1))
    plot = ablation.plot_ladder(rows, out / "ladder.png")
    report["wrote"] = [str(out / "ladder.json"), str(plot) if plot else "no plot: matplotlib is not installed"]
    _emit(report, as_json, hide=("status",))


@main.command()
@target_options()
@json_option
@click.pass_context
def demo(ctx, gpu, arch, sms, as_json):
    """Forward and backward checked and timed on a GPU; without one, the Numba twins on the CPU simulator and the
    launch and occupancy report from an offline compile for the target (--gpu, default H200)."""
    from . import demo as demo_mod

    if sysinfo.gpu_available():
        if gpu or arch:
            _step("note: --gpu only chooses the offline report's target without a GPU; this runs on the GPU here")
        report, ok = demo_mod.gpu_demo(_step)
    else:
        report, ok = demo_mod.cpu_demo(_step, _target(gpu, arch, sms))
    for key in ("grades", "simulator grades"):
        if key in report:
            _grade_notes(report[key])
    _emit(report, as_json, hide=("ok",))
    if not ok:
        ctx.exit(EXIT_FAILED)


# ---------------------------------------------------------------- bench
@main.command()
@click.option("--impl", "impls", multiple=True, type=click.Choice(bench_mod.IMPLS),
              help="Implementations to time (default: every one available here).")
@click.option("--direction", "directions", multiple=True, type=click.Choice(["fwd", "bwd"]), default=("fwd", "bwd"))
@click.option("--dtype", "dtypes", multiple=True,
              type=click.Choice(["bfloat16", "float16", "float32", "float8_e4m3fn"]),
              default=("bfloat16",))
@click.option("--head-dims", default="64,128,256", show_default=True, callback=_csv_ints)
@click.option("--seqlens", default="512,1024,2048,4096,8192,16384", show_default=True, callback=_csv_ints)
@click.option("--causal/--no-causal", default=None, help="Bottom-right aligned causal mask  [default: both]")
@click.option("--kv-ratio", type=click.IntRange(min=1), default=1, show_default=True,
              help="Query heads per kv head (4 = GQA 32 on 8 at d=64).")
@click.option("--tokens", type=click.IntRange(min=1), default=16384, show_default=True,
              help="batch * seqlen of every case.")
@click.option("--hidden", type=click.IntRange(min=1), default=2048, show_default=True,
              help="heads * head_dim of every case.")
@click.option("--repeats", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="bench/results", show_default=True)
@click.option("--tag", default="", help="Suffix of the output file names.")
@click.option("--features", is_flag=True,
              help="Time the features instead (windows, varlen, soft-capping, ALiBi, sinks: bf16, d = 128, each "
                   "beside the case its target compares with; --direction picks the forward or backward cases; "
                   "--dtype float8_e4m3fn adds the FP8 forward's cases, beside bf16's when both are given).")
@click.option("--decode", is_flag=True,
              help="Time decode instead (a KV-cache step: bandwidth beside a device copy and PyTorch's SDPA): "
                   "batch 1/8/64 x context 1k-128k x GQA 32/8, 64/8, MQA x contiguous and paged 16/64/256; "
                   "--dtype float8_e4m3fn: FP8 caches, each beside its bf16 cache; --mla: the latent cache "
                   "(MLA's absorbed decode, 576 / 512, 128 heads on one kv head).")
@click.option("--quick", is_flag=True, help="With --decode: a subset of 12 cases (about 2 minutes on an H200).")
@click.option("--paged", is_flag=True,
              help="Time a paged prefill instead (forward with block_table: 16 sequences of 256 - 8192 tokens, pages "
                   "of 64 and 16, bf16, causal, d = 128, GQA 32/8) beside the same call on contiguous keys and "
                   "PyTorch's SDPA per sequence.")
@click.option("--mla", is_flag=True,
              help="Time DeepSeek-V3's prefill attention instead (MLA: 128 heads, head_dim_qk 192, head_dim_v 128, "
                   "bf16, N 4096 / 8192 / 16384 with batch 16384 / N, forward and backward, full and causal) beside "
                   "PyTorch's SDPA on its cuDNN backend.")
@click.option("--feature-head-dim", type=click.IntRange(min=8, max=256), default=None,
              help="With --features: the head dim of every feature case (heads = 2048 / it)  [default: 128]")
@click.option("--deterministic", is_flag=True,
              help="Also time the backward with deterministic=True (rawflash-fa2-det) beside the default one.")
@click.option("--host", is_flag=True,
              help="What a call costs on the host beside its kernels (forward, backward, decode; PyTorch's SDPA "
                   "beside it where importable).")
@click.option("--jax", "use_jax", is_flag=True,
              help="Time rawflash inside jax.jit beside jax.nn.dot_product_attention's cudnn and xla (bf16; head "
                   "dims 64,128 unless given; --direction bwd: forward + backward), on GPU events around the "
                   "jitted work, in a process of its own.")
@json_option
@click.pass_context
def bench(ctx, impls, directions, dtypes, head_dims, seqlens, causal, kv_ratio, tokens, hidden, repeats, out_dir,
          tag, features, decode, quick, paged, mla, feature_head_dim, deterministic, host, use_jax, as_json):
    """Validate, then time rawflash beside its peers on the FA2 paper's sweep; write JSON, CSV and a plot. GPU
    only. The headline is the public call's time (calls back to back); the rawflash rows also give the kernels' own
    time (kernel_tflops: the launches alone, a CUDA graph of them replayed)."""
    if quick and not decode:
        raise click.UsageError("--quick goes with --decode")
    if feature_head_dim is not None and not features:
        raise click.UsageError("--feature-head-dim goes with --features")
    if deterministic and (decode or features):
        raise click.UsageError("--deterministic goes with the FA2 sweep (not --decode or --features)")
    if features and set(dtypes) - {"bfloat16", bench_mod.FP8}:
        raise click.UsageError("--features times bfloat16 and float8_e4m3fn (the FP8 forward) only, got --dtype "
                               + ", ".join(sorted(set(dtypes) - {"bfloat16", bench_mod.FP8})))
    if use_jax:
        given = [f"--{n}" for n, on in (("impl", impls), ("features", features), ("decode", decode),
                                         ("deterministic", deterministic), ("host", host)) if on]
        if given:
            raise click.UsageError(f"--jax times its own sweep; it does not go with {', '.join(given)}")
        if set(dtypes) != {"bfloat16"}:
            raise click.UsageError("--jax times bfloat16 only")
    if mla and not decode:  # (--decode --mla: decode's latent cache, below)
        given = [f"--{n}" for n, on in (("impl", impls), ("features", features), ("decode", decode),
                                         ("paged", paged), ("deterministic", deterministic), ("host", host),
                                         ("jax", use_jax)) if on]
        if given:
            raise click.UsageError(f"--mla times its own cases; it does not go with {', '.join(given)}")
        _require_gpu("bench --mla", "there are no MLA figures without one (rawflash.cli.bench_mla.mla_cases() lists "
                                    "its cases)")
        _bench_mla(repeats, out_dir, tag, as_json)
        return
    _require_gpu("bench", "'rawflash io' and 'rawflash explain' give the predicted numbers without one")
    if use_jax:
        _bench_jax(ctx, directions, head_dims, seqlens, causal, kv_ratio, tokens, hidden, repeats, out_dir, tag,
                   as_json)
        return
    if paged:
        from . import bench_paged

        result = bench_paged.run_paged(repeats)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"bench-paged{('-' + tag) if tag else ''}.json").write_text(json.dumps(result, indent=1))
        _emit({"paged": result}, as_json)
        return
    if host:
        from . import bench_host

        rows = bench_host.measure(progress=None if as_json else click.echo)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"bench-host{('-' + tag) if tag else ''}.json").write_text(json.dumps(rows, indent=1))
        if as_json:
            _emit({"host": rows}, True)
        return
    if decode or features:  # the decode sweep or the feature cases instead of the FA2 sweep
        from . import bench_decode

        if decode and bench_mod.FP8 in dtypes:
            if quick or set(dtypes) != {bench_mod.FP8}:
                raise click.UsageError("--decode --dtype float8_e4m3fn times its own cases (FP8 caches beside bf16 "
                                       "ones): give it alone, without --quick")
            cases = bench_decode.fp8_cases()
        elif decode and mla:
            cases = bench_decode.latent_cases()
        else:
            cases = bench_decode.quick_cases() if quick else None
        name, result = ("decode", bench_decode.run_decode(repeats, cases=cases)) if decode else \
            ("features", bench_mod.run_features(repeats, feature_head_dim or 128, tuple(directions), tuple(dtypes)))
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"bench-{name}{('-' + tag) if tag else ''}.json").write_text(json.dumps(result, indent=1))
        _emit({name: result}, as_json)
        return
    impls = list(impls) or bench_mod.default_impls(bench_mod.available_impls(), deterministic)
    if deterministic and not impls.count("rawflash-fa2-det"):
        impls.append("rawflash-fa2-det")
    missing = [i for i in impls if i not in bench_mod.available_impls()]
    if missing:
        raise click.ClickException(f"not available here: {', '.join(missing)} (PyTorch with CUDA is needed)")
    cases = bench_mod.sweep_cases(impls, directions, dtypes, head_dims, seqlens, _causal_modes(causal), tokens,
                                  hidden, kv_ratio)
    records, validated = [], {}
    with click.progressbar(cases, label=f"{len(cases)} cases", file=sys.stderr,
                           item_show_func=lambda c: c and f"{c.impl} {c.direction} d={c.head_dim} N={c.seqlen}") as bar:
        for case in bar:
            records.append(bench_mod.run_case(case, repeats, validated))
    rows = [dataclasses.asdict(r) for r in records]
    out, stem = Path(out_dir), f"bench{('-' + tag) if tag else ''}"
    wrote = _write_rows(rows, out, stem)
    plot_path = _plot(records, out / f"{stem}.png")
    bad = [{k: r[k] for k in ("impl", "direction", "status", "head_dim", "seqlen", "causal")} for r in rows
           if r["status"] != "ok"]
    wrote.append(str(plot_path) if plot_path else "no plot: matplotlib is not installed")
    det = bench_mod.ratios(records, "rawflash-fa2-det")  # its "x rawflash-fa2": deterministic over default
    if as_json:
        extra = {"fp8 published": bench_mod.FP8_PUBLISHED} if bench_mod.FP8 in dtypes else {}
        _emit({"cases": rows, "not timed": bad, "ratios": bench_mod.ratios(records), "ratios_deterministic": det,
               "wrote": wrote, **extra}, True)
        return
    click.echo(report_mod.table(bad) if bad else "every case validated and timed")
    click.echo(report_mod.table(bench_mod.ratios(records)))
    if det:
        click.echo(report_mod.table(det))
    if bench_mod.FP8 in dtypes:
        click.echo(f"FP8 peers (PyTorch's SDPA has no FP8 path to call), published: {bench_mod.FP8_PUBLISHED}")
    click.echo("wrote " + ", ".join(wrote))


def _write_rows(rows: list[dict], out: Path, stem: str, report: dict | None = None) -> list[str]:
    """``rows`` as ``out/stem.csv`` and as ``out/stem.json`` (``report`` in their place when given); the paths."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(rows if report is None else report, indent=1))
    with open(out / f"{stem}.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
    return [str(out / f"{stem}.json"), str(out / f"{stem}.csv")]


def _bench_mla(repeats: int, out_dir: str, tag: str, as_json: bool) -> None:
    """bench --mla: every case of ``bench_mla.mla_cases()`` validated and timed; the cases (JSON, CSV) and the
    summary (rawflash's TFLOP/s beside cuDNN's) written to ``out_dir`` and printed."""
    from . import bench_mla

    verdicts: dict = {}
    records = _rows_with_progress(bench_mla.mla_cases(), lambda c: bench_mla.run_case(c, repeats, verdicts),
                                  "MLA cases", show=lambda c: c and f"{c.impl} {c.direction} N={c.seqlen}")
    rows, summary = [dataclasses.asdict(r) for r in records], bench_mla.summary(records)
    wrote = _write_rows(rows, Path(out_dir), f"bench-mla{('-' + tag) if tag else ''}",
                        {"cases": rows, "summary": summary})
    mla = {"cases": rows, "summary": summary} if as_json else summary  # (text: the summary's table alone)
    _emit({"mla": mla, "wrote": wrote}, as_json)


def _bench_jax(ctx, directions, head_dims, seqlens, causal, kv_ratio, tokens, hidden, repeats, out_dir, tag,
               as_json) -> None:
    """bench --jax: ``python -m rawflash.cli.bench_jax`` in a child process (JAX's GPU memory apart from this
    process's CuPy); its report printed here, its exit status this command's."""
    from . import bench_jax

    if not bench_jax.have_jax():
        raise click.ClickException(f"bench --jax needs JAX and it is not importable here: {bench_jax.INSTALL_JAX}")
    if ctx.get_parameter_source("head_dims") is click.core.ParameterSource.DEFAULT:
        head_dims = list(bench_jax.HEAD_DIMS)
    code, out = bench_jax.spawn(bench_jax.child_args(head_dims, seqlens, causal, directions, tokens, hidden,
                                                     kv_ratio, repeats, out_dir, tag, as_json))
    click.echo(out, nl=False)
    ctx.exit(code)


def _plot(records, path: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = sorted({(r.direction, r.head_dim, r.causal, r.dtype) for r in records if r.tflops})
    if not panels:
        return None
    cols = 3
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, (direction, d, causal, dtype) in zip(axes.flat, panels):
        for impl in bench_mod.IMPLS:
            pts = sorted((r.seqlen, r.tflops) for r in records if r.impl == impl and r.tflops and
                         (r.direction, r.head_dim, r.causal, r.dtype) == (direction, d, causal, dtype))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{direction} d={d} {'causal' if causal else 'non-causal'} {dtype}", fontsize=9)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
