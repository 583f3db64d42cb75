"""The ``rawflash`` command line: what every launch does, and how fast it is.

Commands stay short: the numbers come from ``introspect`` (launches, occupancy, bytes, dry runs), ``sysinfo``,
``variants``, ``accuracy``, ``ablation``, ``demo`` and ``bench``; every report is a dict that prints either as text
(``report.render``) or, with ``--json``, as JSON. Bad options exit with status 2 and a message naming the option;
a refused call, a failed check or a missing GPU exit with status 1 and a message, never a traceback
(``RAWFLASH_DEBUG=1`` shows the traceback of an unexpected error).
"""
from __future__ import annotations

import csv
import dataclasses
import functools
import json
import os
import sys
from pathlib import Path

import click

from . import accuracy, configs, introspect, iomodel, launch, occupancy, registry, settings, sysinfo, validation
from . import bench as bench_mod
from . import report as report_mod

DIRECTIONS = click.Choice(["fwd", "bwd", "both"])


class _Group(click.Group):
    """Turns an unexpected exception into a one-line error (exit 1) unless RAWFLASH_DEBUG is set."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as err:
            if settings.load().debug:
                raise
            raise click.ClickException(f"{type(err).__name__}: {err}\n(set RAWFLASH_DEBUG=1 for the traceback)")


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="rawflash")
def main():
    """rawflash: FlashAttention as raw CUDA C kernels, with the numbers that explain them."""


# ---------------------------------------------------------------- shared options and helpers
def shape_options(batch=4, seqlen=2048, heads=16, head_dim=128, dtype="bfloat16", causal=False, kernel=False,
                  backend=False, min_size=1):
    """The shape of a call as options; the command receives them as one ``spec`` (an ``introspect.ShapeSpec``)."""
    size = click.IntRange(min=min_size)
    options = [
        click.option("--batch", type=size, default=batch, show_default=True, help="Batch size."),
        click.option("--seqlen-q", type=size, default=seqlen, show_default=True, help="Query length."),
        click.option("--seqlen-k", type=size, default=None, help="Key length  [default: --seqlen-q]"),
        click.option("--heads", type=size, default=heads, show_default=True, help="Query heads."),
        click.option("--kv-heads", type=size, default=None, help="Key/value heads (GQA/MQA)  [default: --heads]"),
        click.option("--head-dim", type=click.IntRange(min=1), default=head_dim, show_default=True),
        click.option("--dtype", type=click.Choice(configs.DTYPES), default=dtype, show_default=True),
        click.option("--causal/--no-causal", default=causal, show_default=True,
                     help="Bottom-right aligned causal mask."),
    ]
    if kernel:
        options.append(click.option("--kernel", type=click.Choice(validation.KERNELS), default="fa2",
                                    show_default=True, help="Forward kernel (the backward is always fa2)."))
    if backend:
        options.append(click.option("--backend", type=click.Choice(validation.BACKENDS), default="cupy",
                                    show_default=True))
    names = ("batch", "seqlen_q", "seqlen_k", "heads", "kv_heads", "head_dim", "dtype", "causal")

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(**kw):
            spec = introspect.ShapeSpec(**{n: kw.pop(n) for n in names})
            return fn(spec=spec, **kw)

        for option in reversed(options):
            wrapper = option(wrapper)
        return wrapper

    return decorate


json_option = click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")


def target_options(fn):
    """--arch (compile offline for it) and --sms (SMs for wave counts)."""
    fn = click.option("--sms", type=click.IntRange(min=1), default=None,
                      help="SMs for wave counts  [default: the GPU's, else 132 (H200)]")(fn)
    return click.option("--arch", type=click.Choice(sorted(occupancy.ARCHS)), default=None,
                        help="Compile offline with NVRTC for this target  [default: the GPU, else sm_90]")(fn)


def _emit(report: dict, as_json: bool, hide: tuple[str, ...] = ()) -> None:
    click.echo(json.dumps(report, indent=1, default=str) if as_json else report_mod.render(report, hide))


def _step(message: str) -> None:
    click.echo(message, err=True)


def _problem(spec: introspect.ShapeSpec, arch: str | None = None, **call) -> launch.Problem:
    """The validated problem (for ``arch``'s tile rows and kernels when given), or the API's own error message as a
    usage error."""
    try:
        p = introspect.validate(spec, **call).problem
    except (TypeError, ValueError) as err:
        raise click.UsageError(f"rawflash would refuse this call: {err}")
    return dataclasses.replace(p, arch=arch) if arch else p


def _require_gpu(command: str, instead: str) -> None:
    if not sysinfo.gpu_available():
        raise click.ClickException(f"{command} needs a CUDA GPU and none is visible (cupy.cuda.is_available() is "
                                   f"False); {instead}")


def _rows_with_progress(items: list, fn, label: str, show=None) -> list:
    if len(items) <= 3:
        return [fn(x) for x in items]
    with click.progressbar(items, label=label, file=sys.stderr, item_show_func=show) as bar:
        return [fn(x) for x in bar]


def _shape_text(p: launch.Problem) -> str:
    return (f"batch {p.batch}, seqlen_q {p.seqlen_q}, seqlen_k {p.seqlen_k}, heads {p.heads}, kv_heads {p.kv_heads}, "
            f"head_dim {p.head_dim}, {p.dtype}, {'causal' if p.causal else 'non-causal'}")


def _csv_ints(ctx, param, text: str) -> list[int]:
    """Click callback: comma-separated positive integers."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise click.BadParameter(f"expected comma-separated positive integers, got {text!r}")
    return values


# ---------------------------------------------------------------- info, list
@main.command()
@json_option
def info(as_json):
    """GPUs, CUDA driver / runtime / NVRTC, library versions and the kernel cache."""
    _emit(sysinfo.summary(), as_json)


@main.command("list")
@json_option
def list_(as_json):
    """The variant registry and the tile table (configs.TABLE)."""
    _emit({"variants": {v.name: _variant_entry(v) for v in registry.REGISTRY.values()},
           "tiles": _tile_rows()}, as_json)


def _variant_entry(v: registry.Variant) -> dict:
    return {"source": f"cuda/{v.source}", "direction": v.direction, "api": f"kernel={v.api_kernel!r}",
            "paper algorithm": v.paper_algorithm, "warp partition": v.warp_partition,
            "forms": {f.kernel: f"{f.arch}+, cuda/{f.source} with cuda/{f.mainloop}" for f in v.forms},
            "helpers": [h.kernel for h in v.helpers],
            "supports": list(v.supports),
            "numba twin": f"{v.numba_factory} in {v.numba_module}" + ("" if v.has_numba_twin() else " (absent)")}


def _tile_rows() -> list[dict]:
    """configs.TABLE with rows that differ only in head_dim or dtype merged."""
    merged: dict = {}
    for (kernel, d, dtype), cfg in configs.TABLE.items():
        merged.setdefault((kernel, cfg, dtype), []).append(d)
    rows: dict = {}
    for (kernel, cfg, dtype), dims in merged.items():
        rows.setdefault((kernel, cfg, tuple(dims)), []).append(dtype)
    out = []
    for (kernel, cfg, dims), dtypes in rows.items():
        fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("br", "bc", "why")}
        out.append({"kernel": kernel, "head_dims": ",".join(map(str, dims)), "dtypes": ",".join(dtypes),
                    "Br": cfg.br, "Bc": cfg.bc, **fields, "threads": cfg.threads, "why": cfg.why})
    return out


