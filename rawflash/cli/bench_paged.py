"""``rawflash bench --paged``: a paged prefill (``rawflash.forward`` with ``block_table``: packed queries against
keys in pages, in a shuffled page order; its default form, FA3's on Hopper, and its cp.async form) beside the same
call on the same keys packed contiguously (both forms again) and PyTorch's SDPA on each sequence's contiguous keys
in turn (it has no packed form), bf16, causal, d = 128, GQA 32/8.

The paged call and the contiguous call are each timed once more in their default forms, ", new lengths each call":
every call gives seqused_k values no earlier call gave (a serving loop's chunked prefill, whose keys grow each
step; :func:`lengths_each_call`; copied to the device before the timing, :func:`_new_lengths`) with the same
longest sequence, so every call after the first runs the first's
plan (the signature holds the lengths' layout and maxima) after the host checks its values, as the rows with
repeated lengths do. "ms over repeated lengths" is that difference per call (the contiguous call's new-lengths row
gives seqused_k, its repeated row none; the kernels' work differs by under MAX_TRIM keys a sequence).

Each case is first validated on a reduced case of its kind (4 sequences of at most 1000 tokens) by flash-attn's rule
against the float64 reference, then timed as public calls back to back (``bench.time_calls_ms``) and, for rawflash,
as its kernels alone (a CUDA graph of the bound launches, ``bench.time_kernels_ms``). "x contiguous" is the paged
call's speed over the contiguous call's (1.0: paging costs nothing).
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


@dataclasses.dataclass(frozen=True)
class PagedCase:
    lengths: tuple      # each sequence's queries = keys (a whole prompt prefilled)
    page: int           # the paged call's page size (the contiguous calls read the same keys packed)

    @property
    def name(self) -> str:
        lo, hi = min(self.lengths), max(self.lengths)
        return f"{len(self.lengths)} seqs {lo}-{hi} tokens, pages of {self.page}"

    def flops(self) -> float:
        """Causal attention's matmul FLOPs (half of 4 n^2 d per head)."""
        return sum(2.0 * n * n * HEAD_DIM * HEADS for n in self.lengths)


def paged_cases() -> list[PagedCase]:
    """16 sequences of 256 - 8192 tokens (geometric spacing), pages of 64 and 16."""
    lengths = tuple(int(round(x / 64) * 64) for x in np.geomspace(256, 8192, 16))
    return [PagedCase(lengths, 64), PagedCase(lengths, 16)]


