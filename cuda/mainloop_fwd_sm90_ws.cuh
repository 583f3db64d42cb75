// mainloop_fwd_sm90_ws: FlashAttention-3's forward mainloop (Shah et al. 2024, Alg.1 with warp specialisation)
// for float16 / bfloat16 on sm_90a. No Numba twin: TMA, mbarriers and warp specialisation have no counterpart
// there; the twin of mainloop_fwd_sm80 computes the same results.
//
// A CTA has NC = BR / 64 consumer warpgroups and one producer warpgroup (the last one):
//   - the producer's first warp issues TMA copies (tma.cuh): Q_i once per tile, then K_j and V_j of every
//     visible key block, into a ring of STAGES stages, each stage guarded by a "full" mbarrier (the copies'
//     bytes complete it) and an "empty" one (every consumer thread arrives when it is done reading the stage);
//     it gives its registers back (setmaxnreg) so the consumers can hold S, P and O of 64 rows each;
//   - consumer warpgroup w owns query rows 64w..64w+63 of the tile and runs FA2's loop on wgmma exactly as
//     mainloop_fwd_sm90 does (S = Q K^T from shared memory, P from registers into O += P V, the online softmax,
//     FA3's intra-warpgroup OVERLAP of the softmax of block j with P_{j-1} V_{j-1});
//   - PINGPONG (FA3 section 3.1): named barriers hand the tensor cores from one consumer warpgroup to the next,
//     so warpgroup w issues its products while the others run their softmax; each warpgroup waits for its
//     turn before it issues and passes the turn on after.
// The key blocks are visited in the policy's BlockRange order (interior first, edges after), the same for the
// producer and the consumers: both sides walk the same tiles and blocks and keep their ring counters in step.
#pragma once
#include "epilogue.cuh"
#include "hopper.cuh"
#include "policy.cuh"
#include "softmax.cuh"
#include "tma.cuh"

namespace rf {

template <typename T_, int D, int BR_, int BC, int STAGES, bool OVERLAP, bool PINGPONG, class Pol_>
struct MainloopFwdSm90Ws {
  using T = T_;
  using Pol = Pol_;
  static constexpr int BR = BR_, NC = BR_ / 64, NTHREADS = (NC + 1) * 128, NT = BC / 8, NO = D / 8;
  static constexpr int ALIGN = 1024, Q_BYTES = BR_ * D * 2, KV_BYTES = BC * D * 2;
  static constexpr int BARRIERS = 2 + 4 * STAGES;  // Q full / empty; K full / empty and V full / empty per stage
  static constexpr int SMEM_BYTES = ALIGN + Q_BYTES + 2 * STAGES * KV_BYTES + 8 * BARRIERS;
  // Registers per thread after the hand-over: the producer keeps what its loop needs, the consumers the rest
  // of the 64K (launch bounds give every thread 65536 / NTHREADS rounded down to 8 before it).
  static constexpr int PRODUCER_REGS = NC == 2 ? 40 : 32, CONSUMER_REGS = NC == 2 ? 232 : 160;
  static_assert(NC == 2 || NC == 3, "two or three consumer warpgroups");
  static_assert(BC % 16 == 0 && BC <= 256 && D % 64 == 0, "a wgmma N of at most 256; panels of 64 columns");
  static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * 128 * NC <= 65536, "the register file");

  struct State {
    Acc<1, NO> o;
    OnlineSoftmax<2> sm;
  };
  // The rings' positions; each side (producer, consumer warpgroups) keeps its own copy.
  struct Pipes {
    PipeState<1> q;
    PipeState<STAGES> kv;
  };
  // Shared-memory addresses: Q_i, then STAGES stages of K_j and of V_j, then the mbarriers.
  struct Smem {
    u32 base;
    __device__ __forceinline__ explicit Smem(char* smem)
        : base(((u32)__cvta_generic_to_shared(smem) + ALIGN - 1) & ~(u32)(ALIGN - 1)) {}
    __device__ __forceinline__ Sw128<T, BR_, D> q() const { return {base}; }
    __device__ __forceinline__ Sw128<T, BC, D> k(int s) const { return {base + Q_BYTES + s * KV_BYTES}; }
    __device__ __forceinline__ Sw128<T, BC, D> v(int s) const {
      return {base + Q_BYTES + (STAGES + s) * KV_BYTES};
    }
    __device__ __forceinline__ u32 bar(int i) const { return base + Q_BYTES + 2 * STAGES * KV_BYTES + 8 * i; }
    __device__ __forceinline__ u32 q_full() const { return bar(0); }
    __device__ __forceinline__ u32 q_empty() const { return bar(1); }
    __device__ __forceinline__ u32 k_full(int s) const { return bar(2 + s); }
    __device__ __forceinline__ u32 k_empty(int s) const { return bar(2 + STAGES + s); }
    __device__ __forceinline__ u32 v_full(int s) const { return bar(2 + 2 * STAGES + s); }
    __device__ __forceinline__ u32 v_empty(int s) const { return bar(2 + 3 * STAGES + s); }
    // One thread: full barriers wait for one arrival (the producer's expect_tx) plus the bytes, empty ones for
    // every consumer thread.
    __device__ __forceinline__ void init() const {
      for (int i = 0; i < BARRIERS; ++i) {
        const bool full = i == 0 || (i >= 2 && i < 2 + STAGES) || (i >= 2 + 2 * STAGES && i < 2 + 3 * STAGES);
        mbar_init(bar(i), full ? 1 : NC * 128);
      }
      mbar_init_fence();
    }
  };

