// fa1_fwd: FlashAttention-1 forward as published (Dao et al. 2022, Algorithm 1).
// One CTA per (batch, head). The outer loop walks the key/value blocks K_j, V_j (loaded once each); the
// inner loop walks the query blocks Q_i and reads O_i, l_i, m_i from HBM and writes them back every step,
// with O_i normalised by diag(l_i)^-1 every step. Inside the CTA the warps split the keys of K_j ("split-K")
// and combine their partial results through shared memory (splitk.cuh).
// O, l, m live in float32 work buffers (batch, heads, seqlen_q[, head_dim]); m is kept in log2 units.
// fa1_finalize writes out (in the input dtype) and lse = m + log(l) at the end.
#include "common.cuh"
#include "splitk.cuh"

namespace rf {

template <typename T, int D, int BR, int BC, int NWARPS> struct Fa1FwdSmem {
  static constexpr int BYTES = (BR + 2 * BC) * D * (int)sizeof(T) + SplitK<BR, D, NWARPS>::BYTES;
};

}  // namespace rf

template <typename T, int D, int BR, int BC, int NWARPS, int MIN_BLOCKS, bool CAUSAL, int SMEM_BYTES>
__global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS)
fa1_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, float* __restrict__ o_ws,
        float* __restrict__ m_ws, float* __restrict__ l_ws, long long q_sb, long long q_ss, long long q_sh,
        long long k_sb, long long k_ss, long long k_sh, long long v_sb, long long v_ss, long long v_sh,
        int seqlen_q, int seqlen_k, int heads, int kv_heads, int head_dim, float scale_log2) {
  using namespace rf;
  constexpr int NTHREADS = NWARPS * 32;
  static_assert(Fa1FwdSmem<T, D, BR, BC, NWARPS>::BYTES == SMEM_BYTES,
                "rawflash/launch.py and the kernel disagree on shared memory");
  // ---- [fa1_fwd:setup] (batch, head) from the grid; the state of this head in HBM ----
  extern __shared__ __align__(16) char smem[];
  const int b = blockIdx.y, h = blockIdx.x, hk = h / (heads / kv_heads);
  const long long bh = (long long)b * heads + h;
  q += b * q_sb + h * q_sh;
  k += b * k_sb + hk * k_sh;
  v += b * v_sb + hk * v_sh;
  o_ws += bh * seqlen_q * head_dim;
  m_ws += bh * seqlen_q;
  l_ws += bh * seqlen_q;
  const Tile<T, BR, D> sQ{(T*)smem};
  const Tile<T, BC, D> sK{(T*)(smem + BR * D * sizeof(T))}, sV{(T*)(smem + (BR + BC) * D * sizeof(T))};
  const SplitK<BR, D, NWARPS> sk(smem + (BR + 2 * BC) * D * sizeof(T));
  const Mask mask{seqlen_q, seqlen_k, CAUSAL};
  const int tr = (seqlen_q + BR - 1) / BR, tc = (seqlen_k + BC - 1) / BC;
  for (int x = threadIdx.x; x < BR * D; x += NTHREADS) sk.acc[x] = 0.f;
  // ---- [fa1_fwd:outer] Alg.1 l.5-6: for each K_j, V_j: load them to shared memory once ----
  for (int j = 0; j < tc; ++j) {
    const int k0 = j * BC, nk = min(BC, seqlen_k - k0);
    load_tile<NTHREADS>(sK, k + k0 * k_ss, k_ss, nk, head_dim);
    load_tile<NTHREADS>(sV, v + k0 * v_ss, v_ss, nk, head_dim);
    cp_async_commit();
    // ---- [fa1_fwd:inner] Alg.1 l.7-8: for each Q_i that sees K_j (blocks above the diagonal are skipped) ----
    for (int i = mask.first_query_block(k0, BR); i < tr; ++i) {
      const int q0 = i * BR, nq = min(BR, seqlen_q - q0);
      load_tile<NTHREADS>(sQ, q + q0 * q_ss, q_ss, nq, head_dim);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();  // Q_i, K_j, V_j are visible to every warp
      // ---- [fa1_fwd:block] Alg.1 l.9-11: S_ij, m~_ij, P~_ij, l~_ij and P~_ij V_j, keys split across warps ----
      splitk_block<BR, BC, D, NWARPS>(sk, sQ, sK, sV, mask, q0, k0, scale_log2);
      // ---- [fa1_fwd:update] Alg.1 l.11-13: read O_i, l_i, m_i from HBM, merge, normalise, write back ----
      splitk_merge<T, true, BR, D, NTHREADS>(sk, m_ws + q0, l_ws + q0, o_ws + (long long)q0 * head_dim, head_dim, nq,
                                          head_dim);
    }
    __syncthreads();  // every warp is done with K_j, V_j before the next blocks overwrite them
  }
}

// out = O in the input dtype and lse = m + log(l) (natural log; m is in log2 units), rows that saw no key
// get 0 and -inf. One thread per element of out; grid-stride.
template <typename T>
__global__ void fa1_finalize(const float* __restrict__ o_ws, const float* __restrict__ m_ws,
                             const float* __restrict__ l_ws, T* __restrict__ o, float* __restrict__ lse,
                             long long o_sb, long long o_ss, long long o_sh, int batch, int seqlen_q, int heads,
                             int head_dim) {
  using namespace rf;
  // ---- [fa1_fwd:finalize] ----
  const long long n = (long long)batch * heads * seqlen_q * head_dim;
  for (long long x = blockIdx.x * (long long)blockDim.x + threadIdx.x; x < n; x += (long long)gridDim.x * blockDim.x) {
    const int c = x % head_dim;
    const long long row = x / head_dim;                                     // (b * heads + h) * seqlen_q + i
    const int i = row % seqlen_q, h = (row / seqlen_q) % heads, b = row / ((long long)seqlen_q * heads);
    const bool seen = l_ws[row] > 0.f;
    o[b * o_sb + i * o_ss + h * o_sh + c] = from_float<T>(seen ? o_ws[x] : 0.f);
    if (c == 0) lse[row] = seen ? m_ws[row] * LN2 + logf(l_ws[row]) : -INFINITY;
  }
}
