"""Exact HBM byte counts and FLOP counts of rawflash's kernels, from the IO analysis of the FlashAttention papers.

Every number here is a formula over the shape and the tile counts: nothing is measured or estimated.
The model is the papers' one (FA1 Section 3.2 and Theorem 2, FA2 Section 3): every tile that a kernel
loads or stores is one HBM access. Caches are not modelled. On a real GPU the L2 (50 MB on H100, 60 MB
on H200) serves many of FA2's K/V re-reads, because the CTAs of one head that run at the same time read
the same K/V blocks; a kernel can therefore beat the memory bound that `roofline` derives from these bytes.

Conventions
-----------
- Causal masking is aligned bottom-right: query ``i`` sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``.
  A (Q block, K block) tile is skipped when no query of the Q block sees any key of the K block; skipped
  tiles move no bytes (fa1, fa2). The naive kernel writes the full S and P and masks inside the softmax,
  so its bytes do not depend on ``causal``.
- Ragged edges: a tile partly beyond ``seqlen_q`` or ``seqlen_k`` counts as one computed tile, but moves
  only its in-range rows. (Out-of-range rows never change which tiles are skipped: the last query row
  sees every key, and the first key of every K block is in range.)
- A query row that sees no key still has its O and LSE written; its Q block is not read when the
  block visits no K block, and a K block visited by no Q block is not read (dK, dV are still written).
- Q, K, V, O, dO, dQ, dK, dV move ``itemsize`` bytes per element; LSE, l, m, D and the work buffers
  named below move 4 bytes (float32). An atomicAdd counts 4 bytes read + 4 bytes written per element.
  Zero-filling a buffer and converting a float32 buffer to the output dtype are counted as their own
  terms, also for float32 inputs (FA2's backward zeroes its dQ accumulator in the pass that computes D).
- GQA: K/V belong to kv heads. The forward kernels and FA1's backward run one CTA per query head and
  load K/V per query head. FA2's backward runs one CTA per (K block, kv head) that loops over the
  query heads of its group, so it reads K_j, V_j and writes dK_j, dV_j once per kv head. The naive and
  FA1 backwards produce dK, dV per query head and sum each group in an extra pass when heads != kv_heads.

Examples
--------
>>> shape = Shape(batch=1, seqlen_q=128, seqlen_k=128, heads=1, kv_heads=1, head_dim=64, itemsize=2)
>>> io_bytes("fa2", "fwd", shape, Br=64, Bc=64).total_bytes
98816
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np

__all__ = ["GPU", "GPUS", "IOReport", "Shape", "TileCounts", "flops", "io_bytes", "roofline", "tile_counts",
           "visible_blocks", "visible_pairs", "visited_k_blocks", "visited_q_blocks"]

F32 = 4
"""Bytes of one float32 element (LSE, l, m, D and the work buffers)."""

KERNELS = ("naive", "fa1", "fa2")
DIRECTIONS = ("fwd", "bwd")


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return operator.index(value)


def _cdiv(a, b):
    return -(-a // b)


@dataclass(frozen=True)
class Shape:
    """Problem size of one attention call.

    Attributes
    ----------
    batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim : int
        q is ``(batch, seqlen_q, heads, head_dim)``, k and v are ``(batch, seqlen_k, kv_heads, head_dim)``;
        ``heads % kv_heads == 0``.
    itemsize : int
        Bytes per element of q, k, v and out: 2 (float16, bfloat16) or 4 (float32).
    causal : bool
        Bottom-right aligned causal mask.
    window : (int, int)
        Sliding window (left, right), -1 = unbounded; causal makes right 0.
    head_dim_v : int, optional
        v's head_dim where it differs from q's and k's (MLA: 128 beside 192); None: ``head_dim``. :func:`flops`
        and fa2's :func:`io_bytes` count it (V, O, dO and dV rows of ``dv`` elements); fa1's and naive's model one
        head_dim and refuse a shape that has two.
    """

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    kv_heads: int
    head_dim: int
    itemsize: int = 2
    causal: bool = False
    window: tuple = (-1, -1)
    head_dim_v: int | None = None

    def __post_init__(self):
        for name in ("batch", "seqlen_q", "seqlen_k", "heads", "kv_heads", "head_dim"):
            _positive_int(f"Shape.{name}", getattr(self, name))
        if self.head_dim_v is not None:
            _positive_int("Shape.head_dim_v", self.head_dim_v)
        if self.heads % self.kv_heads:
            raise ValueError(f"Shape.heads must be a multiple of Shape.kv_heads, got heads={self.heads}, "
                             f"kv_heads={self.kv_heads}")
        if self.itemsize not in (2, 4):
            raise ValueError(f"Shape.itemsize must be 2 or 4, got {self.itemsize!r}")

    @property
    def group(self):
        """Query heads per kv head."""
        return self.heads // self.kv_heads

    @property
    def dv(self):
        """v's head_dim (``head_dim_v``, else ``head_dim``)."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v


