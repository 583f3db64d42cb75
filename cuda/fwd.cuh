// The forward skeleton: tile scheduler x mainloop x epilogue. Every forward form of FA2 is this one body with a
// different mainloop (mainloop_fwd_sm80.cuh: mma.sync; mainloop_fwd_sm90.cuh: wgmma; splitk.cuh: FA1's split-K
// partition); the variant policy (policy.cuh) rides in the mainloop's type, BlockInfo locates the sequence.
// FA3's form splits this skeleton by warpgroup role (fa3_fwd_sm90.cu: fwd_kernel_ws).
#pragma once
#include "block_info.cuh"
#include "params.cuh"
#include "scheduler.cuh"

namespace rf {

// Whether a scheduler hands one CTA several query tiles in turn (QTileScheduler's SERIAL: the ablation of FA2's
// sequence parallelism); the others give a CTA one tile.
template <class Scheduler> struct WalksTiles {
  static constexpr bool value = false;
};
template <int BR, bool VARLEN> struct WalksTiles<QTileScheduler<BR, true, VARLEN>> {
  static constexpr bool value = true;
};

// OPAQUE_TILE (a tile-row switch, configs.TileConfig.opaque_tile; the serial walk only): each tile's (b, h, i) is
// hidden from the optimiser at the tile's start instead of the next index at its end, so the tile's base addresses
// are computed per tile, not carried through the mainloop (fewer registers for the sm_80 float32 rows that set it;
// bench/NOTES.md).
template <class Mainloop, class Scheduler, bool OPAQUE_TILE = false>
__device__ __forceinline__ void fwd_kernel(const FwdParams& p) {
  extern __shared__ __align__(16) char smem[];
  Scheduler tiles;
  // ---- [fwd:schedule] this CTA's query tiles: one (sequence parallelism), or all of a (b, h) in turn ----
  if (!tiles.start(p)) return;
  do {
    // ---- [fwd:setup] the sequence, head and kv head of the tile; its variant policy ----
    if constexpr (WalksTiles<Scheduler>::value && OPAQUE_TILE) {
      tiles.b = opaque_here(tiles.b);
      tiles.h = opaque_here(tiles.h);
      tiles.i = opaque_here(tiles.i);
    }
    const typename Mainloop::Pol::Info bi(p, tiles.b, tiles.h);
    const int q0 = tiles.i * Mainloop::BR;
    if (q0 >= bi.seqlen_q) continue;
    const typename Mainloop::Pol pol(p, bi);
    typename Mainloop::State st;
    // ---- [fwd:mainloop] Alg.1 l.4-11 over the key blocks the policy leaves visible ----
    Mainloop::run(p, bi, pol, q0, smem, st);
    // ---- [fwd:epilogue] Alg.1 l.12-13: O_i and L_i ----
    Mainloop::store(p, bi, pol, q0, smem, st);
    // The serial walk only: the next tile's index must not be derivable from this one's, or the compiler carries
    // the next tile's output row addresses, strength-reduced, through the whole mainloop (14 registers at d = 128
    // on sm_80; bench/NOTES.md).
    if constexpr (WalksTiles<Scheduler>::value && !OPAQUE_TILE) tiles.i = opaque(tiles.i);
  } while (tiles.advance());
}

}  // namespace rf
