// fa3_fwd_sm90: the forward skeleton split by warpgroup role (fwd_kernel_ws) with FlashAttention-3's mainloop
// (mainloop_fwd_sm90_ws.cuh: TMA copies by a producer warpgroup, BR/64 consumer warpgroups on wgmma, 16-bit,
// sm_90a). A 1-d grid of query tiles (Fa3Scheduler): one tile per CTA, or persistent with a static or a dynamic
// schedule; MASK / GENERAL select the variant policy, REF what the softmax subtracts (softmax.cuh's SoftmaxRef:
// the running max, a fixed reference for soft-capped bfloat16 scores, or the first block's max for plain bfloat16
// attention, checked, with the REF_RUNNING launch after it as the way back), OVERLAP is FA3's intra-warpgroup
// overlap, PINGPONG its inter-warpgroup schedule, QSTAGES the Q_i buffers (2: the next tile's Q_i is copied during
// this one), STAGE_O the epilogue through shared memory and a TMA store, DV the columns of V and O (D, or MLA's
// narrower head_dim_v: the DV form), WC the consumer warpgroups that share a tile's 64 rows and split O's columns
// (2 at head_dim 512: the column split; 1 elsewhere, the default, left out of the launch's name expression).
// fa3_fwd_sm90_fp8 is the same skeleton with the FP8 mainloop (mainloop_fwd_sm90_fp8.cuh, on the same pipeline):
// e4m3 inputs, the output in OutT (bfloat16 or float16), the plain policy or the general one without its score
// transforms (windows, packed sequences, seqused_k).
#include "fwd.cuh"
#include "mainloop_fwd_sm90_ws.cuh"
#include "mainloop_fwd_sm90_fp8.cuh"

namespace rf {

// The forward skeleton of fwd.cuh split by warpgroup role (FA3's warp specialisation): a producer that only
// copies and consumers that only compute walk the same tiles of the same scheduler, so their pipelines stay in
// step without talking about tiles; BlockInfo, the variant policy and the epilogue are fwd.cuh's.
template <class Mainloop, class Scheduler>
__device__ __forceinline__ void fwd_kernel_ws(const FwdParams& p, const TmaFwd& tma) {
  extern __shared__ __align__(16) char smem[];
  const typename Mainloop::Smem sm(smem);
  // ---- [fa3_fwd_sm90:setup] the pipelines' barriers, initialised once and visible to every warp and the TMA unit ----
  if (threadIdx.x == 0) sm.init();
  __syncthreads();  // the last CTA-wide barrier: from here on the roles meet only at mbarriers and named barriers
  typename Mainloop::Pipes pipes;
  Scheduler tiles;
  if (Mainloop::is_producer()) {
    // ---- [fa3_fwd_sm90:producer] Q_i, K_j, V_j of every tile of this CTA, as far ahead as the stages allow ----
    if (!Mainloop::producer_start(tma)) return;
    if (tiles.start(p)) do {
        const typename Mainloop::Pol::Info bi(p, tiles.b, tiles.h);
        const int q0 = tiles.i * Mainloop::BR;
        if (q0 >= bi.seqlen_q) continue;
        Mainloop::produce(p, tma, bi, typename Mainloop::Pol(p, bi), q0, tiles.t, sm, pipes);
      } while (tiles.advance(p));
    if constexpr (Scheduler::DYNAMIC) Mainloop::produce_end(sm, pipes);
    return;
  }
  // ---- [fa3_fwd_sm90:consumers] Alg.1 l.4-13 on each tile: the mainloop, then the epilogue ----
  Mainloop::consumer_start();
  // the next tile: the static schedules compute it, the dynamic one reads what the producer took
  auto next = [&](bool first) {
    if constexpr (Scheduler::DYNAMIC) return tiles.take(p, Mainloop::published_tile(sm, pipes));
    else return first ? tiles.start(p) : tiles.advance(p);
  };
  if (next(true)) do {
      const typename Mainloop::Pol::Info bi(p, tiles.b, tiles.h);
      const int q0 = tiles.i * Mainloop::BR;
      if (q0 >= bi.seqlen_q) continue;
      const typename Mainloop::Pol pol(p, bi);
      typename Mainloop::State st;
      Mainloop::consume(p, bi, pol, q0, sm, pipes, st);
      Mainloop::store(p, tma, bi, pol, q0, sm, pipes, st);
    } while (next(false));
  Mainloop::consumer_finish();
}

// SCHEDULE: 0 one tile per CTA, 1 a persistent grid with the static schedule, 2 a persistent grid taking tiles
// from a counter (launch.SCHEDULES).
template <int BR, int SCHEDULE, bool VARLEN>
using Fa3Scheduler =
    typename Select<SCHEDULE == 2, DynamicTileScheduler<BR>, LinearTileScheduler<BR, SCHEDULE == 1, VARLEN>>::type;

}  // namespace rf

template <typename T, int D, int BR, int BC, int STAGES, int MASK, bool GENERAL, int REF, bool OVERLAP,
          bool PINGPONG, int SCHEDULE, int QSTAGES, bool STAGE_O, int DV, int SMEM_BYTES, int WC = 1>
__global__ void __launch_bounds__((BR / 64 * WC + 1) * 128, 1)
    fa3_fwd_sm90(const __grid_constant__ rf::FwdParams p, const __grid_constant__ rf::TmaFwd tma) {
  using namespace rf;
  using Mainloop = MainloopFwdSm90Ws<T, D, BR, BC, STAGES, OVERLAP, PINGPONG, Policy<MASK, GENERAL>, QSTAGES, STAGE_O,
                                     REF, DV, WC>;
  // The way back from REF_FIRST: launched after it with p.ref_flag set, a REF_RUNNING kernel runs only where that
  // launch flagged this call (every thread reads the same word, so the whole grid returns or none of it).
  if constexpr (REF == REF_RUNNING)
    if (p.ref_flag && *reinterpret_cast<const volatile int*>(p.ref_flag) != p.ref_gen) return;
  static_assert(Mainloop::SMEM_BYTES == SMEM_BYTES,
                "rawflash/kernels/launch.py and the kernel disagree on shared memory");
  fwd_kernel_ws<Mainloop, Fa3Scheduler<BR, SCHEDULE, GENERAL>>(p, tma);
}

template <typename OutT, int D, int BR, int BC, int STAGES, int MASK, bool GENERAL, bool OVERLAP, bool PINGPONG,
          int SCHEDULE, int QSTAGES, int SMEM_BYTES>
__global__ void __launch_bounds__((BR / 64 + 1) * 128, 1)
    fa3_fwd_sm90_fp8(const __grid_constant__ rf::FwdParams p, const __grid_constant__ rf::TmaFwd tma) {
  using namespace rf;
  using Mainloop = MainloopFwdSm90Fp8<OutT, D, BR, BC, STAGES, OVERLAP, PINGPONG, Policy<MASK, GENERAL>, QSTAGES>;
  static_assert(Mainloop::SMEM_BYTES == SMEM_BYTES,
                "rawflash/kernels/launch.py and the kernel disagree on shared memory");
  fwd_kernel_ws<Mainloop, Fa3Scheduler<BR, SCHEDULE, GENERAL>>(p, tma);
}
