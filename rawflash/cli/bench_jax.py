"""``rawflash bench --jax``: rawflash inside ``jax.jit`` beside JAX's own attention, timed on the GPU.

The FA2 paper's sweep (batch = tokens / N, heads = hidden / d; bf16; head dims 64 and 128; N 512 to 16384; causal
and not), forward and forward + backward (``jax.grad`` of the output's float32 sum, which runs the forward too),
for three implementations in one process: ``rawflash`` (``rawflash.jax.attention``), ``cudnn`` and ``xla``
(``jax.nn.dot_product_attention`` with that ``implementation``; xla not above N = 4096, where it materialises the
N x N scores).

Every implementation is first checked once per (direction, head_dim, causal) on a small problem (batch 1, two
query heads or one GQA group, N 512) against the float64 reference by flash-attn's rule
(``reference.error_ratio_ok``: out within twice, gradients within three times the naive bf16 implementation's
error, plus the rounding floor); one that fails is reported and not timed, and an implementation that raises on a
shape is reported with the error's first line.
Times: the median over executions of the jitted program queued back to back, each timed on the GPU by CUDA
events on XLA's stream around its work (:mod:`rawflash.jax.timing`), after a warm-up. FLOPs: ``iomodel.flops``,
as ``rawflash bench`` counts them (forward 4 B H N^2 d, half when causal; forward + backward 3.5 times that).
Beside each rawflash row: its kernels' own time for the same call through rawflash's CuPy API (the forward's and
the backward's bound launches in a CUDA graph, replayed: ``bench.time_kernels_ms``) and the jitted call's time
over it.

It runs as ``python -m rawflash.cli.bench_jax`` in a process of its own, which ``rawflash bench --jax`` starts
with ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (JAX then takes GPU memory as it needs it and leaves the rest to
CuPy); the report goes to stdout (a text table, or JSON with ``--json``) and ``bench-jax.json`` under ``--out``.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import click
import numpy as np

from .. import reference, settings
from . import iomodel, sysinfo
from . import report as report_mod

IMPLS = ("rawflash", "cudnn", "xla")
DIRECTIONS = ("fwd", "fwd+bwd")
HEAD_DIMS = (64, 128)
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
DTYPE = "bfloat16"
XLA_MAX_SEQLEN = 4096  # xla materialises batch x heads x N x N float32 scores: 8.6 GB at N = 4096, d = 64
VALIDATE_SEQLEN = 512
MODULE = "rawflash.cli.bench_jax"
INSTALL_JAX = "pip install 'rawflash[jax]' and a CUDA build of jaxlib, e.g. pip install 'jax[cuda13]'"


@dataclasses.dataclass(frozen=True)
class JaxCase:
    impl: str
    direction: str  # "fwd" or "fwd+bwd"
    batch: int
    heads: int
    kv_heads: int
    seqlen: int
    head_dim: int
    causal: bool
    dtype: str = DTYPE

    @property
    def shape(self) -> iomodel.Shape:
        return iomodel.Shape(self.batch, self.seqlen, self.seqlen, self.heads, self.kv_heads, self.head_dim, 2,
                             self.causal)

    @property
    def flops(self) -> float:
        forward = iomodel.flops(self.shape, "fwd")
        return float(forward if self.direction == "fwd" else forward + iomodel.flops(self.shape, "bwd"))


def sweep_cases(impls=IMPLS, directions=DIRECTIONS, head_dims=HEAD_DIMS, seqlens=SEQLENS, causals=(False, True),
                tokens: int = 16384, hidden: int = 2048, kv_ratio: int = 1) -> list[JaxCase]:
    """The sweep, grouped by shape (head_dim, N), then causal, direction and implementation; xla only up to
    ``XLA_MAX_SEQLEN``."""
    cases = []
    for d in head_dims:
        for n in seqlens:
            b, h = max(1, tokens // n), max(1, hidden // d)
            for causal in causals:
                for direction in directions:
                    for impl in impls:
                        if impl == "xla" and n > XLA_MAX_SEQLEN:
                            continue
                        cases.append(JaxCase(impl, direction, b, h, max(1, h // kv_ratio), n, d, causal))
    return cases


def _error(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:120] if lines else ''}"


# ---------------------------------------------------------------- the programs
def attention_fn(impl: str):
    """``attend(q, k, v, causal)`` of one implementation, on (batch, seqlen, heads, head_dim) JAX arrays."""
    import jax

    if impl == "rawflash":
        from ..jax import attention

        return lambda q, k, v, causal: attention(q, k, v, causal=causal)
    if impl not in ("cudnn", "xla"):
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return lambda q, k, v, causal: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)


def program(case: JaxCase):
    """What is jitted and timed: the forward, or the gradients (dq, dk, dv) of the output's float32 sum."""
    import jax
    import jax.numpy as jnp

    attend = attention_fn(case.impl)
    if case.direction == "fwd":
        return lambda q, k, v: attend(q, k, v, case.causal)

    def loss(q, k, v):
        return attend(q, k, v, case.causal).astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2))


