// fa1_fwd: FlashAttention-1 forward as published (Dao et al. 2022, Algorithm 1) and as released (flash-attn 1.x).
// One CTA per (head, batch, split). The outer loop walks the key/value blocks K_j, V_j (loaded once each per CTA);
// the inner loop walks the query blocks Q_i that see K_j and reads O_i, l_i, m_i from HBM and writes them back
// every step, with O_i normalised by diag(l_i)^-1 every step. The paper's kernel has one CTA per (batch, head);
// flash-attn 1.x also cuts the query blocks of a head into `splits` sets (its num_splits, chosen to fill the GPU's
// waves: launch.fa1_splits), here query block i belongs to split i % splits, so a long sequence with few heads still
// fills the GPU. Every split reads all of K and V; no two CTAs touch the same rows of O, l, m. Inside the CTA the
// warps split the keys of K_j ("split-K") and merge their partial results through shared memory (splitk.cuh).
// O, l, m live in float32 work buffers (FwdParams::o_ws, m_ws, l_ws; per-row layout, O with head_dim columns);
// m is kept in log2 units. fa1_finalize writes out (in the input dtype) and lse = m + log(l) at the end.
// While a step computes, Q of the next step streams into the other of two Q buffers and the O_i, l_i, m_i it
// merges into are already on their way from HBM into registers.
#include "block_info.cuh"
#include "splitk.cuh"