  __device__ __forceinline__ static bool is_producer() { return warpgroup_id() == NC; }
  __device__ __forceinline__ static int warp_row() { return 16 * warp_id(); }  // consumers: 64 w + 16 * warp in it

  // ---------------------------------------------------------------- producer
  __device__ __forceinline__ static bool producer_start(const TmaFwd& tma) {
    regs_release<PRODUCER_REGS>();
    if (warp_id() != 4 * NC) return false;                                   // one warp walks the tiles
    if (lane_id() == 0) {
      tma_prefetch_desc(tma.q);
      tma_prefetch_desc(tma.k);
      tma_prefetch_desc(tma.v);
    }
    return true;
  }
  // The copies of one tile. Coordinates are (column, row, head, batch); packed sequences are one "batch" whose
  // rows start at the sequence's first row.
  __device__ __forceinline__ static void produce(const FwdParams& p, const TmaFwd& tma, const typename Pol::Info& bi,
                                                 const Pol& pol, int q0, const Smem& sm, Pipes& pipes) {
    const int nrows = min(BR, bi.seqlen_q - q0);
    const BlockRange kv = pol.kv_blocks(q0, nrows, BC);
    const int n = kv.n(), bq = p.cu_seqlens_q ? 0 : bi.b, bk = p.cu_seqlens_k ? 0 : bi.b;
    if (lane_id() != 0) return;
    // ---- [mainloop_fwd_sm90_ws:load_q] Q_i, once the consumers are done with the previous tile's ----
    mbar_wait(sm.q_empty(), pipes.q.parity() ^ 1);
    mbar_expect_tx(sm.q_full(), Q_BYTES);
#pragma unroll
    for (int c = 0; c < D; c += 64)
      tma_load_4d(tma.q, sm.q().base + c / 64 * Sw128<T, BR_, D>::PANEL_BYTES, sm.q_full(), c, bi.q_row0 + q0, bi.h, bq);
    pipes.q.advance();
    // ---- [mainloop_fwd_sm90_ws:load_kv] K_j, then V_j, into the next free stage ----
#pragma unroll 1
    for (int step = 0; step < n; ++step) {
      const int s = pipes.kv.stage(), free = pipes.kv.parity() ^ 1, row = bi.k_row0 + kv.block(step) * BC;
      mbar_wait(sm.k_empty(s), free);
      mbar_expect_tx(sm.k_full(s), KV_BYTES);
#pragma unroll
      for (int c = 0; c < D; c += 64)
        tma_load_4d(tma.k, sm.k(s).base + c / 64 * Sw128<T, BC, D>::PANEL_BYTES, sm.k_full(s), c, row, bi.hk, bk);
      mbar_wait(sm.v_empty(s), free);
      mbar_expect_tx(sm.v_full(s), KV_BYTES);
#pragma unroll
      for (int c = 0; c < D; c += 64)
        tma_load_4d(tma.v, sm.v(s).base + c / 64 * Sw128<T, BC, D>::PANEL_BYTES, sm.v_full(s), c, row, bi.hk, bk);
      pipes.kv.advance();
    }
  }

  // ---------------------------------------------------------------- consumers
  // Ping-pong turns: warpgroup w waits on barrier 1 + w and passes the turn to 1 + (w + 1) % NC; 256 threads
  // meet at each (the waiting warpgroup and the one passing the turn).
  __device__ __forceinline__ static void turn_wait() {
    if (PINGPONG) named_sync(1 + warpgroup_id(), 256);
  }
  __device__ __forceinline__ static void turn_pass() {
    if (PINGPONG) named_arrive(1 + (warpgroup_id() + 1) % NC, 256);
  }
  __device__ __forceinline__ static void consumer_start() {
    regs_claim<CONSUMER_REGS>();
    if (PINGPONG && warpgroup_id() == NC - 1) named_arrive(1, 256);          // warpgroup 0 has the first turn
  }
  __device__ __forceinline__ static void consumer_finish() {
    if (PINGPONG && warpgroup_id() == 0) named_sync(1, 256);                 // the last turn passed to it
  }

