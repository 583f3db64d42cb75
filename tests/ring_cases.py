"""Ring attention on GPUs checked by flash-attn's rule against the float64 reference of the whole sequence.

Used by the GPU tests in test_distributed.py (every rank in one process, :class:`LocalRing`), and run as a
script over NCCL by the multi-GPU tests::

    python -m rawflash.distributed.run --gpus 4 tests/ring_cases.py

Each rank draws the same full inputs, runs the ring on its shard (backend 'cupy') and checks its shard of out,
lse, dq, dk, dv against the same shard of the reference; the script exits 1 if any check fails.
"""
from __future__ import annotations

import itertools
import sys

import numpy as np

from rawflash import reference
from rawflash.distributed import ring_attention, ring_attention_backward, shard
from conftest import random_qkv

CASES = list(itertools.product(("bfloat16", "float16"), (True, False), ("zigzag", "contiguous")))
TOKENS_PER_RANK, HEADS, KV_HEADS, HEAD_DIM = 96, 4, 2, 64     # GQA; several key tiles per shard


def check_rank(comm, dtype: str, causal: bool, layout: str) -> list[str]:
    """This rank's failures (empty when every output passes) for one case."""
    import cupy

    n = TOKENS_PER_RANK * comm.world_size
    q, k, v = random_qkv(1, n, n, HEADS, KV_HEADS, HEAD_DIM, dtype, seed=comm.world_size)
    dout = np.random.default_rng(7).standard_normal(q.shape).astype(q.dtype)

    def mine(x, axis=1):
        return shard(x, comm.rank, comm.world_size, layout=layout, axis=axis)

    qs, ks, vs, douts = (cupy.asarray(mine(x)) for x in (q, k, v, dout))
    out, lse = ring_attention(qs, ks, vs, comm, causal=causal, layout=layout)
    grads = ring_attention_backward(douts, qs, ks, vs, out, lse, comm, causal=causal, layout=layout)
    refs = reference.forward(q, k, v, causal=causal) + reference.backward(dout, q, k, v, causal=causal)
    bases = (reference.forward(q, k, v, causal=causal, upcast=False)
             + reference.backward(dout, q, k, v, causal=causal, upcast=False))
    failures = []
    for name, got, ref, base, axis, factor in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), refs, bases,
                                                  (1, 2, 1, 1, 1), (2, 2, 3, 3, 3)):
        ok, err, base_err, bound = reference.error_ratio_ok(cupy.asnumpy(got), mine(ref, axis), mine(base, axis),
                                                            q.dtype, factor)
        if not ok:
            failures.append(f"rank {comm.rank}/{comm.world_size} {dtype} causal={causal} {layout} {name}: "
                            f"error {err:.3g} > bound {bound:.3g} (naive {base_err:.3g})")
    return failures


def main() -> int:
    from rawflash.distributed import NcclComm

    with NcclComm.from_env() as comm:
        failures = [f for case in CASES for f in check_rank(comm, *case)]
    for line in failures:
        print(line, flush=True)
    print(f"rank {comm.rank}: {len(CASES)} cases, {len(failures)} failures", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