# ---------------------------------------------------------------- launch-config, occupancy
@main.command("launch-config")
@shape_options(kernel=True)
@click.option("--direction", type=DIRECTIONS, default="fwd", show_default=True)
@click.option("--deterministic", is_flag=True, help="Backward without atomics (adds the fa2_bwd_dq pass).")
@target_options
@json_option
def launch_config(spec, kernel, direction, deterministic, arch, sms, as_json):
    """Every launch of a call: instantiation, tiles, grid, block, shared memory, CTAs, skipped tiles and waves."""
    tgt = introspect.target(arch, sms)
    p = _problem(spec, tgt.arch, kernel=kernel, direction=direction, deterministic=deterministic)
    rows = introspect.launch_config_rows(p, kernel, direction, deterministic, tgt)
    _emit({"shape": _shape_text(p), "target": tgt.description, "launches": rows,
           "notes": ["tiles, skipped: (Q block, K block) tiles over all (batch, head), causal skipping from iomodel",
                     "ctas_per_sm: rawflash.occupancy with the compiled register count; waves = CTAs / (ctas_per_sm "
                     "* SMs)"] + (["naive: the two cuBLAS products are not listed"] if kernel == "naive" else [])},
          as_json)


@main.command("occupancy")
@shape_options(kernel=True)
@click.option("--direction", type=DIRECTIONS, default="fwd", show_default=True)
@click.option("--deterministic", is_flag=True, help="Backward without atomics (adds the fa2_bwd_dq pass).")
@click.option("--all", "every", is_flag=True,
              help="Every instantiation of the tile table for --dtype and --causal/--no-causal (shape ignored).")
