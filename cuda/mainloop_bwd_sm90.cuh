// mainloop_bwd_sm90: FA2's backward mainloop (Alg.2 l.6-16, atomic dQ) on Hopper's warpgroup products, for
// float16 / bfloat16 and head_dim 64 or 128 (sm_90a). No Numba twin of its own: mainloop_bwd_sm80's twin computes
// the same results. Two mainloops share the load of Q_i, dO_i, L_i, D_i and the dQ reduction:
//
// MainloopBwdSm90 (BC = 64 keys per warpgroup): warpgroup w owns keys 64w..64w+63. S^T = K_w Q_i^T and dP^T =
//   V_w dO_i^T read both operands from shared memory; dV_w += P^T dO_i and dK_w += dS^T Q_i take P^T and dS^T from
//   registers, dO_i and Q_i read MN-major. dQ_i += dS K_j needs every warpgroup's dS: dS^T goes to shared memory
//   and warpgroup w computes columns w*D/NWG.. of dQ_i from it (both operands MN-major), added to a float32
//   buffer with vector reductions. P^T is formed while dP^T is still running (plain scores).
// MainloopBwdSm90SplitD (head_dim 256, where dK and dV of 64 keys x D do not fit one warpgroup's registers): the
//   CTA's two warpgroups share 64 keys. Warpgroup 0 computes S^T, warpgroup 1 dP^T (handed over through shared
//   memory); warpgroup 0 forms P^T and dS^T and stores both to shared memory; then each warpgroup accumulates dK,
//   dV for its half of the columns, with P^T and dS^T read from shared memory (K-major), and half of dQ_i.
#pragma once
#include "bwd.cuh"
#include "epilogue.cuh"
#include "hopper.cuh"

