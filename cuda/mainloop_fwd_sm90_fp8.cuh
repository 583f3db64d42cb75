// mainloop_fwd_sm90_fp8: FlashAttention-3's forward mainloop (mainloop_fwd_sm90_ws.cuh) for FP8 e4m3 inputs on
// sm_90a: the same producer / consumer warpgroups, rings, ping-pong and overlap, with the products on
// wgmma.m64nNk32.e4m3 (twice the 16-bit rate). No Numba twin (the 16-bit FA3 form has none either); the
// reference backend dequantises the inputs and is the judge.
//
// What differs from the 16-bit mainloop:
//   - tiles are bytes (Sw128x8: panels of 128 columns); the head_dim D is a multiple of 128, columns past the
//     caller's head_dim are zero-filled by the copies (as 16-bit TMA tiles are past theirs);
//   - 8-bit wgmma reads both shared-memory operands K-major only, so O += P V needs V^T (keys contiguous): the
//     producer copies tiles of a V^T workspace that fp8_prep.cu's fp8_vt_permute writes before the launch
//     (per (batch, kv head): head_dim rows of keys padded to BC with zeros);
//   - P goes from S's accumulator registers straight into the A operand of P V without moving between threads.
//     The accumulator holds, per thread (g = lane / 4, t = lane % 4) and 32-key slice, keys 8j + 2t, 8j + 2t + 1
//     (j = 0..3) of rows g and g + 8; the 8-bit A fragment of k32 wants, per register, 4 consecutive k columns
//     4t..4t+3 (registers 0, 1: rows g, g + 8) and 16 + 4t..16 + 4t + 3 (registers 2, 3). Packing
//     (j = 0, j = 1) of a row into one register and (j = 2, j = 3) into the next puts key
//         sigma(p) = 16 (p / 16) + 8 ((p % 4) / 2) + 2 ((p % 16) / 4) + p % 2
//     at k column p of the fragment. The sum over keys in P V does not care about their order as long as
//     V^T's column p holds key sigma(p) of the same slice: fp8_vt_permute writes it so (tests/test_fp8.py
//     models both layouts and checks that the product is P V);
//   - P is scaled by 2^P_LOG2 before its cast (OnlineSoftmax::update's p_log2): e4m3's smallest subnormal is
//     2^-9, so unscaled probabilities below about 2^-10 of the row max would vanish; l carries the same factor
//     and it cancels at the end (rawflash/fp8.py's p_underflow measures what each choice loses);
//   - descales: q_descale * k_descale of the (batch, kv head) multiply the softmax scale, v_descale the output.
#pragma once
#include "epilogue.cuh"
#include "hopper.cuh"
#include "policy.cuh"
#include "softmax.cuh"
#include "tma.cuh"

namespace rf {

// Four P values (already scaled) -> one register of four e4m3 bytes, x0 in the low byte (cvt puts its first
// source in the high byte).
__device__ __forceinline__ u32 pack4_e4m3(float x0, float x1, float x2, float x3) {
  u32 out;
  asm("{\n.reg .b16 lo, hi;\ncvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\ncvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      "mov.b32 %0, {lo, hi};\n}\n" : "=r"(out) : "f"(x0), "f"(x1), "f"(x2), "f"(x3));
  return out;
}

// P (64 x 8*NT, C layout) -> A fragments of k32 slices, keys permuted by sigma inside each slice (see above).
template <int NT>
__device__ __forceinline__ void to_a_operand_e4m3(u32 (&pa)[NT / 4][4], const Acc<1, NT>& s) {
#pragma unroll
  for (int kk = 0; kk < NT / 4; ++kk) {
    const auto& a = s.v[0];
    const int j = 4 * kk;
    pa[kk][0] = pack4_e4m3(a[j][0], a[j][1], a[j + 1][0], a[j + 1][1]);          // row g, keys 2t.., 8 + 2t..
    pa[kk][1] = pack4_e4m3(a[j][2], a[j][3], a[j + 1][2], a[j + 1][3]);          // row g + 8
    pa[kk][2] = pack4_e4m3(a[j + 2][0], a[j + 2][1], a[j + 3][0], a[j + 3][1]);  // row g, keys 16 + 2t.., 24 + 2t..
    pa[kk][3] = pack4_e4m3(a[j + 2][2], a[j + 2][3], a[j + 3][2], a[j + 3][3]);  // row g + 8
  }
}

template <typename OutT, int D, int BR_, int BC, int STAGES, bool OVERLAP, bool PINGPONG, class Pol_>
struct MainloopFwdSm90Fp8 {
  using T = OutT;  // what the softmax's exp2 and the epilogue's stores are instantiated for
  using Pol = Pol_;
  static constexpr int BR = BR_, NC = BR_ / 64, NTHREADS = (NC + 1) * 128, NT = BC / 8, NO = D / 8;
  static constexpr int ALIGN = 1024, Q_BYTES = BR_ * D, KV_BYTES = BC * D;
  static constexpr int BARRIERS = 2 + 4 * STAGES;
  static constexpr int SMEM_BYTES = ALIGN + Q_BYTES + 2 * STAGES * KV_BYTES + 8 * BARRIERS;
  // FA3's split for two consumer warpgroups (24 / 240): at d = 256 O (128), S (64) and P (32) need the 240.
  static constexpr int PRODUCER_REGS = NC == 2 ? 24 : 32, CONSUMER_REGS = NC == 2 ? 240 : 160;
  static constexpr float P_LOG2 = 8.f;  // P in [0, 256] before its cast (e4m3's largest finite value is 448)
  static_assert(NC == 2 || NC == 3, "two or three consumer warpgroups");
  static_assert(BC % 128 == 0 && BC <= 256 && D % 128 == 0 && D <= 256, "whole 128-byte panels; wgmma N <= 256");
  static_assert(!Pol_::GENERAL, "the FP8 form runs the plain policy (its scale folded with the descales)");
  static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * 128 * NC <= 65536, "the register file");

