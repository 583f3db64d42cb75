"""What float32 additions into L2 cost on this GPU: the backward's dQ additions, three ways. The d = 256 backward is
bound by L2, which carries its float32 dQ additions and its copies of Q_i and dO_i; a contributor runs this on a
GPU machine before choosing how dQ reaches global memory (cuda/mainloop_bwd_sm90_ws_split_d.cuh cites its
figures), or on a new GPU, to see how fast the L2 takes float32 additions when they arrive:

- ``red_v4``: as ``red.global.add.v4.f32`` from registers, lane for lane in the column split's pattern
  (``MainloopBwdSm90WsSplitD::add_dq``: a warp adds 16 rows x 8 columns, each lane 4 floats, per instruction);
- ``red_bulk``: as ``cp.reduce.async.bulk`` (1-D, ``.add.f32``) from a shared-memory tile, issued by one thread
  in chunks of ``chunk`` bytes, at most ``inflight`` tiles' groups still reading (the d <= 128 backward's TMA
  reduce-add is the 2-D tensor form of the same operation);
- ``st_v4``: plain 16-byte stores of the same bytes (what the L2 takes when nothing is added).

Each CTA-iteration adds one 64 x 256 float32 block (64 KB: one step's dQ_i at d = 256) into a 128 MB buffer of
2048 blocks; ``share`` consecutive CTAs add into the same block in the same iteration (the key blocks of one head
reaching the same query block together: up to 64 of them at N = 4096). Every kernel is checked first: one
iteration on a zeroed buffer must leave each block holding the number of CTAs that added into it (1 for stores).
The figure printed is GB of float32 added (or stored) per millisecond, i.e. TB/s; on an H200, red_v4 gives
1.8 - 2.4 TB/s, red_bulk 2.6 - 3.8 and st_v4 4.7. tests/test_compile.py compiles its source for sm_90a offline.
Example:

    python3 tools/l2_reduce.py --share 1,16,64 [--gbytes 8] [--repeats 5]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BLOCK_FLOATS = 64 * 256  # one step's dQ_i at d = 256: 64 query rows x 256 columns
BLOCKS = 2048            # 128 MB of float32 rows
THREADS = 256

SOURCE = r"""
typedef unsigned int u32;
// the block CTA group g adds into at iteration it (groups of `share` consecutive CTAs share one)
__device__ __forceinline__ long long block_of(int share, int it, int nblocks) {
  return ((long long)(blockIdx.x / share) * 7919 + it) % nblocks;
}
// red.global.add.v4.f32 in add_dq's lane pattern: warp v of warpgroup w adds rows 16v.. (lane quad t: row g or
// g + 8 for odd t) of columns 128w + 8j + 4(t / 2).., j = 0..15: 64 rows x 256 columns per CTA-iteration
extern "C" __global__ void red_v4(float* dst, int nblocks, int iters, int share) {
  const int tid = threadIdx.x, w = tid >> 7, v = (tid & 127) >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int row = 16 * v + g + ((t & 1) ? 8 : 0), col = 128 * w + 2 * (t & ~1);
  for (int it = 0; it < iters; ++it) {
    float* at = dst + block_of(share, it, nblocks) * 16384 + row * 256 + col;
#pragma unroll
    for (int j = 0; j < 16; ++j)
      asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(at + 8 * j), "f"(1.f), "f"(1.f), "f"(1.f),
                   "f"(1.f) : "memory");
  }
}
// 16-byte stores of the same bytes, consecutive threads on consecutive 16 bytes
extern "C" __global__ void st_v4(float* dst, int nblocks, int iters, int share) {
  for (int it = 0; it < iters; ++it) {
    float4* at = (float4*)(dst + block_of(share, it, nblocks) * 16384);
#pragma unroll
    for (int j = 0; j < 16; ++j) at[j * 256 + threadIdx.x] = make_float4(1.f, 1.f, 1.f, 1.f);
  }
}
// cp.reduce.async.bulk from a 64 KB shared tile of ones, issued by thread 0 in chunks of `chunk` bytes; before the
// next tile's group it waits until at most inflight - 1 groups still read shared memory (the tile is never
// rewritten, so this only bounds what is in flight, as a kernel reusing its tile would)
extern "C" __global__ void red_bulk(float* dst, int nblocks, int iters, int share, int chunk, int inflight) {
  extern __shared__ __align__(128) float4 tile[];
  for (int i = threadIdx.x; i < 4096; i += blockDim.x) tile[i] = make_float4(1.f, 1.f, 1.f, 1.f);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic stores, then the bulk unit's reads
  __syncthreads();
  if (threadIdx.x != 0) return;
  const u32 s = (u32)__cvta_generic_to_shared(tile);
  for (int it = 0; it < iters; ++it) {
    char* base = (char*)(dst + block_of(share, it, nblocks) * 16384);
    for (int c = 0; c < 65536; c += chunk)
      asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                   ::"l"(base + c), "r"(s + c), "r"(chunk) : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    if (inflight <= 1) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    else asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
  }
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");  // every addition done before the CTA exits
}
"""
OPTIONS = ("-std=c++17", "-arch=sm_90a")
# (kernel, CTAs per SM, (chunk bytes, tiles in flight) for red_bulk)
VARIANTS = (("red_v4", 4, None), ("st_v4", 4, None), ("red_bulk", 3, (16384, 2)), ("red_bulk", 3, (65536, 2)),
            ("red_bulk", 3, (4096, 2)), ("red_bulk", 1, (16384, 1)))


def expected_counts(grid: int, share: int, iters: int = 1):
    """How many CTA-iterations add into each block: what one launch of ``grid`` CTAs leaves in a zeroed buffer."""
    import numpy as np

    ctas = np.arange(grid, dtype=np.int64)
    hits = np.concatenate([(ctas // share * 7919 + it) % BLOCKS for it in range(iters)])
    return np.bincount(hits, minlength=BLOCKS).astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--share", default="1,16,64", help="CTAs adding into the same block at once")
    ap.add_argument("--gbytes", type=float, default=8.0, help="float32 bytes added per timed launch")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per launch (the median)")
    args = ap.parse_args()
    import cupy as cp
    import numpy as np

    from rawflash.cli.bench import time_ms  # CUDA events, median (its L2 flush runs outside the timed region)

    mod = cp.RawModule(code=SOURCE, options=OPTIONS)
    dst = cp.zeros(BLOCKS * BLOCK_FLOATS, dtype=cp.float32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]

    def launcher(name, grid, iters, share, extra):
        fn = mod.get_function(name)
        ints = [np.int32(BLOCKS), np.int32(iters), np.int32(share)]
        if name == "red_bulk":
            fn.max_dynamic_shared_size_bytes = 65536
            ints += [np.int32(extra[0]), np.int32(extra[1])]
            return lambda: fn((grid,), (THREADS,), (dst, *ints), shared_mem=65536)
        return lambda: fn((grid,), (THREADS,), (dst, *ints))

    print(f"{'share':>5} {'kernel':>9} {'CTAs/SM':>7} {'chunk, inflight':>15} {'ms':>8} {'TB/s':>6}")
    for share in (int(x) for x in args.share.split(",")):
        for name, per_sm, extra in VARIANTS:
            grid = sms * per_sm
            # validate: one iteration on zeros, every block holds its count (stores: 1 where written)
            dst.fill(0)
            launcher(name, grid, 1, share, extra)()
            want = expected_counts(grid, share)
            if name == "st_v4":
                want = np.minimum(want, 1)
            got = dst.reshape(BLOCKS, BLOCK_FLOATS)
            if not (bool((got.min(axis=1) == got.max(axis=1)).all()) and np.array_equal(got[:, 0].get(), want)):
                raise SystemExit(f"{name} (share {share}): wrong sums; not timed")
            iters = max(1, int(args.gbytes * 1e9) // (BLOCK_FLOATS * 4 * grid))
            ms = time_ms(launcher(name, grid, iters, share, extra), args.repeats)
            moved = BLOCK_FLOATS * 4 * grid * iters / 1e9
            print(f"{share:>5} {name:>9} {per_sm:>7} {str(extra or '-'):>15} {ms:8.3f} {moved / ms:6.2f}", flush=True)


if __name__ == "__main__":
    main()
