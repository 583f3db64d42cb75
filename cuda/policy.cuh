// The variant policy: which keys a query sees (visibility), what a score becomes before the softmax (the score
// transform) and the sink logit that joins every row's denominator. Kernels take it as a template argument,
// Policy<MASK, GENERAL>; its runtime part comes from the parameter struct and the BlockInfo. GENERAL = false is
// the fast path of plain attention (fixed lengths, scores only scaled); GENERAL = true adds packed variable
// lengths (BlockInfo<true>), soft-capping and ALiBi, all chosen at run time by the parameters.
//
// Visibility, bottom-right aligned (flash-attn >= 2.1): with diag = seqlen_k - seqlen_q, query i sees key j iff
//     0 <= j < seqlen_k   and   i + diag - left <= j <= i + diag + right        (left, right = -1: unbounded)
// so causal is (left, right) = (-1, 0) and a sliding window is (left, right). MASK is the compile-time mode:
// NO_MASK (only the seqlen_k edge is ever masked), CAUSAL ((-1, 0) as constants) or WINDOW (left and right from
// the parameters; causal windows included). The plain policy has the first two, the general one the first and
// the last.
// Score transform, GENERAL = true (natural units, then times log2(e) for the exp2-based softmax):
//     s = softcap > 0 ? softcap * tanh(scale * q.k / softcap) : scale * q.k;   s -= slope * |i + diag - j| (ALiBi)
// GENERAL = false, and in 16-bit GENERAL = true on a head with neither soft-capping nor ALiBi (transforms() is
// false: a window or packed lengths alone; float32's general policy takes every score through score(), exactly):
// s = scale * q.k, and the scale is folded into the softmax's exponent (softmax_scale<T>()), so those calls do no
// per-score work beyond plain attention's. Where the transform runs, its parts are chosen once per tile by
// branches uniform over the CTA (not per score), ALiBi's distance |i + diag - j| is a per-thread float base plus
// a compile-time offset per register (no integer conversion per score: conversions run at the special-function
// unit's rate, like the exponential), and in 16-bit the scores stay in the units of their last step (tanh values
// with soft-capping, q.k with ALiBi alone) for the softmax's exponent to scale (softmax_scale<T>()), so neither
// pays a multiply per score of its own.
// Sinks: sink_log2() is the sink logit of a head in log2 units (-inf without sinks); it only changes the
// softmax's denominator (OnlineSoftmax::finalize), so the backward needs nothing beyond an lse that includes it.
#pragma once
#include "acc.cuh"
#include "block_info.cuh"