def _inputs(lengths, page: int, seed: int = 0):
    """Device arrays: packed q; pages of k and v (shuffled) with block_table; the same keys packed; cu_seqlens and
    seqused_k."""
    import cupy
    import ml_dtypes

    from .bench_decode import _fill

    rng = cupy.random.default_rng(seed)
    total = int(sum(lengths))
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))

    def rand(*shape):
        x = cupy.empty(shape, dtype=np.dtype(ml_dtypes.bfloat16))
        _fill(x, rng)
        return x

    q = rand(total, HEADS, HEAD_DIM)
    k, v = rand(total, KV_HEADS, HEAD_DIM), rand(total, KV_HEADS, HEAD_DIM)
    per = [-(-n // page) for n in lengths]
    pages = sum(per)
    order = np.random.default_rng(seed).permutation(pages)
    table = np.zeros((len(lengths), max(per)), np.int32)
    kp = cupy.zeros((pages, page, KV_HEADS, HEAD_DIM), dtype=k.dtype)
    vp = cupy.zeros_like(kp)
    at, start = 0, 0
    for b, n in enumerate(lengths):
        for j in range(per[b]):
            slot, rows = int(order[at]), min(page, n - j * page)
            table[b, j] = slot
            kp[slot, :rows] = k[start + j * page:start + j * page + rows]
            vp[slot, :rows] = v[start + j * page:start + j * page + rows]
            at += 1
        start += n
    used = cupy.asarray(np.asarray(lengths, np.int32))
    return dict(q=q, k=k, v=v, kp=kp, vp=vp, table=cupy.asarray(table), cu=cu, used=used)


NEW_LENGTHS = ", new lengths each call"
MAX_TRIM = 64  # keys a call's seqused_k leaves out of a sequence at most (lengths_each_call)


def lengths_each_call(lengths, start: int = 1):
    """seqused_k of successive calls (host int32 arrays), no two alike: call n uses ``lengths[b] - digit b of n in
    base MAX_TRIM`` keys of sequence b (at least 0), so sequences longer than MAX_TRIM keys give new values every
    call and the kernels' work changes by under MAX_TRIM keys a sequence; the high digits stay 0 over the calls a
    timing makes, so the last sequences (the cases' longest) keep all their keys and every call the maxima of the
    first. ``start`` >= 1: call 0 would be the full lengths, which the rows with repeated lengths plan."""
    n = start
    while True:
        trims = [(n // MAX_TRIM ** b) % MAX_TRIM for b in range(len(lengths))]
        yield np.maximum(np.asarray(lengths, np.int64) - trims, 0).astype(np.int32)
        n += 1


NEW_LENGTH_ARRAYS = 256  # seqused_k arrays made before a timing (more than its calls: no two calls alike)


def _new_lengths(lengths):
    """A function giving each call's seqused_k on the device, taken in turn from arrays copied there before the
    timing: the timed calls pay rawflash's own work on new lengths, not the bench's copy from pageable host memory
    (which waits for the GPU to finish the previous call before the call's own host work can start)."""
    import itertools

    import cupy

    made = [cupy.asarray(x) for x in itertools.islice(lengths_each_call(lengths), NEW_LENGTH_ARRAYS)]
    cupy.cuda.get_current_stream().synchronize()
    each = itertools.cycle(made)
    return lambda: next(each)


def _paged_call(x, new_lengths=None, **switches):
    """The paged call on ``x``; ``new_lengths``: a function giving each call's seqused_k (else x's)."""
    import rawflash

    return lambda: rawflash.forward(x["q"], x["kp"], x["vp"], cu_seqlens_q=x["cu"],
                                    seqused_k=x["used"] if new_lengths is None else new_lengths(),
                                    block_table=x["table"], causal=True, **switches)


def _contiguous_call(x, new_lengths=None, **switches):
    """The contiguous call on ``x``; ``new_lengths``: a function giving each call's seqused_k (else none)."""
    import rawflash

    return lambda: rawflash.forward(x["q"], x["k"], x["v"], cu_seqlens_q=x["cu"], cu_seqlens_k=x["cu"], causal=True,
                                    seqused_k=None if new_lengths is None else new_lengths(), **switches)


def _bound(x, paged: bool, override=None, **switches):
    """The paged call's (``paged``) or the contiguous call's kernels bound once (``Bound.launch``); ``override``:
    tile rows in place of the table's (tools/tune_paged.py)."""
    from .. import settings, validation
    from ..kernels import cupy_backend, forms

    if paged:
        feats = validation.Features(cu_seqlens_q=x["cu"], seqused_k=x["used"], block_table=x["table"])
        k, v = x["kp"], x["vp"]
    else:
        feats = validation.Features(cu_seqlens_q=x["cu"], cu_seqlens_k=x["cu"])
        k, v = x["k"], x["v"]
    c = validation.check_forward(x["q"], k, v, True, None, "fa2", "cupy", feats)
    return cupy_backend.bind_forward(c.problem, x["q"], k, v, c.scale, "fa2", forms.Switches(**switches), c.extras,
                                     settings.load(), override=override)


REDUCED = (100, 1, 1000, 437)  # the validation case's sequences


def validate(page: int, **switches) -> tuple[bool, str]:
    """flash-attn's rule for the paged call on a reduced case of its page size (4 sequences, 100 - 1000 tokens)."""
    x = _inputs(REDUCED, page, seed=3)
    out, _ = _paged_call(x, **switches)()
    return check_out(x, out)


def validate_new_lengths(page: int, paged: bool, calls: int = 2) -> tuple[bool, str]:
    """flash-attn's rule for ``calls`` successive calls of a new-lengths row (the paged call's with ``paged``, else
    the contiguous call's) on the reduced case, each against the reference with that call's seqused_k."""
    import cupy

    x = _inputs(REDUCED, page, seed=3)
    each = lengths_each_call(REDUCED)
    for _ in range(calls):
        used = next(each)
        out, _ = (_paged_call if paged else _contiguous_call)(x, functools.partial(cupy.asarray, used))()
        ok, why = check_out(x, out, used)
        if not ok:
            return ok, f"{why} (seqused_k {used.tolist()})"
    return True, "ok"


def check_out(x, out, used=None) -> tuple[bool, str]:
    """flash-attn's rule for a paged or contiguous call's ``out`` on the inputs ``x`` (against the same keys packed;
    ``used``: the call's seqused_k where it gave one)."""
    import cupy

    from .bench import rule_verdict

    host = {n: cupy.asnumpy(a) for n, a in x.items()}
    return rule_verdict(cupy.asnumpy(out), host["q"], host["k"], host["v"], cu_seqlens_q=host["cu"],
                        cu_seqlens_k=host["cu"], seqused_k=used, causal=True)


def _torch_loop(x, lengths):
    """PyTorch SDPA (its default backend choice) on each sequence's contiguous keys, one call per sequence."""
    from .bench import _torch

    torch = _torch()
    if torch is None:
        return None
    q, k, v = (torch.from_dlpack(x[n]) for n in ("q", "k", "v"))
    spans, start = [], 0
    for n in lengths:
        spans.append((start, start + n))
        start += n
    views = [(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None], v[a:b].transpose(0, 1)[None])
             for a, b in spans]

    def call():
        for tq, tk, tv in views:
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)

    return call


def compare(rows: list[dict], by: dict) -> None:
    """Adds to one case's rows (``by``: its timed rows' ms by impl) each paged row's "x contiguous" (and "x
    contiguous cp.async"), against the contiguous row of its kind (repeated or new lengths), and each new-lengths
    row's "ms over repeated lengths"."""
    for r in rows:
        impl, ms = r["impl"], by.get(r["impl"])
        if ms is None:
            continue
        if impl.endswith(NEW_LENGTHS):
            repeated = by.get(impl[:-len(NEW_LENGTHS)])
            if repeated is not None:
                r["ms over repeated lengths"] = round(ms - repeated, 4)
            if impl.startswith("rawflash paged") and "rawflash contiguous" + NEW_LENGTHS in by:
                r["x contiguous"] = round(by["rawflash contiguous" + NEW_LENGTHS] / ms, 3)
        elif impl.startswith("rawflash paged"):
            r["x contiguous"] = round(by["rawflash contiguous"] / ms, 3)
            r["x contiguous cp.async"] = round(by["rawflash contiguous cp.async"] / ms, 3)


def run_paged(repeats: int = 10, cases: list[PagedCase] | None = None) -> dict:
    """Validate and time every case; rows of (case, impl, ms, kernel_ms, TFLOP/s, x contiguous; the new-lengths
    rows: ms over repeated lengths, no kernel_ms)."""
    import cupy

    from .bench import time_calls_ms, time_kernels_ms

    rows = []
    for case in cases or paged_cases():
        x = _inputs(case.lengths, case.page)
        timed = []
        for suffix, switches in (("", {}), (" cp.async", {"warp_specialize": False})):
            impl = f"rawflash paged {case.page}{suffix}"
            ok, why = validate(case.page, **switches)
            if ok:
                timed.append((impl, _paged_call(x, **switches), _bound(x, True, **switches)))
            else:
                rows.append({"case": case.name, "impl": impl, "status": f"invalid: {why}"})
        timed.append(("rawflash contiguous", _contiguous_call(x), _bound(x, False)))
        timed.append(("rawflash contiguous cp.async", _contiguous_call(x, warp_specialize=False),
                      _bound(x, False, warp_specialize=False)))
        for impl, paged, call in ((f"rawflash paged {case.page}", True, _paged_call),
                                  ("rawflash contiguous", False, _contiguous_call)):
            ok, why = validate_new_lengths(case.page, paged)
            if ok:
                timed.append((impl + NEW_LENGTHS, call(x, _new_lengths(case.lengths)), None))
            else:
                rows.append({"case": case.name, "impl": impl + NEW_LENGTHS, "status": f"invalid: {why}"})
        loop = _torch_loop(x, case.lengths)
        if loop is not None:
            timed.append(("torch SDPA per sequence", loop, None))
        by = {}
        for impl, call, bound in timed:
            ms = time_calls_ms(call, repeats=repeats)
            kernel_ms = time_kernels_ms(bound.launch, repeats=repeats) if bound is not None else None
            by[impl] = ms
            rows.append({"case": case.name, "impl": impl, "status": "ok", "ms": round(ms, 4),
                         "kernel_ms": None if kernel_ms is None else round(kernel_ms, 4),
                         "TFLOP/s": round(case.flops() / ms / 1e9, 1)})
        compare([r for r in rows if r["case"] == case.name], by)
        del x
        cupy.get_default_memory_pool().free_all_blocks()
    return {"rows": rows}
