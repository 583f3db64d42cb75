"""Compatibility shim applied before ``numba.cuda`` is imported.

numba-cuda 0.30.x registers an overload for ``numpy.row_stack`` when its array implementations are imported
(``numba_cuda/numba/cuda/np/arrayobj.py``: ``overload(np.row_stack)(impl_np_vstack)``), which happens at the
first CUDA kernel compile. numpy 2.5 removed ``row_stack`` (deprecated since 2.0 as an alias of ``vstack``), so
with numpy >= 2.5 that import fails with ``AttributeError: module 'numpy' has no attribute 'row_stack'`` and no
Numba CUDA kernel compiles at all. Restoring the alias is exactly what numpy < 2.5 had, so the overload
registered for it is ``vstack``'s, as before.

On numpy < 2.5 ``row_stack`` exists and :func:`apply` does nothing. ``rawflash.numba_kernels`` calls it before
anything imports ``numba.cuda``.
"""
from __future__ import annotations

import numpy


def apply() -> None:
    """Make ``numpy.row_stack`` an alias of ``numpy.vstack`` when numpy lacks it (numpy >= 2.5); else a no-op."""
    if not hasattr(numpy, "row_stack"):
        numpy.row_stack = numpy.vstack
