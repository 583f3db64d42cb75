// fa1_fwd: FlashAttention-1 forward as published (Dao et al. 2022, Algorithm 1).
// One CTA per (head, batch). The outer loop walks the key/value blocks K_j, V_j (loaded once each); the inner
// loop walks the query blocks Q_i that see K_j and reads O_i, l_i, m_i from HBM and writes them back every step,
// with O_i normalised by diag(l_i)^-1 every step. Inside the CTA the warps split the keys of K_j ("split-K") and
// combine their partial results through shared memory (splitk.cuh).
// O, l, m live in float32 work buffers (FwdParams::o_ws, m_ws, l_ws; per-row layout, O with head_dim columns);
// m is kept in log2 units. fa1_finalize writes out (in the input dtype) and lse = m + log(l) at the end.
#include "block_info.cuh"
#include "splitk.cuh"

template <typename T, int D, int BR, int BC, int NWARPS, int MIN_BLOCKS, int MASK, int SMEM_BYTES>
__global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS) fa1_fwd(const __grid_constant__ rf::FwdParams p) {
  using namespace rf;
  using Pol = Policy<MASK, false>;
  constexpr int NTHREADS = NWARPS * 32;
  static_assert((BR + 2 * BC) * D * (int)sizeof(T) + SplitK<BR, D, NWARPS>::BYTES == SMEM_BYTES,
                "rawflash/launch.py and the kernel disagree on shared memory");
  // ---- [fa1_fwd:setup] (batch, head) from the grid; the state of this head in HBM ----
  extern __shared__ __align__(16) char smem[];
  const typename Pol::Info bi(p, blockIdx.y, blockIdx.x);
  const Pol pol(p, bi);
  const T *q = bi.template q<T>(p), *k = bi.template k<T>(p), *v = bi.template v<T>(p);
  float *o_ws = p.o_ws + bi.row0 * p.head_dim, *m_ws = p.m_ws + bi.row0, *l_ws = p.l_ws + bi.row0;
  const Tile<T, BR, D> sQ{(T*)smem};
  const Tile<T, BC, D> sK{(T*)(smem + BR * D * sizeof(T))}, sV{(T*)(smem + (BR + BC) * D * sizeof(T))};
  const SplitK<BR, D, NWARPS> sk(smem + (BR + 2 * BC) * D * sizeof(T));
  const int tr = cdiv(bi.seqlen_q, BR), tc = cdiv(bi.seqlen_k, BC);
  for (int x = threadIdx.x; x < BR * D; x += NTHREADS) sk.acc[x] = 0.f;
  // ---- [fa1_fwd:outer] Alg.1 l.5-6: for each K_j, V_j: load them to shared memory once ----
  for (int j = 0; j < tc; ++j) {
    const int k0 = j * BC, nk = min(BC, bi.seqlen_k - k0);
    load_tile<NTHREADS>(sK, k + k0 * p.k_ss, p.k_ss, nk, p.head_dim);
    load_tile<NTHREADS>(sV, v + k0 * p.v_ss, p.v_ss, nk, p.head_dim);
    cp_async_commit();
    // ---- [fa1_fwd:inner] Alg.1 l.7-8: for each Q_i that sees K_j (blocks that see none of it are skipped) ----
    const BlockRange qb = pol.q_blocks(k0, BC, BR, tr);
    for (int s = 0; s < qb.n(); ++s) {
      const int q0 = qb.block(s) * BR, nq = min(BR, bi.seqlen_q - q0);
      load_tile<NTHREADS>(sQ, q + q0 * p.q_ss, p.q_ss, nq, p.head_dim);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();  // Q_i, K_j, V_j are visible to every warp
      // ---- [fa1_fwd:block] Alg.1 l.9-11: S_ij, m~_ij, P~_ij, l~_ij and P~_ij V_j, keys split across warps ----
      splitk_block<BR, BC, D, NWARPS>(sk, sQ, sK, sV, pol, q0, k0, qb.is_edge(s));
      // ---- [fa1_fwd:update] Alg.1 l.11-13: read O_i, l_i, m_i from HBM, merge, normalise, write back ----
      splitk_merge<T, true, BR, D, NTHREADS>(sk, m_ws + q0, l_ws + q0, o_ws + (long long)q0 * p.head_dim, p.head_dim,
                                             nq, p.head_dim);
    }
    cp_async_wait<0>();  // K_j, V_j have landed even when no query block saw them (never with today's policies)
    __syncthreads();  // every warp is done with K_j, V_j before the next blocks overwrite them
  }
}

// out = O in the input dtype and lse = m + log(l) (natural log; m is in log2 units), rows that saw no key
// get 0 and -inf. One thread per element of out; grid-stride over (batch, heads, seqlen_q, head_dim).
template <typename T> __global__ void fa1_finalize(const __grid_constant__ rf::FwdParams p) {
  using namespace rf;
  // ---- [fa1_fwd:finalize] ----
  const long long n = (long long)p.batch * p.heads * p.seqlen_q * p.head_dim;
  for (long long x = blockIdx.x * (long long)blockDim.x + threadIdx.x; x < n; x += (long long)gridDim.x * blockDim.x) {
    const int c = x % p.head_dim;
    const long long row = x / p.head_dim;                                   // (b * heads + h) * seqlen_q + i
    const int i = row % p.seqlen_q, h = (row / p.seqlen_q) % p.heads, b = row / ((long long)p.seqlen_q * p.heads);
    float f, lse;
    finalize_row<T, true>(p.m_ws[row], p.l_ws[row], -INFINITY, f, lse);
    ((T*)p.o)[b * p.o_sb + i * p.o_ss + h * p.o_sh + c] = from_float<T>(p.o_ws[x] * f);
    if (c == 0) p.lse[row] = lse;
  }
}