@target_options
@json_option
@click.pass_context
def occupancy_cmd(ctx, spec, kernel, direction, deterministic, every, arch, sms, as_json):
    """Registers, shared memory, spills and resident CTAs per SM; on a GPU, the driver's count beside ours."""
    tgt = introspect.target(arch, sms)
    if every:
        launches = introspect.instantiations(spec.dtype, spec.causal, tgt.arch)
        what = f"every {spec.dtype} {'causal' if spec.causal else 'non-causal'} instantiation"
    else:
        p = _problem(spec, tgt.arch, kernel=kernel, direction=direction, deterministic=deterministic)
        launches = [lau for _, lau in introspect.launches(p, kernel, direction, deterministic)]
        what = _shape_text(p)
    rows = _rows_with_progress(launches, lambda lau: introspect.occupancy_row(lau, tgt), "compiling",
                               lambda lau: lau and lau.kernel)
    checks = introspect.occupancy_checks(rows, tgt)
    _emit({"for": what, "target": tgt.description, "occupancy": rows, "checks": checks}, as_json)
    if checks.get("calculator != driver", "none") != "none":
        ctx.exit(1)


# ---------------------------------------------------------------- io, explain
@main.command("io")
@shape_options()
@click.option("--gpu", type=click.Choice(list(iomodel.GPUS)), default=None,
              help="Peaks for the roofline  [default: the current GPU, else H200]")
@click.option("--measure", is_flag=True, help="Also measure DRAM bytes with ncu (GPU and ncu needed).")
@click.option("--breakdown", is_flag=True, help="Print each term of the byte counts.")
@json_option
@click.pass_context
def io_cmd(ctx, spec, gpu, measure, breakdown, as_json):
    """Predicted HBM bytes, FLOPs, intensity and roofline bound of naive, fa1 and fa2, forward and backward."""
    p = _problem(spec)
    try:
        key, why = introspect.roofline_gpu(gpu)
    except ValueError as err:
        raise click.UsageError(str(err))
    rows = introspect.io_rows(p, key)
    problem = _measure(p, rows) if measure else None
    peak = iomodel.GPUS[key]
    report = {"shape": _shape_text(p), "io": rows,
              "roofline": f"{key} ({why}): {peak.tensor_tflops:g} TFLOP/s tensor, {peak.fp32_tflops:g} float32, "
                          f"{peak.hbm_tbps:g} TB/s; caches are not modelled, so a kernel may beat the bound"}
    if breakdown:
        report["breakdown (bytes)"] = {f"{r['kernel']} {r['dir']}": r["breakdown_bytes"] for r in rows}
    if problem:
        report["measure"] = f"not measured: {problem}"
    _emit(report, as_json, hide=("breakdown_bytes",))
    if problem:
        ctx.exit(1)


