// mainloop_fwd_sm90: FA2's forward mainloop (Alg.1 l.4-11) on Hopper's warpgroup products, for float16 /
// bfloat16 and head_dim a multiple of 64 (sm_90a). It has no Numba twin of its own: the twin of
// mainloop_fwd_sm80 computes the same results; the sections differ where the wgmma pipeline orders the steps
// differently (S_{j+1} is computed before P_j V_j, see OVERLAP).
//
// A CTA of BR/64 warpgroups takes query block Q_i; warpgroup w owns rows 64w..64w+63 (split-Q at warpgroup
// grain). S = Q_i K_j^T reads both operands from shared memory; O += P V_j takes P from registers and V_j from
// shared memory read MN-major (no transpose). K_j and V_j are double-buffered and stream in with cp.async one
// block ahead, so one barrier per key block suffices. Blocks are visited in the policy's BlockRange order
// (interior, then edges); step j of the pipeline masks block j + 1 when that one is an edge.
// OVERLAP (FA3's intra-warpgroup pipelining, Shah et al. 2024, Alg.1): S_{j+1} = Q K_{j+1}^T and O += P_j V_j
// are issued together, and the softmax of block j+1 runs on the CUDA cores while P_j V_j runs on the tensor cores.
#pragma once
#include "epilogue.cuh"
#include "hopper.cuh"
#include "policy.cuh"
#include "softmax.cuh"