def _bounds(causal, window):
    """(left, right) of a mask: -1 = unbounded, causal makes right 0 (the policy's window_bounds)."""
    left, right = window if window is not None else (-1, -1)
    return (left, 0) if causal else (left, right)


def _row_spans(seqlen_q, seqlen_k, causal, window):
    """Per query row, [start, end) of the keys it sees (numpy arrays), bottom-right aligned."""
    import numpy as np

    left, right = _bounds(causal, window)
    diag = np.arange(seqlen_q, dtype=np.int64) + (seqlen_k - seqlen_q)
    start = np.maximum(0, diag - left) if left >= 0 else np.zeros(seqlen_q, np.int64)
    end = np.clip(diag + right + 1, 0, seqlen_k) if right >= 0 else np.full(seqlen_q, seqlen_k, np.int64)
    return start, np.maximum(end, start)


def visible_pairs(seqlen_q, seqlen_k, causal, window=(-1, -1)):
    """Number of (query, key) pairs that attention computes, per (batch, head).

    Parameters
    ----------
    seqlen_q, seqlen_k : int
    causal : bool
    window : (int, int)
        Sliding window (left, right), -1 = unbounded.

    Returns
    -------
    int
        ``seqlen_q * seqlen_k``, or with the causal mask the exact number of pairs with
        ``j <= i + seqlen_k - seqlen_q``, or those inside the window.
    """
    if _bounds(causal, window)[0] >= 0 or (not causal and tuple(window) != (-1, -1)):
        start, end = _row_spans(seqlen_q, seqlen_k, causal, window)
        return int((end - start).sum())
    if not causal:
        return seqlen_q * seqlen_k
    # Row i sees max(0, i + seqlen_k - seqlen_q + 1) keys: a ramp that ends at seqlen_k on the last row.
    first = max(1, seqlen_k - seqlen_q + 1)
    return (seqlen_k * (seqlen_k + 1) - (first - 1) * first) // 2


def flops(shape, direction):
    """FLOPs reported for one call, by the benchmark convention of the FA2 paper and flash-attn.

    Only the matrix products count (a multiply-add is 2 FLOPs), per visible (query, key) pair and (batch, head):
    the forward's ``S = QK^T`` is ``2 d`` and ``PV`` is ``2 dv``; the backward recomputes S (``2 d``) and computes
    ``dV = P^T dO`` (``2 dv``), ``dP = dO V^T`` (``2 dv``), ``dQ = dS K`` (``2 d``) and ``dK = dS^T Q`` (``2 d``).
    ``d`` is q's and k's head_dim, ``dv`` v's (``Shape.dv``): with ``dv == d`` the forward is
    ``4 * batch * heads * seqlen_q * seqlen_k * head_dim`` and the backward 2.5x that.
    Causal with ``seqlen_q == seqlen_k`` reports exactly half, as the paper and flash-attn's benchmarks
    do (the diagonal makes the true count ``N(N+1)/2`` pairs, slightly more than half). Causal with
    different lengths, where no such convention exists, counts the exact visible pairs.

    Parameters
    ----------
    shape : Shape
    direction : {'fwd', 'bwd'}

    Returns
    -------
    int
    """
    _check_direction(direction)
    s = shape
    per_pair = 2 * (s.head_dim + s.dv) if direction == "fwd" else 2 * (3 * s.head_dim + 2 * s.dv)
    if s.causal and s.seqlen_q == s.seqlen_k and s.window[0] < 0:
        return s.batch * s.heads * s.seqlen_q * s.seqlen_k * per_pair // 2
    return s.batch * s.heads * per_pair * visible_pairs(s.seqlen_q, s.seqlen_k, s.causal, s.window)