  __device__ __forceinline__ static void consume(const FwdParams& p, const typename Pol::Info& bi, const Pol& pol,
                                                 int q0, const Smem& sm, Pipes& pipes, State& st) {
    const int nrows = min(BR, bi.seqlen_q - q0), wg_row = 64 * warpgroup_id(), wq = warp_row();
    const BlockRange kv = pol.kv_blocks(q0, nrows, BC);
    const int n = kv.n();
    const auto sQ = sm.q();
    // ---- [mainloop_fwd_sm90_ws:init] Alg.1 l.5: O = 0, l = 0, m = -inf; Q_i has landed ----
    Acc<1, NT> s;
    u32 pa[NT / 2][4];
    float fo[2];
    zero(st.o);
    st.sm.init();
    auto softmax = [&](int step) {                                           // S of block `step` -> P, fo
      const int k0 = kv.block(step) * BC;
      pol.template transform<T>(s, q0 + wq, k0);
      if (kv.is_edge(step)) pol.mask(s, q0 + wq, k0);
      st.sm.template update<T>(s, pol.template softmax_scale<T>(), fo);
    };
    mbar_wait(sm.q_full(), pipes.q.parity());
    pipes.q.advance();
    if (n > 0) {
      // ---- [mainloop_fwd_sm90_ws:first_scores] S_0 = Q_i K_0^T and its softmax ----
      const int s0 = pipes.kv.stage();
      mbar_wait(sm.k_full(s0), pipes.kv.parity());
      turn_wait();
      wgmma_fence();
      wg_gemm_abt(s, sQ, wg_row, sm.k(s0), 0, false);
      wgmma_commit();
      turn_pass();
      wgmma_wait<0>();
      mbar_arrive(sm.k_empty(s0));
      softmax(0);
      to_a_operand<T>(pa, s);
    }
    int prev = pipes.kv.stage(), prev_parity = pipes.kv.parity();           // the stage of block j - 1
    if (n > 0) pipes.kv.advance();
#pragma unroll 1
    for (int j = 1; j < n; ++j) {
      // ---- [mainloop_fwd_sm90_ws:issue] K_j and V_{j-1} have landed: S_j = Q_i K_j^T and O += P_{j-1} V_{j-1} ----
      const int sj = pipes.kv.stage();
      mbar_wait(sm.k_full(sj), pipes.kv.parity());
      mbar_wait(sm.v_full(prev), prev_parity);
      turn_wait();
      fence_operand(st.o);
      wgmma_fence();
      if (OVERLAP) {
        wg_gemm_abt(s, sQ, wg_row, sm.k(sj), 0, false);
        wgmma_commit();
      }
      wg_gemm_rb(st.o, pa, sm.v(prev), 0, 0);
      wgmma_commit();
      if (!OVERLAP) {
        wg_gemm_abt(s, sQ, wg_row, sm.k(sj), 0, false);
        wgmma_commit();
      }
      turn_pass();
      // ---- [mainloop_fwd_sm90_ws:softmax] Alg.1 l.9 for block j while P_{j-1} V_{j-1} runs, then the rescale ----
      if (OVERLAP) wgmma_wait<1>();
      else wgmma_wait<0>();
      fence_operand(s);
      mbar_arrive(sm.k_empty(sj));
      softmax(j);
      wgmma_wait<0>();
      fence_operand(st.o);
      mbar_arrive(sm.v_empty(prev));
      scale_rows(st.o, fo);                                                  // Alg.1 l.10: diag(e^(m_old - m_new)) O
      to_a_operand<T>(pa, s);
      prev = sj;
      prev_parity = pipes.kv.parity();
      pipes.kv.advance();
    }
    // Every product that reads Q_i has been waited for: the producer may bring the next tile's.
    mbar_arrive(sm.q_empty());
    if (n > 0) {
      // ---- [mainloop_fwd_sm90_ws:last_pv] the last key block: O += P V alone ----
      mbar_wait(sm.v_full(prev), prev_parity);
      turn_wait();
      fence_operand(st.o);
      wgmma_fence();
      wg_gemm_rb(st.o, pa, sm.v(prev), 0, 0);
      wgmma_commit();
      turn_pass();
      wgmma_wait<0>();
      fence_operand(st.o);
      mbar_arrive(sm.v_empty(prev));
    }
  }

  __device__ __forceinline__ static void store(const FwdParams& p, const typename Pol::Info& bi, const Pol& pol,
                                               int q0, const State& st) {
    epilogue_fwd<T, false>(p, bi, pol, st.o, st.sm, q0 + warp_row());
  }
};

}  // namespace rf
