"""Context parallelism: exact attention over one sequence sharded across GPUs (ring attention) on NCCL.

- :func:`ring_attention`, :func:`ring_attention_backward`: this rank's (out, lse) and (dq, dk, dv).
- :func:`shard`, :func:`gather`, :func:`shard_positions`: the ``zigzag`` / ``contiguous`` layouts.
- :class:`NcclComm` (one process per GPU, started by ``python -m rawflash.distributed.run --gpus N script.py``),
  :class:`LocalRing` (every rank in one process, for tests), :class:`ComputeOnly` (timing without transfers).

Importing this package imports neither CuPy nor NCCL; they are loaded when an NCCL communicator is made.
"""
from .comm import ComputeOnly, LocalRing, NcclComm
from .ring import Block, ring_attention, ring_attention_backward, schedule
from .sharding import LAYOUTS, gather, shard, shard_positions

__all__ = ["ring_attention", "ring_attention_backward", "schedule", "Block", "shard", "gather", "shard_positions",
           "LAYOUTS", "NcclComm", "LocalRing", "ComputeOnly"]
