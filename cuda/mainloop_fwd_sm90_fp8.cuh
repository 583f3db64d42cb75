// mainloop_fwd_sm90_fp8: FlashAttention-3's forward mainloop for FP8 e4m3 inputs on sm_90a, with the products on
// wgmma.m64nNk32.e4m3 (twice the 16-bit rate). The producer / consumer warpgroups, rings, ping-pong, overlap and
// the walk over key blocks are mainloop_fwd_sm90_ws.cuh's Fa3FwdPipeline, which the 16-bit form shares; this
// file holds only what FP8 does otherwise. No Numba twin (the 16-bit FA3 form has none either); the reference
// backend dequantises the inputs and is the judge.
//
// What differs from the 16-bit mainloop:
//   - tiles are bytes (Sw128x8: panels of 128 columns; V^T of 192 keys in Sw64x8's 64-column panels); the head_dim
//     D is a multiple of 128, columns past the caller's head_dim are zero-filled by the copies (as 16-bit TMA
//     tiles are past theirs);
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
//   - descales: q_descale * k_descale of the (batch, kv head) multiply the softmax scale, v_descale the output;
//   - the general policy (GENERAL: windows, packed sequences, seqused_k) without its score transforms: the host
//     refuses soft-capping and ALiBi on FP8 inputs, so softmax_scale() is the descaled scale_log2 and the policy
//     only masks. Packed sequences share one V^T workspace row per kv head, sequence b's keys from key
//     vt_key0(b) = 128 (k_row0 / 128 + b) on (fp8_vt_permute writes it so): a multiple of 128, so its 32-key
//     slices and the tiles' boxes start where a fixed-length sequence's do, and far enough from the previous
//     sequence's start to hold all of its keys (padded with zeros; what a tile reads past its sequence is masked).
#pragma once
#include "mainloop_fwd_sm90_ws.cuh"

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

// V_j^T tiles: whole 128-byte panels of keys where BC allows it, else 64-byte ones (BC = 192).
template <int D, int BC> using VtTile = typename Select<BC % 128 == 0, Sw128x8<D, BC>, Sw64x8<D, BC>>::type;

