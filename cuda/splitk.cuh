// The split-K warp partition of FlashAttention-1 (FA2 paper, section 3.3): every warp of the CTA sees all
// BR query rows and a slice of the BC keys of a block; the block's row maxima, row sums and P V products are
// combined across warps through shared memory. fa1_fwd uses it, and so does fa2_fwd with SPLIT_Q off.
#pragma once
#include "common.cuh"

namespace rf {

// Shared buffers of one split-K step: partial row maxima and sums per warp, the summed P V, and the
// per-row factors that merge a block into the running (m, l, O) state.
template <int BR, int D, int NWARPS> struct SplitK {
  static constexpr int BYTES = (2 * NWARPS * BR + BR * D + 2 * BR) * 4;
  float* red_max;  // [NWARPS][BR]  block row max (log2 units) of each warp's key slice
  float* red_sum;  // [NWARPS][BR]  row sum of exp2(S - block max) over each warp's key slice
  float* acc;      // [BR][D]       sum over warps of P~ V (zeroed between blocks)
  float* alpha;    // [BR]          factor on the old O
  float* beta;     // [BR]          factor on acc
  __device__ explicit SplitK(char* base)
      : red_max((float*)base), red_sum(red_max + NWARPS * BR), acc(red_sum + NWARPS * BR),
        alpha(acc + BR * D), beta(alpha + BR) {}
};

// One block step (FA1 Alg.1 l.9-11 within a CTA): S = Q K_j^T for this warp's keys, the block max across
// warps, P~ = exp2(S - m~), the block row sums, and P~ V summed over warps into sk.acc.
// Rows are [q0, q0 + BR), keys [k0, k0 + BC). Ends with a barrier: sk is complete when it returns.
template <int BR, int BC, int D, int NWARPS, typename T>
__device__ __forceinline__ void splitk_block(const SplitK<BR, D, NWARPS>& sk, const Tile<T, BR, D>& sQ,
                                             const Tile<T, BC, D>& sK, const Tile<T, BC, D>& sV, const Mask& mask,
                                             int q0, int k0, float scale_log2) {
  constexpr int MT = BR / 16, KEYS = BC / NWARPS, NT = KEYS / 8, DC = D % 64 == 0 ? 64 : 32;
  static_assert(KEYS % 16 == 0 && D % DC == 0, "each warp takes whole 16-key slices");
  const int w = warp_id(), g = lane_id() >> 2, t = lane_id() & 3, kw = w * KEYS;
  float s[MT][NT][4];
  zero(s);
  gemm_abt<MT, NT, D, 1>(s, sQ, 0, sK, kw);                                     // FA1 Alg.1 l.9: S_ij slice
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][j][e] *= scale_log2;
  if (mask.block_needs_mask(q0, BR, k0, BC)) apply_mask(s, mask, q0, k0 + kw);
  float mx[2 * MT], sum[2 * MT];
  row_max(mx, s);
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r)
    if (t == 0) sk.red_max[w * BR + 16 * (r / 2) + g + 8 * (r % 2)] = mx[r];
  __syncthreads();  // every warp's slice maximum is visible
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r) {                                           // FA1 Alg.1 l.10: m~ over the whole block
    float m = -INFINITY;
    for (int v = 0; v < NWARPS; ++v) m = fmaxf(m, sk.red_max[v * BR + 16 * (r / 2) + g + 8 * (r % 2)]);
    mx[r] = m == -INFINITY ? 0.f : m;                                          // a fully hidden row keeps P~ = 0
  }
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][j][e] = exp2_<T>(s[i][j][e] - mx[2 * i + (e >> 1)]);
  row_sum(sum, s);
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r)
    if (t == 0) sk.red_sum[w * BR + 16 * (r / 2) + g + 8 * (r % 2)] = sum[r];
#pragma unroll
  for (int dc = 0; dc < D; dc += DC) {                                         // P~ V over this warp's keys
    float pv[MT][DC / 8][4];
    zero(pv);
    gemm_rb<MT, DC / 8, NT / 2>(pv, s, sV, kw, dc);
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int j = 0; j < DC / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          atomicAdd(&sk.acc[(16 * i + g + 8 * (e >> 1)) * D + dc + 8 * j + 2 * t + (e & 1)], pv[i][j][e]);
  }
  __syncthreads();  // partial sums and P~ V of every warp are in sk
}

// Merge the block in sk into a running state (FA1 Alg.1 l.11-13): m, l per row and O (row stride ldo), which
// live in global memory for fa1 and in shared memory for fa2 with split-K. NORMALIZE keeps O divided by l
// after every block (FA1); otherwise O stays unnormalised until the end (FA2's deferred normalisation).
// Rows >= nrows are left alone. Ends with sk.acc zeroed again and a barrier.
template <typename T, bool NORMALIZE, int BR, int D, int NTHREADS, int NWARPS>
__device__ __forceinline__ void splitk_merge(const SplitK<BR, D, NWARPS>& sk, float* m, float* l, float* O,
                                             long long ldo, int nrows, int ncols) {
  for (int r = threadIdx.x; r < BR; r += NTHREADS) {
    float m_blk = -INFINITY, l_blk = 0.f;
    for (int v = 0; v < NWARPS; ++v) {
      m_blk = fmaxf(m_blk, sk.red_max[v * BR + r]);
      l_blk += sk.red_sum[v * BR + r];
    }
    if (r >= nrows) continue;
    const float m_old = m[r], l_old = l[r], m_new = fmaxf(m_old, m_blk);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;                      // nothing visible yet: keep factors finite
    const float a = exp2_<T>(m_old - m_use), b = m_blk == -INFINITY ? 0.f : exp2_<T>(m_blk - m_use);
    const float l_new = a * l_old + b * l_blk;
    const float inv = (NORMALIZE && l_new > 0.f) ? 1.f / l_new : 1.f;
    sk.alpha[r] = NORMALIZE ? a * l_old * inv : a;
    sk.beta[r] = b * inv;
    m[r] = m_new;
    l[r] = l_new;
  }
  __syncthreads();  // alpha, beta of every row are visible
  for (int idx = threadIdx.x; idx < BR * D; idx += NTHREADS) {
    const int r = idx / D, c = idx % D;
    if (r < nrows && c < ncols) O[r * ldo + c] = sk.alpha[r] * O[r * ldo + c] + sk.beta[r] * sk.acc[idx];
    sk.acc[idx] = 0.f;
  }
  __syncthreads();  // acc is zero and the state is written before the next block reuses them
}

}  // namespace rf
