"""rawflash: FlashAttention for people who do not use PyTorch.

Exact attention, forward and backward, as raw CUDA C kernels compiled by CuPy at first use, with Numba twins,
a float64 NumPy reference and a command line that shows what every launch does.
"""
from . import combine, distributed, reference
from .api import attention, backward, clear_cache, decode, forward, plan_decode, plan_forward, vjp

__version__ = "0.1.0"
__all__ = ["forward", "backward", "attention", "vjp", "decode", "plan_forward", "plan_decode", "clear_cache",
           "reference", "combine", "distributed", "__version__"]
