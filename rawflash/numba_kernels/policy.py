"""The variant policy of the twins: the counterpart of ``cuda/policy.cuh``.

Which keys a query sees (visibility), what a score becomes before the softmax (the score transform, with its
derivative for the backward) and the sink logit that joins every row's denominator.

Visibility, bottom-right aligned (flash-attn >= 2.1): with diag = seqlen_k - seqlen_q, query i sees key j iff
``0 <= j < seqlen_k`` and ``i + diag - left <= j <= i + diag + right`` (left, right = -1: unbounded), so causal
is (-1, 0). The mask mode is NO_MASK, CAUSAL ((-1, 0) as constants) or WINDOW (left and right from the
parameters). Score transform, general policy (natural units, then times log2(e)):
``s = softcap > 0 ? softcap * tanh(scale * q.k / softcap) : scale * q.k``, ``s -= slope * |i + diag - j|``;
plain policy: ``s = scale * q.k`` in log2 units (prescale). Sinks change only the softmax's denominator.

Block ranges: the blocks [lo, hi) of one axis that are visible at all, of them [lo_full, hi_full) visible in every
element (interior blocks skip the mask); a kernel visits them as n() steps, the interior first, then the edges.
"""
from __future__ import annotations

import collections
import math

from numba import cuda, float32, float64

from .common import LOG2E, LOG2E_D, NEG_INF, ONE, ZERO, cdiv, exp2

NO_MASK, CAUSAL, WINDOW = 0, 1, 2  # policy.cuh's Mask

BlockRange = collections.namedtuple("BlockRange", ["lo", "lo_full", "hi_full", "hi"])

# MIRROR: MASK, GENERAL and the element type (exact: T is float) are template arguments of the CUDA C's Policy;
# here they are fields set from the factories' constants, so one set of device functions serves every variant.
Policy = collections.namedtuple("Policy", ["mask", "general", "exact", "seqlen_q", "seqlen_k", "diag", "left",
                                           "right", "scale_log2", "cap_in", "cap_out", "slope_nat", "scale"])


# ---------------------------------------------------------------- BlockRange
@cuda.jit(device=True)
def block_range(lo, lo_full, hi_full, hi):
    """BlockRange::make: clamp to lo <= lo_full <= hi_full <= hi (an empty interior where the edges meet)."""
    hi = max(hi, lo)
    lo_full = min(max(lo_full, lo), hi)
    hi_full = min(max(hi_full, lo_full), hi)
    return BlockRange(lo, lo_full, hi_full, hi)


@cuda.jit(device=True)
def range_n(r):
    """BlockRange::n: the steps of the walk."""
    return r.hi - r.lo


@cuda.jit(device=True)
def interior_steps(r):
    return r.hi_full - r.lo_full


@cuda.jit(device=True)
def is_edge(r, s):
    """Whether step s visits an edge block (one that needs the mask)."""
    return s >= r.hi_full - r.lo_full


@cuda.jit(device=True)
def block(r, s):
    """The block of step s: [lo_full, hi_full), then [lo, lo_full), then [hi_full, hi)."""
    ni = r.hi_full - r.lo_full
    nl = r.lo_full - r.lo
    if s < ni:
        return r.lo_full + s
    if s < ni + nl:
        return r.lo + (s - ni)
    return r.hi_full + (s - ni - nl)


# ---------------------------------------------------------------- the policy of one (sequence, head)
@cuda.jit(device=True)
def head_slope(general, p, g, bi):
    """The ALiBi slope of the tile's head in natural units (0: off)."""
    return g.slopes[bi.b * p.alibi_sb + bi.h] if general and p.has_alibi else ZERO


@cuda.jit(device=True)
def make_policy(mask, general, exact, p, g, bi):
    """Policy<MASK, GENERAL>(p, bi)."""
    left = p.window_left if mask == WINDOW else -1
    right = p.window_right if mask == WINDOW else (0 if mask == CAUSAL else -1)
    cap_in = p.scale / p.softcap if p.softcap > ZERO else ZERO
    cap_out = p.softcap * LOG2E
    return Policy(mask, general, exact, bi.seqlen_q, bi.seqlen_k, bi.seqlen_k - bi.seqlen_q, left, right,
                  p.scale_log2, cap_in, cap_out, head_slope(general, p, g, bi), p.scale)