def host_inputs(batch: int, seqlen: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0) -> list:
    """q, k, v as NumPy bfloat16 arrays of unit-normal values."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    shapes = [(batch, seqlen, heads, head_dim)] + [(batch, seqlen, kv_heads, head_dim)] * 2
    return [rng.standard_normal(s, dtype=np.float32).astype(ml_dtypes.bfloat16) for s in shapes]


def validate(case: JaxCase, seed: int = 11) -> tuple[bool, str]:
    """flash-attn's rule on a small problem of the same kind (batch 1, two query heads or one kv group, N 512):
    out (factor 2), and with the backward dq, dk, dv (factor 3) of a random cotangent."""
    import jax

    heads = max(2, case.heads // case.kv_heads)
    small = dataclasses.replace(case, batch=1, heads=heads, kv_heads=heads * case.kv_heads // case.heads,
                                seqlen=VALIDATE_SEQLEN)
    q, k, v = host_inputs(small.batch, small.seqlen, small.heads, small.kv_heads, small.head_dim, seed)
    dout = host_inputs(small.batch, small.seqlen, small.heads, small.kv_heads, small.head_dim, seed + 1)[0]
    attend = attention_fn(case.impl)
    causal = case.causal
    if case.direction == "fwd":
        got = [np.asarray(jax.jit(lambda q, k, v: attend(q, k, v, causal))(q, k, v))]
        refs = [reference.forward(q, k, v, causal=causal)[0]]
        bases = [reference.forward(q, k, v, causal=causal, upcast=False)[0]]
        names, factors = ["out"], [2]
    else:
        def run(q, k, v, dout):
            out, vjp = jax.vjp(lambda *x: attend(*x, causal), q, k, v)
            return (out, *vjp(dout))

        got = [np.asarray(x) for x in jax.jit(run)(q, k, v, dout)]
        refs = [reference.forward(q, k, v, causal=causal)[0], *reference.backward(dout, q, k, v, causal=causal)]
        bases = [reference.forward(q, k, v, causal=causal, upcast=False)[0],
                 *reference.backward(dout, q, k, v, causal=causal, upcast=False)]
        names, factors = ["out", "dq", "dk", "dv"], [2, 3, 3, 3]
    for name, g, ref, base, factor in zip(names, got, refs, bases, factors):
        ok, err, _, bound = reference.error_ratio_ok(g.astype(np.float64), ref, base, q.dtype, factor)
        if not ok:
            return False, f"{name} error {err:.3g} > {bound:.3g}"
    return True, "ok"


# ---------------------------------------------------------------- timing
def time_jit_ms(case: JaxCase, inputs: list, repeats: int) -> float:
    """The median GPU time of the jitted program on ``inputs`` (JAX arrays), executions queued back to back."""
    from ..jax import timing

    return statistics.median(timing.measure_ms(program(case), *inputs, repeats=repeats))


def time_kernels_ms(case: JaxCase, host: list, repeats: int) -> float:
    """rawflash's kernels alone for the same call through its CuPy API: the forward's bound launches, and with the
    backward the backward's after them (cotangent of ones, as the gradient of a sum), a CUDA graph replayed."""
    import cupy

    try:
        return _kernels_ms(case, [cupy.asarray(x) for x in host], repeats)
    finally:
        cupy.get_default_memory_pool().free_all_blocks()


def _kernels_ms(case: JaxCase, qkv: list, repeats: int) -> float:
    import cupy
    import ml_dtypes

    from . import bench

    q, k, v = qkv
    c = bench.Case("rawflash-fa2", "fwd", DTYPE, case.batch, case.heads, case.kv_heads, case.seqlen, case.head_dim,
                   case.causal)
    forward = bench.bound_call(c, q, k, v, None)
    if case.direction == "fwd":
        return bench.time_kernels_ms(forward.launch, repeats=repeats)
    dout = cupy.ones(q.shape, dtype=np.dtype(ml_dtypes.bfloat16))
    backward = bench.bound_call(dataclasses.replace(c, direction="bwd"), q, k, v, dout)

    def both():
        forward.launch()
        backward.launch()

    return bench.time_kernels_ms(both, repeats=repeats)


def record(case: JaxCase, ms: float | None, status: str = "ok", kernel_ms: float | None = None) -> dict:
    row = dataclasses.asdict(case)
    row.update(ms=ms, tflops=case.flops / (ms * 1e-3) / 1e12 if ms else None, status=status)
    if case.impl == "rawflash":
        row.update(kernel_ms=kernel_ms, kernel_tflops=case.flops / (kernel_ms * 1e-3) / 1e12 if kernel_ms else None)
    return row