namespace rf {

// Shared memory of both mainloops, from a 1024-byte aligned base: K_j, V_j; 2 stages of Q_i, then of dO_i; dS^T;
// EXTRA bytes of the mainloop's own (the column split's P^T and dP^T); 2 stages of L_i, then of D_i.
template <typename T, int D, int BR, int BC, int EXTRA> struct SmemBwdSm90 {
  static constexpr int ALIGN = 1024, KV = BC * D * 2, QB = BR * D * 2, DS = BC * BR * 2;
  static constexpr int BYTES = ALIGN + 2 * KV + 4 * QB + DS + EXTRA + 4 * BR * 4;
  Sw128<T, BC, D> sK, sV;
  Sw128<T, BC, BR> sdS;
  u32 q_base, do_base;
  char* extra;         // the EXTRA bytes (generic address)
  float *sL0, *sDelta0;
  __device__ __forceinline__ explicit SmemBwdSm90(char* smem) {
    const u32 raw = (u32)__cvta_generic_to_shared(smem), base = (raw + ALIGN - 1) & ~(u32)(ALIGN - 1);
    char* const aligned = smem + (base - raw);
    sK = {base};
    sV = {base + KV};
    q_base = base + 2 * KV;
    do_base = q_base + 2 * QB;
    sdS = {do_base + 2 * QB};
    extra = aligned + 2 * KV + 4 * QB + DS;
    sL0 = (float*)(aligned + BYTES - ALIGN - 4 * BR * 4);
    sDelta0 = sL0 + 2 * BR;
  }
  __device__ __forceinline__ Sw128<T, BR, D> q(int stage) const { return {q_base + stage * QB}; }
  __device__ __forceinline__ Sw128<T, BR, D> dout(int stage) const { return {do_base + stage * QB}; }
  __device__ __forceinline__ const float* lse2(int stage) const { return sL0 + stage * BR; }
  __device__ __forceinline__ const float* delta(int stage) const { return sDelta0 + stage * BR; }
};

// Iteration it's Q_i, dO_i, L_i, D_i into stage it % 2, all with cp.async (a plain load would stall its warp, and
// with it the warpgroup's next wgmma, for a full memory latency every step). Rows past the sequence read Q = dO = 0
// and L = D = 0: their P is 1 but their dP and dO are 0, so they add nothing to dV_j, dK_j, and their dQ rows are
// never written.
template <int NTHREADS, typename T, int BR, int D, class Info, class Sm>
__device__ __forceinline__ void load_query_block_sm90(const BwdParams& p, const Info& bi, const QIter& walk, int it,
                                                      const Sm& sm) {
  Info bn = bi;
  bn.set_head(p, walk.head(it));
  const int q0 = walk.block(it) * BR, stage = it & 1, nq = min(BR, bn.seqlen_q - q0);
  load_tile<NTHREADS>(sm.q(stage), bn.template q<T>(p) + q0 * p.q_ss, p.q_ss, nq, p.head_dim);
  load_tile<NTHREADS>(sm.dout(stage), bn.template q_like<const T>(p.dout, p.do_sb, p.do_ss, p.do_sh) + q0 * p.do_ss,
                      p.do_ss, nq, p.head_dim);
  for (int r = threadIdx.x; r < 2 * BR; r += NTHREADS) {
    const int row = r % BR;
    const float* src = (r < BR ? p.lse2 : p.delta) + bn.row0 + q0 + (row < nq ? row : 0);
    cp_async4((u32)__cvta_generic_to_shared((r < BR ? sm.sL0 : sm.sDelta0) + stage * BR + row), src, row < nq);
  }
  cp_async_commit();
}

// The walk both mainloops share (Alg.2 l.6-8): K_j, V_j once, dK_j = dV_j = 0, then for each (query head, query
// block) of the walk, once its Q_i, dO_i, L_i, D_i have landed and the next block's stream in behind them,
// step(q0, edge, bh, sQ, sdO, sL, sDelta) with bh at the block's query head.
template <int NTHREADS, typename T, int D, int BR, int BC, class Pol, class Sm, class State, class Step>
__device__ __forceinline__ void walk_sm90(const BwdParams& p, const typename Pol::Info& bi, Pol& pol, int k0,
                                          const QIter& walk, const Sm& sm, State& st, Step&& step) {
  typename Pol::Info bh = bi;
  // ---- [mainloop_bwd_sm90:load_kv] Alg.2 l.6-7: K_j, V_j to shared memory once; dK_j = dV_j = 0 ----
  load_key_block<NTHREADS, BC, T>(p, bi, k0, sm.sK, sm.sV);
  zero(st.dk);
  zero(st.dv);
  if (walk.total > 0) load_query_block_sm90<NTHREADS, T, BR, D>(p, bi, walk, 0, sm);
  for (int it = 0; it < walk.total; ++it) {
    const int q0 = walk.enter<BR>(p, it, bh, pol), stage = it & 1;
    // ---- [mainloop_bwd_sm90:load_q] Alg.2 l.8: Q_i, dO_i, L_i, D_i have landed; the next block's stream in ----
    cp_async_wait<0>();
    fence_async_smem();
    __syncthreads();  // this stage is visible to all; every warpgroup is done with the other stage and with dS^T
    if (it + 1 < walk.total) load_query_block_sm90<NTHREADS, T, BR, D>(p, bi, walk, it + 1, sm);
    step(q0, walk.edge(it), bh, sm.q(stage), sm.dout(stage), sm.lse2(stage), sm.delta(stage));
  }
  cp_async_wait<0>();
}

// Alg.2 l.14: dQ_i += scale * dS K_j for columns c0.. (N of them) from dS^T in shared memory, once this batch's
// dK_j, dV_j products are committed: float32 vector reductions into the dQ accumulator rows.
template <int BC, int N, typename T, int BR, int D, class Info, class State>
__device__ __forceinline__ void accumulate_dq(const BwdParams& p, const Info& bh, const Sw128<T, BC, BR>& sdS,
                                              const Sw128<T, BC, D>& sK, int q0, int c0, State& st) {
  Acc<1, N / 8> dq;
  wg_gemm_atb<BC>(dq, sdS, 0, sK, c0, false);
  wgmma_commit();
  wgmma_wait<0>();
  fence_operand(dq);
  fence_operand(st.dk);
  fence_operand(st.dv);
  const int g = lane_id() >> 2, t = lane_id() & 3, qr = 16 * warp_in_group();
  float* dq_rows = p.dq_ws + bh.row0 * p.head_dim;
#pragma unroll
  for (int y = 0; y < N / 8; ++y)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = q0 + qr + g + 8 * hh, col = c0 + 8 * y + 2 * t;
      if (row < bh.seqlen_q && col < p.head_dim)
        red_add2(dq_rows + (long long)row * p.head_dim + col, p.scale * dq.v[0][y][2 * hh],
                 p.scale * dq.v[0][y][2 * hh + 1]);
    }
}

