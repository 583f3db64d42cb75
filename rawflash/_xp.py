"""The array module (NumPy or CuPy) an array belongs to, without importing CuPy for NumPy arrays."""
from __future__ import annotations

from typing import Any

import numpy as np

Array = Any
"""A NumPy or CuPy array (for type hints; CuPy is optional)."""


def array_module(x):
    """``numpy`` for NumPy arrays (CuPy is not imported then), else ``cupy.get_array_module(x)``."""
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy.get_array_module(x)
