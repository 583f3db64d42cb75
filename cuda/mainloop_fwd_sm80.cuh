// mainloop_fwd_sm80: FA2's forward mainloop on mma.sync (Dao 2023, Alg.1 l.4-11) for one query tile Q_i.
// Q_i stays in shared memory; each warp owns 16 MT whole rows ("split-Q"), so the softmax needs no exchange
// between warps; K_j streams in (cp.async) while P_{j-1} V_{j-1} runs and V_j while S_ij = Q_i K_j^T runs.
// With WC > 1 (head_dim 512, where 16 x D of O would take 256 registers a thread) WC neighbouring warps share
// their rows and split O's columns, D / WC each: every one of them computes the rows' S and softmax itself (the
// same values from the same operands, so still no exchange) and multiplies P by its own columns of V_j.
// The key blocks come from the policy's BlockRange: interior blocks skip the mask, edge blocks apply it.
// DEFER_NORM = false keeps O divided by l after every block (FA1's normalisation; the ablation of FA2's idea).
// Works for float16 / bfloat16 (tensor cores) and float32 (the FMA products of sm80.cuh) alike.
#pragma once
#include "epilogue.cuh"
#include "policy.cuh"
#include "sm80.cuh"
#include "softmax.cuh"

namespace rf {

template <typename T_, int D, int BR_, int BC, int NWARPS, int KUNROLL, bool DEFER_NORM, class Pol_, int WC = 1>
struct MainloopFwdSm80 {
  using T = T_;
  using Pol = Pol_;
  static constexpr int BR = BR_, NTHREADS = NWARPS * 32, MT = BR_ / (16 * (NWARPS / WC)), NT = BC / 8;
  static constexpr int NO = D / (8 * WC);                                    // n8 tiles of O's columns per warp
  static constexpr int SMEM_BYTES = (BR_ + 2 * BC) * D * (int)sizeof(T_);  // Q_i, K_j, V_j
  static_assert(NWARPS % WC == 0 && BR_ % (16 * (NWARPS / WC)) == 0, "split-Q: every warp owns whole 16-row tiles");
  static_assert(D % (16 * WC) == 0, "each warp's columns of O are whole pairs of n8 tiles");
  struct State {
    Acc<MT, NO> o;
    OnlineSoftmax<2 * MT> sm;
  };
  __device__ __forceinline__ static int warp_row() { return 16 * MT * (warp_id() / WC); }
  __device__ __forceinline__ static int col0() { return D / WC * (warp_id() % WC); }  // this warp's first O column

  __device__ __forceinline__ static void run(const FwdParams& p, const typename Pol::Info& bi, const Pol& pol, int q0,
                                             char* smem, State& st) {
    const Tile<T, BR, D> sQ{(T*)smem};
    const Tile<T, BC, D> sK{(T*)(smem + BR * D * sizeof(T))}, sV{(T*)(smem + (BR + BC) * D * sizeof(T))};
    const T *q = bi.template q<T>(p), *k = bi.template k<T>(p), *v = bi.template v<T>(p);
    const int wq = warp_row(), nrows = min(BR, bi.seqlen_q - q0);
    const BlockRange kv = pol.kv_blocks(q0, nrows, BC);                     // blocks no row sees: never loaded
    // K_j or V_j (g: the sequence's k or v) into s; a paged forward's keys (the general policy with block_table,
    // 16-bit, Hopper: forms.forward_plan refuses it elsewhere, and sm_80's registers have no room for it) row by
    // row through the page table
    auto load = [&](const Tile<T, BC, D>& s, const T* g, long long ss, int step) {
      const int k0 = kv.block(step) * BC, rows = min(BC, bi.seqlen_k - k0);
#if __CUDA_ARCH__ >= 900
      if (Pol::GENERAL && sizeof(T) == 2 && p.block_table) {
        const bool is_k = g == k;
        const T* base = (const T*)(is_k ? p.k : p.v);
        const long long sb = is_k ? p.k_sb : p.v_sb, sh = is_k ? p.k_sh : p.v_sh;
        load_tile_rows<NTHREADS>(s, [&](int r) { return base + bi.paged_key(p, k0 + r, sb, ss, sh); }, base, rows,
                                 p.head_dim);
        return;
      }
#endif
      load_tile<NTHREADS>(s, g + k0 * ss, ss, rows, p.head_dim);
    };
    // ---- [mainloop_fwd_sm80:load_q] Alg.1 l.4: Q_i to shared memory, where it stays; the first K_j behind it ----
    load_tile<NTHREADS>(sQ, q + q0 * p.q_ss, p.q_ss, nrows, p.head_dim);
    if (kv.n() > 0) load(sK, k, p.k_ss, 0);
    cp_async_commit();
    // ---- [mainloop_fwd_sm80:init] Alg.1 l.5: O = 0, l = 0, m = -inf ----
    zero(st.o);
    st.sm.init();
    for (int s = 0; s < kv.n(); ++s) {
      const int k0 = kv.block(s) * BC;
      // ---- [mainloop_fwd_sm80:load_kv] Alg.1 l.7: V_j streams in while S = Q_i K_j^T is computed ----
      cp_async_wait<0>();
      __syncthreads();  // K_j (and Q_i) have landed; every warp is done reading V_{j-1}
      load(sV, v, p.v_ss, s);
      cp_async_commit();
      // ---- [mainloop_fwd_sm80:scores] Alg.1 l.8: S_ij = Q_i K_j^T, through the policy's score transform ----
      Acc<MT, NT> sc;
      zero(sc);
      gemm_abt<MT, NT, D, KUNROLL>(sc, sQ, wq, sK, 0);
      pol.template transform<T>(sc, q0 + wq, k0);
      // S in log2 units, rounded once: the float32 path stays as exact as a naive float32 softmax
      pol.template prescale<T>(sc);
      // ---- [mainloop_fwd_sm80:mask] edge blocks only: hidden scores to -inf ----
      if (kv.is_edge(s)) pol.mask(sc, q0 + wq, k0);
      // ---- [mainloop_fwd_sm80:softmax] Alg.1 l.9-10: P = exp2(S - m_new), l and O rescaled by e^(m_old - m_new) ----
      float fo[2 * MT];
      st.sm.template update<T, !DEFER_NORM>(sc, 1.f, fo);
      scale_rows(st.o, fo);
      // ---- [mainloop_fwd_sm80:wait_v] K_{j+1} streams in while O += P V_j is computed ----
      cp_async_wait<0>();
      __syncthreads();  // V_j has landed; every warp is done reading K_j
      if (s + 1 < kv.n()) load(sK, k, p.k_ss, s + 1);
      cp_async_commit();
      // ---- [mainloop_fwd_sm80:pv] Alg.1 l.10: O += P V_j with P as the A operand straight from registers ----
      gemm_rb<MT, NO, NT / 2>(st.o, sc, sV, 0, col0());
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the tiles (with SEQ_PARALLEL off the next query block reuses them)
  }

  __device__ __forceinline__ static void store(const FwdParams& p, const typename Pol::Info& bi, const Pol& pol, int q0,
                                               char*, const State& st) {
    epilogue_fwd<T, !DEFER_NORM>(p, bi, pol, st.o, st.sm, q0 + warp_row(), 1.f, col0());
  }
};

}  // namespace rf