// Alg.2 l.10 and l.13 on a warpgroup's S^T and dP^T (rows keys k_row.., columns queries q0..), both committed
// in that order and still running: P^T and dS^T = P^T * (dP^T - D_i) in place. The plain policy forms P^T while
// dP^T is still running (probs_p_sm90, then probs_ds_sm90 once dP^T is done); the general one needs both (its
// transform's derivative scales dS).
template <typename T, class Pol, int NT>
__device__ __forceinline__ void probs_p_sm90(const Pol& pol, Acc<1, NT>& s, int q0, int k_row, const float* sL,
                                             bool edge) {
  static_assert(!Pol::GENERAL, "the general policy forms P^T and dS^T together (probs_sm90)");
  wgmma_wait<1>();
  fence_operand(s);
  if (edge) pol.mask_t(s, k_row, q0);
  const float scale = pol.scale_log2;
  for_each_col(s, [&](float& x, int col) { x = exp2_<T>(fmaf(x, scale, -sL[col])); });
}
// (PENDING: the batches committed after dP^T that may still run)
template <int PENDING, int NT>
__device__ __forceinline__ void probs_ds_sm90(Acc<1, NT>& s, Acc<1, NT>& dp, const float* sDelta) {
  wgmma_wait<PENDING>();
  fence_operand(dp);
  for_each2(s, dp, [&](float& x, float& y, int, int col) { y = x * (y - sDelta[col]); });
}
// (SPARE_REGS, PREMASK: Policy::backward_tile's; FA3's consumers pass SPARE_REGS, but its 128-row tiles PREMASK)
template <typename T, bool SPARE_REGS, bool PREMASK = false, class Pol, int NT>
__device__ __forceinline__ void probs_sm90(const Pol& pol, Acc<1, NT>& s, Acc<1, NT>& dp, int q0, int k_row,
                                           const float* sL, const float* sDelta, bool edge) {
  if constexpr (Pol::GENERAL) {
    wgmma_wait<0>();
    fence_operand(s);
    fence_operand(dp);
    pol.template backward_tile<T, true, SPARE_REGS, PREMASK>(s, dp, q0, k_row, sL, sDelta, edge);
  } else {
    probs_p_sm90<T>(pol, s, q0, k_row, sL, edge);
    probs_ds_sm90<0>(s, dp, sDelta);
  }
}

