"""The benchmark: validate every implementation against the reference, then time it beside the peers.

Conventions: FLOPs are ``4 B H Nq Nk d`` forward (half when causal), backward 2.5x that (``iomodel.flops``, which
also counts a v with a head_dim of its own: ``Case.head_dim_v``, ``rawflash bench --mla``);
times are the median of CUDA-event timings after a warm-up, of calls queued back to back (``time_calls_ms``: the
public call's time, host included, which is the headline; the kernels' time beside it, a CUDA graph of them
replayed back to back: ``time_kernels_ms``); every
implementation is first checked by flash-attn's rule on a reduced problem with the same kernel instantiation
(same dtype, head_dim and causal flag) and an implementation that fails is reported, not timed.
Peers: ``torch-flash`` and ``torch-cudnn`` (PyTorch SDPA backends, only when PyTorch is importable; never a
dependency) and ``cupy-naive`` (the matmul-softmax-matmul a CuPy user writes today).

``float8_e4m3fn`` (the FP8 forward): rawflash-fa2's forward only, on inputs drawn like the others and quantised per
(batch, kv head) by ``rawflash.fp8.quantize``; validated against the float64 reference of the dequantised inputs by
the FP8 forward's documented bounds (``FP8_BOUNDS``), and compared with rawflash-fa2's bfloat16 row of the same
shape when the run has one. PyTorch's SDPA has no FP8 path to call, so the peers' FP8 figures are the published
ones (``FP8_PUBLISHED``).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Callable

import ml_dtypes
import numpy as np

from .. import reference
from . import iomodel

IMPLS = ("rawflash-fa2", "rawflash-fa2-det", "rawflash-fa2-wgmma", "rawflash-fa2-mma", "rawflash-fa1", "rawflash-naive",
         "torch-flash", "torch-cudnn", "cupy-naive")
# rawflash implementations: (kernel=, extra forward switches). rawflash-fa2 is what a user gets (on Hopper FA3's
# warp-specialised form where it applies); rawflash-fa2-wgmma forces the wgmma form without warp specialisation and
# rawflash-fa2-mma the mma.sync kernel, to show what each Hopper step is worth.
RAWFLASH_IMPLS = {"rawflash-fa2": ("fa2", {}), "rawflash-fa2-wgmma": ("fa2", {"warp_specialize": False}),
                  "rawflash-fa2-mma": ("fa2", {"wgmma": False}),
                  "rawflash-fa1": ("fa1", {}), "rawflash-naive": ("naive", {}), "rawflash-fa2-det": ("fa2", {})}
FORWARD_ONLY = ("rawflash-fa2-wgmma", "rawflash-fa2-mma", "rawflash-fa1", "rawflash-naive", "cupy-naive")
# rawflash-fa2-det: the backward with deterministic=True (on Hopper FA3's form with its dQ reduce-adds in order),
# timed only when asked (``rawflash bench --deterministic`` or ``--impl rawflash-fa2-det``)
DETERMINISTIC = ("rawflash-fa2-det",)
BACKWARD_ONLY = DETERMINISTIC
OPT_IN = DETERMINISTIC
FLUSH_BYTES = 256 << 20  # larger than the H200's 60 MB L2
FP8 = "float8_e4m3fn"
FP8_BOUNDS = {"rmse": 0.02, "max": 0.25}  # unit-normal inputs: the FP8 forward's error budget (README, tests)
FP8_PUBLISHED = "cuDNN 9.19 FP8 forward 1062 TFLOP/s (H200, d = 128, N = 16384); FA3 FP8 1171 (H100, d = 256)"


@dataclasses.dataclass(frozen=True)
class Case:
    impl: str
    direction: str
    dtype: str
    batch: int
    heads: int
    kv_heads: int
    seqlen: int
    head_dim: int
    causal: bool
    head_dim_v: int | None = None  # v's head_dim where it differs from q's and k's (MLA); None: head_dim

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def flops(self) -> float:
        shape = iomodel.Shape(self.batch, self.seqlen, self.seqlen, self.heads, self.kv_heads, self.head_dim, 2,
                              self.causal, head_dim_v=self.head_dim_v)
        return float(iomodel.flops(shape, self.direction))


@dataclasses.dataclass
class Record:
    impl: str
    direction: str
    dtype: str
    batch: int
    heads: int
    kv_heads: int
    seqlen: int
    head_dim: int
    causal: bool
    ms: float | None
    tflops: float | None
    status: str = "ok"
    kernel_ms: float | None = None  # rawflash: the launches alone (no validation, allocation or copy)
    head_dim_v: int | None = None

    @property
    def case(self) -> Case:
        return Case(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Case)})

    @classmethod
    def of(cls, case: Case, ms: float | None, status: str = "ok", kernel_ms: float | None = None) -> "Record":
        tf = case.flops / (ms * 1e-3) / 1e12 if ms else None
        return cls(**dataclasses.asdict(case), ms=ms, tflops=tf, status=status, kernel_ms=kernel_ms)

    @property
    def kernel_tflops(self) -> float | None:
        return self.case.flops / (self.kernel_ms * 1e-3) / 1e12 if self.kernel_ms else None


def sweep_cases(impls, directions, dtypes, head_dims, seqlens, causals, tokens=16384, hidden=2048, kv_ratio=1):
    """The FA2 paper's sweep: B = tokens / N, H = hidden / d (kv_heads = H / kv_ratio for GQA runs)."""
    cases = []
    for impl in impls:
        for direction in directions:
            if (direction == "bwd" and impl in FORWARD_ONLY) or (direction == "fwd" and impl in BACKWARD_ONLY):
                continue
            for dtype in dtypes:
                if impl == "cupy-naive" and dtype != "float16":
                    continue  # CuPy has no bfloat16 matmul: the plain-CuPy peer runs in float16
                if dtype == FP8 and (impl != "rawflash-fa2" or direction != "fwd"):
                    continue  # FP8 is rawflash's forward alone (no FP8 backward; no peer to call)
                for d in head_dims:
                    for n in seqlens:
                        for causal in causals:
                            b, h = max(1, tokens // n), hidden // d
                            cases.append(Case(impl, direction, dtype, b, h, h // kv_ratio, n, d, causal))
    return cases


# ---------------------------------------------------------------- timing
def _warm_ms(fn: Callable[[], object], warmup: int) -> float:
    """``warmup`` calls of ``fn`` back to back; the CUDA-event time of one of them in ms (sizes the timing)."""
    import cupy

    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(warmup):
        fn()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / warmup


def time_ms(fn: Callable[[], object], repeats: int = 20, warmup: int = 3, budget_ms: float = 3000.0) -> float:
    """Median CUDA-event time of ``fn`` in ms, with L2 flushed (a 256 MB memset) before every timed call.

    Slow cases get fewer repeats (at least 3) so that one case stays within about ``budget_ms``.
    """
    import cupy

    flush = cupy.empty(FLUSH_BYTES, dtype=cupy.uint8)
    once = _warm_ms(fn, warmup)
    repeats = max(3, min(repeats, int(budget_ms / max(once, 1e-3))))
    times = []
    for _ in range(repeats):
        flush.fill(1)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def time_calls_ms(fn: Callable[[], object], repeats: int = 20, warmup: int = 3, budget_ms: float = 3000.0) -> float:
    """Median CUDA-event time of one call of ``fn`` in ms, calls queued back to back with nothing between them:
    ``repeats`` loops of a few calls (enough for about 2 ms of GPU work), each loop timed by one pair of events and
    divided by its calls. Where the host takes longer to queue a call than the GPU takes to run it, this shows it
    (a flush before each call would hide it behind the flush's own GPU time)."""
    import cupy

    once = _warm_ms(fn, warmup)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    calls = max(1, min(50, int(2.0 / max(once, 1e-3))))
    repeats = max(3, min(repeats, int(budget_ms / max(once * calls, 1e-3))))
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / calls)
    return statistics.median(times)


def time_kernels_ms(launch: Callable[[], object], repeats: int = 20) -> float:
    """Median time of ``launch`` (a bound call's kernels) in ms, captured once in a CUDA graph on a stream of its
    own and replayed back to back (``time_calls_ms``): the kernels with no host work between them. A launch that
    cannot be captured is timed as it is."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        launch()
        stream.synchronize()
        try:
            stream.begin_capture()
            launch()
        finally:
            graph = stream.end_capture() if stream.is_capturing() else None
        if graph is None:
            return time_calls_ms(launch, repeats=repeats)
        return time_calls_ms(graph.launch, repeats=repeats)


# ---------------------------------------------------------------- implementations
def _torch():
    try:
        import torch

        return torch if torch.cuda.is_available() else None
    except Exception:
        return None


def available_impls() -> list[str]:
    have_torch = _torch() is not None
    return [i for i in IMPLS if have_torch or not i.startswith("torch")]


def default_impls(available: list[str], deterministic: bool = False) -> list[str]:
    """What ``rawflash bench`` times without --impl: every available implementation but the opt-in ones, and the
    deterministic backward too with ``deterministic``."""
    return [i for i in available if i not in OPT_IN or (deterministic and i in DETERMINISTIC)]


def make_inputs(case: Case, seed: int = 0):
    import cupy

    from ..validation import check_choice

    check_choice(case.dtype, "dtype", ("float16", "bfloat16", "float32", FP8))
    rng = cupy.random.default_rng(seed)
    dt = np.dtype(ml_dtypes.bfloat16) if case.dtype in ("bfloat16", FP8) else np.dtype(case.dtype)
    shape_q = (case.batch, case.seqlen, case.heads, case.head_dim)
    shape_k = (case.batch, case.seqlen, case.kv_heads, case.head_dim)
    shape_v, shape_o = (*shape_k[:3], case.dv), (*shape_q[:3], case.dv)
    q, k, v = (rng.standard_normal(s, dtype=cupy.float32).astype(dt) for s in (shape_q, shape_k, shape_v))
    if case.dtype == FP8:  # the fourth value is then the descales (an FP8 case is a forward)
        from .. import fp8

        (q, qd), (k, kd), (v, vd) = (fp8.quantize(x, "head", kv_heads=case.kv_heads) for x in (q, k, v))
        return q, k, v, {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    dout = rng.standard_normal(shape_o, dtype=cupy.float32).astype(dt)
    return q, k, v, dout


def bound_call(case: Case, q, k, v, dout, override=None):
    """rawflash only: the call bound to its buffers once (``cupy_backend.Bound``): ``.launch()`` queues its kernels
    alone, the kernels' own time without the public call's validation, allocation and copies; ``.result()`` is what
    the call returns. ``override`` replaces tile rows (tools/tune.py)."""
    import rawflash

    from .. import settings, validation
    from ..kernels import cupy_backend, forms

    kernel, switches = RAWFLASH_IMPLS[case.impl]
    env = settings.load()
    if case.dtype == FP8:  # dout holds the descales (make_inputs)
        c = validation.check_forward(q, k, v, case.causal, None, kernel)
        c, ds = validation.check_fp8(c, kernel, "cupy", validation.Features(), dout, None, False)
        return cupy_backend.bind_forward_fp8(c.problem, q, k, v, c.scale, ds, forms.Switches(**switches), c.extras,
                                             env, override)
    if case.direction == "fwd":
        c = validation.check_forward(q, k, v, case.causal, None, kernel)
        bound = cupy_backend.bind_forward(c.problem, q, k, v, c.scale, kernel, forms.Switches(**switches), c.extras,
                                          env, override)
    else:
        out, lse = rawflash.forward(q, k, v, causal=case.causal)
        det = case.impl in DETERMINISTIC
        c = validation.check_backward(dout, q, k, v, out, lse, case.causal, None, det)
        bound = cupy_backend.bind_backward(c.problem, dout, q, k, v, out, lse, c.scale, det, c.extras, env,
                                           override)
    return bound


def runner(case: Case, q, k, v, dout):
    """A zero-argument callable that runs ``case`` once (the forward of a backward case is done here, once)."""
    import rawflash

    if case.impl in RAWFLASH_IMPLS:
        kernel, switches = RAWFLASH_IMPLS[case.impl]
        if case.dtype == FP8:  # dout holds the descales (make_inputs)
            return lambda: rawflash.forward(q, k, v, causal=case.causal, kernel=kernel, **dout, **switches)
        if case.direction == "fwd":
            return lambda: rawflash.forward(q, k, v, causal=case.causal, kernel=kernel, **switches)
        out, lse = rawflash.forward(q, k, v, causal=case.causal)
        det = case.impl in DETERMINISTIC
        return lambda: rawflash.backward(dout, q, k, v, out, lse, causal=case.causal, deterministic=det)
    if case.impl == "cupy-naive":
        return lambda: cupy_naive(q, k, v, case.causal)
    return _torch_runner(case, q, k, v, dout)


def cupy_naive(q, k, v, causal: bool):
    """Plain CuPy attention, as a CuPy user writes it today: matmul, softmax, matmul (MHA layout)."""
    import cupy

    group = q.shape[2] // k.shape[2]
    qh, kh, vh = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    if group > 1:
        kh, vh = cupy.repeat(kh, group, axis=1), cupy.repeat(vh, group, axis=1)
    s = cupy.matmul(qh, kh.transpose(0, 1, 3, 2)) * q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
    if causal:
        nq, nk = s.shape[-2:]
        s = cupy.where(cupy.tri(nq, nk, nk - nq, dtype=bool), s, s.dtype.type(-np.inf))
    s = s - s.max(axis=-1, keepdims=True)
    p = cupy.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return cupy.matmul(p, vh).transpose(0, 2, 1, 3)


def _torch_runner(case: Case, q, k, v, dout):
    torch = _torch()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"torch-flash": SDPBackend.FLASH_ATTENTION, "torch-cudnn": SDPBackend.CUDNN_ATTENTION}[case.impl]
    tq, tk, tv, tdo = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v, dout))
    gqa = case.heads != case.kv_heads

    def fwd():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=case.causal,
                                                                     enable_gqa=gqa)

    if case.direction == "fwd":
        return fwd
    tq.requires_grad_(True), tk.requires_grad_(True), tv.requires_grad_(True)
    out = fwd()
    return lambda: torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True)


# ---------------------------------------------------------------- validation before timing
def validate(case: Case, seqlen_cap: int = 512) -> tuple[bool, str]:
    """flash-attn's rule on a reduced problem (1 batch, 2 query heads, seqlen <= seqlen_cap) of the same kind."""
    small = dataclasses.replace(case, batch=1, heads=2, kv_heads=max(1, 2 * case.kv_heads // case.heads),
                                seqlen=min(case.seqlen, seqlen_cap) - 3)
    return check_case(small)


def check_case(small: Case, seed: int = 11) -> tuple[bool, str]:
    """Run ``small`` once on inputs of its own (``make_inputs``, ``runner``) and grade its result: flash-attn's rule
    (``rule_verdict``), or the FP8 forward's bounds."""
    import cupy

    q, k, v, dout = make_inputs(small, seed=seed)
    got = runner(small, q, k, v, dout)()
    if small.dtype == FP8:
        return _validate_fp8(small, q, k, v, dout, got)

    def host(x):
        return x.transpose(1, 2).float().cpu().numpy() if hasattr(x, "cpu") else cupy.asnumpy(x)

    hq, hk, hv, hdo = (cupy.asnumpy(x) for x in (q, k, v, dout))
    if small.direction == "fwd":
        return rule_verdict(host(got[0] if isinstance(got, tuple) else got), hq, hk, hv, causal=small.causal)
    return rule_verdict([host(g) for g in got], hq, hk, hv, hdo, causal=small.causal)


def rule_verdict(got, q, k, v, dout=None, **reference_kw) -> tuple[bool, str]:
    """flash-attn's rule for a result against the float64 reference of the same inputs (``reference_kw``: causal,
    cu_seqlens, window, ...): each tensor's worst error at most ``factor`` times the naive computation's in the
    input dtype (``reference.error_ratio_ok``), factor 2 for a forward's ``got`` (out; ``dout`` None), 3 for a
    backward's (dq, dk, dv, and dsinks with sinks). ``(True, "ok")``, or ``(False, why)`` naming the first tensor
    that fails."""
    if dout is None:
        ref = reference.forward(q, k, v, **reference_kw)[0]
        base = reference.forward(q, k, v, upcast=False, **reference_kw)[0]
        pairs, factor = [("out", got, ref, base)], 2
    else:
        refs = reference.backward(dout, q, k, v, **reference_kw)
        bases = reference.backward(dout, q, k, v, upcast=False, **reference_kw)
        pairs, factor = list(zip(("dq", "dk", "dv", "dsinks"), got, refs, bases)), 3
    for name, g, ref, base in pairs:
        ok, err, _, bound = reference.error_ratio_ok(g, ref, base, q.dtype, factor)
        if not ok:
            return False, f"{name} error {err:.3g} > {bound:.3g}"
    return True, "ok"


def _validate_fp8(case: Case, q, k, v, descales: dict, got) -> tuple[bool, str]:
    """The FP8 forward against the float64 reference of its dequantised inputs, by ``FP8_BOUNDS``."""
    return fp8_rule(q, k, v, descales, got, kv_heads=case.kv_heads, causal=case.causal)


def fp8_rule(q, k, v, descales: dict, got, kv_heads: int | None = None, **reference_kw) -> tuple[bool, str]:
    """``FP8_BOUNDS`` (out's RMSE and worst error) for an FP8 forward's result ``got`` against the float64 reference
    of its dequantised inputs (descales per tensor, or per (batch, kv head) of ``kv_heads``), the reference called
    with ``reference_kw`` (causal, window, sinks, ...)."""
    import cupy

    from .. import fp8

    qf, kf, vf = (fp8.dequantize(x, descales[f"{n}_descale"], kv_heads=kv_heads) for x, n in
                  ((q, "q"), (k, "k"), (v, "v")))
    ref = reference.forward(qf, kf, vf, **reference_kw)[0]
    err = cupy.asnumpy(got[0]).astype(np.float64) - ref
    rmse, worst = float(np.sqrt(np.mean(err ** 2))), float(np.abs(err).max())
    if rmse > FP8_BOUNDS["rmse"] or worst > FP8_BOUNDS["max"]:
        return False, f"out RMSE {rmse:.3g} / max {worst:.3g} > {FP8_BOUNDS['rmse']} / {FP8_BOUNDS['max']}"
    return True, "ok"


def fits(case: Case, free_bytes: int) -> bool:
    """Whether the case's buffers (and the O(N^2) score matrices of the naive implementations) fit in memory."""
    item = {"float32": 4, FP8: 1}.get(case.dtype, 2)
    tokens = case.batch * case.seqlen
    d, dv = case.head_dim, case.dv  # q, out, dout; k, v, dk, dv
    need = tokens * (case.heads * (d + 2 * dv) + case.kv_heads * 2 * (d + dv)) * item + FLUSH_BYTES
    if case.impl in ("cupy-naive", "rawflash-naive"):
        need += 4 * case.batch * case.heads * case.seqlen ** 2 * item
    return need < 0.8 * free_bytes


def run_case(case: Case, repeats: int, validated: dict, override=None, check=None) -> Record:
    """Validate (once per kind of case, by ``check``: ``validate`` unless given), then time the public call and, for
    rawflash, its kernels alone."""
    import cupy

    key = (case.impl, case.direction, case.dtype, case.head_dim, case.dv, case.causal)
    if key not in validated:
        try:
            validated[key] = (check or validate)(case)
        except Exception as err:  # a peer that cannot run this case (e.g. no cuDNN kernel) is reported
            validated[key] = (False, f"{type(err).__name__}: {str(err).splitlines()[0][:100]}")
    ok, why = validated[key]
    if not ok:
        return Record.of(case, None, f"invalid: {why}")
    free, _ = cupy.cuda.Device().mem_info
    if not fits(case, free):
        return Record.of(case, None, "skipped: does not fit in memory")
    try:
        q, k, v, dout = make_inputs(case)
        ms = None if override else time_calls_ms(runner(case, q, k, v, dout), repeats=repeats)
        kernel_ms = None
        if case.impl in RAWFLASH_IMPLS:
            kernel_ms = time_kernels_ms(bound_call(case, q, k, v, dout, override).launch, repeats=repeats)
    except Exception as err:
        return Record.of(case, None, f"failed: {type(err).__name__}: {str(err).splitlines()[0][:100]}")
    finally:
        cupy.get_default_memory_pool().free_all_blocks()
    return Record.of(case, ms if ms is not None else kernel_ms, kernel_ms=kernel_ms)


def ratios(records: list[Record], impl: str = "rawflash-fa2") -> list[dict]:
    """For each timed ``impl`` record: its TFLOP/s over each peer's at the same case."""
    index = {(r.impl, r.direction, r.dtype, r.seqlen, r.head_dim, r.causal, r.kv_heads): r for r in records}
    rows = []
    for r in records:
        if r.impl != impl or r.tflops is None:
            continue
        row = {"direction": r.direction, "dtype": r.dtype, "seqlen": r.seqlen, "head_dim": r.head_dim,
               "causal": r.causal, "kv_heads": r.kv_heads, "tflops": r.tflops, "kernel_tflops": r.kernel_tflops}
        for peer in IMPLS:
            other = index.get((peer, r.direction, r.dtype, r.seqlen, r.head_dim, r.causal, r.kv_heads))
            if peer != impl and other is not None and other.tflops:
                row[f"x {peer}"] = r.tflops / other.tflops
        if r.dtype == FP8:  # FP8 against the same implementation's bfloat16 (the target's ratio)
            other = index.get((impl, r.direction, "bfloat16", r.seqlen, r.head_dim, r.causal, r.kv_heads))
            if other is not None and other.tflops:
                row[f"x {impl} bfloat16"] = r.tflops / other.tflops
                if r.kernel_tflops and other.kernel_tflops:
                    row[f"kernels x {impl} bfloat16"] = r.kernel_tflops / other.kernel_tflops
        rows.append(row)
    return rows


# ---------------------------------------------------------------- the features models use (their speed targets)
@dataclasses.dataclass(frozen=True)
class FeatureCase:
    """One feature measurement: a name, the call's shape (packed lengths for varlen) and its feature arguments."""

    name: str
    direction: str
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    causal: bool
    opts: tuple = ()              # (name, value) pairs: window, softcap, alibi, sinks
    lengths: tuple = ()           # packed sequences (varlen): batch and seqlen do not apply
    switches: tuple = ()          # (name, value) pairs of forms.Switches other than the defaults (forward only)
    dtype: str = "bfloat16"       # or FP8: q, k, v quantised per tensor (the forward only)

    @property
    def flops(self) -> float:
        """FLOPs over the visible (query, key) pairs only (a window's or each packed sequence's)."""
        window = dict(self.opts).get("window", (-1, -1))
        seqs = [(n, n) for n in self.lengths] or [(self.seqlen, self.seqlen)] * self.batch
        return float(sum(iomodel.flops(iomodel.Shape(1, sq, sk, self.heads, self.heads, self.head_dim, 2,
                                                     self.causal, window), self.direction) for sq, sk in seqs if sq))


def varlen_lengths(count: int = 16, low: int = 256, high: int = 8192, seed: int = 0) -> tuple:
    """The lengths of the varlen target: ``count`` sequences drawn uniformly in [low, high] with a fixed seed."""
    rng = np.random.default_rng(seed)
    return tuple(int(x) for x in rng.integers(low, high + 1, count))


def feature_cases(head_dim: int = 128, dtype: str = "bfloat16") -> list[FeatureCase]:
    """The cases behind the features' speed targets (bf16, 2048 / head_dim heads): a 1024-key causal window over
    16384 against dense causal 2048; a varlen batch against an equal-length batch of the same tokens (both forward
    and backward); soft-capping, ALiBi and sinks against plain attention at N = 4096, forward and backward.

    ``dtype=FP8``: the same cases for the FP8 forward (float8_e4m3fn q, k, v quantised per tensor), forward only,
    without the features it refuses (``validation.FP8_REFUSED``: soft-capping, ALiBi) and the switch variants."""
    if dtype == FP8:
        from ..validation import FP8_REFUSED

        refused = {"softcap": "softcap", "alibi": "alibi_slopes"}
        return [dataclasses.replace(c, dtype=FP8) for c in feature_cases(head_dim)
                if c.direction == "fwd" and not c.switches
                and not any(refused.get(n) in FP8_REFUSED for n, _ in c.opts)]
    lengths = varlen_lengths()
    even = sum(lengths) // len(lengths)
    h = 2048 // head_dim
    window = (("window", (1024, 0)),)
    cases = []
    for direction in ("fwd", "bwd"):  # (the targets are the forward's; the backward's figures beside them)
        cases += [FeatureCase("window (1024, 0), N 16384", direction, 1, 16384, h, head_dim, True, window)]
        if direction == "fwd":
            cases += [FeatureCase("window (1024, 0), N 16384, persistent", "fwd", 1, 16384, h, head_dim, True, window,
                                  switches=(("persistent", True),))]
        cases += [FeatureCase("dense causal, N 2048", direction, 8, 2048, h, head_dim, True)]
        for causal in (False, True):
            cases += [FeatureCase(f"varlen x16{' causal' if causal else ''}", direction, len(lengths), 0, h, head_dim,
                                  causal, lengths=lengths),
                      FeatureCase(f"equal x16 of {even}{' causal' if causal else ''}", direction, len(lengths), even,
                                  h, head_dim, causal)]
    for direction in ("fwd", "bwd"):
        for name, opts in (("plain", ()), ("softcap 30", (("softcap", 30.0),)), ("alibi", (("alibi", True),)),
                           ("sinks", (("sinks", True),))):
            cases.append(FeatureCase(f"{name}, N 4096", direction, 4, 4096, h, head_dim, False, opts))
    return cases


def _feature_inputs(case: FeatureCase):
    import cupy

    rng = cupy.random.default_rng(7)
    dt = np.dtype(ml_dtypes.bfloat16)
    if case.lengths:
        shape = (sum(case.lengths), case.heads, case.head_dim)
    else:
        shape = (case.batch, case.seqlen, case.heads, case.head_dim)
    q, k, v, dout = (rng.standard_normal(shape, dtype=cupy.float32).astype(dt) for _ in range(4))
    opts = dict(case.opts)
    feats = {}
    if "window" in opts:
        feats["window"] = opts["window"]
    if "softcap" in opts:
        feats["softcap"] = opts["softcap"]
    if opts.get("alibi"):
        feats["alibi_slopes"] = cupy.linspace(0.01, 0.3, case.heads, dtype=cupy.float32)
    if opts.get("sinks"):
        feats["sinks"] = cupy.linspace(-1, 1, case.heads, dtype=cupy.float32)
    if case.lengths:
        cu = cupy.asarray(np.cumsum((0,) + case.lengths).astype(np.int32))
        feats.update(cu_seqlens_q=cu, cu_seqlens_k=cu)
    if case.dtype == FP8:  # per-tensor scales (the granularity packed sequences take); no dout (a forward)
        from .. import fp8

        (q, qd), (k, kd), (v, vd) = (fp8.quantize(x, "tensor") for x in (q, k, v))
        feats.update(q_descale=qd, k_descale=kd, v_descale=vd)
        dout = None
    return q, k, v, dout, feats


def feature_bound(case: FeatureCase, q, k, v, dout, feats, override=None):
    """The call of ``case`` bound once (its kernels alone are timed; the public call, which checks cu_seqlens on
    the host, is timed beside it); ``override`` replaces tile rows (tools/tune.py --features)."""
    import rawflash

    from .. import settings, validation
    from ..kernels import cupy_backend, forms

    f = validation.Features(**{n: feats.get(n, d) for n, d in (("window", (-1, -1)), ("softcap", 0.0),
                                                                  ("alibi_slopes", None), ("sinks", None),
                                                                  ("cu_seqlens_q", None), ("cu_seqlens_k", None))})
    env = settings.load()
    if case.dtype == FP8:
        c = validation.check_forward(q, k, v, case.causal, None, "fa2", "cupy", f)
        descales = {n: feats[n] for n in ("q_descale", "k_descale", "v_descale")}
        c, ds = validation.check_fp8(c, "fa2", "cupy", f, descales, None, False)
        return cupy_backend.bind_forward_fp8(c.problem, q, k, v, c.scale, ds, forms.Switches(**dict(case.switches)),
                                             c.extras, env, override)
    if case.direction == "fwd":
        c = validation.check_forward(q, k, v, case.causal, None, "fa2", "cupy", f)
        return cupy_backend.bind_forward(c.problem, q, k, v, c.scale, "fa2", forms.Switches(**dict(case.switches)),
                                         extras=c.extras, env=env, override=override)
    out, lse = rawflash.forward(q, k, v, causal=case.causal, **feats)
    c = validation.check_backward(dout, q, k, v, out, lse, case.causal, None, False, "cupy", f)
    return cupy_backend.bind_backward(c.problem, dout, q, k, v, out, lse, c.scale, False, c.extras, env, override)


def run_features(repeats: int = 10, head_dim: int = 128, directions: tuple = ("fwd", "bwd"),
                 dtypes: tuple = ("bfloat16",)) -> list[dict]:
    """Time every feature case at ``head_dim`` in ``directions`` for each of ``dtypes`` (bfloat16, FP8: kernels
    alone, and the public call); validated elsewhere (tests/test_gpu_features, tests/test_gpu_fp8)."""
    import cupy

    import rawflash

    rows = []
    cases = [c for dt in dtypes for c in feature_cases(head_dim, dt) if c.direction in directions]
    for case in cases:
        q, k, v, dout, feats = _feature_inputs(case)
        bound = feature_bound(case, q, k, v, dout, feats)
        kernel_ms = time_kernels_ms(bound.launch, repeats=repeats)
        if case.direction == "fwd":
            public = lambda: rawflash.forward(q, k, v, causal=case.causal, **feats, **dict(case.switches))  # noqa: E731
        else:
            out, lse = rawflash.forward(q, k, v, causal=case.causal, **feats)
            public = lambda: rawflash.backward(dout, q, k, v, out, lse, causal=case.causal, **feats)  # noqa: E731
        ms = time_calls_ms(public, repeats=repeats)
        row = {"case": case.name, "direction": case.direction, "dtype": case.dtype, "kernel_ms": kernel_ms, "ms": ms,
               "kernel_tflops": case.flops / (kernel_ms * 1e-3) / 1e12, "tflops": case.flops / (ms * 1e-3) / 1e12}
        # a PyTorch user's peer for packed sequences: torch-flash called once per sequence
        if case.lengths and case.direction == "fwd" and case.dtype != FP8 and _torch() is not None:
            torch_ms = time_calls_ms(_torch_per_sequence(case, q, k, v), repeats=repeats)
            row.update({"torch-flash per sequence ms": torch_ms, "x torch-flash per sequence": torch_ms / ms})
        rows.append(row)
        del q, k, v, dout, feats, bound
        cupy.get_default_memory_pool().free_all_blocks()
    return _feature_ratios(rows)


def _torch_per_sequence(case: FeatureCase, q, k, v):
    """PyTorch SDPA's flash backend called once per packed sequence (it takes no cu_seqlens), forward."""
    torch = _torch()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    bounds = np.cumsum((0,) + case.lengths)
    # (1, heads, n, d) views of each sequence, made once: the timed loop is the calls alone
    seqs = [tuple(t[a:b].transpose(0, 1).unsqueeze(0) for t in (tq, tk, tv)) for a, b in zip(bounds, bounds[1:])]

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            for sq, sk, sv in seqs:
                torch.nn.functional.scaled_dot_product_attention(sq, sk, sv, is_causal=case.causal)

    return run


def _feature_ratios(rows: list[dict]) -> list[dict]:
    """Each row with the ratio its target compares (window / dense causal, varlen / equal, feature / plain), within
    its dtype; an FP8 row also against the bfloat16 row of the same case when the run has one."""
    by = {(r["case"], r["direction"], r["dtype"]): r for r in rows}
    for r in rows:
        name, d, dt = r["case"], r["direction"], r["dtype"]
        same = by.get((name, d, "bfloat16"))
        if dt == FP8 and same is not None:
            r["x bfloat16 (kernels)"] = r["kernel_tflops"] / same["kernel_tflops"]
        if name.startswith("window"):
            other = by[("dense causal, N 2048", d, dt)]
        elif name.startswith("varlen"):
            other = next(x for (n, dd, t), x in by.items() if n.startswith("equal") and dd == d and t == dt
                         and n.endswith("causal") == name.endswith("causal"))
        elif name.endswith("N 4096") and not name.startswith("plain"):
            other = by[("plain, N 4096", d, dt)]
        else:
            continue
        r["vs"] = other["case"]
        r["ratio (kernels)"] = r["kernel_tflops"] / other["kernel_tflops"]
    return rows
