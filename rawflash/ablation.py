"""FA2's three ideas switched off one at a time (and all together), validated, then timed (needs a GPU).

The variants are ``forms.ABLATIONS``: full FA2 (the mma.sync kernel), no deferred normalisation, no sequence
parallelism, no split-Q warp partition, none of the three, and on sm_90 the wgmma kernel with and without FA3's
softmax / P V overlap. Each variant is first graded against the float64 reference on a small
problem of the same instantiation (same dtype, head_dim and causal flag); a variant that fails is reported, not timed.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from . import accuracy, bench, forms, iomodel
from .launch import Problem

VALIDATION_SEQLEN = 203  # ragged: not a multiple of any tile


@dataclasses.dataclass(frozen=True)
class Case:
    variant: str
    dtype: str
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    causal: bool

    @property
    def problem(self) -> Problem:
        return Problem(self.batch, self.seqlen, self.seqlen, self.heads, self.heads, self.head_dim, self.dtype,
                       self.causal)


def cases(dtype: str, head_dims, seqlens, causal: bool, tokens: int = 16384, hidden: int = 2048) -> list[Case]:
    """The FA2 paper's shapes (B = tokens / N, H = hidden / d) for every variant of ``forms.ABLATIONS``."""
    return [Case(name, dtype, max(1, tokens // n), max(1, hidden // d), n, d, causal)
            for d in head_dims for n in seqlens for name in forms.ABLATIONS]


def validate(case: Case) -> tuple[bool, str]:
    """Grade ``case.variant``'s out on a small problem with the same instantiation."""
    import rawflash

    small = dataclasses.replace(case, batch=1, heads=2, seqlen=VALIDATION_SEQLEN).problem
    x = accuracy.random_inputs(small, seed=5)
    try:
        out, lse = rawflash.forward(x["q"], x["k"], x["v"], causal=small.causal, **forms.ABLATIONS[case.variant].given)
    except ValueError as err:  # e.g. the wgmma rows on a GPU that is not sm_90
        return False, f"not run: {err}"
    rows = accuracy.grade_forward(x, out, lse, small.causal, None)
    bad = [r for r in rows if not r["ok"]]
    return (not bad, "ok" if not bad else ", ".join(f"{r['quantity']} error {r['max_err']:.3g} > {r['bound']:.3g}"
                                                    for r in bad))


def time_case(case: Case, repeats: int) -> float:
    """Median ms of one forward of ``case`` (bench.time_ms: CUDA events, L2 flushed)."""
    import cupy

    import rawflash

    q, k, v, _ = bench.make_inputs(bench.Case("rawflash-fa2", "fwd", case.dtype, case.batch, case.heads, case.heads,
                                              case.seqlen, case.head_dim, case.causal))
    switches = forms.ABLATIONS[case.variant].given
    try:
        return bench.time_ms(lambda: rawflash.forward(q, k, v, causal=case.causal, **switches), repeats=repeats)
    finally:
        del q, k, v
        cupy.get_default_memory_pool().free_all_blocks()


def tflops(case: Case, ms: float) -> float:
    p = case.problem
    shape = iomodel.Shape(p.batch, p.seqlen_q, p.seqlen_k, p.heads, p.kv_heads, p.head_dim, p.itemsize, p.causal)
    return iomodel.flops(shape, "fwd") / (ms * 1e-3) / 1e12


def run(all_cases: list[Case], repeats: int, step: Callable[[Case], None] = lambda _: None) -> list[dict]:
    """Validate each (variant, head_dim) once, time every case; rows carry TFLOP/s and the ratio to full FA2."""
    verdicts, rows = {}, []
    for case in all_cases:
        step(case)
        key = (case.variant, case.head_dim)
        if key not in verdicts:
            verdicts[key] = validate(case)
        ok, why = verdicts[key]
        ms = time_case(case, repeats) if ok else None
        rows.append({"variant": case.variant, "dtype": case.dtype, "head_dim": case.head_dim, "seqlen": case.seqlen,
                     "batch": case.batch, "heads": case.heads, "causal": case.causal, "ms": ms,
                     "tflops": tflops(case, ms) if ms else None, "status": why})
    full = {(r["head_dim"], r["seqlen"]): r["tflops"] for r in rows if r["variant"] == "fa2"}
    for r in rows:
        base = full.get((r["head_dim"], r["seqlen"]))
        r["x_fa2"] = r["tflops"] / base if r["tflops"] and base else None
    return rows


def plot(rows: list[dict], path: Path) -> Path | None:
    """Grouped bars of TFLOP/s per shape and variant; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    shapes = sorted({(r["head_dim"], r["seqlen"]) for r in rows})
    names = list(forms.ABLATIONS)
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(2.2 * len(shapes) + 2, 4))
    for i, name in enumerate(names):
        values = [next((r["tflops"] or 0 for r in rows if r["variant"] == name and (r["head_dim"], r["seqlen"]) == s),
                       0) for s in shapes]
        ax.bar([j + i * width for j in range(len(shapes))], values, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], [f"d={d}\nN={n}" for d, n in shapes])
    ax.set_ylabel("TFLOP/s (forward)")
    ax.set_title("FA2 ablation: each idea switched off alone")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
