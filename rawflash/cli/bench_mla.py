"""``rawflash bench --mla``: DeepSeek-V3's prefill attention (MLA as the model computes it in prefill: 128 heads
(MHA), q and k with head_dim_qk 192 = 128 + 64 rope dims, v with head_dim_v 128), bf16, forward and backward, full
and causal, beside PyTorch's SDPA restricted to its cuDNN backend (``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)``),
which takes a v narrower than q and k.

Cases: N = 4096, 8192, 16384 with batch = max(1, 16384 // N), so every call attends 16384 tokens (the FA2 paper's
rule, ``bench.sweep_cases``). FLOPs: ``iomodel.flops`` with ``head_dim_v`` (per (batch, head) forward
``2 N^2 (dqk + dv)``, backward ``2 N^2 (3 dqk + 2 dv)``, causal half of either).

Each kind of case (implementation, direction, causal) is first run on reduced cases of its kind (batch 1, 8 heads,
N = 512 and a ragged 700) and graded against the float64 reference by flash-attn's rule (``bench.check_case``,
``bench.rule_verdict``); a kind that fails is reported "invalid", one whose call raises (cuDNN without a kernel for
the shape, a backend that refuses v's own head_dim) "refused", with the reason, and neither is timed. A valid case
is timed as public calls back to back (``bench.time_calls_ms``: the headline TFLOP/s) and, for rawflash, as its
kernels alone (a CUDA graph of the bound launches, ``bench.time_kernels_ms``), through ``bench.run_case``.
"""
from __future__ import annotations

import dataclasses

from . import bench

HEADS, HEAD_DIM_QK, HEAD_DIM_V = 128, 192, 128
SEQLENS = (4096, 8192, 16384)
TOKENS = 16384  # batch * N of every case
DTYPE = "bfloat16"
RAWFLASH, PEER = "rawflash-fa2", "torch-cudnn"
REDUCED_HEADS, REDUCED_SEQLENS = 8, (512, 700)  # the validation's cases (batch 1)


def mla_cases(impls: tuple = (RAWFLASH, PEER)) -> list[bench.Case]:
    """Every (implementation, direction, N, causal) case: batch = max(1, TOKENS // N), 128 heads, dqk 192, dv 128."""
    return [bench.Case(impl, direction, DTYPE, max(1, TOKENS // n), HEADS, HEADS, n, HEAD_DIM_QK, causal,
                       head_dim_v=HEAD_DIM_V)
            for impl in impls for direction in ("fwd", "bwd") for n in SEQLENS for causal in (False, True)]


def reduced_cases(case: bench.Case) -> list[bench.Case]:
    """The cases that validate ``case``'s kind: batch 1, ``REDUCED_HEADS`` heads, each of ``REDUCED_SEQLENS``."""
    return [dataclasses.replace(case, batch=1, heads=REDUCED_HEADS, kv_heads=REDUCED_HEADS, seqlen=n)
            for n in REDUCED_SEQLENS]


def validate(case: bench.Case, check=bench.check_case) -> tuple[bool, str]:
    """``check`` (run a case once and grade it: ``bench.check_case``) on each of ``reduced_cases(case)``; the first
    failure, named by its N."""
    for small in reduced_cases(case):
        ok, why = check(small)
        if not ok:
            return False, f"N {small.seqlen}: {why}"
    return True, "ok"


def verdict(case: bench.Case, check=bench.check_case) -> str:
    """``validate``'s outcome as a row's status: "ok", "invalid: why" (the rule failed) or "refused: why" (the call
    raised: no kernel for the shape, head_dim_v refused, ...)."""
    try:
        ok, why = validate(case, check)
    except Exception as err:
        return f"refused: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:120]}"
    return "ok" if ok else f"invalid: {why}"


def peer_missing() -> str | None:
    """Why the cuDNN peer cannot run here (no PyTorch with CUDA, or no cuDNN SDPA backend in it), or None."""
    torch = bench._torch()
    if torch is None:
        return "PyTorch with CUDA is not importable here"
    try:
        from torch.nn.attention import SDPBackend
    except ImportError:
        SDPBackend = None
    if not hasattr(SDPBackend, "CUDNN_ATTENTION"):
        return f"PyTorch {torch.__version__} has no SDPA cuDNN backend (SDPBackend.CUDNN_ATTENTION)"
    return None


def run_case(case: bench.Case, repeats: int, verdicts: dict) -> bench.Record:
    """One case: its kind's verdict (computed once into ``verdicts``), then, if "ok", ``bench.run_case``'s timing."""
    if case.impl == PEER:
        missing = peer_missing()
        if missing:
            return bench.Record.of(case, None, f"not run: {missing}")
    key = (case.impl, case.direction, case.causal)
    if key not in verdicts:
        verdicts[key] = verdict(case)
    if verdicts[key] != "ok":
        return bench.Record.of(case, None, verdicts[key])
    return bench.run_case(case, repeats, {}, check=lambda _: (True, "ok"))  # (validated just above)


def summary(records: list[bench.Record]) -> list[dict]:
    """One row per (direction, causal, N): rawflash's TFLOP/s (public call, then kernels), cuDNN's, and the ratios;
    ``status`` says why a number is missing."""
    by = {(r.impl, r.direction, r.causal, r.seqlen): r for r in records}
    rows = []
    for r in records:
        if r.impl != RAWFLASH:
            continue
        peer = by.get((PEER, r.direction, r.causal, r.seqlen))
        ptf = peer.tflops if peer else None
        bad = [f"{name}: {x.status}" for name, x in (("rawflash", r), ("cuDNN", peer)) if x and x.status != "ok"]
        rows.append({"direction": r.direction, "causal": r.causal, "N": r.seqlen, "batch": r.batch,
                     "rawflash TFLOP/s": _round(r.tflops, 1), "kernels TFLOP/s": _round(r.kernel_tflops, 1),
                     "cuDNN TFLOP/s": _round(ptf, 1),
                     "x cuDNN": _round(r.tflops / ptf, 3) if r.tflops and ptf else None,
                     "kernels x cuDNN": _round(r.kernel_tflops / ptf, 3) if r.kernel_tflops and ptf else None,
                     "status": "; ".join(bad) or "ok"})
    return rows


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)