  struct State {
    Acc<1, NO> o;
    OnlineSoftmax<2> sm;
  };
  struct Pipes {
    PipeState<1> q;
    PipeState<STAGES> kv;
  };
  // Shared memory: Q_i (BR x D), STAGES stages of K_j (BC x D) and of V_j^T (D x BC), the mbarriers.
  struct Smem {
    u32 base;
    __device__ __forceinline__ explicit Smem(char* smem)
        : base(((u32)__cvta_generic_to_shared(smem) + ALIGN - 1) & ~(u32)(ALIGN - 1)) {}
    __device__ __forceinline__ Sw128x8<BR_, D> q() const { return {base}; }
    __device__ __forceinline__ Sw128x8<BC, D> k(int s) const { return {base + Q_BYTES + s * KV_BYTES}; }
    __device__ __forceinline__ Sw128x8<D, BC> vt(int s) const {
      return {base + Q_BYTES + (STAGES + s) * KV_BYTES};
    }
    __device__ __forceinline__ u32 bar(int i) const { return base + Q_BYTES + 2 * STAGES * KV_BYTES + 8 * i; }
    __device__ __forceinline__ u32 q_full() const { return bar(0); }
    __device__ __forceinline__ u32 q_empty() const { return bar(1); }
    __device__ __forceinline__ u32 k_full(int s) const { return bar(2 + s); }
    __device__ __forceinline__ u32 k_empty(int s) const { return bar(2 + STAGES + s); }
    __device__ __forceinline__ u32 v_full(int s) const { return bar(2 + 2 * STAGES + s); }
    __device__ __forceinline__ u32 v_empty(int s) const { return bar(2 + 3 * STAGES + s); }
    __device__ __forceinline__ void init() const {
      for (int i = 0; i < BARRIERS; ++i) {
        const bool full = i == 0 || (i >= 2 && i < 2 + STAGES) || (i >= 2 + 2 * STAGES && i < 2 + 3 * STAGES);
        mbar_init(bar(i), full ? 1 : NC * 128);
      }
      mbar_init_fence();
    }
  };

  __device__ __forceinline__ static bool is_producer() { return warpgroup_id() == NC; }
  __device__ __forceinline__ static int warp_row() { return 16 * warp_id(); }

