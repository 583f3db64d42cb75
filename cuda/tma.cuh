// rawflash Hopper asynchrony verbs (sm_90a): tensor-memory-accelerator (TMA) copies, mbarrier pipelines, named
// barriers between warpgroups and register reallocation. PTX ISA: "cp.async.bulk.tensor", "mbarrier",
// "bar.sync / bar.arrive", "setmaxnreg".
//
// A TMA copy moves a whole box of a tensor (here: 64 columns x ROWS rows of one (batch, head) of q, k or v)
// from global to shared memory with one instruction from one thread, described by a tensor map that the host
// encodes (rawflash/kernels/tma.py, cuTensorMapEncodeTiled) and passes by value as a `__grid_constant__`
// parameter. With the 128-byte swizzle the box lands in exactly the Sw128 layout of hopper.cuh (chunk c of row r at
// c ^ (r % 8)), so wgmma reads it as it reads a cp.async tile. Out-of-bounds rows and columns are filled with
// zeros: that is how a head_dim that is not a multiple of 64 runs without a padding copy in HBM.
//
// Completion is counted in bytes by an mbarrier: the producer arms it with the bytes it expects
// (arrive.expect_tx) and the copies complete the phase; consumers wait for the phase's parity. A stage's
// "empty" barrier is the way back: every consumer thread arrives after its last read of the stage.
#pragma once
#include "core.cuh"

namespace rf {

// The opaque 128-byte CUtensorMap of the driver API (cuda.h is a host header NVRTC does not have).
struct alignas(128) TmaDesc {
  u64 opaque[16];
};
// The forward's tensor maps, one kernel parameter: q, k, v and o as 4-d tensors (head_dim, rows, heads, batch);
// o's box is 64 rows (one consumer warpgroup's rows), the 16-bit FA3 epilogue's TMA store (the FP8 form leaves
// it unused).
struct TmaFwd {
  TmaDesc q, k, v, o;
};

// ---------------------------------------------------------------- mbarrier
__device__ __forceinline__ void mbar_init(u32 bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Make barrier initialisation visible to the async proxy (the TMA unit) before anyone uses them.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Block until the phase of parity `parity` of the barrier has completed (a fresh barrier's phase "1" counts as
// completed, so a producer's first wait on an empty barrier passes at once).
__device__ __forceinline__ void mbar_wait(u32 bar, int parity) {
  u32 done;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}

// A ring of STAGES buffers: stage s of use number n (n counts from 0 over the whole kernel) is n % STAGES and
// its barriers' parity is (n / STAGES) & 1. Producer and consumers keep their own counters in step.
template <int STAGES> struct PipeState {
  int n = 0;
  __device__ __forceinline__ int stage() const { return n % STAGES; }
  __device__ __forceinline__ int parity() const { return (n / STAGES) & 1; }
  __device__ __forceinline__ void advance() { ++n; }
};

// ---------------------------------------------------------------- TMA
__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc& d) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"((u64)&d) : "memory");
}
// Box (c0.., c1.., c2, c3) of the tensor of `d` into shared memory at dst; completes `bytes` on bar.
__device__ __forceinline__ void tma_load_4d(const TmaDesc& d, u32 dst, u32 bar, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], \
[%1, {%3, %4, %5, %6}], [%2];\n"  // (a backslash-newline continues the string: one literal, spliced before tokens)
      ::"r"(dst), "l"((u64)&d), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
// A whole swizzled tile (hopper.cuh's Sw128, Sw128x8 or Sw64x8: PANELS panels of PANEL_COLS columns,
// PANEL_BYTES each), one box a panel: panel i comes from columns c0 + i * PANEL_COLS.. of the tensor, rows c1.. .
template <class Tile>
__device__ __forceinline__ void tma_load_tile(const TmaDesc& d, const Tile& t, u32 bar, int c0, int c1, int c2,
                                              int c3) {
#pragma unroll
  for (int i = 0; i < Tile::PANELS; ++i)
    tma_load_4d(d, t.base + i * Tile::PANEL_BYTES, bar, c0 + i * Tile::PANEL_COLS, c1, c2, c3);
}

// Rows r0.. of a swizzled tile from one box a panel (a paged key block's boxes, each from its own page): the
// same as tma_load_tile into the tile's rows from r0, a multiple of 8 (whole swizzle atoms, so the swizzle that
// the TMA unit applies to the absolute address is the tile's).
template <class Tile>
__device__ __forceinline__ void tma_load_rows(const TmaDesc& d, const Tile& t, u32 bar, int r0, int c1, int c2,
                                              int c3) {
#pragma unroll
  for (int i = 0; i < Tile::PANELS; ++i)
    tma_load_4d(d, t.base + i * Tile::PANEL_BYTES + r0 * Tile::ROW_BYTES, bar, i * Tile::PANEL_COLS, c1, c2, c3);
}

// Box (c0.., c1..) of a 2-d float32 tensor += the shared-memory tile at src (row-major, no swizzle): the TMA unit
// reads shared memory and adds into global memory atomically per element. Issued by one thread, then committed to
// its bulk group; the tile may be overwritten once bulk_wait_read says the reads are done.
__device__ __forceinline__ void tma_reduce_add_2d(const TmaDesc& d, u32 src, int c0, int c1) {
  asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3}], [%1];\n"
               ::"l"((u64)&d), "r"(src), "r"(c0), "r"(c1) : "memory");
}
// The shared-memory box at src (64 columns x the map's box rows, in the map's swizzle) -> box (c0.., c1.., c2, c3)
// of the tensor of `d`; committed to the issuing thread's bulk group like the reduce-add. Rows and columns past
// the tensor's extents are not written (a tile's rows past seqlen_q, columns past head_dim).
__device__ __forceinline__ void tma_store_4d(const TmaDesc& d, u32 src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
               ::"l"((u64)&d), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// At most N of this thread's committed bulk groups still reading shared memory.
template <int N> __device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}