template <typename T, int D, int BR, int BC, int NWARPS, int MIN_BLOCKS, int MASK, int SMEM_BYTES>
__global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS) fa1_fwd(const __grid_constant__ rf::FwdParams p) {
  using namespace rf;
  using Pol = Policy<MASK, false>;
  using SK = SplitK<BR, D, NWARPS>;
  using State = SplitKState<BR, D, NWARPS>;
  constexpr int NTHREADS = NWARPS * 32, MT = BR / 16, OWN = SK::OWN, QT = BR * D * (int)sizeof(T);
  static_assert(2 * QT + 2 * BC * D * (int)sizeof(T) + SK::BYTES == SMEM_BYTES,
                "rawflash/kernels/launch.py and the kernel disagree on shared memory");
  // ---- [fa1_fwd:setup] (batch, head, split) from the grid; the state of this head in HBM ----
  extern __shared__ __align__(16) char smem[];
  const typename Pol::Info bi(p, blockIdx.y, blockIdx.x);
  const Pol pol(p, bi);
  const int split = blockIdx.z, splits = gridDim.z;
  const T *q = bi.template q<T>(p), *k = bi.template k<T>(p), *v = bi.template v<T>(p);
  float *o_ws = p.o_ws + bi.row0 * p.head_dim, *m_ws = p.m_ws + bi.row0, *l_ws = p.l_ws + bi.row0;
  auto sQ = [&](int buf) { return Tile<T, BR, D>{(T*)(smem + buf * QT)}; };  // two Q buffers, alternating
  const Tile<T, BC, D> sK{(T*)(smem + 2 * QT)}, sV{(T*)(smem + 2 * QT + BC * D * sizeof(T))};
  const SK sk(smem + 2 * QT + 2 * BC * D * sizeof(T));
  const int tr = cdiv(bi.seqlen_q, BR), tc = cdiv(bi.seqlen_k, BC);
  const int g = lane_id() >> 2, t = lane_id() & 3, c0 = State::col0();
  // This CTA's next query block >= from that sees K_j (i % splits == split), or -1.
  auto owned = [&](int j, int from) {
    const BlockRange qb = pol.q_blocks(j * BC, BC, BR, tr);
    int i = max(from, qb.lo);
    i += ((split - i % splits) % splits + splits) % splits;
    return i < qb.hi ? i : -1;
  };
  // The step after (j, i): the next query block of K_j, else the first of the next K block this CTA has work in.
  auto advance = [&](int& j, int& i) {
    i = owned(j, i + 1);
    while (i < 0 && ++j < tc) i = owned(j, 0);
  };
  auto load_kv = [&](int j) {
    const int k0 = j * BC, nk = min(BC, bi.seqlen_k - k0);
    load_tile<NTHREADS>(sK, k + k0 * p.k_ss, p.k_ss, nk, p.head_dim);
    load_tile<NTHREADS>(sV, v + k0 * p.v_ss, p.v_ss, nk, p.head_dim);
  };
  auto load_q = [&](int i, int buf) {
    load_tile<NTHREADS>(sQ(buf), q + i * BR * p.q_ss, p.q_ss, min(BR, bi.seqlen_q - i * BR), p.head_dim);
  };
  int j = 0, i = -1, buf = 0;
  advance(j, i);
  if (j >= tc) return;  // no query block of this split sees any key (a guard: no policy leaves a split so)
  // ---- [fa1_fwd:outer] Alg.1 l.5-6: for each K_j, V_j this CTA has work in: load them to shared memory once ----
  load_kv(j);
  load_q(i, buf);
  cp_async_commit();
  while (j < tc) {
    const int jc = j, k0 = j * BC;
    const BlockRange qb = pol.q_blocks(k0, BC, BR, tr);
    // ---- [fa1_fwd:inner] Alg.1 l.7-8: each Q_i of this split that sees K_j (blocks that see none are skipped) ----
    while (j == jc) {
      int jn = j, in = i;
      advance(jn, in);
      const int q0 = i * BR, nq = min(BR, bi.seqlen_q - q0);
      cp_async_wait<0>();
      __syncthreads();  // Q_i (and K_j, V_j) have landed; every warp is done with the slots and the other Q buffer
      if (jn == j) load_q(in, buf ^ 1);  // Q of the next step streams in while this one computes
      cp_async_commit();
      // ---- [fa1_fwd:load] Alg.1 l.8: O_i, l_i, m_i from HBM into the registers of the warps that merge them ----
      State st;
#pragma unroll
      for (int r = 0; r < 2 * MT; ++r) {
        const int row = 16 * (r / 2) + g + 8 * (r % 2);
        st.m[r] = row < nq ? m_ws[q0 + row] : -INFINITY;
        st.l[r] = row < nq ? l_ws[q0 + row] : 0.f;
#pragma unroll
        for (int jj = 0; jj < OWN; ++jj) {
          const int col = c0 + 8 * jj + 2 * t;
          const float2 x = row < nq && col < p.head_dim
                               ? *reinterpret_cast<const float2*>(o_ws + (long long)(q0 + row) * p.head_dim + col)
                               : make_float2(0.f, 0.f);
          st.o.v[r / 2][jj][2 * (r % 2)] = x.x;
          st.o.v[r / 2][jj][2 * (r % 2) + 1] = x.y;
        }
      }
      // ---- [fa1_fwd:block] Alg.1 l.9-10: S_ij, m~_ij, P~_ij, l~_ij and P~_ij V_j, keys split across warps ----
      splitk_block<BR, BC, D, NWARPS>(sk, sQ(buf), sK, sV, pol, q0, k0, i < qb.lo_full || i >= qb.hi_full);
      __syncthreads();  // every warp's partials are in its slot; K_j, V_j and this Q buffer are free
      if (jn != j && jn < tc) {  // the next K block (and its first Q block) stream in while the warps merge
        load_kv(jn);
        load_q(in, buf ^ 1);
      }
      cp_async_commit();
      // ---- [fa1_fwd:update] Alg.1 l.11-13: merge into O_i, l_i, m_i, normalise, write them back to HBM ----
      splitk_merge<T, true>(sk, st);
#pragma unroll
      for (int r = 0; r < 2 * MT; ++r) {
        const int row = 16 * (r / 2) + g + 8 * (r % 2);
        if (row >= nq) continue;
        if (warp_id() == 0 && t == 0) {
          m_ws[q0 + row] = st.m[r];
          l_ws[q0 + row] = st.l[r];
        }
#pragma unroll
        for (int jj = 0; jj < OWN; ++jj) {
          const int col = c0 + 8 * jj + 2 * t;
          if (col < p.head_dim)
            *reinterpret_cast<float2*>(o_ws + (long long)(q0 + row) * p.head_dim + col) =
                make_float2(st.o.v[r / 2][jj][2 * (r % 2)], st.o.v[r / 2][jj][2 * (r % 2) + 1]);
        }
      }
      j = jn;
      i = in;
      buf ^= 1;
    }
  }
  cp_async_wait<0>();
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