namespace rf {

// Blocks [lo, hi) of one axis (key blocks of a query tile, or query blocks of a key tile) are visible at all; of
// them [lo_full, hi_full) are visible in every element: interior blocks, which skip the mask. A kernel visits them
// as a sequence of n() steps, the interior first and the edges after it, so "is this block an edge" is one
// comparison of the step with interior_steps(), a branch that is uniform over the CTA. (A loop per stage, as the
// Triton tutorial writes it, costs ptxas a second set of accumulator registers here: 250 registers instead of 187
// for the d = 128 wgmma forward, offline; bench/NOTES.md.)
struct BlockRange {
  int lo, lo_full, hi_full, hi;
  __device__ __forceinline__ int n() const { return hi - lo; }
  __device__ __forceinline__ int interior_steps() const { return hi_full - lo_full; }
  __device__ __forceinline__ bool is_edge(int s) const { return s >= hi_full - lo_full; }
  // The block of step s: [lo_full, hi_full), then [lo, lo_full), then [hi_full, hi).
  __device__ __forceinline__ int block(int s) const {
    const int ni = hi_full - lo_full, nl = lo_full - lo;
    return s < ni ? lo_full + s : s < ni + nl ? lo + (s - ni) : hi_full + (s - ni - nl);
  }
  // Clamp to lo <= lo_full <= hi_full <= hi (an empty interior where the edges meet).
  __device__ __forceinline__ static BlockRange make(int lo, int lo_full, int hi_full, int hi) {
    hi = max(hi, lo);
    lo_full = min(max(lo_full, lo), hi);
    hi_full = min(max(hi_full, lo_full), hi);
    return BlockRange{lo, lo_full, hi_full, hi};
  }
};

enum Mask { NO_MASK = 0, CAUSAL = 1, WINDOW = 2 };

template <int MASK_, bool GENERAL_> struct Policy {
  static constexpr int MASK = MASK_;
  static constexpr bool GENERAL = GENERAL_;
  using Info = BlockInfo<GENERAL_>;  // the general policy also reads packed variable lengths
  int seqlen_q, seqlen_k, diag, left, right;
  float scale_log2;
  float cap_in, cap_out;  // softcap: tanh's argument is q.k * cap_in, its value times cap_out is the log2 score
  float slope_nat;        // ALiBi slope of this head (natural units; 0: off)
  float scale;            // the softmax scale in natural units (the float32 score)

  template <class P> __device__ __forceinline__ Policy(const P& p, const Info& bi)
      : seqlen_q(bi.seqlen_q), seqlen_k(bi.seqlen_k), diag(bi.seqlen_k - bi.seqlen_q),
        left(MASK_ == WINDOW ? p.window_left : -1), right(MASK_ == WINDOW ? p.window_right : MASK_ == CAUSAL ? 0 : -1),
        scale_log2(p.scale_log2), scale(p.scale) {
    cap_in = p.softcap > 0.f ? p.scale / p.softcap : 0.f;
    cap_out = p.softcap * LOG2E;
    set_head(p, bi);
  }
  template <class P> __device__ __forceinline__ void set_head(const P& p, const Info& bi) {
    slope_nat = (GENERAL_ && p.alibi_slopes) ? p.alibi_slopes[bi.b * p.alibi_sb + bi.h] : 0.f;
  }
  // The sink logit of the tile's head in log2 units, -inf without sinks (read at the end of a row, not kept).
  template <class P> __device__ __forceinline__ static float sink_log2(const P& p, const Info& bi) {
    return p.sinks ? p.sinks[bi.h] * LOG2E : -INFINITY;
  }

  // ---------------------------------------------------------------- visibility
  // Keys j in [row_start(i), row_end(i)) are visible to query i.
  __device__ __forceinline__ bool bounded_left() const { return MASK_ == WINDOW && left >= 0; }
  __device__ __forceinline__ bool bounded_right() const { return MASK_ == CAUSAL || (MASK_ == WINDOW && right >= 0); }
  // The same from the parameters alone, before a Policy exists (the backward's tile scheduler asks).
  template <class P> __device__ __forceinline__ static bool bounded_right(const P& p) {
    return MASK_ == CAUSAL || (MASK_ == WINDOW && p.window_right >= 0);
  }
  __device__ __forceinline__ int row_start(int i) const { return bounded_left() ? max(0, i + diag - left) : 0; }
  __device__ __forceinline__ int row_end(int i) const {
    return bounded_right() ? min(seqlen_k, max(0, i + diag + (MASK_ == CAUSAL ? 0 : right) + 1)) : seqlen_k;
  }
  __device__ __forceinline__ bool visible(int i, int j) const { return j >= row_start(i) && j < row_end(i); }

  // Key blocks of width bc seen by the query rows [r0, r0 + nr) (nr >= 1 valid rows).
  __device__ __forceinline__ BlockRange kv_blocks(int r0, int nr, int bc) const {
    const int last = r0 + nr - 1;
    return BlockRange::make(row_start(r0) / bc, cdiv(row_start(last), bc), row_end(r0) / bc, cdiv(row_end(last), bc));
  }
  // Query blocks of height br (tr of them) that see the key block [c0, c0 + bc): at all, and in every element.
  __device__ __forceinline__ BlockRange q_blocks(int c0, int bc, int br, int tr) const {
    const int nc = min(bc, seqlen_k - c0);
    int first = 0, last = seqlen_q - 1, full_first = 0, full_last = seqlen_q - 1;
    if (bounded_right()) {
      const int r = MASK_ == CAUSAL ? 0 : right;
      first = max(0, c0 - diag - r);
      full_first = c0 + bc - 1 - diag - r;       // every key of the block is at or before row i's diagonal edge
    }
    if (bounded_left()) {
      last = min(last, c0 + nc - 1 - diag + left);
      full_last = c0 + left - diag;               // every key of the block is within row i's left edge
    }
    const int lo = first / br, hi = last >= first ? last / br + 1 : lo;
    const bool full_keys = c0 + bc <= seqlen_k;     // keys past seqlen_k are masked
    const int lo_full = full_keys ? cdiv(max(full_first, 0), br) : hi;
    const int hi_full = full_keys && full_last >= 0 ? min((full_last + 1) / br, tr) : lo_full;
    return BlockRange::make(lo, lo_full, hi_full, hi);
  }

  // The deterministic backward's order of the key blocks that add into query block [q0, q0 + br)'s dQ rows: key
  // block j's rank among them. They are kv_blocks' [lo, hi), exactly the key blocks whose q_blocks hold the query
  // block (both give the rows / keys that see each other; for a query block with a row that sees a key: a row
  // that sees none is at the start or the end of the block, where it changes neither bound), so the ranks of the
  // key blocks that visit a query block are 0, 1, ... with none missing. Under a mask bounded on the right the
  // last of them goes first (it reaches the query block earliest in its ascending walk; the scheduler dispatches
  // it first: KTileScheduler's reverse), otherwise the first.
  __device__ __forceinline__ int dq_rank(int q0, int br, int bc, int j) const {
    const BlockRange kv = kv_blocks(q0, min(br, seqlen_q - q0), bc);
    return bounded_right() ? kv.hi - 1 - j : j - kv.lo;
  }
  // The rotated order (BwdParams::dq_rotate: no bound on either side, so every key block sees every query block).
  // In the ascending order key block j adds into query block i after key block j - 1 has, at the same step of
  // both walks, so the waits chain up along the key blocks (j of them for key block j). Rotated, key block j of nk
  // starts its walk at query block s_j = j nq / nk (dq_start) and reaches block i at step t_j = (i - s_j) mod nq;
  // the key blocks add into block i in the order of (t_j, j), so each waits only for additions made at earlier
  // steps of the others' walks (or at the same step by a key block with the same start and a lower index). That
  // order is well founded, and a CTA can wait on CTAs of higher block index, so the grid must hold every key block
  // of a (sequence, kv head) at once: launch.fa3_bwd_dq_rotates allows it where nk is at most half the SMs.
  // Rank of j at i: with F(a) = ceil(a nk / nq) the first key block whose start is >= a, the key blocks before j
  // are those starting in (s_j, i] (if s_j <= i) or in [0, i] and (s_j, nq) (if s_j > i), then those starting at
  // s_j with a lower index.
  // (32-bit unsigned products: the host allows the rotation only for nk <= SMs / 2, so a nk and j nq stay far
  // below 2^32 for any query length an int holds in rows; 64-bit divisions spill the dQ writer warps' 24
  // registers)
  __device__ __forceinline__ static int dq_start(int j, int nq, int nk) { return (int)((u32)j * (u32)nq / (u32)nk); }
  // (the host's flag, checked against the mask; the host sets it without a mask only, so the masked
  // instantiations compile no rotation)
  template <class P> __device__ __forceinline__ bool dq_rotates(const P& p) const {
    return MASK_ == NO_MASK && p.dq_rotate;
  }
  __device__ __forceinline__ int dq_rank_rotated(int q0, int br, int bc, int j) const {
    const int nq = cdiv(seqlen_q, br), nk = cdiv(seqlen_k, bc), i = q0 / br, s = dq_start(j, nq, nk);
    const auto F = [&](int a) { return (int)(((u32)a * (u32)nk + (u32)nq - 1) / (u32)nq); };
    return (s <= i ? F(i + 1) - F(s + 1) : F(i + 1) + nk - F(s + 1)) + j - F(s);
  }

  // Hidden scores to -inf; rows of s are queries r0.., columns keys c0.. .
  template <int MT, int NT> __device__ __forceinline__ void mask(Acc<MT, NT>& s, int r0, int c0) const {
    const int g = lane_id() >> 2, t = lane_id() & 3;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = r0 + 16 * i + g + 8 * h;
        const int lo = row_start(row) - c0 - 2 * t, hi = row_end(row) - c0 - 2 * t;  // visible: lo <= 8j + e < hi
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (8 * j + e >= hi || (MASK_ == WINDOW && 8 * j + e < lo)) s.v[i][j][2 * h + e] = -INFINITY;
      }
  }
  // A tile's scores as the forward's softmax takes them: through the transform, then (edge blocks only) the mask.
  template <typename T, int MT, int NT> __device__ __forceinline__ void scores(Acc<MT, NT>& s, int r0, int c0,
                                                                               bool edge) const {
    transform<T>(s, r0, c0);
    if (edge) mask(s, r0, c0);
  }
  // The same for a transposed tile (S^T): rows are keys k0.., columns queries q0.. .
  template <int MT, int NT> __device__ __forceinline__ void mask_t(Acc<MT, NT>& s, int k0, int q0) const {
    for_each(s, [&](float& x, int row, int col) {
      if (!visible(q0 + col, k0 + row)) x = -INFINITY;
    });
  }

