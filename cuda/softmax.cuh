// OnlineSoftmax: FlashAttention's running softmax over key blocks (FA2 Alg.1 l.9-13) for the rows a thread
// holds: the row max m (log2 units) and sum l, their update by one block of scores, and the end of the row (the
// factor O is divided by, the lse, the sink's share of the denominator, and the -inf guards of rows that see
// nothing). Every forward kernel uses it; the split-K partition of FA1 merges the same state through shared
// memory (splitk.cuh).
#pragma once
#include "acc.cuh"

namespace rf {

// The end of a row, Alg.1 l.12-13, from its max m (log2 units) and sum l: f multiplies the running O and lse is
// the natural-log denominator. A sink logit (log2 units, -inf for none) joins the denominator with no value:
// relative to M = max(m, sink), L = l 2^(m - M) + 2^(sink - M). A row that saw no key gets f = 0 and lse = -inf,
// or lse = sink with a sink. NORMALIZED: O is already divided by l (per-step normalisation).
template <typename T, bool NORMALIZED>
__device__ __forceinline__ void finalize_row(float m, float l, float sink_log2, float& f, float& lse) {
  if (sink_log2 == -INFINITY) {
    f = l > 0.f ? (NORMALIZED ? 1.f : 1.f / l) : 0.f;
    lse = l > 0.f ? m * LN2 + logf(l) : -INFINITY;
  } else {
    const float mm = fmaxf(m, sink_log2), a = exp2_<T>(m - mm), denom = l * a + exp2_<T>(sink_log2 - mm);
    f = (NORMALIZED ? l : 1.f) * a / denom;
    lse = (mm + log2f(denom)) * LN2;
  }
}

// What a row's softmax subtracts in the exponent (the FA3 16-bit forward's REF; softmax is exact for any value,
// only P's range depends on it):
//   REF_RUNNING: the running max (FA2's online softmax), O rescaled when it moves;
//   REF_BOUNDED: a fixed reference (Policy::fixed_ref) for scores known to be bounded (soft-capping);
//   REF_FIRST:   the max of the row's first block (under ALiBi, of its scores without their bias: Policy::
//                first_ref), kept for the rest of the row (no max, no rescale after it): P = 2^(s - m_first) may
//                exceed 1, and the caller checks at the end of the row that l stayed <= 2^80 (every P did) and,
//                where the row has a reference, >= 2^-60, else the call is recomputed with REF_RUNNING
//                (FwdParams::ref_flag).
enum SoftmaxRef { REF_RUNNING = 0, REF_BOUNDED = 1, REF_FIRST = 2 };

template <int ROWS> struct OnlineSoftmax {
  float m[ROWS], l[ROWS];

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) { m[r] = -INFINITY; l[r] = 0.f; }
  }

  // One key block, Alg.1 l.9-10: S (times scale: raw q.k with the softmax scale in log2 units, or 1 when the
  // policy has already produced log2 units) -> P = exp2(S scale - m_new) in place, l = e^(m_old - m_new) l +
  // rowsum(P); fo[r] receives e^(m_old - m_new), the factor the running O must be multiplied by.
  // NORMALIZE (FA1's per-step normalisation, the defer_norm=false ablation) also divides P by the new l and turns
  // fo into l_old e^(m_old - m_new) / l_new, so the running O stays normalised.
  // p_log2 (FP8's P scale): P comes out times 2^p_log2 (and so does l), which cancels in O / l.
  // stale_log2 (FA4's lazy rescale): the running max is kept while the block's max exceeds it by at most this
  // much (log2 units), so P may reach 2^stale_log2 (times 2^p_log2) and fo is exactly 1: O's rescale can be
  // skipped. 0 keeps the exact max of every block.
  // REF (SoftmaxRef) other than REF_RUNNING: no max is taken and fo is exactly 1 (the caller skips O's rescale):
  // REF_BOUNDED subtracts fixed_ref (log2 units), which becomes m; REF_FIRST keeps m, the reference an earlier
  // REF_RUNNING update of the row set (its first block's max) or the caller (Policy::first_ref) set, and a row
  // that has seen nothing yet (m = -inf: where REF_FIRST runs, no window bounds the rows on the left, so it sees
  // nothing at all) subtracts 0, so its -inf scores give P = 0.
  template <typename T, bool NORMALIZE = false, int REF = REF_RUNNING, int MT, int NT>
  __device__ __forceinline__ void update(Acc<MT, NT>& s, float scale, float (&fo)[ROWS], float p_log2 = 0.f,
                                         float stale_log2 = 0.f, float fixed_ref = 0.f) {
    static_assert(2 * MT == ROWS, "one softmax row per accumulator row");
    float mx[ROWS], rs[ROWS];
    if constexpr (REF == REF_BOUNDED) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r) { m[r] = mx[r] = fixed_ref; fo[r] = 1.f; }
    } else if constexpr (REF == REF_FIRST) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r) { mx[r] = m[r] == -INFINITY ? 0.f : m[r]; fo[r] = 1.f; }
    } else {
      row_max(mx, s);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const float cand = fmaxf(m[r], mx[r] * scale);
        // The max stays (fo = 1 exactly) within stale_log2 (never while the row has seen nothing: +inf or NaN).
        if (stale_log2 > 0.f && cand - m[r] <= stale_log2) {
          fo[r] = 1.f;
          mx[r] = m[r] - p_log2;
          continue;
        }
        const float m_new = cand;
        mx[r] = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet keeps P = 0
        fo[r] = exp2_<T>(m[r] - mx[r]);
        m[r] = m_new;
        mx[r] -= p_log2;
      }
    }
    for_each_row(s, [&](float& x, int r) { x = exp2_<T>(fmaf(x, scale, -mx[r])); });
    row_sum(rs, s);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const float l_old = l[r];
      l[r] = fo[r] * l_old + rs[r];
      if (NORMALIZE) {
        mx[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;
        fo[r] *= l_old * mx[r];
      }
    }
    if (NORMALIZE) scale_rows(s, mx);
  }

  // Alg.1 l.10: O = diag(fo) O. LAZY (a stale_log2 update): skipped when no row of the warp moved its max (every
  // fo exactly 1), decided by one vote so the warp stays converged. EMPTY_ROWS: rows that see nothing for many
  // blocks (decode's padding rows) do not count (m = -inf: their O is 0 whatever fo); the FA3 forwards count
  // them (under a mask a row sees nothing for a few blocks at most), which keeps the test out of their key loop
  // (bench/NOTES.md).
  template <bool LAZY, bool EMPTY_ROWS = false, int MT, int NT>
  __device__ __forceinline__ void rescale(Acc<MT, NT>& o, const float (&fo)[ROWS]) const {
    if constexpr (LAZY) {
      bool moved = false;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) moved |= fo[r] != 1.f && (!EMPTY_ROWS || m[r] != -INFINITY);
      if (!__any_sync(0xffffffffu, moved)) return;
    }
    scale_rows(o, fo);
  }

  // The end of the rows (finalize_row for each).
  template <typename T, bool NORMALIZED = false>
  __device__ __forceinline__ void finalize(float sink_log2, float (&f)[ROWS], float (&lse)[ROWS]) const {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) finalize_row<T, NORMALIZED>(m[r], l[r], sink_log2, f[r], lse[r]);
  }
};

}  // namespace rf