// At most N of this thread's committed bulk groups not yet complete: their writes (a reduce-add's additions into
// global memory) are done, not only their reads of shared memory (flash-attention issue #2244: a semaphore
// released after .read alone lets the next adder start before these additions have landed).
template <int N> __device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
// Orders this thread's generic-proxy global accesses with its async-proxy (TMA) ones.
__device__ __forceinline__ void fence_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }

// ---------------------------------------------------------------- clusters (sm_90)
__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// Every non-exited thread of the cluster: arrive (release), then wait (acquire).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
// This CTA's shared address `a` as the address of the same offset in the cluster's CTA `rank`.
__device__ __forceinline__ u32 map_shared(u32 a, u32 rank) {
  u32 r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(rank));
  return r;
}
// Arrive on the mbarrier at this CTA's shared offset `bar` in the cluster's CTA `rank`, releasing at the CTA's
// scope (the default), which is what "done reading a buffer" needs. (At the cluster's scope, .release.cluster, the
// arrive also waits until this thread's earlier global reductions are performed: a loop that issues one after its
// dQ additions is 27 % slower; bench/NOTES.md.)
__device__ __forceinline__ void mbar_arrive_remote(u32 bar, u32 rank) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(map_shared(bar, rank)) : "memory");
}
// One arrival that also expects `bytes` more, on the mbarrier at cluster address `bar` (another CTA's).
__device__ __forceinline__ void mbar_expect_tx_remote(u32 bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cluster.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// `bytes` (a multiple of 16) from this CTA's shared memory at src to cluster address dst in another CTA, completing
// on that CTA's mbarrier at cluster address bar. Generic stores to src need fence_async_smem() first.
__device__ __forceinline__ void bulk_copy_to_cta(u32 dst, u32 src, int bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "r"(src), "r"(bytes), "r"(bar) : "memory");
}

// ---------------------------------------------------------------- semaphores in global memory (gpu scope)
__device__ __forceinline__ int ld_acquire(const int* at) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(at) : "memory");
  return v;
}
__device__ __forceinline__ void st_release(int* at, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(at), "r"(v) : "memory");
}

// ---------------------------------------------------------------- warpgroups
// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads: sync waits for all, arrive only counts.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Registers each thread of a CTA of THREADS holds at launch under __launch_bounds__(THREADS, 1): the register
// file shared out in steps of 8. setmaxnreg only moves registers within this pool (THREADS x launch_regs, not the
// whole 65536 of the file): a claim larger than what the other warpgroups released waits forever (a hang, not an
// error: 32 / 240 over three warpgroups asks for 65536 of a pool of 64512).
constexpr int launch_regs(int threads) { return 65536 / threads / 8 * 8; }
// Give registers back (producer) or take them (consumers); every warp of a warpgroup runs the same one.
template <int REGS> __device__ __forceinline__ void regs_release() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS> __device__ __forceinline__ void regs_claim() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

}  // namespace rf