  // ---------------------------------------------------------------- producer
  __device__ __forceinline__ static bool producer_start(const TmaFwd& tma) {
    regs_release<PRODUCER_REGS>();
    if (warp_id() != 4 * NC) return false;
    if (lane_id() == 0) {
      tma_prefetch_desc(tma.q);
      tma_prefetch_desc(tma.k);
      tma_prefetch_desc(tma.v);
    }
    return true;
  }
  // Q and K maps: (column, row, head, batch) of the e4m3 tensors, boxes of 128 columns; the V map describes the
  // V^T workspace as (key, head_dim row, kv head, batch), boxes of 128 keys by D rows.
  __device__ __forceinline__ static void produce(const FwdParams& p, const TmaFwd& tma, const typename Pol::Info& bi,
                                                 const Pol& pol, int q0, const Smem& sm, Pipes& pipes) {
    const int nrows = min(BR, bi.seqlen_q - q0);
    const BlockRange kv = pol.kv_blocks(q0, nrows, BC);
    const int n = kv.n();
    if (lane_id() != 0) return;
    // ---- [mainloop_fwd_sm90_fp8:load_q] Q_i, once the consumers are done with the previous tile's ----
    mbar_wait(sm.q_empty(), pipes.q.parity() ^ 1);
    mbar_expect_tx(sm.q_full(), Q_BYTES);
#pragma unroll
    for (int c = 0; c < D; c += 128)
      tma_load_4d(tma.q, sm.q().base + c / 128 * Sw128x8<BR_, D>::PANEL_BYTES, sm.q_full(), c, bi.q_row0 + q0, bi.h,
                  bi.b);
    pipes.q.advance();
    // ---- [mainloop_fwd_sm90_fp8:load_kv] K_j, then V_j^T, into the next free stage ----
#pragma unroll 1
    for (int step = 0; step < n; ++step) {
      const int s = pipes.kv.stage(), free = pipes.kv.parity() ^ 1, row = kv.block(step) * BC;
      mbar_wait(sm.k_empty(s), free);
      mbar_expect_tx(sm.k_full(s), KV_BYTES);
#pragma unroll
      for (int c = 0; c < D; c += 128)
        tma_load_4d(tma.k, sm.k(s).base + c / 128 * Sw128x8<BC, D>::PANEL_BYTES, sm.k_full(s), c, bi.k_row0 + row,
                    bi.hk, bi.b);
      mbar_wait(sm.v_empty(s), free);
      mbar_expect_tx(sm.v_full(s), KV_BYTES);
#pragma unroll
      for (int c = 0; c < BC; c += 128)
        tma_load_4d(tma.v, sm.vt(s).base + c / 128 * Sw128x8<D, BC>::PANEL_BYTES, sm.v_full(s), row + c, 0, bi.hk,
                    bi.b);
      pipes.kv.advance();
    }
  }

  // ---------------------------------------------------------------- consumers
  __device__ __forceinline__ static void turn_wait() {
    if (PINGPONG) named_sync(1 + warpgroup_id(), 256);
  }
  __device__ __forceinline__ static void turn_pass() {
    if (PINGPONG) named_arrive(1 + (warpgroup_id() + 1) % NC, 256);
  }
  __device__ __forceinline__ static void consumer_start() {
    regs_claim<CONSUMER_REGS>();
    if (PINGPONG && warpgroup_id() == NC - 1) named_arrive(1, 256);
  }
  __device__ __forceinline__ static void consumer_finish() {
    if (PINGPONG && warpgroup_id() == 0) named_sync(1, 256);
  }
  // The descale of (batch, kv head) of one of q / k / v: per tensor (strides 0) or per (batch, kv head).
  __device__ __forceinline__ static float descale(const FwdParams& p, const float* x, const typename Pol::Info& bi) {
    return x ? x[bi.b * p.descale_sb + bi.hk * p.descale_sh] : 1.f;
  }

  // S = Q_i K^T over D / 32 k-steps; O += P V^T over BC / 32 k-steps.
  template <class SQ, class SK>
  __device__ __forceinline__ static void gemm_qk(Acc<1, NT>& s, const SQ& sq, int r0, const SK& sk) {
#pragma unroll
    for (int k = 0; k < D; k += 32) WgmmaE4m3<BC>::ss(s.v[0], sq.desc_k(r0, k), sk.desc_k(0, k), k > 0 ? 1 : 0);
  }
  template <class SV>
  __device__ __forceinline__ static void gemm_pv(Acc<1, NO>& o, const u32 (&pa)[NT / 4][4], const SV& svt) {
#pragma unroll
    for (int kk = 0; kk < NT / 4; ++kk) WgmmaE4m3<D>::rs(o.v[0], pa[kk], svt.desc_k(0, 32 * kk), 1);
  }

