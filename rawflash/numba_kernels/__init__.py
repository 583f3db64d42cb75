"""Numba CUDA twins of the CUDA C kernels in ``cuda/``: one module per CUDA file, same stems, same section anchors.

``fwd``, ``bwd`` (the skeletons), ``mainloop_fwd_sm80``, ``splitk``, ``mainloop_bwd_sm80``, ``mainloop_decode``
(the mainloops) and ``fa2_fwd``, ``fa2_bwd``, ``fa1_fwd``, ``decode`` (the kernels) mirror the files with section
anchors section by section;
``params``, ``block_info``, ``policy``, ``softmax``, ``scheduler``, ``epilogue`` and ``common`` mirror the headers
without anchors. Each kernel of the registry with a twin has a factory ``make_<kernel>(*template_args)`` taking the
CUDA template's arguments in order (``Launch.template_args``) and returning a ``common.Twin``: the compiled
``numba.cuda.jit`` kernel, its threads per CTA and its shared memory.

The twins favour clarity over speed: every thread owns whole rows and does scalar float32 arithmetic; each
``# MIRROR:`` comment says where and why a twin differs from the CUDA C. They also run on the CPU under
``NUMBA_ENABLE_CUDASIM=1`` (read once when numba is imported).
"""
from . import _shim  # first: numba-cuda needs numpy.row_stack, which numpy 2.5 removed

_shim.apply()

from .common import Twin  # noqa: E402
from .decode import make_decode_append, make_decode_combine, make_decode_combine_warp, make_decode_split  # noqa: E402
from .fa1_fwd import make_fa1_finalize, make_fa1_fwd  # noqa: E402
from .fa2_bwd import make_fa2_bwd, make_fa2_bwd_convert_dq, make_fa2_bwd_dq, make_fa2_bwd_preprocess  # noqa: E402
from .fa2_fwd import make_fa2_fwd  # noqa: E402

__all__ = ["Twin", "make_fa1_fwd", "make_fa1_finalize", "make_fa2_fwd", "make_fa2_bwd", "make_fa2_bwd_dq",
           "make_fa2_bwd_preprocess", "make_fa2_bwd_convert_dq", "make_decode_append", "make_decode_split",
           "make_decode_combine", "make_decode_combine_warp"]