namespace rf {

template <typename T_, int D, int BR_, int BC, bool OVERLAP, class Pol_> struct MainloopFwdSm90 {
  using T = T_;
  using Pol = Pol_;
  static constexpr int BR = BR_, NTHREADS = BR_ / 64 * 128, NT = BC / 8, NO = D / 8;
  static constexpr int ALIGN = 1024, Q_BYTES = BR_ * D * 2, KV_BYTES = BC * D * 2;
  static constexpr int SMEM_BYTES = ALIGN + Q_BYTES + 4 * KV_BYTES;          // Q_i; two stages of K_j and of V_j
  static_assert(BR_ % 64 == 0 && BC % 16 == 0 && D % 64 == 0, "warpgroups own 64 rows; panels of 64 columns");
  struct State {
    Acc<1, NO> o;
    OnlineSoftmax<2> sm;
  };
  __device__ __forceinline__ static int warp_row() { return 16 * warp_id(); }  // = 64 * warpgroup + 16 * warp in it

  __device__ __forceinline__ static void run(const FwdParams& p, const typename Pol::Info& bi, const Pol& pol, int q0,
                                             char* smem, State& st) {
    const u32 base = ((u32)__cvta_generic_to_shared(smem) + ALIGN - 1) & ~(u32)(ALIGN - 1);
    const Sw128<T, BR, D> sQ{base};
    const u32 k_base = base + Q_BYTES, v_base = k_base + 2 * KV_BYTES;
    auto sK = [&](int s) { return Sw128<T, BC, D>{k_base + (s & 1) * KV_BYTES}; };
    auto sV = [&](int s) { return Sw128<T, BC, D>{v_base + (s & 1) * KV_BYTES}; };
    const T *q = bi.template q<T>(p), *k = bi.template k<T>(p), *v = bi.template v<T>(p);
    const int nrows = min(BR, bi.seqlen_q - q0), wg_row = 64 * uniform_warpgroup_id(), wq = warp_row();
    const BlockRange kv = pol.kv_blocks(q0, nrows, BC);                      // blocks no row sees: never loaded
    const int n = kv.n();
    // K_j or V_j (g: the sequence's k or v) into s; a paged forward's keys (the general policy with block_table)
    // row by row through the page table
    auto load = [&](const Sw128<T, BC, D>& s, const T* g, long long ss, int step) {
      const int k0 = kv.block(step) * BC, rows = min(BC, bi.seqlen_k - k0);
      if (Pol::GENERAL && p.block_table) {
        const bool is_k = g == k;
        const T* base = (const T*)(is_k ? p.k : p.v);
        const long long sb = is_k ? p.k_sb : p.v_sb, sh = is_k ? p.k_sh : p.v_sh;
        load_tile_rows<NTHREADS>(s, [&](int r) { return base + bi.paged_key(p, k0 + r, sb, ss, sh); }, base, rows,
                                 p.head_dim);
      } else {
        load_tile<NTHREADS>(s, g + k0 * ss, ss, rows, p.head_dim);
      }
    };
    // ---- [mainloop_fwd_sm90:load_q] Alg.1 l.4: Q_i to shared memory, where it stays; K_0, then V_0 behind it ----
    load_tile<NTHREADS>(sQ, q + q0 * p.q_ss, p.q_ss, nrows, p.head_dim);
    if (n > 0) load(sK(0), k, p.k_ss, 0);
    cp_async_commit();
    if (n > 0) load(sV(0), v, p.v_ss, 0);
    cp_async_commit();
    // ---- [mainloop_fwd_sm90:init] Alg.1 l.5: O = 0, l = 0, m = -inf ----
    Acc<1, NT> s;
    u32 pa[NT / 2][4];
    float fo[2];
    zero(st.o);
    st.sm.init();
    auto softmax = [&](int step) {                                           // S of block `step` -> P, fo
      const int k0 = kv.block(step) * BC;
      pol.template scores<T>(s, q0 + wq, k0, kv.is_edge(step));
      st.sm.template update<T>(s, pol.template softmax_scale<T>(), fo);
    };
    // ---- [mainloop_fwd_sm90:first_scores] S_0 = Q_i K_0^T and its softmax; K_1 streams in meanwhile ----
    cp_async_wait<1>();
    fence_async_smem();
    __syncthreads();  // Q_i and K_0 have landed
    if (n > 1) load(sK(1), k, p.k_ss, 1);
    cp_async_commit();
    if (n > 0) {
      wgmma_fence();
      wg_gemm_abt(s, sQ, wg_row, sK(0), 0, false);
      wgmma_commit();
      wgmma_wait<0>();
      softmax(0);
      to_a_operand<T>(pa, s);
    }
    int j = 0;
#pragma unroll 1
    for (; j + 1 < n; ++j) {                                                 // a next block exists
      // ---- [mainloop_fwd_sm90:load_kv] V_j and K_{j+1} have landed; V_{j+1} and K_{j+2} start streaming ----
      cp_async_wait<0>();
      fence_async_smem();
      __syncthreads();  // V_j, K_{j+1} visible to all; every warpgroup is done with V_{j-1} and K_j
      load(sV(j + 1), v, p.v_ss, j + 1);
      if (j + 2 < n) load(sK(j), k, p.k_ss, j + 2);
      cp_async_commit();
      // ---- [mainloop_fwd_sm90:issue] Alg.1 l.8 and l.10 on the tensor cores: S_{j+1} = Q_i K_{j+1}^T, O += P_j V_j
      // (each branch waits for everything it issued: ptxas serialises every wgmma when a batch may cross a branch)
      fence_operand(st.o);
      wgmma_fence();
      if (OVERLAP) {
        wg_gemm_abt(s, sQ, wg_row, sK(j + 1), 0, false);
        wgmma_commit();
      }
      wg_gemm_rb(st.o, pa, sV(j), 0, 0);
      wgmma_commit();
      if (!OVERLAP) {
        wg_gemm_abt(s, sQ, wg_row, sK(j + 1), 0, false);
        wgmma_commit();
      }
      // ---- [mainloop_fwd_sm90:softmax] Alg.1 l.9 for block j+1 while P_j V_j runs (OVERLAP); O *= e^(m_old - m_new)
      if (OVERLAP) wgmma_wait<1>();                                          // S_{j+1} is done; P_j V_j may still run
      else wgmma_wait<0>();
      fence_operand(s);
      softmax(j + 1);
      wgmma_wait<0>();
      fence_operand(st.o);
      scale_rows(st.o, fo);                                                  // Alg.1 l.10: diag(e^(m_old - m_new)) O
      to_a_operand<T>(pa, s);
    }
    if (n > 0) {
      // ---- [mainloop_fwd_sm90:last_pv] the last key block: O += P_j V_j alone ----
      cp_async_wait<0>();
      fence_async_smem();
      __syncthreads();  // V_j visible to all
      fence_operand(st.o);
      wgmma_fence();
      wg_gemm_rb(st.o, pa, sV(j), 0, 0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_operand(st.o);
    }
    cp_async_wait<0>();  // no copy may still be writing when the CTA exits
  }

  __device__ __forceinline__ static void store(const FwdParams& p, const typename Pol::Info& bi, const Pol& pol, int q0,
                                               char*, const State& st) {
    epilogue_fwd<T, false>(p, bi, pol, st.o, st.sm, q0 + warp_row());
  }
};

}  // namespace rf
