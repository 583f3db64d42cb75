// fa2_fwd: FlashAttention-2 forward (Dao 2023, Algorithm 1) on mma.sync, for every dtype and GPU (sm_80+).
// Grid (Tr, heads, batch): one CTA per query block Q_i ("sequence parallelism"); each warp owns whole query rows
// ("split-Q"); O is divided by l once at the end ("deferred normalisation"). Each idea is a template switch so
// the ablation can turn it off alone: SEQ_PARALLEL = false walks all query blocks in one CTA per (batch, head),
// SPLIT_Q = false uses FA1's split-K warp partition (splitk.cuh), DEFER_NORM = false rescales O by 1/l after every
// key block. MASK / GENERAL select the variant policy (policy.cuh); OPAQUE_TILE is a register switch of the serial
// walk (fwd.cuh); WC > 1 splits O's columns between the warps that share rows (mainloop_fwd_sm80.cuh: head_dim
// 512; split-Q only). Scores are kept in log2 units, so every exponential is one exp2.
#include "fwd.cuh"
#include "mainloop_fwd_sm80.cuh"
#include "splitk.cuh"

template <typename T, int D, int BR, int BC, int NWARPS, int MIN_BLOCKS, int KUNROLL, int MASK, bool GENERAL,
          bool DEFER_NORM, bool SEQ_PARALLEL, bool SPLIT_Q, bool OPAQUE_TILE, int SMEM_BYTES, int WC = 1>
__global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS) fa2_fwd(const __grid_constant__ rf::FwdParams p) {
  using namespace rf;
  using Pol = Policy<MASK, GENERAL>;
  using Mainloop = typename Select<SPLIT_Q, MainloopFwdSm80<T, D, BR, BC, NWARPS, KUNROLL, DEFER_NORM, Pol, WC>,
                                   MainloopFwdSplitK<T, D, BR, BC, NWARPS, DEFER_NORM, Pol>>::type;
  static_assert(SPLIT_Q || WC == 1, "the column split is split-Q's");
  static_assert(Mainloop::SMEM_BYTES == SMEM_BYTES,
                "rawflash/kernels/launch.py and the kernel disagree on shared memory");
  fwd_kernel<Mainloop, QTileScheduler<BR, !SEQ_PARALLEL, GENERAL>, OPAQUE_TILE>(p);
}
