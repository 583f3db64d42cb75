"""rawflash under JAX: ``attention`` and ``decode`` on JAX arrays, inside ``jax.jit`` too (:mod:`rawflash.jax.ops`),
as XLA custom calls (:mod:`rawflash.jax.targets`) whose handlers are Python functions (:mod:`rawflash.jax.ffi`).
JAX is imported when a function is first called, never by ``import rawflash``."""
from .ops import attention, decode

__all__ = ["attention", "decode"]