def run(cases: list[JaxCase], repeats: int, progress=None) -> list[dict]:
    """Validate (once per implementation, direction, head_dim and causal), then time every case."""
    import gc

    import jax

    rows, validated = [], {}
    shape = host = inputs = None
    for i, case in enumerate(cases):
        key = (case.impl, case.direction, case.head_dim, case.causal, case.heads // case.kv_heads)
        if key not in validated:
            try:
                validated[key] = validate(case)
            except Exception as err:  # an implementation that cannot run this kind of case is reported
                validated[key] = (False, f"failed: {_error(err)}")
        ok, why = validated[key]
        if not ok:
            row = record(case, None, why if why.startswith("failed") else f"invalid: {why}")
        else:
            if (case.batch, case.seqlen, case.heads, case.kv_heads, case.head_dim) != shape:
                shape = (case.batch, case.seqlen, case.heads, case.kv_heads, case.head_dim)
                host = inputs = None
                gc.collect()
                host = host_inputs(*shape)
                inputs = [jax.device_put(x) for x in host]
            try:
                row = record(case, time_jit_ms(case, inputs, repeats))
            except Exception as err:
                row = record(case, None, f"failed: {_error(err)}")
            if case.impl == "rawflash" and row["ms"]:
                try:
                    row = record(case, row["ms"], kernel_ms=time_kernels_ms(case, host, repeats))
                except Exception as err:  # the jitted time stands; the kernels' is missing, and the status says why
                    row["status"] = f"kernels failed: {_error(err)}"
        rows.append(row)
        if progress is not None:
            what = f"{case.impl} {case.direction} d={case.head_dim} N={case.seqlen}{' causal' if case.causal else ''}"
            done = f"{row['tflops']:.1f} TFLOP/s" if row["tflops"] else row["status"]
            progress(f"[{i + 1}/{len(cases)}] {what}: {done}")
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """For each timed rawflash row: its TFLOP/s, each peer's and rawflash's over each, its kernels' TFLOP/s and
    the jitted call's time over the kernels' time."""
    index = {(r["impl"], r["direction"], r["seqlen"], r["head_dim"], r["causal"], r["kv_heads"]): r for r in rows}
    out = []
    for r in rows:
        if r["impl"] != "rawflash" or not r["tflops"]:
            continue
        row = {"direction": r["direction"], "head_dim": r["head_dim"], "seqlen": r["seqlen"], "causal": r["causal"],
               "tflops": r["tflops"]}
        for peer in IMPLS[1:]:
            other = index.get((peer, r["direction"], r["seqlen"], r["head_dim"], r["causal"], r["kv_heads"]))
            row[f"{peer} tflops"] = other["tflops"] if other else None
            row[f"x {peer}"] = r["tflops"] / other["tflops"] if other and other["tflops"] else None
        row["kernel_tflops"] = r.get("kernel_tflops")
        row["jit / kernels"] = r["ms"] / r["kernel_ms"] if r.get("kernel_ms") else None
        out.append(row)
    return out


# ---------------------------------------------------------------- the process rawflash bench --jax starts
def have_jax() -> bool:
    """Whether JAX is importable (it is not imported here)."""
    return importlib.util.find_spec("jax") is not None


def child_args(head_dims, seqlens, causal: bool | None, directions, tokens: int, hidden: int, kv_ratio: int,
               repeats: int, out_dir: str, tag: str, as_json: bool) -> list[str]:
    """The options of ``python -m rawflash.cli.bench_jax`` for ``rawflash bench --jax``'s (``--direction bwd``:
    forward + backward)."""
    args = ["--head-dims", ",".join(map(str, head_dims)), "--seqlens", ",".join(map(str, seqlens))]
    if causal is not None:
        args.append("--causal" if causal else "--no-causal")
    for direction in dict.fromkeys("fwd+bwd" if d == "bwd" else d for d in directions):
        args += ["--direction", direction]
    args += ["--tokens", str(tokens), "--hidden", str(hidden), "--kv-ratio", str(kv_ratio), "--repeats",
             str(repeats), "--out", str(out_dir)]
    if tag:
        args += ["--tag", tag]
    return args + (["--json"] if as_json else [])


def child_env() -> dict:
    return sysinfo.child_env(XLA_PYTHON_CLIENT_PREALLOCATE="false")


def spawn(args: list[str]) -> tuple[int, str]:
    """Runs ``python -m rawflash.cli.bench_jax *args``; its exit status and stdout (stderr, the progress, passes
    through)."""
    proc = subprocess.run([sys.executable, "-m", MODULE, *args], env=child_env(), stdout=subprocess.PIPE, text=True)
    return proc.returncode, proc.stdout


# ---------------------------------------------------------------- its command line
from .commands import _csv_ints  # noqa: E402  (the command line's own parser of comma-separated integers)


def _require_gpu() -> dict:
    """The device JAX times on, or a one-line error (exit 1) where CuPy or JAX sees no CUDA GPU."""
    if not sysinfo.gpu_available():
        raise click.ClickException("bench --jax needs a CUDA GPU and none is visible (cupy.cuda.is_available() is "
                                   "False)")
    if not have_jax():
        raise click.ClickException(f"bench --jax needs JAX and it is not importable here: {INSTALL_JAX}")
    import jax

    try:
        device = jax.devices("gpu")[0]
    except RuntimeError as err:
        raise click.ClickException(f"bench --jax needs JAX's CUDA backend and JAX has none here "
                                   f"({_error(err)}): {INSTALL_JAX}") from None
    import jaxlib

    return {"device": device.device_kind, "jax": f"{jax.__version__} (jaxlib {jaxlib.__version__})"}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--impl", "impls", multiple=True, type=click.Choice(IMPLS), default=IMPLS, show_default=True)
@click.option("--direction", "directions", multiple=True, type=click.Choice(DIRECTIONS), default=DIRECTIONS,
              show_default=True)
@click.option("--head-dims", default=",".join(map(str, HEAD_DIMS)), show_default=True, callback=_csv_ints)
@click.option("--seqlens", default=",".join(map(str, SEQLENS)), show_default=True, callback=_csv_ints)
@click.option("--causal/--no-causal", default=None, help="Bottom-right aligned causal mask  [default: both]")
@click.option("--tokens", type=click.IntRange(min=1), default=16384, show_default=True)
@click.option("--hidden", type=click.IntRange(min=1), default=2048, show_default=True)
@click.option("--kv-ratio", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="bench/results", show_default=True)
@click.option("--tag", default="", help="Suffix of the output file's name.")
@click.option("--json", "as_json", is_flag=True, help="Print the report (or the error) as JSON.")
def main(impls, directions, head_dims, seqlens, causal, tokens, hidden, kv_ratio, repeats, out_dir, tag, as_json):
    """rawflash inside jax.jit beside jax.nn.dot_product_attention (cudnn, xla), timed on the GPU."""
    about = _require_gpu()
    causals = [False, True] if causal is None else [causal]
    cases = sweep_cases(impls, directions, head_dims, seqlens, causals, tokens, hidden, kv_ratio)
    click.echo(f"{len(cases)} cases on {about['device']}, jax {about['jax']}", err=True)
    rows = run(cases, repeats, progress=lambda line: click.echo(line, err=True))
    table = ratios(rows)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench-jax{('-' + tag) if tag else ''}.json"
    path.write_text(json.dumps({**about, "cases": rows, "ratios": table}, indent=1))
    bad = [{k: r[k] for k in ("impl", "direction", "head_dim", "seqlen", "causal", "status")} for r in rows
           if r["status"] != "ok"]
    note = f"xla is not run above N = {XLA_MAX_SEQLEN}: it materialises the N x N scores"
    if as_json:
        click.echo(json.dumps({**about, "cases": rows, "not timed": bad, "ratios": table, "note": note,
                               "wrote": [str(path)]}, indent=1))
        return
    click.echo(f"device: {about['device']}\njax: {about['jax']}")
    click.echo(("not timed:\n" + report_mod.table(bad)) if bad else "every case validated and timed")
    click.echo("\nrawflash in jax.jit beside its peers:\n" + report_mod.table(table))
    click.echo(f"tflops: the jitted call on GPU events; kernel_tflops: rawflash's kernels through its CuPy API; "
               f"jit / kernels: the two times' ratio. {note}.")
    click.echo(f"wrote {path}")


def cli(argv: list[str] | None = None) -> int:
    """``main`` with rawflash's error conventions: a one-line error (exit 1 cannot run here, 2 invalid input),
    as JSON on stdout with ``--json``; ``RAWFLASH_DEBUG=1`` shows the traceback of an unexpected error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # read when JAX first uses the GPU
    try:
        main.main(args=argv, prog_name="rawflash bench --jax", standalone_mode=False)
        return 0
    except click.exceptions.Exit as done:
        return done.exit_code
    except click.Abort:
        message, code = "aborted", 1
    except click.ClickException as err:
        message, code = err.format_message(), err.exit_code
    except Exception as err:
        if settings.load().debug:
            raise
        message, code = f"{_error(err)} (set RAWFLASH_DEBUG=1 for the traceback)", 1
    if "--json" in argv:
        click.echo(json.dumps({"error": message, "exit_code": code, "command": "bench"}, indent=1))
    else:
        click.echo(f"Error: {message}", err=True)
    return code


if __name__ == "__main__":
    sys.exit(cli())
