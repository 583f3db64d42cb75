"""fa2_fwd twin: FlashAttention-2 forward (Dao 2023, Algorithm 1), mirroring ``cuda/fa2_fwd.cu``.

The fwd.py skeleton with the split-Q mainloop (mainloop_fwd_sm80.py), or with SPLIT_Q off FA1's split-K partition
(splitk.py). Grid (Tr, heads, batch): one CTA per query block Q_i ("sequence parallelism"); SEQ_PARALLEL = False
walks all query blocks in one CTA per (batch, head); DEFER_NORM = False rescales O by 1/l after every key block.
MASK / GENERAL select the variant policy (policy.py). Scores are kept in log2 units, so every exponential is one
exp2.
"""
from __future__ import annotations

import functools

from .common import Twin
from .fwd import make_fwd_kernel
from .mainloop_fwd_sm80 import make_mainloop_fwd_sm80
from .splitk import make_mainloop_fwd_splitk


@functools.lru_cache(maxsize=None)
def make_fa2_fwd(T: str, D: int, BR: int, BC: int, NWARPS: int, MIN_BLOCKS: int, KUNROLL: int, MASK: int,
                 GENERAL: bool, DEFER_NORM: bool, SEQ_PARALLEL: bool, SPLIT_Q: bool, OPAQUE_TILE: bool,
                 SMEM_BYTES: int, WC: int = 1) -> Twin:
    """The twin of ``fa2_fwd<...>``, taking the CUDA template's arguments in order (``Launch.template_args``).

    MIN_BLOCKS (``__launch_bounds__``), OPAQUE_TILE (a register switch: the same results) and WC (warps that share
    rows and split O's columns, head_dim 512: a twin thread holds its row's whole O) have no counterpart;
    SMEM_BYTES is the CUDA C's size (16-bit tiles where T is), the twin's own (float32 tiles) is the returned
    ``Twin.smem``.

    Returns
    -------
    Twin
        The kernel (``fwd.make_fwd_kernel``'s arguments), its threads per CTA and its shared memory in bytes; launch
        it with the Launch's grid.
    """
    if SPLIT_Q:
        ml = make_mainloop_fwd_sm80(T, D, BR, BC, NWARPS, KUNROLL, DEFER_NORM, MASK, GENERAL)
    else:
        ml = make_mainloop_fwd_splitk(T, D, BR, BC, NWARPS, DEFER_NORM, MASK, GENERAL)
    kernel = make_fwd_kernel("fa2_fwd", ml, not SEQ_PARALLEL, GENERAL)
    return Twin(kernel, ml.NTHREADS, ml.SMEM_BYTES)