  // ---------------------------------------------------------------- score transform
  // Whether this head's scores go through transform() (soft-capping or ALiBi); uniform over the CTA.
  __device__ __forceinline__ bool transforms() const { return GENERAL_ && (cap_in > 0.f || slope_nat != 0.f); }
  // Soft-capped scores are bounded: cap_out tanh(.) lies in [-cap_out, cap_out] (log2 units). Where P has the
  // range of float32 (bfloat16) and no ALiBi bias is added (it is unbounded below), a row's softmax can take the
  // fixed reference fixed_ref() = cap_out - FIXED_TOP_LOG2 instead of its running max (the FA3 forward's
  // REF_BOUNDED instantiations, chosen by the host: rawflash/kernels/launch.py's Problem.bounded_scores; softmax is
  // exact for any reference): P = 2^(s - fixed_ref) lies in [2^(56 - 2 cap_out), 2^56]. For softcap <= 50
  // (launch.BOUNDED_SOFTCAP_MAX, Gemma 2's 50 included) the smallest P is >= 2^-88, so a row whose every score sits
  // at -softcap still has P V products far above float32's smallest normal for |V| >= 2^-38, and the largest
  // leaves O and l 2^71 below float32's overflow.
  static constexpr float FIXED_TOP_LOG2 = 56.f;
  __device__ __forceinline__ float fixed_ref() const { return cap_out - FIXED_TOP_LOG2; }  // in log2 units
  // The factor the softmax multiplies transform()'s output by to reach log2 units: the scale (log2 units) where
  // the scores are q.k, softcap * log2(e) where they are tanh values (16-bit soft-capping: ALiBi's bias is then
  // divided by it in transform(), so no score pays a multiply of its own), 1 where transform() has produced log2
  // units itself (float32's general policy: every score goes through score(), the exact path).
  template <typename T> __device__ __forceinline__ float softmax_scale() const {
    if constexpr (GENERAL_ && sizeof(T) == 4) return 1.f;
    return GENERAL_ && cap_in > 0.f ? cap_out : scale_log2;
  }
  // The same folded into the scores themselves, each product rounded once (no contraction with what follows):
  // the mma.sync forms do this, so their float32 results round like a naive float32 softmax.
  template <typename T, int MT, int NT> __device__ __forceinline__ void prescale(Acc<MT, NT>& s) const {
    if constexpr (GENERAL_ && sizeof(T) == 4) return;
    const float f = softmax_scale<T>();
    for_each_row(s, [&](float& x, int) { x = __fmul_rn(x, f); });
  }
  // |i + diag - j| of element v[i][j][e] of a tile as a float, in two parts: this thread's base (one conversion
  // per tile) and a compile-time offset per register, so a score pays one add (conversions run at the
  // special-function unit's rate). Rows of the tile are queries r0.., columns keys c0..; TRANSPOSED: rows are keys
  // r0.., columns queries c0... Exact: distances are far below 2^24.
  template <bool TRANSPOSED> __device__ __forceinline__ float distance_base(int r0, int c0) const {
    const int g = lane_id() >> 2, t = lane_id() & 3;
    return TRANSPOSED ? (float)(c0 + 2 * t + diag - r0 - g) : (float)(r0 + g + diag - c0 - 2 * t);
  }
  template <bool TRANSPOSED> __device__ __forceinline__ static float distance(float base, int i, int j, int e) {
    const int off = 16 * i + 8 * (e >> 1) - 8 * j - (e & 1);  // the row part minus the column part
    return fabsf(base + (float)(TRANSPOSED ? -off : off));
  }

