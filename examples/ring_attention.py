"""Ring attention over N GPUs, checked against attention of the whole sequence on one GPU.

    python -m rawflash.distributed.run --gpus 8 examples/ring_attention.py --seqlen 65536

Every rank draws the same full q, k, v (one seed), keeps its zigzag shard, runs the ring forward and backward,
and compares its shard of the results with single-GPU rawflash on the whole sequence (computed on each rank:
keep --seqlen small enough for one GPU to hold it).
"""
from __future__ import annotations

import argparse

import cupy
import ml_dtypes
import numpy as np

import rawflash
from rawflash.distributed import NcclComm, ring_attention, ring_attention_backward, shard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag")
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    args = parser.parse_args()

    with NcclComm.from_env() as comm:                     # rank, world size, device and NCCL id from the launcher
        rng = cupy.random.default_rng(0)                  # the same full inputs on every rank
        bf16 = np.dtype(ml_dtypes.bfloat16)
        q = rng.standard_normal((1, args.seqlen, args.heads, args.head_dim), dtype=cupy.float32).astype(bf16)
        k, v = (rng.standard_normal((1, args.seqlen, args.kv_heads, args.head_dim), dtype=cupy.float32).astype(bf16)
                for _ in range(2))
        dout = rng.standard_normal(q.shape, dtype=cupy.float32).astype(bf16)

        def mine(x, axis=1):
            return shard(x, comm.rank, comm.world_size, layout=args.layout, axis=axis)

        qs, ks, vs, douts = mine(q), mine(k), mine(v), mine(dout)
        out, lse = ring_attention(qs, ks, vs, comm, causal=args.causal, layout=args.layout)
        dq, dk, dv = ring_attention_backward(douts, qs, ks, vs, out, lse, comm, causal=args.causal,
                                             layout=args.layout)

        full_out, full_lse = rawflash.forward(q, k, v, causal=args.causal)
        full_grads = rawflash.backward(dout, q, k, v, full_out, full_lse, causal=args.causal)
        diffs = {name: float(cupy.abs(got.astype(cupy.float32) - mine(want, axis).astype(cupy.float32)).max())
                 for name, got, want, axis in (("out", out, full_out, 1), ("lse", lse, full_lse, 2),
                                               ("dq", dq, full_grads[0], 1), ("dk", dk, full_grads[1], 1),
                                               ("dv", dv, full_grads[2], 1))}
        print(f"rank {comm.rank}/{comm.world_size}: max |ring - single GPU| "
              + ", ".join(f"{name} {d:.2e}" for name, d in diffs.items()), flush=True)


if __name__ == "__main__":
    main()