def _measure(p: launch.Problem, rows: list[dict]) -> str | None:
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
    return None


@main.command()
@shape_options(kernel=True, backend=True, min_size=0)
@click.option("--scale", type=float, default=None, help="Softmax scale  [default: 1/sqrt(head_dim)]")
@click.option("--direction", type=DIRECTIONS, default="both", show_default=True)
@click.option("--deterministic", is_flag=True)
@click.option("--gpu", type=click.Choice(list(iomodel.GPUS)), default=None,
              help="Peaks for the time bound  [default: the current GPU, else H200]")
@json_option
@click.pass_context
def explain(ctx, spec, kernel, backend, scale, direction, deterministic, gpu, as_json):
    """Dry run of a call: the API's verdict (or its exact error), variant, launches, bytes, time bound.

    Nothing is launched and no GPU is needed. Exits 1 when the API would refuse the call.
    """
    try:
        report = introspect.explain(spec, kernel=kernel, backend=backend, scale=scale, direction=direction,
                                    deterministic=deterministic, gpu=gpu)
    except ValueError as err:  # no roofline for the current GPU
        raise click.UsageError(str(err))
    _emit(report, as_json)
    if not report["valid"]:
        ctx.exit(1)


# ---------------------------------------------------------------- check, ablate, demo
@main.command()
@shape_options(batch=1, seqlen=256, heads=4, head_dim=64, kernel=True, backend=True)
@click.option("--scale", type=float, default=None, help="Softmax scale  [default: 1/sqrt(head_dim)]")
@click.option("--deterministic", is_flag=True)
@click.option("--seed", type=int, default=0, show_default=True)
@json_option
@click.pass_context
def check(ctx, spec, kernel, backend, scale, deterministic, seed, as_json):
    """Run forward and backward on this shape and grade out, lse, dq, dk, dv against the float64 reference."""
    p = _problem(spec, kernel=kernel, backend=backend, scale=scale, direction="both", deterministic=deterministic)
    if accuracy.reference_bytes(p) > accuracy.REFERENCE_BUDGET:
        raise click.UsageError(f"the float64 reference of this shape needs about "
                               f"{accuracy.reference_bytes(p) / 2**30:.0f} GiB; pick a smaller shape")
    try:
        where = accuracy.prepare_backend(backend)
    except accuracy.Unavailable as err:
        raise click.ClickException(str(err))
    _step(where)
    try:
        rows = accuracy.check(p, kernel=kernel, backend=backend, scale=scale, deterministic=deterministic, seed=seed,
                              step=_step)
    except ImportError as err:
        raise click.ClickException(f"backend {backend!r} could not be loaded: {err}")
    ok = all(r["ok"] for r in rows)
    _emit({"ran": where, "shape": _shape_text(p), "forward kernel": kernel, "backward": "fa2", "grades": rows,
           "rule": "max|ours - ref| <= factor * max|base - ref| + floor (flash-attn's; base = naive attention in "
                   "the input precision)", "verdict": "passed" if ok else "FAILED"}, as_json, hide=("ok",))
    if not ok:
        ctx.exit(1)


@main.command()
@click.option("--dtype", type=click.Choice(configs.DTYPES), default="bfloat16", show_default=True)
@click.option("--head-dims", default="64,128", show_default=True, callback=_csv_ints)
@click.option("--seqlens", default="1024,4096", show_default=True, callback=_csv_ints)
@click.option("--causal/--no-causal", default=False, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="bench/results", show_default=True)
@json_option
def ablate(dtype, head_dims, seqlens, causal, repeats, out_dir, as_json):
    """FA2 forward with each of its three ideas off alone, and all three off (B = 16384/N, H = 2048/d)."""
    from . import ablation

    cases = ablation.cases(dtype, head_dims, seqlens, causal)
    _require_gpu("ablate", "'rawflash launch-config' and 'rawflash io' show the launches and bytes without one")
    with click.progressbar(length=len(cases), label=f"{len(cases)} cases", file=sys.stderr) as bar:
        rows = ablation.run(cases, repeats, step=lambda _: bar.update(1))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablation.json").write_text(json.dumps(rows, indent=1))
    plot = ablation.plot(rows, out / "ablation.png")
    _emit({"ablation": rows, "wrote": [str(out / "ablation.json"),
                                        str(plot) if plot else "no plot: matplotlib is not installed"]}, as_json)


