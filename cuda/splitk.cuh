// The split-K warp partition of FlashAttention-1 (FA2 paper, section 3.3): every warp of the CTA sees all
// BR query rows and a slice of the BC keys of a block; the block's row maxima, row sums and P V products are
// combined across warps through shared memory. fa1_fwd uses it, and so does fa2_fwd with SPLIT_Q off.
#pragma once
#include "policy.cuh"
#include "sm80.cuh"
#include "softmax.cuh"

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

// One block step (FA1 Alg.1 l.9-11 within a CTA): S = Q K_j^T for this warp's keys (through the policy's
// transform and, on edge blocks, its mask), the block max across warps, P~ = exp2(S - m~), the block
// row sums, and P~ V summed over warps into sk.acc.
// Rows are [q0, q0 + BR), keys [k0, k0 + BC). Ends with a barrier: sk is complete when it returns.
template <int BR, int BC, int D, int NWARPS, typename T, class Pol>
__device__ __forceinline__ void splitk_block(const SplitK<BR, D, NWARPS>& sk, const Tile<T, BR, D>& sQ,
                                             const Tile<T, BC, D>& sK, const Tile<T, BC, D>& sV, const Pol& pol,
                                             int q0, int k0, bool edge) {
  constexpr int MT = BR / 16, KEYS = BC / NWARPS, NT = KEYS / 8, DC = D % 64 == 0 ? 64 : 32;
  static_assert(KEYS % 16 == 0 && D % DC == 0, "each warp takes whole 16-key slices");
  const int w = warp_id(), g = lane_id() >> 2, t = lane_id() & 3, kw = w * KEYS;
  Acc<MT, NT> s;
  zero(s);
  gemm_abt<MT, NT, D, 1>(s, sQ, 0, sK, kw);                                     // FA1 Alg.1 l.9: S_ij slice
  pol.template transform<T>(s, q0, k0 + kw);
  if (edge) pol.mask(s, q0, k0 + kw);
  pol.prescale(s);
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
  for_each_row(s, [&](float& x, int r) { x = exp2_<T>(x - mx[r]); });
  row_sum(sum, s);
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r)
    if (t == 0) sk.red_sum[w * BR + 16 * (r / 2) + g + 8 * (r % 2)] = sum[r];
#pragma unroll
  for (int dc = 0; dc < D; dc += DC) {                                         // P~ V over this warp's keys
    Acc<MT, DC / 8> pv;
    zero(pv);
    gemm_rb<MT, DC / 8, NT / 2>(pv, s, sV, kw, dc);
    for_each(pv, [&](float& x, int row, int col) { atomicAdd(&sk.acc[row * D + dc + col], x); });
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


// The forward mainloop with FA1's split-K partition (the ablation of FA2's split-Q, fa2_fwd with SPLIT_Q off): all
// warps see all BR rows of Q_i and split the keys of each block; the running O, m, l live in shared memory
// (after Q_i, K_j, V_j and the SplitK buffers) and the tile's own store writes them out.
template <typename T_, int D, int BR_, int BC, int NWARPS, bool DEFER_NORM, class Pol_> struct MainloopFwdSplitK {
  using T = T_;
  using Pol = Pol_;
  using SK = SplitK<BR_, D, NWARPS>;
  static constexpr int BR = BR_, NTHREADS = NWARPS * 32, TILES = (BR_ + 2 * BC) * D * (int)sizeof(T_);
  static constexpr int SMEM_BYTES = TILES + SK::BYTES + (BR_ * D + 2 * BR_) * 4;  // + O, m, l
  struct State {};

  __device__ __forceinline__ static void run(const FwdParams& p, const typename Pol::Info& bi, const Pol& pol, int q0,
                                             char* smem, State&) {
    const Tile<T, BR, D> sQ{(T*)smem};
    const Tile<T, BC, D> sK{(T*)(smem + BR * D * sizeof(T))}, sV{(T*)(smem + (BR + BC) * D * sizeof(T))};
    const SK sk(smem + TILES);
    float *sO = (float*)(smem + TILES + SK::BYTES), *sM = sO + BR * D, *sL = sM + BR;
    const T *q = bi.template q<T>(p), *k = bi.template k<T>(p), *v = bi.template v<T>(p);
    const int nrows = min(BR, bi.seqlen_q - q0);
    const BlockRange kv = pol.kv_blocks(q0, nrows, BC);
    // ---- [splitk:init] O = 0, m = -inf, l = 0 in shared memory ----
    for (int x = threadIdx.x; x < BR * D; x += NTHREADS) { sO[x] = 0.f; sk.acc[x] = 0.f; }
    for (int r = threadIdx.x; r < BR; r += NTHREADS) { sM[r] = -INFINITY; sL[r] = 0.f; }
    load_tile<NTHREADS>(sQ, q + q0 * p.q_ss, p.q_ss, nrows, p.head_dim);
    cp_async_commit();  // its own group, so the final wait covers it when no key block is visible
    for (int s = 0; s < kv.n(); ++s) {
      const int k0 = kv.block(s) * BC;
      // ---- [splitk:step] every warp takes BC/NWARPS keys; rows are merged through shared memory ----
      load_tile<NTHREADS>(sK, k + k0 * p.k_ss, p.k_ss, min(BC, bi.seqlen_k - k0), p.head_dim);
      load_tile<NTHREADS>(sV, v + k0 * p.v_ss, p.v_ss, min(BC, bi.seqlen_k - k0), p.head_dim);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();  // Q_i, K_j, V_j and the zeroed state are visible to every warp
      splitk_block<BR, BC, D, NWARPS>(sk, sQ, sK, sV, pol, q0, k0, kv.is_edge(s));
      splitk_merge<T, !DEFER_NORM, BR, D, NTHREADS>(sk, sM, sL, sO, D, BR, D);
    }
    cp_async_wait<0>();
    __syncthreads();  // the state is final (also when no key block was visible)
  }

  // ---- [splitk:store] O_i = diag(l)^-1 O_i (or as kept), L_i = m_i + log(l_i), with the sink in the denominator ----
  __device__ __forceinline__ static void store(const FwdParams& p, const typename Pol::Info& bi, const Pol& pol, int q0,
                                               char* smem, const State&) {
    const float *sO = (const float*)(smem + TILES + SK::BYTES), *sM = sO + BR * D, *sL = sM + BR;
    const int nrows = min(BR, bi.seqlen_q - q0);
    T* o = bi.template q_like<T>(p.o, p.o_sb, p.o_ss, p.o_sh);
    for (int x = threadIdx.x; x < nrows * p.head_dim; x += NTHREADS) {
      const int r = x / p.head_dim, c = x % p.head_dim;
      float f, lse;
      finalize_row<T, !DEFER_NORM>(sM[r], sL[r], pol.sink_log2(p, bi), f, lse);
      o[(q0 + r) * p.o_ss + c] = from_float<T>(sO[r * D + c] * f);
      if (c == 0) p.lse[bi.row0 + q0 + r] = lse;
    }
    __syncthreads();  // every thread is done with the state before the next query block resets it
  }
};

}  // namespace rf
