"""Numba CUDA twins of the CUDA C kernels in ``cuda/``: same names, same section anchors, same loop nests.

Each module mirrors one ``.cu`` file (``common`` and ``splitk`` mirror the ``.cuh`` headers) and has a factory
named after its template, ``make_<kernel>(tile sizes, flags)``, that returns a compiled ``numba.cuda.jit``
kernel. The twins favour clarity over speed: every thread owns whole rows and does scalar float32 arithmetic;
each ``# MIRROR:`` comment says where and why a twin differs from the CUDA C. They also run on the CPU under
``NUMBA_ENABLE_CUDASIM=1`` (read once when numba is imported).
"""
from . import _shim  # first: numba-cuda needs numpy.row_stack, which numpy 2.5 removed

_shim.apply()

from .fa1_fwd import fa1_finalize, make_fa1_fwd  # noqa: E402
from .fa2_bwd import fa2_bwd_convert_dq, fa2_bwd_preprocess, make_fa2_bwd, make_fa2_bwd_dq  # noqa: E402
from .fa2_fwd import make_fa2_fwd  # noqa: E402

__all__ = ["make_fa1_fwd", "fa1_finalize", "make_fa2_fwd", "make_fa2_bwd", "make_fa2_bwd_dq", "fa2_bwd_preprocess",
           "fa2_bwd_convert_dq"]