def visited_k_blocks(seqlen_q, seqlen_k, Br, Bc, causal, window=(-1, -1)):
    """For each Q block, the K blocks that the forward visits (the policy's kv_blocks).

    Parameters
    ----------
    seqlen_q, seqlen_k : int
    Br, Bc : int
        Rows per Q block and per K block.
    causal : bool
    window : (int, int)
        Sliding window (left, right), -1 = unbounded: blocks wholly outside it are never visited.

    Returns
    -------
    list of range
        Entry ``i`` is the range of K block indices visited by Q block ``i`` (empty when its rows see no key).
    """
    start, end = _row_spans(seqlen_q, seqlen_k, causal, window)
    ranges = []
    for i in range(_cdiv(seqlen_q, Br)):
        first, last = i * Br, min((i + 1) * Br, seqlen_q) - 1
        lo, hi = int(start[first]) // Bc, _cdiv(int(end[last]), Bc)
        ranges.append(range(lo, max(lo, hi)))
    return ranges


def visited_q_blocks(seqlen_q, seqlen_k, Br, Bc, causal, window=(-1, -1)):
    """For each K block, the Q blocks that the backward visits (the policy's q_blocks).

    Parameters
    ----------
    seqlen_q, seqlen_k : int
    Br, Bc : int
        Rows per Q block and per K block.
    causal : bool
    window : (int, int)

    Returns
    -------
    list of range
        Entry ``j`` is the range of Q block indices whose rows see at least one key of K block ``j``.
    """
    import numpy as np

    start, end = _row_spans(seqlen_q, seqlen_k, causal, window)
    ranges = []
    for j in range(_cdiv(seqlen_k, Bc)):
        c0, c1 = j * Bc, min((j + 1) * Bc, seqlen_k)
        rows = np.nonzero((start < c1) & (end > c0))[0]
        ranges.append(range(int(rows[0]) // Br, int(rows[-1]) // Br + 1) if rows.size else range(0))
    return ranges


def _span_rows(blocks, n, size):
    """Rows in range covered by the contiguous blocks ``blocks`` of ``size`` rows over ``n`` rows."""
    return max(0, min(blocks.stop * size, n) - blocks.start * size)


@dataclass(frozen=True)
class TileCounts:
    """Tile counts per (batch, head) that the byte formulas use.

    Attributes
    ----------
    q_blocks, k_blocks : int
        ``Tr = ceil(seqlen_q / Br)`` and ``Tc = ceil(seqlen_k / Bc)``.
    computed, skipped : int
        Tiles computed and tiles skipped by the causal mask; they sum to ``Tr * Tc``.
    q_rows_loaded, k_rows_loaded : int
        In-range rows of the Q blocks that visit a K block, of the K blocks that a Q block visits.
    k_rows_in_tiles, q_rows_in_tiles : int
        In-range K (or Q) rows summed over the computed tiles: what re-reading a K/V (or Q) block
        per computed tile moves, in rows.
    k_rows_split_loads : int
        In-range K rows loaded when the Q blocks are dealt to ``splits`` CTAs (block i to CTA i % splits) and
        each CTA loads every K block one of its Q blocks visits (fa1's splits); ``k_rows_loaded`` for one split.
    """

    q_blocks: int
    k_blocks: int
    computed: int
    skipped: int
    q_rows_loaded: int
    k_rows_loaded: int
    k_rows_in_tiles: int
    q_rows_in_tiles: int
    k_rows_split_loads: int = 0


def tile_counts(seqlen_q, seqlen_k, Br, Bc, causal, window=(-1, -1), splits=1):
    """Count the computed and skipped tiles and the rows they move, per (batch, head).

    Parameters
    ----------
    seqlen_q, seqlen_k, Br, Bc : int
    causal : bool
    window : (int, int)
    splits : int
        CTAs that share the Q blocks of a (batch, head) (fa1's splits), for ``k_rows_split_loads``.

    Returns
    -------
    TileCounts
    """
    Br, Bc, splits = _positive_int("Br", Br), _positive_int("Bc", Bc), _positive_int("splits", splits)
    per_q = visited_k_blocks(seqlen_q, seqlen_k, Br, Bc, causal, window)
    per_k = visited_q_blocks(seqlen_q, seqlen_k, Br, Bc, causal, window)
    computed = sum(len(r) for r in per_q)
    return TileCounts(
        q_blocks=len(per_q), k_blocks=len(per_k), computed=computed,
        skipped=len(per_q) * len(per_k) - computed,
        q_rows_loaded=sum(_span_rows(range(i, i + 1), seqlen_q, Br) for i, r in enumerate(per_q) if r),
        k_rows_loaded=sum(_span_rows(range(j, j + 1), seqlen_k, Bc) for j, r in enumerate(per_k) if r),
        k_rows_in_tiles=sum(_span_rows(r, seqlen_k, Bc) for r in per_q),
        q_rows_in_tiles=sum(_span_rows(r, seqlen_q, Br) for r in per_k),
        k_rows_split_loads=sum(min(splits, len(r)) * _span_rows(range(j, j + 1), seqlen_k, Bc)
                               for j, r in enumerate(per_k)))


def visible_blocks(seqlen_q, seqlen_k, Br, Bc, causal, window=(-1, -1)):
    """Tiles computed and skipped per (batch, head).

    Parameters
    ----------
    seqlen_q, seqlen_k, Br, Bc : int
    causal : bool
    window : (int, int)

    Returns
    -------
    (int, int)
        ``(computed, skipped)``; a tile is skipped when no query of its Q block sees any of its keys (above the
        causal diagonal, or outside the window). Tiles on the ragged edge count as computed.
    """
    counts = tile_counts(seqlen_q, seqlen_k, Br, Bc, causal, window)
    return counts.computed, counts.skipped


@dataclass(frozen=True)
class IOReport:
    """Predicted HBM traffic and FLOPs of one kernel call.

    Attributes
    ----------
    kernel : {'naive', 'fa1', 'fa2'}
    direction : {'fwd', 'bwd'}
    shape : Shape
    Br, Bc : int or None
        Tile sizes (None for 'naive').
    read_bytes, write_bytes, total_bytes : int
        Bytes read from, written to, and moved to or from HBM.
    flops : int
        `flops(shape, direction)`, the reporting convention (the same for every kernel).
    intensity : float
        ``flops / total_bytes``.
    breakdown : dict of str to int
        Bytes (read + written) of each term, e.g. ``'K,V re-read per Q block'``.
    """

    kernel: str
    direction: str
    shape: Shape
    Br: int | None
    Bc: int | None
    read_bytes: int
    write_bytes: int
    flops: int
    breakdown: dict
    total_bytes: int = field(init=False)
    intensity: float = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "total_bytes", self.read_bytes + self.write_bytes)
        object.__setattr__(self, "intensity", self.flops / self.total_bytes)


def _group_sum(s, row):
    """The pass that sums per-query-head dK, dV over each group of query heads (GQA only)."""
    if s.group == 1:
        return []
    return [("dK,dV summed over query heads (GQA)", 2 * s.batch * s.heads * s.seqlen_k * row,
             2 * s.batch * s.kv_heads * s.seqlen_k * row)]


def _naive_fwd(s, _):
    bh, row, score = s.batch * s.heads, s.head_dim * s.itemsize, s.seqlen_q * s.seqlen_k * s.itemsize
    return [
        ("S = QK^T: Q, K read", bh * (s.seqlen_q + s.seqlen_k) * row, 0),
        ("S = QK^T: S written", 0, bh * score),
        ("softmax: S read", bh * score, 0),
        ("softmax: P written", 0, bh * score),
        ("softmax: lse written (float32)", 0, bh * s.seqlen_q * F32),
        ("O = PV: P read", bh * score, 0),
        ("O = PV: V read", bh * s.seqlen_k * row, 0),
        ("O = PV: O written", 0, bh * s.seqlen_q * row),
    ]


def _naive_bwd(s, _):
    """FA1 Algorithm 3 (standard attention backward): P comes from HBM; dP and dS go through HBM."""
    bh, score = s.batch * s.heads, s.seqlen_q * s.seqlen_k * s.itemsize
    q_rows, k_rows = bh * s.seqlen_q * s.head_dim * s.itemsize, bh * s.seqlen_k * s.head_dim * s.itemsize
    return [
        ("dV = P^T dO: P, dO read", bh * score + q_rows, 0),
        ("dV = P^T dO: dV written", 0, k_rows),
        ("dP = dO V^T: dO, V read", q_rows + k_rows, 0),
        ("dP = dO V^T: dP written", 0, bh * score),
        ("dS = P*(dP - D): P, dP read", 2 * bh * score, 0),
        ("dS = P*(dP - D): dS written", 0, bh * score),
        ("dQ = dS K: dS, K read", bh * score + k_rows, 0),
        ("dQ = dS K: dQ written", 0, q_rows),
        ("dK = dS^T Q: dS, Q read", bh * score + q_rows, 0),
        ("dK = dS^T Q: dK written", 0, k_rows),
    ] + _group_sum(s, s.head_dim * s.itemsize)


def _fa1_fwd(s, t):
    """FA1 Algorithm 1; O, l, m live in float32 work buffers in HBM; each of the splits that share a head's Q
    blocks reads the K blocks its Q blocks see."""
    bh, row, f32_row = s.batch * s.heads, s.head_dim * s.itemsize, s.head_dim * F32
    state = f32_row + 2 * F32  # O_i, l_i, m_i of one row
    return [
        ("O,l,m initialised (float32)", 0, bh * s.seqlen_q * state),
        ("K_j,V_j read once per K block and split", bh * 2 * t.k_rows_split_loads * row, 0),
        ("Q_i re-read per K block", bh * t.q_rows_in_tiles * row, 0),
        ("O_i,l_i,m_i read per K block (float32)", bh * t.q_rows_in_tiles * state, 0),
        ("O_i,l_i,m_i written per K block (float32)", 0, bh * t.q_rows_in_tiles * state),
        ("O float32 converted to out dtype", bh * s.seqlen_q * f32_row, bh * s.seqlen_q * row),
        ("lse = m + log l (float32)", bh * s.seqlen_q * 2 * F32, bh * s.seqlen_q * F32),
    ]


def _fa1_bwd(s, t):
    """FA1 Algorithm 4; dQ lives in a float32 work buffer read and written every inner step."""
    bh, row, f32_row = s.batch * s.heads, s.head_dim * s.itemsize, s.head_dim * F32
    return [
        ("dQ initialised (float32)", 0, bh * s.seqlen_q * f32_row),
        ("K_j,V_j read once per K block", bh * 2 * t.k_rows_loaded * row, 0),
        ("Q_i,O_i,dO_i re-read per K block", bh * t.q_rows_in_tiles * 3 * row, 0),
        ("l_i,m_i re-read per K block (float32)", bh * t.q_rows_in_tiles * 2 * F32, 0),
        ("dQ_i read and written per K block (float32)", bh * t.q_rows_in_tiles * f32_row,
         bh * t.q_rows_in_tiles * f32_row),
        ("dK_j,dV_j written once", 0, bh * 2 * s.seqlen_k * row),
        ("dQ float32 converted to out dtype", bh * s.seqlen_q * f32_row, bh * s.seqlen_q * row),
    ] + _group_sum(s, row)


def _fa2_fwd(s, t):
    """FA2 Algorithm 1: grid over (Q block, head, batch); K/V loaded per query head (V and O rows of v's head_dim)."""
    bh, row, row_v = s.batch * s.heads, s.head_dim * s.itemsize, s.dv * s.itemsize
    return [
        ("Q read once", bh * t.q_rows_loaded * row, 0),
        ("K,V re-read per Q block", bh * t.k_rows_in_tiles * (row + row_v), 0),
        ("O written once", 0, bh * s.seqlen_q * row_v),
        ("LSE written once (float32)", 0, bh * s.seqlen_q * F32),
    ]


def _fa2_bwd(s, t):
    """FA2 Algorithm 2: D precomputed; one CTA per (K block, kv head, batch) loops over its query heads (V, O, dO
    and dV rows of v's head_dim)."""
    bh, bkv = s.batch * s.heads, s.batch * s.kv_heads
    row, row_v, f32_row = s.head_dim * s.itemsize, s.dv * s.itemsize, s.head_dim * F32
    return [
        ("D = rowsum(dO*O): O, dO read, D written (float32)", bh * s.seqlen_q * 2 * row_v, bh * s.seqlen_q * F32),
        ("dQ accumulator zero-filled by the D pass (float32)", 0, bh * s.seqlen_q * f32_row),
        ("K_j,V_j read once per CTA", bkv * t.k_rows_loaded * (row + row_v), 0),
        ("Q_i,dO_i re-read per K block", bh * t.q_rows_in_tiles * (row + row_v), 0),
        ("L_i,D_i re-read per K block (float32)", bh * t.q_rows_in_tiles * 2 * F32, 0),
        ("dQ atomicAdd per K block (float32)", bh * t.q_rows_in_tiles * f32_row, bh * t.q_rows_in_tiles * f32_row),
        ("dK,dV written once", 0, bkv * s.seqlen_k * (row + row_v)),
        ("dQ float32 converted to out dtype", bh * s.seqlen_q * f32_row, bh * s.seqlen_q * row),
    ]


_TERMS = {("naive", "fwd"): _naive_fwd, ("naive", "bwd"): _naive_bwd, ("fa1", "fwd"): _fa1_fwd,
          ("fa1", "bwd"): _fa1_bwd, ("fa2", "fwd"): _fa2_fwd, ("fa2", "bwd"): _fa2_bwd}


def _check_direction(direction):
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")


def io_bytes(kernel, direction, shape, *, Br=None, Bc=None, splits=1):
    """Predict the HBM bytes and FLOPs of one kernel call.

    Parameters
    ----------
    kernel : {'naive', 'fa1', 'fa2'}
    direction : {'fwd', 'bwd'}
        'fa1' 'bwd' is FA1's Algorithm 4 (rawflash has no such kernel; it is the paper's baseline).
    shape : Shape
    Br, Bc : int, optional
        Tile sizes, required for 'fa1' and 'fa2' (take them from ``rawflash.kernels.configs``); ignored for 'naive'.
    splits : int
        'fa1' 'fwd': the CTAs that share the Q blocks of a (batch, head) (its launch's grid z,
        ``launch.fa1_splits``); each reads the K/V blocks its Q blocks see. Ignored elsewhere.

    Returns
    -------
    IOReport
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    _check_direction(direction)
    if shape.dv != shape.head_dim and kernel != "fa2":
        raise ValueError(f"io_bytes models one head_dim for kernel {kernel!r}; got head_dim {shape.head_dim} and "
                         f"head_dim_v {shape.dv} (kernel 'fa2' counts v's own)")
    tiles = None
    if kernel != "naive":
        if Br is None or Bc is None:
            raise ValueError(f"kernel {kernel!r} needs the tile sizes Br and Bc, got Br={Br!r}, Bc={Bc!r}")
        tiles = tile_counts(shape.seqlen_q, shape.seqlen_k, Br, Bc, shape.causal, shape.window,
                            splits if (kernel, direction) == ("fa1", "fwd") else 1)
    else:
        Br = Bc = None
    terms = _TERMS[kernel, direction](shape, tiles)
    return IOReport(kernel=kernel, direction=direction, shape=shape, Br=Br, Bc=Bc,
                    read_bytes=sum(read for _, read, _ in terms), write_bytes=sum(write for _, _, write in terms),
                    flops=flops(shape, direction), breakdown={name: read + write for name, read, write in terms})


@dataclass(frozen=True)
class GPU:
    """Peak rates of one GPU.

    Attributes
    ----------
    name : str
    tensor_tflops : float
        Dense float16 / bfloat16 tensor-core peak, TFLOP/s.
    fp32_tflops : float
        Non-tensor float32 (FMA) peak, TFLOP/s.
    hbm_tbps : float
        HBM bandwidth, bytes read + written, TB/s (1e12 B/s).
    """

    name: str
    tensor_tflops: float
    fp32_tflops: float
    hbm_tbps: float


GPUS = {
    # Measured on the H200 test machine: cuBLAS bf16 8192^3 matmul through PyTorch, 751 TFLOP/s; device-to-device
    # copy, 4.26 TB/s read + written. fp32 is the datasheet value (not measured).
    "H200": GPU("H200", 751.0, 67.0, 4.26),
    # NVIDIA H200 datasheet (SXM): bf16/fp16 1979 TFLOP/s with sparsity = 989 dense; fp32 67; HBM3e 4.8 TB/s.
    "H200-datasheet": GPU("H200-datasheet", 989.0, 67.0, 4.8),
    # NVIDIA H100 datasheet (SXM5): bf16/fp16 1979 TFLOP/s with sparsity = 989 dense; fp32 67; HBM3 3.35 TB/s.
    "H100-SXM": GPU("H100-SXM", 989.0, 67.0, 3.35),
    # NVIDIA A100 datasheet (SXM4 80GB): bf16/fp16 312 dense; fp32 19.5; HBM2e 2.039 TB/s (the 40GB part: 1.555).
    "A100-80GB-SXM": GPU("A100-80GB-SXM", 312.0, 19.5, 2.039),
}

_DTYPE_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


def roofline(report, gpu, dtype):
    """Lower bounds on the run time of a call from its FLOPs and its HBM bytes.

    Parameters
    ----------
    report : IOReport
    gpu : str or GPU
        A key of `GPUS` or a `GPU`.
    dtype : str or dtype-like
        'float16', 'bfloat16' (tensor-core peak) or 'float32' (FMA peak); must match ``report.shape.itemsize``.

    Returns
    -------
    dict
        ``compute_ms`` and ``memory_ms`` (the two bounds), ``bound_ms`` (the larger), ``limiter``
        ('compute' or 'memory', the larger bound; 'compute' on a tie) and ``tflops`` (FLOP/s at ``bound_ms``).
        The memory bound ignores caches (see the module docstring), so a kernel may beat it.
    """
    if isinstance(gpu, str):
        if gpu not in GPUS:
            raise ValueError(f"gpu must be one of {sorted(GPUS)} or a GPU, got {gpu!r}")
        gpu = GPUS[gpu]
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if _DTYPE_ITEMSIZE.get(name) != report.shape.itemsize:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_ITEMSIZE)} with itemsize {report.shape.itemsize} "
                         f"(the report's), got {dtype!r}")
    peak = gpu.fp32_tflops if name == "float32" else gpu.tensor_tflops
    compute_ms = report.flops / (peak * 1e12) * 1e3
    memory_ms = report.total_bytes / (gpu.hbm_tbps * 1e12) * 1e3
    bound_ms = max(compute_ms, memory_ms)
    return {"compute_ms": compute_ms, "memory_ms": memory_ms, "bound_ms": bound_ms,
            "limiter": "compute" if compute_ms >= memory_ms else "memory",
            "tflops": report.flops / (bound_ms * 1e-3) / 1e12}