  // REF_FIRST's reference for a row of ALiBi scores (softmax.cuh's SoftmaxRef; the FA3 16-bit forward's first key
  // block, s as scores() left it): the block's largest visible score without its bias, minus the bias of the
  // row's nearest visible key, in log2 units (-inf where the row sees nothing in the block). Its own biased scores
  // lie at or below it (a key's bias is at least its nearest key's), and a later block's P exceeds 1 only where
  // the score without the bias exceeds the first block's, as in plain attention. (The biased max would not do:
  // the first block holds key 0, whose bias -slope * (i + diag) the row's later keys shed.) Without a left bound
  // (where REF_FIRST runs) row i sees keys [0, row_end(i)); rows past seqlen_q too, by the same formula.
  template <typename T, int NT> __device__ __forceinline__ void first_ref(const Acc<1, NT>& s, int r0, int c0,
                                                                          float (&ref)[2]) const {
    const float slope = slope_nat * LOG2E / softmax_scale<T>(), base = distance_base<false>(r0, c0);
    float mx[2] = {-INFINITY, -INFINITY};
    for_each_index<1, NT>([&](int i, int j, int e, int, int) {
      mx[e >> 1] = fmaxf(mx[e >> 1], fmaf(slope, distance<false>(base, i, j, e), s.v[i][j][e]));
    });
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m = quad_max(mx[r]);
      const int row = r0 + (lane_id() >> 2) + 8 * r, at = row + diag;
      const int nearest = min(max(at, 0), max(row_end(row) - 1, 0));  // (a row that sees nothing has m = -inf)
      ref[r] = (m - slope * (float)abs(at - nearest)) * softmax_scale<T>();
    }
  }
  // Whether this head's scores carry an ALiBi bias (uniform over the CTA).
  __device__ __forceinline__ bool biased() const { return GENERAL_ && slope_nat != 0.f; }

  // The ALiBi slope (natural units) of query head hk * group + hh of the block's sequence: decode's packed rows
  // mix the heads of a group.
  template <class P> __device__ __forceinline__ float head_slope(const P& p, const Info& bi, int hh) const {
    return (GENERAL_ && p.alibi_slopes) ? p.alibi_slopes[bi.b * p.alibi_sb + bi.hk * (p.heads / p.kv_heads) + hh]
                                        : 0.f;
  }

  // x = q.k of query i, key j -> the score in log2 units; *dz = d(score in natural units) / d(scale * q.k).
  template <typename T> __device__ __forceinline__ float score(float x, int i, int j, float* dz = nullptr) const {
    return score<T>(x, i, j, dz, slope_nat);
  }
  // The same with the ALiBi slope (natural units) of the row's own head.
  template <typename T> __device__ __forceinline__ float score(float x, int i, int j, float* dz, float alibi) const {
    const float slope = alibi * LOG2E, slope_nat = alibi;
    const int dist = i + diag - j;
    const float adist = (float)(dist < 0 ? -dist : dist);
    if (GENERAL_ && cap_in > 0.f) {
      const float th = tanh_<T>(x * cap_in);
      if (dz) *dz = 1.f - th * th;
      return th * cap_out - slope * adist;
    }
    if (dz) *dz = 1.f;
    if (!GENERAL_) return __fmul_rn(x, scale_log2);
    if constexpr (sizeof(T) == 4)  // float32: the score and its ALiBi bias summed in natural units, rounded once
      return (float)(((double)x * scale - (double)slope_nat * adist) * (double)LOG2E_D);
    return x * scale_log2 - slope * adist;
  }
  // One element of the backward (FA2 Alg.2 l.10-13) for the general policy: x = q.k of query i and key j, dp =
  // dO_i . V_j, the row's L (log2 units) and D -> P_ij (in x) and dS_ij (in dp), with the transform's derivative
  // folded into dS (the caller multiplies by the softmax scale at the end, as for plain scores). Hidden elements
  // of edge blocks get P = dS = 0.
  template <typename T> __device__ __forceinline__ void backward(float& x, float& dp, int i, int j, float L, float D,
                                                                 bool edge) const {
    float dz;
    const float s = score<T>(x, i, j, &dz);
    x = (edge && !visible(i, j)) ? 0.f : exp2_<T>(s - L);
    dp = x * (dp - D) * dz;
  }
  // P and dS of a whole tile (FA2 Alg.2 l.10-13): s holds q.k, dp holds dO.V, and they become P and dS. TRANSPOSED:
  // rows are keys k0.., columns queries q0.. (S^T), L and D indexed by column; else rows are queries q0.., columns
  // keys k0.., L and D indexed by row. The plain policy masks edge blocks only and leaves interior blocks without
  // any mask code (-inf before the exponential gives the same P = dS = 0 as backward()'s select, in ~20 fewer
  // registers than testing visibility per element in every block: bench/NOTES.md); the general one runs
  // backward() per element. SPARE_REGS: the caller's threads have registers to spare (FA3's consumers, 240 each):
  // the general 16-bit elements then run without a predicate and edge tiles zero their hidden elements in a pass
  // of their own (hide), and ALiBi's one-sided tiles split the bias (backward_alibi_one_side); the forms at the
  // 255-register cap keep the select inside the element loop and the distance form (the other two spill there:
  // 8 - 56 B in fa2_bwd at d = 96 / 256 and 16 B in fa2_bwd_sm90's column split, offline; bench/NOTES.md), and
  // so do FA3's 128-row tiles, which pass false. PREMASK (those tiles): a window's elements without a transform run
  // as plain attention's do, hidden scores to -inf before the exponential and no select (for_each_hidden).
  template <typename T, bool TRANSPOSED, bool SPARE_REGS = false, bool PREMASK = false, int MT, int NT>
  __device__ __forceinline__ void backward_tile(Acc<MT, NT>& s, Acc<MT, NT>& dp, int q0, int k0, const float* L,
                                                const float* D, bool edge) const {
    if constexpr (GENERAL_ && sizeof(T) == 4) {  // float32, the accuracy path: every element through score()
      for_each2(s, dp, [&](float& x, float& y, int row, int col) {
        const int r = TRANSPOSED ? col : row;
        backward<T>(x, y, q0 + r, k0 + (TRANSPOSED ? row : col), L[r], D[r], edge);
      });
    } else if constexpr (GENERAL_) {  // the transform's parts chosen once per tile
      const bool cap = cap_in > 0.f, alibi = slope_nat != 0.f;
      if (cap && alibi) backward_general<T, TRANSPOSED, true, true, SPARE_REGS, PREMASK>(s, dp, q0, k0, L, D, edge);
      else if (cap) backward_general<T, TRANSPOSED, true, false, SPARE_REGS, PREMASK>(s, dp, q0, k0, L, D, edge);
      else if (alibi) backward_general<T, TRANSPOSED, false, true, SPARE_REGS, PREMASK>(s, dp, q0, k0, L, D, edge);
      else backward_general<T, TRANSPOSED, false, false, SPARE_REGS, PREMASK>(s, dp, q0, k0, L, D, edge);
    } else {
      if (edge) {
        if constexpr (TRANSPOSED) mask_t(s, k0, q0);
        else mask(s, q0, k0);
      }
      plain_elements<T, TRANSPOSED>(s, dp, L, D);
    }
  }
  // P and dS of scores without a transform, hidden ones already -inf (L = +inf for a row that sees nothing,
  // fa2_bwd_preprocess, so its P is 0 too): the plain policy's element loop, without a predicate.
  template <typename T, bool TRANSPOSED, int MT, int NT>
  __device__ __forceinline__ void plain_elements(Acc<MT, NT>& s, Acc<MT, NT>& dp, const float* L,
                                                 const float* D) const {
    for_each2(s, dp, [&](float& x, float& y, int row, int col) {
      const int r = TRANSPOSED ? col : row;
      x = exp2_<T>(__fmul_rn(x, scale_log2) - L[r]);
      y = x * (y - D[r]);
    });
  }
  // The plain policy's backward_tile in its two halves, for a mainloop that runs a product between them
  // (mainloop_bwd_sm80's EARLY_DV): P from q.k (edge blocks masked: P = 0 where hidden), then dS from P and dP.
  // (backward_tile keeps its one loop: written as these two calls, the SASS of the kernels using it changes.)
  template <typename T, bool TRANSPOSED, int MT, int NT>
  __device__ __forceinline__ void probs_tile(Acc<MT, NT>& s, int q0, int k0, const float* L, bool edge) const {
    static_assert(!GENERAL_, "the general policy's P and dS come from backward(), one element at a time");
    if (edge) {
      if constexpr (TRANSPOSED) mask_t(s, k0, q0);
      else mask(s, q0, k0);
    }
    for_each(s, [&](float& x, int row, int col) {
      x = exp2_<T>(__fmul_rn(x, scale_log2) - L[TRANSPOSED ? col : row]);
    });
  }
  template <bool TRANSPOSED, int MT, int NT>
  __device__ __forceinline__ static void dscores_tile(Acc<MT, NT>& pr, Acc<MT, NT>& dp, const float* D) {
    for_each2(pr, dp, [&](float& x, float& y, int row, int col) { y = x * (y - D[TRANSPOSED ? col : row]); });
  }
  // P and dS of every element of a 16-bit tile (hidden elements of edge blocks 0), soft-capping (CAP) and ALiBi
  // compiled in or out; SPARE_REGS as in backward_tile.
  template <typename T, bool TRANSPOSED, bool CAP, bool ALIBI, bool SPARE_REGS, bool PREMASK, int MT, int NT>
  __device__ __forceinline__ void backward_general(Acc<MT, NT>& s, Acc<MT, NT>& dp, int q0, int k0, const float* L,
                                                   const float* D, bool edge) const {
    if constexpr (SPARE_REGS && ALIBI && !CAP) {
      const float side = alibi_side<TRANSPOSED, MT, NT>(q0, k0);
      if (side != 0.f)
        return backward_alibi_one_side<T, TRANSPOSED>(s, dp, q0, k0, L, D, edge, side * slope_nat * LOG2E);
    }
    if constexpr (PREMASK && !SPARE_REGS && !CAP && !ALIBI && MASK_ == WINDOW) {
      // A window without a transform where the select stays: hidden scores to -inf before the exponential as plain
      // attention's edge blocks do (P = 0 and dS = 0 (dP - D) = 0), then plain attention's element loop, without a
      // predicate. (Offline: without a mask the same spills 20 - 56 B in FA3's d = 64 backward, and fa2_bwd's
      // windowed d = 256 tiles spill 8 B with it.)
      if (edge) for_each_hidden<TRANSPOSED>(s, dp, q0, k0, [](float& x, float&) { x = -INFINITY; });
      return plain_elements<T, TRANSPOSED>(s, dp, L, D);
    }
    const float slope = slope_nat * LOG2E, base = distance_base<TRANSPOSED>(TRANSPOSED ? k0 : q0, TRANSPOSED ? q0 : k0);
    for_each_index<MT, NT>([&](int i, int j, int e, int row, int col) {
      float &x = s.v[i][j][e], &y = dp.v[i][j][e];
      const int r = TRANSPOSED ? col : row;
      float dz = 1.f, sc;
      if constexpr (CAP) {
        const float th = tanh_<T>(x * cap_in);
        dz = 1.f - th * th;
        sc = th * cap_out;
      } else {
        sc = __fmul_rn(x, scale_log2);
      }
      if constexpr (ALIBI) sc = fmaf(-slope, distance<TRANSPOSED>(base, i, j, e), sc);
      if constexpr (SPARE_REGS) x = exp2_<T>(sc - L[r]);
      else x = (edge && !visible(q0 + r, k0 + (TRANSPOSED ? row : col))) ? 0.f : exp2_<T>(sc - L[r]);
      y = x * (y - D[r]) * dz;
    });
    if constexpr (SPARE_REGS)
      if (edge) hide<TRANSPOSED>(s, dp, q0, k0);
  }
  // ALiBi's distance i + diag - j over a warp tile of 16 MT x 8 NT (rows queries q0.., columns keys k0..; TRANSPOSED:
  // rows keys): +1 where it is >= 0 in every element (every key at or before its query's diagonal), -1 where it is
  // <= 0 in every element, 0 where the tile crosses the diagonal. Uniform over the warp.
  template <bool TRANSPOSED, int MT, int NT> __device__ __forceinline__ float alibi_side(int q0, int k0) const {
    const int nq = TRANSPOSED ? 8 * NT : 16 * MT, nk = TRANSPOSED ? 16 * MT : 8 * NT;
    return q0 + diag - (k0 + nk - 1) >= 0 ? 1.f : q0 + nq - 1 + diag - k0 <= 0 ? -1.f : 0.f;
  }
  // backward_general with ALiBi alone on a warp tile that lies on one side of the diagonal (sig = side x slope, log2
  // units). There the bias separates, -slope |i + diag - j| = sig (j - k0) - sig (i + diag - k0): a key part and a
  // query part, each a function of one register row or column, so the loops' unrolled copies share them (computed
  // once per row and per column of the thread's fragment, the query part added to L_i), and a score pays one FFMA
  // (q.k scale + its key part) and one subtraction before the exponential, as plain attention's scores do, instead of
  // a multiply, a distance, a multiply-add and a subtraction. Offsets are tile-relative, so the parts stay small
  // near the diagonal (float32 rounding of the large ones only touches probabilities far below the row's max).
  template <typename T, bool TRANSPOSED, int MT, int NT>
  __device__ __forceinline__ void backward_alibi_one_side(Acc<MT, NT>& s, Acc<MT, NT>& dp, int q0, int k0,
                                                          const float* L, const float* D, bool edge, float sig) const {
    const int g = lane_id() >> 2, t = lane_id() & 3;
    // this thread's first key offset and query distance (i + diag - k0) as floats: one conversion each per tile
    const float kb = (float)(TRANSPOSED ? g : 2 * t), qb = (float)(q0 + diag - k0 + (TRANSPOSED ? 2 * t : g));
    for_each_index<MT, NT>([&](int i, int j, int e, int row, int col) {
      float &x = s.v[i][j][e], &y = dp.v[i][j][e];
      const int r = TRANSPOSED ? col : row;
      const int roff = 16 * i + 8 * (e >> 1), coff = 8 * j + (e & 1);  // compile-time parts of row and column
      const float key = sig * (kb + (float)(TRANSPOSED ? roff : coff));
      const float lq = fmaf(sig, qb + (float)(TRANSPOSED ? coff : roff), L[r]);
      x = exp2_<T>(fmaf(x, scale_log2, key) - lq);
      y = x * (y - D[r]);
    });
    if (edge) hide<TRANSPOSED>(s, dp, q0, k0);
  }
  // f(x, y) for the elements of two tiles whose key is hidden from their query (rows queries q0.., columns keys
  // k0..; TRANSPOSED: rows keys). Under a window the test is one unsigned compare of j - i against the window's
  // span: key j is visible to query i iff diag - left <= j - i <= diag + right (a side without a bound taken as
  // +-2^30) and j < seqlen_k (j >= 0 always, so row_start's and row_end's clamps to 0 change nothing), with j - i a
  // per-thread base plus a compile-time offset per register. (visible() per element, each row's two bounds
  // clamped, spills 16 / 52 B in FA3's d = 128 backward; the one compare does not, so its windowed loops need no
  // per-element select.)
  template <bool TRANSPOSED, int MT, int NT, class F>
  __device__ __forceinline__ void for_each_hidden(Acc<MT, NT>& s, Acc<MT, NT>& dp, int q0, int k0, F f) const {
    if constexpr (MASK_ == WINDOW) {
      const int g = lane_id() >> 2, t = lane_id() & 3;
      const int lo = left >= 0 ? diag - left : -(1 << 30), hi = right >= 0 ? diag + right : (1 << 30);
      const u32 span = (u32)hi - (u32)lo;
      // (j - i - lo) of this thread's first element: rows are keys (TRANSPOSED) or queries
      const int base = (TRANSPOSED ? k0 + g - q0 - 2 * t : k0 + 2 * t - q0 - g) - lo;
      for_each_index<MT, NT>([&](int i, int j, int e, int row, int col) {
        const int roff = 16 * i + 8 * (e >> 1), coff = 8 * j + (e & 1);
        const int key = k0 + (TRANSPOSED ? row : col);
        if ((u32)(base + (TRANSPOSED ? roff - coff : coff - roff)) > span || key >= seqlen_k)
          f(s.v[i][j][e], dp.v[i][j][e]);
      });
    } else {
      for_each2(s, dp, [&](float& x, float& y, int row, int col) {
        if (!visible(q0 + (TRANSPOSED ? col : row), k0 + (TRANSPOSED ? row : col))) f(x, y);
      });
    }
  }
  // P = dS = 0 where the key is hidden from the query, for the general policy's edge tiles (for_each_hidden's
  // layout). A pass of its own after the element-wise one, which then runs without a predicate: selected per
  // element there, every L_i and D_i load and exponential becomes predicated and ptxas loads L_i, D_i once per
  // element instead of once per register column (FA3 backward, d = 128: 42 shared loads and 98 integer
  // instructions for a warp tile's 32 scores against plain attention's 16 and ~20; offline SASS, bench/NOTES.md).
  // Hidden elements computed on the way may be inf or NaN (a masked score above L_i); they are overwritten,
  // never used.
  template <bool TRANSPOSED, int MT, int NT>
  __device__ __forceinline__ void hide(Acc<MT, NT>& s, Acc<MT, NT>& dp, int q0, int k0) const {
    for_each_hidden<TRANSPOSED>(s, dp, q0, k0, [](float& x, float& y) { x = y = 0.f; });
  }
  // Scores of a tile (rows queries r0.., columns keys c0..) through soft-capping and ALiBi (GENERAL only, and only
  // on heads that transforms()), in the units softmax_scale<T>() turns into log2 units.
  template <typename T, int MT, int NT>
  __device__ __forceinline__ void transform(Acc<MT, NT>& s, int r0, int c0) const {
    if constexpr (GENERAL_) {
      if constexpr (sizeof(T) == 4) {  // float32, the accuracy path: every score through score(), which rounds the
        for_each(s, [&](float& x, int row, int col) { x = score<T>(x, r0 + row, c0 + col); });  // ALiBi sum once
      } else {
        if (!transforms()) return;
        if (cap_in > 0.f) for_each_row(s, [&](float& x, int) { x = tanh_<T>(x * cap_in); });
        if (slope_nat != 0.f) {  // in the units softmax_scale() multiplies
          const float slope = slope_nat * LOG2E / softmax_scale<T>(), base = distance_base<false>(r0, c0);
          for_each_index<MT, NT>([&](int i, int j, int e, int, int) {
            s.v[i][j][e] = fmaf(-slope, distance<false>(base, i, j, e), s.v[i][j][e]);
          });
        }
      }
    }
  }
};

}  // namespace rf