@cuda.jit(device=True)
def set_head(pol, p, g, bi):
    """Policy::set_head: the slope of another query head of the same sequence."""
    # MIRROR: returns a new namedtuple (they are immutable); the CUDA C assigns slope_nat in place.
    return Policy(pol.mask, pol.general, pol.exact, pol.seqlen_q, pol.seqlen_k, pol.diag, pol.left, pol.right,
                  pol.scale_log2, pol.cap_in, pol.cap_out, head_slope(pol.general, p, g, bi), pol.scale)


@cuda.jit(device=True)
def sink_log2(p, g, bi):
    """The sink logit of the tile's head in log2 units, -inf without sinks."""
    return g.sinks[bi.h] * LOG2E if p.has_sinks else NEG_INF


# ---------------------------------------------------------------- visibility
@cuda.jit(device=True)
def bounded_left(pol):
    return pol.mask == WINDOW and pol.left >= 0


@cuda.jit(device=True)
def bounded_right(pol):
    return pol.mask == CAUSAL or (pol.mask == WINDOW and pol.right >= 0)


@cuda.jit(device=True)
def row_start(pol, i):
    """Keys j in [row_start(i), row_end(i)) are visible to query i."""
    return max(0, i + pol.diag - pol.left) if bounded_left(pol) else 0


@cuda.jit(device=True)
def row_end(pol, i):
    if bounded_right(pol):
        r = 0 if pol.mask == CAUSAL else pol.right
        return min(pol.seqlen_k, max(0, i + pol.diag + r + 1))
    return pol.seqlen_k


@cuda.jit(device=True)
def visible(pol, i, j):
    return j >= row_start(pol, i) and j < row_end(pol, i)


@cuda.jit(device=True)
def kv_blocks(pol, r0, nr, bc):
    """Key blocks of width bc seen by the query rows [r0, r0 + nr) (nr >= 1 valid rows)."""
    last = r0 + nr - 1
    return block_range(row_start(pol, r0) // bc, cdiv(row_start(pol, last), bc), row_end(pol, r0) // bc,
                       cdiv(row_end(pol, last), bc))


