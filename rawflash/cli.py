"""The ``rawflash`` command line: what every launch does, and how fast it is."""
from __future__ import annotations

import csv
import dataclasses
import json
import sys
from pathlib import Path

import click

from . import bench as bench_mod


def _table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A plain aligned text table of dict rows."""
    if not rows:
        return "(nothing)"
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return "-" if v is None else str(v)

    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _csv_ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="rawflash")
def main():
    """rawflash: FlashAttention as raw CUDA C kernels, with the numbers that explain them."""


@main.command()
@click.option("--impl", "impls", multiple=True, type=click.Choice(bench_mod.IMPLS),
              help="Implementations to time (default: every one available here).")
@click.option("--direction", "directions", multiple=True, type=click.Choice(["fwd", "bwd"]), default=("fwd", "bwd"))
@click.option("--dtype", "dtypes", multiple=True, type=click.Choice(["bfloat16", "float16", "float32"]),
              default=("bfloat16",))
@click.option("--head-dims", default="64,128,256", show_default=True)
@click.option("--seqlens", default="512,1024,2048,4096,8192,16384", show_default=True)
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
    try:
        import cupy

        if not cupy.cuda.is_available():
            raise RuntimeError("no CUDA GPU is visible")
    except Exception as err:
        raise click.ClickException(f"bench needs a CUDA GPU ({err}); 'rawflash io' and 'rawflash explain' "
                                   "give the predicted numbers without one")
    impls = list(impls) or bench_mod.available_impls()
    missing = [i for i in impls if i not in bench_mod.available_impls()]
    if missing:
        raise click.ClickException(f"not available here: {', '.join(missing)} (PyTorch with CUDA is needed)")
    cases = bench_mod.sweep_cases(impls, directions, dtypes, _csv_ints(head_dims), _csv_ints(seqlens),
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
    click.echo(_table([{k: r[k] for k in ("impl", "direction", "status", "head_dim", "seqlen", "causal")}
                       for r in bad]) if bad else "every case validated and timed")
    click.echo(_table(bench_mod.ratios(records)))
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
