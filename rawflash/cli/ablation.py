"""FA2's three ideas switched off one at a time (and all together), and the ladder from standard attention to
FlashAttention-3 one idea at a time; validated, then timed (needs a GPU).

The variants are ``forms.ABLATIONS``: full FA2 (the mma.sync kernel), no deferred normalisation, no sequence
parallelism, no split-Q warp partition, none of the three, and on sm_90 the wgmma kernel with and without FA3's
softmax / P V overlap. The ladder is ``LADDER``: naive, fa1, FA2 with its three ideas added one at a time, Hopper's
wgmma and FA3's ideas (a rung whose switches ``rawflash.forward`` does not take yet is shown as not built). Each
variant or rung is first graded against the float64 reference on a small problem of the same instantiation (same
dtype, head_dim and causal flag); one that fails is reported, not timed.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from ..kernels import forms
from ..problem import Problem
from . import accuracy, bench, iomodel

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
    small = dataclasses.replace(case, batch=1, heads=2, seqlen=VALIDATION_SEQLEN).problem
    return grade(small, "fa2", forms.ABLATIONS[case.variant].given)


def grade(small: Problem, kernel: str, switches: dict) -> tuple[bool, str]:
    """Run ``rawflash.forward(kernel=kernel, **switches)`` on ``small`` and grade out and lse against the float64
    reference: (ok, 'ok' or what failed); 'not built' when forward does not take a switch (TypeError), 'not run'
    when it refuses the call here (ValueError, e.g. wgmma on a GPU that is not sm_90)."""
    import rawflash

    x = accuracy.random_inputs(small, seed=5)
    try:
        out, lse = rawflash.forward(x["q"], x["k"], x["v"], causal=small.causal, kernel=kernel, **switches)
    except TypeError as err:
        return False, f"not built: {err}"
    except ValueError as err:
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


# ---------------------------------------------------------------- the ladder: standard attention to FlashAttention-3
@dataclasses.dataclass(frozen=True)
class Rung:
    """One step of the ladder: what ``rawflash.forward`` runs (``kernel`` and the whole set of ``switches``, not
    just the new one), what the step changes over the rung below it and what its paper claims for it."""

    name: str
    kernel: str
    switches: tuple  # (name, value) pairs of forward()'s switches
    changes: str
    claim: str

    @property
    def kwargs(self) -> dict:
        return dict(self.switches)

    @property
    def call(self) -> str:
        args = [f"kernel={self.kernel!r}"] + [f"{k}={v}" for k, v in self.switches]
        return f"forward({', '.join(args)})"


_MMA = (("wgmma", False),)
_FA3 = (("wgmma", True),)
LADDER: tuple[Rung, ...] = (
    Rung("naive", "naive", (),
         "standard attention: S = Q K^T and P = softmax(S) are written to HBM and read back (cuBLAS products, one "
         "softmax kernel)",
         "the baseline (FA1 paper, Algorithm 0)"),
    Rung("fa1", "fa1", (),
         "tiling and the online softmax: S and P never leave the chip. K/V blocks in the outer loop, query blocks "
         "inside; O, l, m go to HBM and back every step, normalised every step; warps split the keys (split-K)",
         "up to 3x faster than standard attention (FA1 paper, Sec. 4.3, A100); 2-4x over optimised baselines in "
         "the FA2 paper's summary (Sec. 1)"),
    Rung("fa2: loop order", "fa2", (("defer_norm", False), ("seq_parallel", False), ("split_q", False)) + _MMA,
         "query blocks in the outer loop: O, l, m of a query block stay on chip until it is done; still one CTA per "
         "(batch, head), split-K warps and a normalisation every step",
         "part of FA2's Algorithm 1 (FA2 paper, Sec. 3.1); not measured alone"),
    Rung("+ deferred normalisation", "fa2", (("seq_parallel", False), ("split_q", False)) + _MMA,
         "O is divided by l once at the end instead of after every key block (fewer non-matmul FLOPs)",
         "FA2 Sec. 3.1: a non-matmul FLOP costs up to 16x a matmul FLOP on A100; not measured alone"),
    Rung("+ sequence parallelism", "fa2", (("split_q", False),) + _MMA,
         "one CTA per (query block, head, batch) instead of per (batch, head): the GPU fills even when batch x "
         "heads is small (long sequences)",
         "FA2 Sec. 3.2: helps long sequences and small batches; not measured alone"),
    Rung("+ split-Q = fa2", "fa2", _MMA,
         "each warp owns whole query rows (split-Q): no merge of partial results between warps through shared "
         "memory",
         "FA2 Sec. 3.3: fewer shared-memory reads and writes; FA2 as a whole about 2x FA1 (FA2 abstract, A100)"),
    Rung("wgmma", "fa2", _FA3 + (("warp_specialize", False), ("overlap", False)),
         "Hopper's asynchronous warpgroup products (wgmma, operands from shared memory); every thread copies with "
         "cp.async; sm_90 only",
         "part of FA3's 1.5-2.0x over FA2 (FA3 paper, abstract, H100); not measured alone"),
    Rung("+ intra-warpgroup overlap", "fa2", _FA3 + (("warp_specialize", False), ("overlap", True)),
         "the softmax of one key block runs while the warpgroup's P V product of the block before is in flight",
         "FA3 Table 2 (H100, d 128, N 8k): 582 -> 661 TFLOP/s with the GEMM-softmax pipelining (1.14x)"),
    Rung("+ TMA and warp specialisation", "fa2", _FA3 + (("warp_specialize", True), ("overlap", True),
                                                         ("pingpong", False), ("persistent", False)),
         "a producer warpgroup only copies (one thread issues TMA bulk tensor copies into an mbarrier ring) and "
         "consumer warpgroups only compute, with registers moved to them (setmaxnreg); rawflash has no TMA form "
         "without the producer, so the two ideas share a rung",
         "FA3 Table 2: 570 -> 661 TFLOP/s with warp specialisation (1.16x)"),
    Rung("+ ping-pong", "fa2", _FA3 + (("warp_specialize", True), ("overlap", True), ("pingpong", True),
                                       ("persistent", False)),
         "consumer warpgroups take turns on the tensor cores (named barriers): one's softmax runs under the "
         "other's products",
         "FA3 Sec. 3.1: about 570 -> 620 TFLOP/s (d 128, N 8k)"),
    Rung("+ persistent", "fa2", _FA3 + (("warp_specialize", True), ("overlap", True), ("pingpong", True),
                                        ("persistent", True)),
         "one CTA per SM loops over tiles, taking the next from a counter when it is ready for one (a dynamic "
         "schedule): no launch of a CTA per tile, the next "
         "tile's loads start under this tile's epilogue",
         "FA3's released kernels; the paper gives no separate figure"),
)


def rung(name: str) -> Rung:
    """The rung called ``name``."""
    for r in LADDER:
        if r.name == name:
            return r
    raise ValueError(f"no rung {name!r}; the ladder is {[r.name for r in LADDER]}")


def ladder_cases(dtype: str, head_dims, seqlens, causal: bool, tokens: int = 16384, hidden: int = 2048) -> list[Case]:
    """Every rung at the FA2 paper's shapes (B = tokens / N, H = hidden / d), rung by rung within each shape."""
    return [Case(r.name, dtype, max(1, tokens // n), max(1, hidden // d), n, d, causal)
            for d in head_dims for n in seqlens for r in LADDER]


def plan_of(r: Rung, p: Problem) -> tuple[list | None, str]:
    """The launches ``r`` makes for ``p`` (no GPU needed), or None and why it is not built (a switch
    ``rawflash.forward`` does not take yet) or cannot run (ValueError from the plan, e.g. wgmma off sm_90)."""
    from .. import api

    unknown = sorted(set(r.kwargs) - set(api.SWITCHES))
    if unknown:
        return None, f"not built: rawflash.forward has no switch {', '.join(unknown)} yet"
    try:
        return forms.forward_plan(p, r.kernel, forms.Switches(**r.kwargs)), "ok"
    except TypeError as err:
        return None, f"not built: {err}"
    except ValueError as err:
        return None, f"not run: {err}"


def predicted_bytes(r: Rung, p: Problem, plan: list | None = None) -> int | None:
    """The HBM bytes ``rawflash io`` predicts for ``r`` at ``p`` with the tiles (and fa1's splits) of its plan."""
    plan = plan if plan is not None else plan_of(r, p)[0]
    if plan is None:
        return None
    shape = iomodel.Shape(p.batch, p.seqlen_q, p.seqlen_k, p.heads, p.kv_heads, p.head_dim, p.itemsize, p.causal)
    if r.kernel == "naive":
        return iomodel.io_bytes("naive", "fwd", shape).total_bytes
    lau = plan[0]
    splits = lau.grid[2] if r.kernel == "fa1" else 1
    return iomodel.io_bytes(r.kernel, "fwd", shape, Br=lau.config.br, Bc=lau.config.bc, splits=splits).total_bytes


def rung_table(p: Problem) -> list[dict]:
    """The ladder's rungs: the call, what each changes, the paper's claim, and whether it is built for ``p``."""
    rows = []
    for r in LADDER:
        plan, why = plan_of(r, p)
        rows.append({"rung": r.name, "runs": r.call, "changes": r.changes, "paper": r.claim,
                     "kernel": plan[0].kernel if plan else None, "status": why})
    return rows


def validate_rung(case: Case) -> tuple[bool, str]:
    """Grade the rung's out and lse on a small problem with the same instantiation; a rung whose switches
    ``rawflash.forward`` does not accept is 'not built', one it refuses here 'not run'."""
    r = rung(case.variant)
    small = dataclasses.replace(case, batch=1, heads=2, seqlen=VALIDATION_SEQLEN).problem
    plan, why = plan_of(r, small)
    return grade(small, r.kernel, r.kwargs) if plan is not None else (False, why)


def time_rung(case: Case, repeats: int) -> float:
    """Median ms of one forward of the rung at ``case``'s shape (bench.time_ms: CUDA events, L2 flushed);
    MemoryError when its buffers (naive: its scores) would not fit (bench.fits)."""
    import cupy

    import rawflash

    r = rung(case.variant)
    bcase = bench.Case("rawflash-naive" if r.kernel == "naive" else "rawflash-fa2", "fwd", case.dtype, case.batch,
                       case.heads, case.heads, case.seqlen, case.head_dim, case.causal)
    if not bench.fits(bcase, cupy.cuda.Device().mem_info[0]):
        raise MemoryError("does not fit in memory")
    q, k, v, _ = bench.make_inputs(bcase)
    try:
        return bench.time_ms(lambda: rawflash.forward(q, k, v, causal=case.causal, kernel=r.kernel, **r.kwargs),
                             repeats=repeats)
    finally:
        del q, k, v
        cupy.get_default_memory_pool().free_all_blocks()


def run_ladder(all_cases: list[Case], repeats: int | None, step: Callable[[Case], None] = lambda _: None) -> list[dict]:
    """One row per (rung, shape): the predicted HBM bytes and, with ``repeats`` (a GPU), the validation verdict,
    the time, TFLOP/s and the speedup over the nearest timed rung below at the same shape. ``repeats=None``: the
    predictions only (no GPU)."""
    verdicts, rows = {}, []
    for case in all_cases:
        step(case)
        r, p = rung(case.variant), case.problem
        plan, why = plan_of(r, p)
        ms = None
        if repeats is not None and plan is not None:
            key = (case.variant, case.head_dim)
            if key not in verdicts:
                verdicts[key] = validate_rung(case)
            ok, why = verdicts[key]
            try:
                ms = time_rung(case, repeats) if ok else None
            except MemoryError as err:  # naive's N^2 scores at long N (CuPy's OutOfMemoryError is one too)
                why = f"not timed: {str(err).splitlines()[0][:100]}"
        elif plan is not None:
            why = "not timed: needs a CUDA GPU"
        mb = predicted_bytes(r, p, plan)
        rows.append({"rung": r.name, "dtype": case.dtype, "head_dim": case.head_dim, "seqlen": case.seqlen,
                     "batch": case.batch, "heads": case.heads, "causal": case.causal,
                     "kernel": plan[0].kernel if plan else None, "hbm_MB": mb / 1e6 if mb is not None else None,
                     "ms": ms, "tflops": tflops(case, ms) if ms else None, "x_below": None, "vs": None,
                     "status": why})
    below: dict[tuple, dict] = {}
    for row in rows:  # rows come rung by rung within each shape
        shape = (row["head_dim"], row["seqlen"])
        prev = below.get(shape)
        if row["tflops"] and prev:
            row["x_below"], row["vs"] = row["tflops"] / prev["tflops"], prev["rung"]
        if row["tflops"]:
            below[shape] = row
    return rows


def plot_ladder(rows: list[dict], path: Path) -> Path | None:
    """The climb as one chart: TFLOP/s (log scale) of every rung in order, one line per shape, rungs that were not
    timed marked on the axis; None when matplotlib is missing or nothing was timed."""
    if not any(r["tflops"] for r in rows):
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = [r.name for r in LADDER]
    shapes = sorted({(r["head_dim"], r["seqlen"]) for r in rows})
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(names) + 2), 4.8))
    for d, n in shapes:
        pts = [(names.index(r["rung"]), r["tflops"]) for r in rows
               if (r["head_dim"], r["seqlen"]) == (d, n) and r["tflops"]]
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"d={d}, N={n}")
    timed = {r["rung"] for r in rows if r["tflops"]}
    labels = [name if name in timed else f"{name}\n(not timed)" for name in names]
    ax.set_xticks(range(len(names)), labels, rotation=35, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("TFLOP/s (forward)")
    first = rows[0]
    ax.set_title(f"From standard attention to FlashAttention-3 ({first['dtype']}, "
                 f"{'causal' if first['causal'] else 'non-causal'}, B = 16384/N, H = 2048/d)")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