template <typename T_, int D, int BR_, int BC_, class Pol_> struct MainloopBwdSm90 {
  using T = T_;
  using Pol = Pol_;
  static constexpr int BR = BR_, BC = BC_, NWG = BC_ / 64, NTHREADS = NWG * 128, NQ = BR_ / 8, DQN = D / NWG;
  static constexpr int NO = D / 8;
  using Sm = SmemBwdSm90<T_, D, BR_, BC_, 0>;
  static constexpr int SMEM_BYTES = Sm::BYTES;
  static_assert(BC_ % 64 == 0 && BR_ == 64 && D % 64 == 0 && DQN % 32 == 0,
                "warpgroup tiles: dQ_i is one 64-row wgmma");
  // dQ_i's column slice must not straddle two 64-column panels (an MN-major operand may start inside a panel only
  // when it ends there).
  static_assert(DQN % 64 == 0 || 64 % DQN == 0, "column slices within panels");
  struct State {
    Acc<1, NO> dk, dv;
  };
  __device__ __forceinline__ static int key_row() { return 64 * warpgroup_id() + 16 * warp_in_group(); }

  __device__ __forceinline__ static void run(const BwdParams& p, const typename Pol::Info& bi, Pol& pol, int k0,
                                             const QIter& walk, char* smem, State& st) {
    const Sm sm(smem);
    const int w = uniform_warpgroup_id(), kw = 64 * w, wk = key_row();
    walk_sm90<NTHREADS, T, D, BR, BC>(p, bi, pol, k0, walk, sm, st, [&](int q0, bool edge, const typename Pol::Info& bh,
                                                                        const Sw128<T, BR, D>& sQ,
                                                                        const Sw128<T, BR, D>& sdO, const float* sL,
                                                                        const float* sDelta) {
      // ---- [mainloop_bwd_sm90:scores] Alg.2 l.9-10 and l.12: S^T = K_w Q_i^T and dP^T = V_w dO_i^T ----
      Acc<1, NQ> s, dp;
      wgmma_fence();
      wg_gemm_abt(s, sm.sK, kw, sQ, 0, false);
      wgmma_commit();
      wg_gemm_abt(dp, sm.sV, kw, sdO, 0, false);
      wgmma_commit();
      // ---- [mainloop_bwd_sm90:probs] Alg.2 l.10 and l.13: P^T and dS^T = P^T * (dP^T - D_i) ----
      probs_sm90<T, false>(pol, s, dp, q0, k0 + wk, sL, sDelta, edge);
      u32 p_a[NQ / 2][4], ds_a[NQ / 2][4];
      to_a_operand<T>(p_a, s);
      to_a_operand<T>(ds_a, dp);
      store_acc(sm.sdS, dp, wk, 0);
      fence_async_smem();
      // ---- [mainloop_bwd_sm90:dkdv] Alg.2 l.11 and l.15: dV_w += P^T dO_i, dK_w += dS^T Q_i (scale at the end) ----
      fence_operand(st.dk);
      fence_operand(st.dv);
      wgmma_fence();
      wg_gemm_rb(st.dv, p_a, sdO, 0, 0);
      wg_gemm_rb(st.dk, ds_a, sQ, 0, 0);
      wgmma_commit();
      // ---- [mainloop_bwd_sm90:dq] Alg.2 l.14: dQ_i += scale * dS K_j, columns w*D/NWG.., dS^T from shared memory
      __syncthreads();  // every warpgroup's dS^T is in shared memory
      accumulate_dq<BC, DQN>(p, bh, sm.sdS, sm.sK, q0, w * DQN, st);
    });
  }

  __device__ __forceinline__ static void store(const BwdParams& p, const typename Pol::Info& bi, int k0,
                                               const State& st) {
    store_dkdv<T>(p, bi, st.dk, st.dv, k0 + key_row(), 0);
  }
};