// Registers after the hand-over: FA3's split for two consumer warpgroups (24 / 240): at d = 256 O (128), S (64)
// and P (32) need the 240.
template <typename OutT, int D, int BR_, int BC, int STAGES, bool OVERLAP, bool PINGPONG, class Pol_, int QSTAGES = 1>
struct MainloopFwdSm90Fp8
    : Fa3FwdPipeline<MainloopFwdSm90Fp8<OutT, D, BR_, BC, STAGES, OVERLAP, PINGPONG, Pol_, QSTAGES>, OutT,
                     Sw128x8<BR_, D>, Sw128x8<BC, D>, VtTile<D, BC>, D, D, BR_, BC, STAGES, OVERLAP, PINGPONG, Pol_,
                     BR_ / 64 == 2 ? 24 : 32, BR_ / 64 == 2 ? 240 : 160, QSTAGES> {
  using Base = typename MainloopFwdSm90Fp8::Fa3FwdPipeline;
  using typename Base::Info, typename Base::Smem, typename Base::Pipes, typename Base::State;
  static_assert(BC % 64 == 0 && BC <= 256 && D % 128 == 0 && D <= 256, "whole 64- / 128-byte panels; wgmma N <= 256");
  static constexpr bool PACKED = Pol_::GENERAL;  // the general policy brings packed sequences
  static constexpr bool PAGED = false;            // paged keys run 16-bit forms only
  static constexpr bool O_VIA_Q = false; // O (OutT) is twice Q_i's bytes: stored from registers
  static constexpr int REF = REF_RUNNING;  // e4m3's P has a narrow range: the running max always
  static constexpr float P_LOG2 = 8.f;  // P in [0, 256] before its cast (e4m3's largest finite value is 448) ...
  // ... and in [0, 430] under a stale max (2^8.75; OnlineSoftmax::update's stale_log2) at head_dim 128, where it
  // gains 3 - 4 % non-causal on H200 (+-1 % causal); at 256 it costs 1 - 3 %, so 256 keeps the exact max
  // (bench/NOTES.md).
  static constexpr float STALE_LOG2 = D == 128 ? 0.75f : 0.f;
  using PA = u32[BC / 32][4];  // P's A fragments, one per 32 keys

  // ---- [mainloop_fwd_sm90_fp8:load_vt] V_j^T: the workspace as (key, head_dim row, kv head, batch) ----
  // Q and K maps are (column, row, head, batch) of the e4m3 tensors in boxes of 128 columns, as 16-bit ones; the
  // V map describes the V^T workspace, boxes of 128 keys (64 when BC is not a multiple of 128) by D rows.
  // Packed sequences: one "batch", sequence b's keys from vt_key0 (the head comment).
  __device__ __forceinline__ static int vt_key0(const FwdParams& p, const Info& bi) {
    return PACKED && p.cu_seqlens_k ? 128 * (bi.k_row0 / 128 + bi.b) : 0;
  }
  __device__ __forceinline__ static void load_v(const FwdParams& p, const TmaFwd& tma, const VtTile<D, BC>& vt,
                                                u32 bar, const Info& bi, int k0, int, int bk) {
    tma_load_tile(tma.v, vt, bar, vt_key0(p, bi) + k0, 0, bi.hk, bk);
  }
  // ---- [mainloop_fwd_sm90_fp8:products] S = Q_i K^T over D / 32 k-steps; O += P V^T over BC / 32 k-steps ----
  template <class SQ, class SK>
  __device__ __forceinline__ static void gemm_qk(Acc<1, BC / 8>& s, const SQ& sq, int r0, const SK& sk) {
#pragma unroll
    for (int k = 0; k < D; k += 32) WgmmaE4m3<BC>::ss(s.v[0], sq.desc_k(r0, k), sk.desc_k(0, k), k > 0 ? 1 : 0);
  }
  // (n0: the warpgroup's first column of O, 0: the FP8 form has no column split)
  template <class SV>
  __device__ __forceinline__ static void gemm_pv(Acc<1, D / 8>& o, const PA& pa, const SV& svt, int) {
#pragma unroll
    for (int kk = 0; kk < BC / 32; ++kk) WgmmaE4m3<D>::rs(o.v[0], pa[kk], svt.desc_k(0, 32 * kk), 1);
  }
  __device__ __forceinline__ static void pack_p(PA& pa, const Acc<1, BC / 8>& s) { to_a_operand_e4m3(pa, s); }

  // ---- [mainloop_fwd_sm90_fp8:descales] folded into the softmax scale (q, k) and O's factor (v) ----
  // The descale of (batch, kv head) of one of q / k / v: per tensor (strides 0) or per (batch, kv head).
  __device__ __forceinline__ static float descale(const FwdParams& p, const float* x, const Info& bi) {
    return x ? x[bi.b * p.descale_sb + bi.hk * p.descale_sh] : 1.f;
  }
  __device__ __forceinline__ static void consume(const FwdParams& p, const Info& bi, const Pol_& pol_in, int q0,
                                                 const Smem& sm, Pipes& pipes, State& st) {
    Pol_ pol = pol_in;
    pol.scale_log2 *= descale(p, p.q_descale, bi) * descale(p, p.k_descale, bi);  // S = descales x (Q8 K8^T)
    Base::walk(bi, pol, q0, sm, pipes, st);
    // l carries P's 2^P_LOG2 (so does O): take it out of l here, out of O in store (an exact power of two).
    st.sm.l[0] *= exp2f(-P_LOG2);
    st.sm.l[1] *= exp2f(-P_LOG2);
  }
  __device__ __forceinline__ static void store(const FwdParams& p, const TmaFwd&, const Info& bi, const Pol_& pol,
                                               int q0, const Smem&, const Pipes&, const State& st) {
    epilogue_fwd<OutT, false>(p, bi, pol, st.o, st.sm, q0 + Base::warp_row(),
                              descale(p, p.v_descale, bi) * exp2f(-P_LOG2));
  }
};

}  // namespace rf