  __device__ __forceinline__ static void consume(const FwdParams& p, const typename Pol::Info& bi, const Pol& pol_in,
                                                 int q0, const Smem& sm, Pipes& pipes, State& st) {
    Pol pol = pol_in;
    pol.scale_log2 *= descale(p, p.q_descale, bi) * descale(p, p.k_descale, bi);  // S = descales x (Q8 K8^T)
    const int nrows = min(BR, bi.seqlen_q - q0), wg_row = 64 * warpgroup_id(), wq = warp_row();
    const BlockRange kv = pol.kv_blocks(q0, nrows, BC);
    const int n = kv.n();
    const auto sQ = sm.q();
    // ---- [mainloop_fwd_sm90_fp8:init] Alg.1 l.5: O = 0, l = 0, m = -inf; Q_i has landed ----
    Acc<1, NT> s;
    u32 pa[NT / 4][4];
    float fo[2];
    zero(st.o);
    st.sm.init();
    auto softmax = [&](int step) {
      const int k0 = kv.block(step) * BC;
      if (kv.is_edge(step)) pol.mask(s, q0 + wq, k0);
      st.sm.template update<T>(s, pol.template softmax_scale<T>(), fo, P_LOG2);
    };
    mbar_wait(sm.q_full(), pipes.q.parity());
    pipes.q.advance();
    if (n > 0) {
      // ---- [mainloop_fwd_sm90_fp8:first_scores] S_0 = Q_i K_0^T and its softmax ----
      const int s0 = pipes.kv.stage();
      mbar_wait(sm.k_full(s0), pipes.kv.parity());
      turn_wait();
      wgmma_fence();
      gemm_qk(s, sQ, wg_row, sm.k(s0));
      wgmma_commit();
      turn_pass();
      wgmma_wait<0>();
      mbar_arrive(sm.k_empty(s0));
      softmax(0);
      to_a_operand_e4m3(pa, s);
    }
    int prev = pipes.kv.stage(), prev_parity = pipes.kv.parity();
    if (n > 0) pipes.kv.advance();
#pragma unroll 1
    for (int j = 1; j < n; ++j) {
      // ---- [mainloop_fwd_sm90_fp8:issue] S_j = Q_i K_j^T and O += P_{j-1} V_{j-1} ----
      const int sj = pipes.kv.stage();
      mbar_wait(sm.k_full(sj), pipes.kv.parity());
      mbar_wait(sm.v_full(prev), prev_parity);
      turn_wait();
      fence_operand(st.o);
      wgmma_fence();
      if (OVERLAP) {
        gemm_qk(s, sQ, wg_row, sm.k(sj));
        wgmma_commit();
      }
      gemm_pv(st.o, pa, sm.vt(prev));
      wgmma_commit();
      if (!OVERLAP) {
        gemm_qk(s, sQ, wg_row, sm.k(sj));
        wgmma_commit();
      }
      turn_pass();
      // ---- [mainloop_fwd_sm90_fp8:softmax] Alg.1 l.9 for block j while P_{j-1} V_{j-1} runs, then the rescale ----
      if (OVERLAP) wgmma_wait<1>();
      else wgmma_wait<0>();
      fence_operand(s);
      mbar_arrive(sm.k_empty(sj));
      softmax(j);
      wgmma_wait<0>();
      fence_operand(st.o);
      mbar_arrive(sm.v_empty(prev));
      scale_rows(st.o, fo);
      to_a_operand_e4m3(pa, s);
      prev = sj;
      prev_parity = pipes.kv.parity();
      pipes.kv.advance();
    }
    mbar_arrive(sm.q_empty());
    if (n > 0) {
      // ---- [mainloop_fwd_sm90_fp8:last_pv] the last key block: O += P V alone ----
      mbar_wait(sm.v_full(prev), prev_parity);
      turn_wait();
      fence_operand(st.o);
      wgmma_fence();
      gemm_pv(st.o, pa, sm.vt(prev));
      wgmma_commit();
      turn_pass();
      wgmma_wait<0>();
      fence_operand(st.o);
      mbar_arrive(sm.v_empty(prev));
    }
    // l carries P's 2^P_LOG2 (so does O): take it out of l here, out of O in store (an exact power of two).
    st.sm.l[0] *= exp2f(-P_LOG2);
    st.sm.l[1] *= exp2f(-P_LOG2);
  }

  __device__ __forceinline__ static void store(const FwdParams& p, const typename Pol::Info& bi, const Pol& pol,
                                               int q0, const State& st) {
    epilogue_fwd<T, false>(p, bi, pol, st.o, st.sm, q0 + warp_row(), descale(p, p.v_descale, bi) * exp2f(-P_LOG2));
  }
};

}  // namespace rf