template <typename T_, int D, int BR_, int BC_, class Pol_> struct MainloopBwdSm90SplitD {
  using T = T_;
  using Pol = Pol_;
  static constexpr int BR = BR_, BC = BC_, NTHREADS = 256, NQ = BR_ / 8, DW = D / 2, NO = DW / 8;
  static constexpr int DS = BC_ * BR_ * 2, DP = BC_ * BR_ * 4;
  using Sm = SmemBwdSm90<T_, D, BR_, BC_, DS + DP>;  // EXTRA: P^T (16-bit), then dP^T (float32)
  static constexpr int SMEM_BYTES = Sm::BYTES;
  static_assert(BC_ == 64 && BR_ == 64 && D % 64 == 0,
                "both warpgroups own the same 64 keys; dQ_i is one 64-row wgmma");
  // A warpgroup's column slice (dQ_i's, dK_j's and dV_j's) must not straddle two 64-column panels: an MN-major
  // operand may start inside a panel only when it ends there (head_dim 192 would split at 96).
  static_assert(DW % 64 == 0 || 64 % DW == 0, "column slices within panels");
  struct State {
    Acc<1, NO> dk, dv;
  };
  __device__ __forceinline__ static int key_row() { return 16 * warp_in_group(); }

  __device__ __forceinline__ static void run(const BwdParams& p, const typename Pol::Info& bi, Pol& pol, int k0,
                                             const QIter& walk, char* smem, State& st) {
    const Sm sm(smem);
    const Sw128<T, BC, BR> sP{sm.sdS.base + DS};
    float* const sdP = (float*)(sm.extra + DS);
    const int w = uniform_warpgroup_id(), wk = key_row(), dc = w * DW, tw = threadIdx.x & 127;
    walk_sm90<NTHREADS, T, D, BR, BC>(p, bi, pol, k0, walk, sm, st, [&](int q0, bool edge, const typename Pol::Info& bh,
                                                                        const Sw128<T, BR, D>& sQ,
                                                                        const Sw128<T, BR, D>& sdO, const float* sL,
                                                                        const float* sDelta) {
      // ---- [mainloop_bwd_sm90_split_d:scores] to shared memory: S^T = K Q_i^T (warpgroup 0), dP^T = V dO_i^T (1)
      // (one instruction stream for both warpgroups: ptxas serialises wgmma in divergent code)
      Acc<1, NQ> s;
      const Sw128<T, BC, D> sA{w == 0 ? sm.sK.base : sm.sV.base};
      const Sw128<T, BR, D> sB{w == 0 ? sQ.base : sdO.base};
      wgmma_fence();
      wg_gemm_abt(s, sA, 0, sB, 0, false);
      wgmma_commit();
      wgmma_wait<0>();
      fence_operand(s);
      if (w == 1) store_dp(sdP, s, tw);
      __syncthreads();  // dP^T is in shared memory
      // ---- [mainloop_bwd_sm90_split_d:probs] warpgroup 0: P^T, dS^T = P^T * (dP^T - D_i), both to shared memory ----
      if (w == 0) {
        Acc<1, NQ> ds;
        load_dp(ds, sdP, tw);
        if constexpr (Pol::GENERAL) {
          pol.template backward_tile<T, true>(s, ds, q0, k0 + wk, sL, sDelta, edge);
        } else {
          if (edge) pol.mask_t(s, k0 + wk, q0);
          const float scale = pol.scale_log2;
          for_each2(s, ds, [&](float& x, float& y, int, int col) {
            x = exp2_<T>(fmaf(x, scale, -sL[col]));
            y = x * (y - sDelta[col]);
          });
        }
        store_acc(sP, s, wk, 0);
        store_acc(sm.sdS, ds, wk, 0);
        fence_async_smem();
      }
      __syncthreads();  // P^T and dS^T are in shared memory; every thread is done reading dP^T
      // ---- [mainloop_bwd_sm90_split_d:dkdv] Alg.2 l.11 and l.15: this warpgroup's columns dc..dc+DW of dV_j, dK_j
      fence_operand(st.dk);
      fence_operand(st.dv);
      wgmma_fence();
      wg_gemm_ab<BR>(st.dv, sP, 0, sdO, dc, true);
      wg_gemm_ab<BR>(st.dk, sm.sdS, 0, sQ, dc, true);
      wgmma_commit();
      // ---- [mainloop_bwd_sm90_split_d:dq] Alg.2 l.14: dQ_i += scale * dS K_j, columns dc..dc+DW ----
      accumulate_dq<BC, DW>(p, bh, sm.sdS, sm.sK, q0, dc, st);
    });
  }

  // dP^T through shared memory, each element read back by the thread that wrote it (no bank conflicts: the 128
  // threads of a warpgroup write one 128-float row per element).
  __device__ __forceinline__ static void store_dp(float* sdP, const Acc<1, NQ>& s, int tw) {
#pragma unroll
    for (int y = 0; y < NQ; ++y)
#pragma unroll
      for (int e = 0; e < 4; ++e) sdP[(4 * y + e) * 128 + tw] = s.v[0][y][e];
  }
  __device__ __forceinline__ static void load_dp(Acc<1, NQ>& ds, const float* sdP, int tw) {
#pragma unroll
    for (int y = 0; y < NQ; ++y)
#pragma unroll
      for (int e = 0; e < 4; ++e) ds.v[0][y][e] = sdP[(4 * y + e) * 128 + tw];
  }

  __device__ __forceinline__ static void store(const BwdParams& p, const typename Pol::Info& bi, int k0,
                                               const State& st) {
    store_dkdv<T>(p, bi, st.dk, st.dv, k0 + key_row(), warpgroup_id() * DW);
  }
};

}  // namespace rf