@main.command()
@json_option
@click.pass_context
def demo(ctx, as_json):
    """Forward and backward checked and timed on a GPU; without one, the Numba twins on the CPU simulator and the
    sm_90 launch and occupancy report from an offline compile."""
    from . import demo as demo_mod

    run = demo_mod.gpu_demo if sysinfo.gpu_available() else demo_mod.cpu_demo
    report, ok = run(_step)
    _emit(report, as_json, hide=("ok",))
    if not ok:
        ctx.exit(1)


# ---------------------------------------------------------------- bench
@main.command()
@click.option("--impl", "impls", multiple=True, type=click.Choice(bench_mod.IMPLS),
              help="Implementations to time (default: every one available here).")
@click.option("--direction", "directions", multiple=True, type=click.Choice(["fwd", "bwd"]), default=("fwd", "bwd"))
@click.option("--dtype", "dtypes", multiple=True, type=click.Choice(["bfloat16", "float16", "float32"]),
              default=("bfloat16",))
@click.option("--head-dims", default="64,128,256", show_default=True, callback=_csv_ints)
@click.option("--seqlens", default="512,1024,2048,4096,8192,16384", show_default=True, callback=_csv_ints)
@click.option("--causal", "causal_modes", multiple=True, type=click.Choice(["no", "yes"]), default=("no", "yes"))
@click.option("--kv-ratio", default=1, show_default=True, help="Query heads per kv head (4 = GQA 32 on 8 at d=64).")
@click.option("--tokens", default=16384, show_default=True, help="batch * seqlen of every case.")
@click.option("--hidden", default=2048, show_default=True, help="heads * head_dim of every case.")
@click.option("--repeats", default=20, show_default=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="bench/results", show_default=True)
@click.option("--tag", default="", help="Suffix of the output file names.")
def bench(impls, directions, dtypes, head_dims, seqlens, causal_modes, kv_ratio, tokens, hidden, repeats, out_dir,
          tag):
    """Validate, then time rawflash beside its peers on the FA2 paper's sweep; write JSON, CSV and a plot."""
    _require_gpu("bench", "'rawflash io' and 'rawflash explain' give the predicted numbers without one")
    impls = list(impls) or bench_mod.available_impls()
    missing = [i for i in impls if i not in bench_mod.available_impls()]
    if missing:
        raise click.ClickException(f"not available here: {', '.join(missing)} (PyTorch with CUDA is needed)")
    cases = bench_mod.sweep_cases(impls, directions, dtypes, head_dims, seqlens,
                                  [m == "yes" for m in causal_modes], tokens, hidden, kv_ratio)
    records, validated = [], {}
    with click.progressbar(cases, label=f"{len(cases)} cases", file=sys.stderr,
                           item_show_func=lambda c: c and f"{c.impl} {c.direction} d={c.head_dim} N={c.seqlen}") as bar:
        for case in bar:
            records.append(bench_mod.run_case(case, repeats, validated))
    rows = [dataclasses.asdict(r) for r in records]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"bench{('-' + tag) if tag else ''}"
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    with open(out / f"{stem}.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot_path = _plot(records, out / f"{stem}.png")
    bad = [r for r in rows if r["status"] != "ok"]
    click.echo(report_mod.table([{k: r[k] for k in ("impl", "direction", "status", "head_dim", "seqlen", "causal")}
                                 for r in bad]) if bad else "every case validated and timed")
    click.echo(report_mod.table(bench_mod.ratios(records)))
    click.echo(f"wrote {out / (stem + '.json')}, {out / (stem + '.csv')}" + (f", {plot_path}" if plot_path else
                                                                             " (no plot: matplotlib missing)"))


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
