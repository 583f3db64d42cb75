"""The kernels' dispatch: everything between a validated call and a kernel launch.

``rawflash.api`` validates a call (``rawflash.validation``), then hands it to a backend here; nothing in this
folder imports the command line or its tools (``rawflash.cli``). Module by module:

- ``registry``: the variants and their forms (source file, tile rows, launch function, twin, what each supports);
  every list of names elsewhere is read from it.
- ``forms``: which form of a variant runs a call (arch, dtype, head_dim, switches) and its plan of launches.
- ``configs``: the tile table (``TABLE``: Br, Bc, warps, stages per kernel, head_dim, dtype, arch) and why.
- ``launch``: the launch formulas (grids, blocks, shared memory, template arguments), one function per form.
- ``params``: the parameter structs of ``cuda/params.cuh`` as NumPy structured scalars, one builder per direction.
- ``tma``: Hopper's TMA tensor maps, encoded on the host through the CUDA driver.
- ``compile``: finds ``cuda/``, instantiates templates through NVRTC, caches kernels and compile reports.
- ``cupy_backend``: the CUDA C backend (CuPy arrays, buffers, binding, launch) and the planned calls of each
  direction (``ForwardCall``, ``BackwardCall``, ``DecodeCall``).
- ``plans``: a call's launches prepacked once per signature (``CallPlan``) and the cache that keeps them.
- ``numba_backend``: the Numba backend, running the twins of ``rawflash.numba_kernels`` for the same plan.
"""
