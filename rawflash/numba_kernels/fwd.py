"""The forward skeleton of the twins: tile scheduler x mainloop x epilogue, mirroring ``cuda/fwd.cuh``.

Every forward form of FA2 is this one body with a different mainloop (mainloop_fwd_sm80.py: split-Q; splitk.py:
FA1's split-K partition); the variant policy rides in the mainloop's constants, BlockInfo locates the sequence.
"""
from __future__ import annotations

from numba import cuda, float32

from .block_info import block_info
from .common import Mainloop
from .params import FwdArrays
from .policy import make_policy
from .scheduler import q_tile_start


def make_fwd_kernel(name: str, ml: Mainloop, serial: bool, varlen: bool):
    """fwd_kernel<Mainloop, QTileScheduler<BR, SERIAL, VARLEN>> as the kernel ``name`` (the CUDA C's __global__).

    The kernel takes ``(p, q, k, v, o, lse, cu_q, cu_k, used_k, slopes, sinks, o_ws, m_ws, l_ws)``: the FwdParams
    namedtuple and the arrays of params.py's FwdArrays.
    """
    BR, STATE, MASK, GENERAL, EXACT, run, store = (ml.BR, ml.STATE_WORDS, ml.MASK, ml.GENERAL, ml.EXACT, ml.run,
                                                    ml.store)

    def fwd_kernel(p, q, k, v, o, lse, cu_q, cu_k, used_k, slopes, sinks, o_ws, m_ws, l_ws):
        g = FwdArrays(q, k, v, o, lse, cu_q, cu_k, used_k, slopes, sinks, o_ws, m_ws, l_ws)
        # MIRROR: one dynamic float32 array carved like the CUDA C's extern __shared__ smem: static shared arrays
        # stop at 48 KB and the tiles need up to 227 KB.
        smem = cuda.shared.array(0, float32)
        st = cuda.local.array(STATE, float32)  # Mainloop::State, allocated once for every tile of the CTA
        # ---- [fwd:schedule] this CTA's query tiles: one (sequence parallelism), or all of a (b, h) in turn ----
        ok, b, h, i, stop = q_tile_start(p, g, BR, serial, varlen)
        if not ok:
            return
        while True:  # do { ... } while (tiles.advance())
            # ---- [fwd:setup] the sequence, head and kv head of the tile; its variant policy ----
            bi = block_info(GENERAL, p, g, b, h)
            q0 = i * BR
            # MIRROR: an if around the tile where the CUDA C's do-while continues to its advance().
            if q0 < bi.seqlen_q:
                pol = make_policy(MASK, GENERAL, EXACT, p, g, bi)
                # ---- [fwd:mainloop] Alg.1 l.4-11 over the key blocks the policy leaves visible ----
                run(p, g, bi, pol, q0, smem, st)
                # ---- [fwd:epilogue] Alg.1 l.12-13: O_i and L_i ----
                store(p, g, bi, pol, q0, smem, st)
            i += 1
            if i >= stop:
                break

    fwd_kernel.__name__ = fwd_kernel.__qualname__ = name
    return cuda.jit(fwd_kernel)
