// fa2_fwd_sm90: the fa2_fwd skeleton with the Hopper mainloop (mainloop_fwd_sm90.cuh: wgmma, 16-bit, head_dim a
// multiple of 64, sm_90a). Grid (Tr, heads, batch), BR/64 warpgroups per CTA; MASK / GENERAL select the
// variant policy, OVERLAP is FA3's intra-warpgroup overlap of the softmax with P V.
#include "fwd.cuh"
#include "mainloop_fwd_sm90.cuh"

template <typename T, int D, int BR, int BC, int MIN_BLOCKS, int MASK, bool GENERAL, bool OVERLAP, int SMEM_BYTES>
__global__ void __launch_bounds__(BR / 64 * 128, MIN_BLOCKS) fa2_fwd_sm90(const __grid_constant__ rf::FwdParams p) {
  using namespace rf;
  using Mainloop = MainloopFwdSm90<T, D, BR, BC, OVERLAP, Policy<MASK, GENERAL>>;
  static_assert(Mainloop::SMEM_BYTES == SMEM_BYTES,
                "rawflash/kernels/launch.py and the kernel disagree on shared memory");
  fwd_kernel<Mainloop, QTileScheduler<BR, false, GENERAL>>(p);
}
