// fa2_bwd_sm90: the fa2_bwd skeleton (bwd.cuh) with the Hopper mainloops (mainloop_bwd_sm90.cuh: wgmma, 16-bit,
// sm_90a, atomic dQ): keys split over warpgroups for head_dim 64 / 128, the column split (SPLIT_D) for 256.
// fa2_bwd_preprocess runs before it and fa2_bwd_convert_dq after it, as for fa2_bwd.
#include "mainloop_bwd_sm90.cuh"

template <typename T, int D, int BR, int BC, int MIN_BLOCKS, int MASK, bool GENERAL, bool SPLIT_D, int SMEM_BYTES>
__global__ void __launch_bounds__((SPLIT_D ? 2 : BC / 64) * 128, MIN_BLOCKS)
fa2_bwd_sm90(const __grid_constant__ rf::BwdParams p) {
  using namespace rf;
  using Pol = Policy<MASK, GENERAL>;
  using Mainloop =
      typename Select<SPLIT_D, MainloopBwdSm90SplitD<T, D, BR, BC, Pol>, MainloopBwdSm90<T, D, BR, BC, Pol>>::type;
  static_assert(Mainloop::SMEM_BYTES == SMEM_BYTES,
                "rawflash/kernels/launch.py and the kernel disagree on shared memory");
  bwd_kernel<Mainloop>(p);
}
