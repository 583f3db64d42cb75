"""The ``rawflash`` command line and the inspection and benchmark tools it drives.

The commands are in ``commands`` (``rawflash.cli:main``, the console script, is its click group). The tools
read the library (``rawflash``, ``rawflash.kernels``); the library never imports them. Module by module:

- ``commands``: the click commands (``info``, ``list``, ``launch-config``, ``occupancy``, ``io``, ``explain``,
  ``check``, ``ablate``, ``demo``, ``bench``) and their shared options.
- ``introspect``: what a call would do without running it (launches, registers, occupancy, tiles, bytes).
- ``iomodel``: exact HBM byte and FLOP counts of every kernel; ``occupancy``: blocks per SM without a GPU.
- ``sysinfo``: GPUs, CUDA and library versions, caches; ``accuracy``: grading against the float64 reference.
- ``bench``, ``bench_decode``: validated, then timed, beside the peers; ``bench_host``: a call's host time beside
  its kernels'; ``bench_jax``: ``rawflash.jax`` inside ``jax.jit`` beside JAX's own attention (a child process);
  ``ablation``: FA2's ideas one at a time and the ladder to FA3; ``ncu``: measured DRAM bytes through Nsight
  Compute.
- ``demo``, ``demo_sim``: ``rawflash demo`` (the twins on Numba's simulator without a GPU); ``report``: text
  rendering of the reports.
"""
from __future__ import annotations


def __getattr__(name: str):
    # ``main`` is loaded on first use, so that importing one tool (``rawflash.cli.iomodel``, or the children run as
    # ``python -m rawflash.cli.ncu``) does not import click and every command.
    if name == "main":
        from .commands import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