@cuda.jit(device=True)
def q_blocks(pol, c0, bc, br, tr):
    """Query blocks of height br (tr of them) that see the key block [c0, c0 + bc): at all, and in every element."""
    nc = min(bc, pol.seqlen_k - c0)
    first = 0
    last = pol.seqlen_q - 1
    full_first = 0
    full_last = pol.seqlen_q - 1
    if bounded_right(pol):
        r = 0 if pol.mask == CAUSAL else pol.right
        first = max(0, c0 - pol.diag - r)
        full_first = c0 + bc - 1 - pol.diag - r   # every key of the block is at or before row i's diagonal edge
    if bounded_left(pol):
        last = min(last, c0 + nc - 1 - pol.diag + pol.left)
        full_last = c0 + pol.left - pol.diag      # every key of the block is within row i's left edge
    lo = first // br
    hi = last // br + 1 if last >= first else lo
    full_keys = c0 + bc <= pol.seqlen_k            # keys past seqlen_k are masked
    lo_full = cdiv(max(full_first, 0), br) if full_keys else hi
    hi_full = min((full_last + 1) // br, tr) if full_keys and full_last >= 0 else lo_full
    return block_range(lo, lo_full, hi_full, hi)


@cuda.jit(device=True)
def dq_rank(pol, q0, br, bc, j):
    """Policy::dq_rank: key block j's turn among the key blocks adding into query block [q0, q0 + br)'s dQ rows
    (the deterministic FA3 backward, which has no twin; tests/test_numba_sim.py checks the order)."""
    kv = kv_blocks(pol, q0, min(br, pol.seqlen_q - q0), bc)
    return kv.hi - 1 - j if bounded_right(pol) else j - kv.lo


@cuda.jit(device=True)
def dq_start(j, nq, nk):
    """Policy::dq_start: the query block key block j of nk starts its walk at in the rotated order (no mask)."""
    return j * nq // nk


@cuda.jit(device=True)
def dq_rank_rotated(pol, q0, br, bc, j):
    """Policy::dq_rank_rotated: key block j's turn at query block q0 // br in the rotated order, where key block j
    reaches query block i at step (i - dq_start(j)) mod nq and the key blocks add in the order of (step, j)."""
    nq, nk, i = cdiv(pol.seqlen_q, br), cdiv(pol.seqlen_k, bc), q0 // br
    s = dq_start(j, nq, nk)
    # F(a) = cdiv(a nk, nq): the first key block whose start is >= a
    f_i1, f_s1, f_s = cdiv((i + 1) * nk, nq), cdiv((s + 1) * nk, nq), cdiv(s * nk, nq)
    return (f_i1 - f_s1 if s <= i else f_i1 + nk - f_s1) + j - f_s


@cuda.jit(device=True)
def mask(pol, s, row, c0):
    """Hidden scores of query ``row`` to -inf; ``s`` is its row of scores for the keys c0.. ."""
    # MIRROR: one row per thread; the CUDA C masks the C-fragment elements a lane holds.
    lo = row_start(pol, row) - c0
    hi = row_end(pol, row) - c0
    for y in range(s.shape[0]):
        if y >= hi or (pol.mask == WINDOW and y < lo):
            s[y] = NEG_INF


# ---------------------------------------------------------------- score transform
@cuda.jit(device=True)
def softmax_scale(pol):
    """The factor the softmax multiplies raw scores by (1 when transform() produced log2 units)."""
    return ONE if pol.general else pol.scale_log2


@cuda.jit(device=True)
def prescale(pol, s):
    """Plain policy: the scale folded into the scores (log2 units), each product rounded once."""
    if not pol.general:
        for y in range(s.shape[0]):
            s[y] = s[y] * pol.scale_log2


@cuda.jit(device=True)
def score(pol, x, i, j):
    """x = q.k of query i, key j -> (the score in log2 units, d(score in natural units) / d(scale * q.k))."""
    # MIRROR: math.tanh for every dtype; the CUDA C's tanh_ is the hardware tanh.approx for bfloat16 and
    # 1 - 2 / (2^(2x log2 e) + 1) with the hardware exp2 and reciprocal for float16. The CUDA C's 16-bit tiles
    # choose soft-capping and ALiBi once per tile and take |i + diag - j| as a float base plus per-register offsets
    # (Policy::transform, backward_general), and in FA3's backward (SPARE_REGS) ALiBi-only tiles that lie on one
    # side of the diagonal split the bias into a key part and a query part added to L_i (backward_alibi_one_side)
    # and edge tiles zero their hidden elements after the element loop (hide); this twin computes the same values
    # element by element. The slope is the policy's own: decode's twin gives each packed row a policy of its head
    # (set_head) where the CUDA C passes the row's slope.
    dist = i + pol.diag - j
    adist = float32(dist if dist >= 0 else -dist)
    slope = pol.slope_nat * LOG2E
    if pol.general and pol.cap_in > ZERO:
        th = float32(math.tanh(x * pol.cap_in))
        return th * pol.cap_out - slope * adist, ONE - th * th
    if not pol.general:
        return x * pol.scale_log2, ONE
    if pol.exact:  # float32: the score and its ALiBi bias summed in natural units, rounded once
        return float32((float64(x) * float64(pol.scale) - float64(pol.slope_nat) * float64(adist)) * LOG2E_D), ONE
    return x * pol.scale_log2 - slope * adist, ONE


@cuda.jit(device=True)
def transform(pol, s, row, c0):
    """Scores of query ``row`` for the keys c0.. into log2 units (general policy only)."""
    if pol.general:
        for y in range(s.shape[0]):
            s[y] = score(pol, s[y], row, c0 + y)[0]


@cuda.jit(device=True)
def backward(pol, x, dp, i, j, L, D, edge):
    """One element of the backward (FA2 Alg.2 l.10-13): x = q.k, dp = dO_i . V_j, the row's L (log2 units) and D
    -> (P_ij, dS_ij) with the transform's derivative folded into dS; hidden elements of edge blocks get 0."""
    s, dz = score(pol, x, i, j)
    pr = ZERO if edge and not visible(pol, i, j) else exp2(s - L)
    return pr, pr * (dp - D) * dz
