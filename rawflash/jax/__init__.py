"""rawflash under JAX: Python functions as XLA FFI targets (:mod:`rawflash.jax.ffi`)."""
