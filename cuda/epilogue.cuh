// Epilogues: how a finished tile leaves the chip.
//
// Forward, register mainloops (each warp holds 16 MT whole query rows of O in C layout; sm80 and sm90 share it):
// FA2 Alg.1 l.12-13, O_i = diag(l_i)^-1 O_i (and the sink's share of the denominator) written in the input dtype,
// L_i = m_i + log(l_i) to lse (FP8: O also times o_scale, V's descale); rows past the sequence are not written.
// A warp that holds columns c0.. of its rows (mma.sync's column split, WC > 1) writes those; the one holding
// column 0 writes lse.
// Split-KV writes its partial O (float32, normalised by its own l) and partial lse instead, for the combine kernel
// to merge.
#pragma once
#include "acc.cuh"
#include "block_info.cuh"
#include "softmax.cuh"

namespace rf {

// The columns of O a forward writes: v's head_dim where the mainloop reads v at its own width (NARROW_V: FA3's
// DV form, MLA's head_dim_v), else q's.
template <bool NARROW_V> __device__ __forceinline__ int o_head_dim(const FwdParams& p) {
  return NARROW_V ? p.head_dim_v : p.head_dim;
}

template <typename T, bool NORMALIZED, bool NARROW_V = false, class Pol, int MT, int NO>
__device__ __forceinline__ void epilogue_fwd(const FwdParams& p, const typename Pol::Info& bi, const Pol& pol,
                                             const Acc<MT, NO>& o, const OnlineSoftmax<2 * MT>& sm, int r0,
                                             float o_scale = 1.f, int c0 = 0) {
  float f[2 * MT], lse[2 * MT];
  sm.template finalize<T, NORMALIZED>(pol.sink_log2(p, bi), f, lse);
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r) f[r] *= o_scale;  // FP8: V's descale (1 otherwise)
  store_rows<T>(bi.template q_like<T>(p.o, p.o_sb, p.o_ss, p.o_sh), p.o_ss, o, f, r0, c0, bi.seqlen_q,
                o_head_dim<NARROW_V>(p));
  if (c0 == 0) store_row_values<MT>(p.lse + bi.row0, lse, r0, bi.seqlen_q);
}

}  // namespace rf
