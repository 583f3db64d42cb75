"""The environment settings of rawflash, read in one place.

Every ``RAWFLASH_*`` variable is read here, into a frozen :class:`Settings`, at the API boundary (each public call
reads them once and hands the object down); no other module reads or writes them.

========================  ===========================================================================
``RAWFLASH_WGMMA=0``      never run Hopper's warpgroup (wgmma) forms: the mma.sync kernels everywhere
``RAWFLASH_FA3=0``        on Hopper, run the wgmma form without warp specialisation (fa2_fwd_sm90) by default
``RAWFLASH_TILE_ARCH``    take another architecture's tile rows (``sm_80``) on the GPU at hand
``RAWFLASH_TILE_GPU``     take another Hopper GPU's rows and gates (``h100``, ``h200``) on the GPU at hand
``RAWFLASH_DV_FORM``      which of FA3's DV forms MLA's narrower v runs where they have a row: ``1`` (default: the
                          forward and the backward), ``fwd`` (the forward; the backward runs v zero-padded), ``0``
                          (neither: v zero-padded everywhere)
``RAWFLASH_CUDA_DIR``     read the CUDA sources from this folder instead of the installed ones
``RAWFLASH_DEBUG=1``      the command line shows tracebacks instead of one-line errors
``RAWFLASH_PROGRESS``     ``1``: always announce slow compiles on stderr, ``0``: never (default: on a tty)
``RAWFLASH_CACHE_DIR``    where offline compile reports are cached (default ``~/.cache/rawflash``)
``RAWFLASH_COMPILE_CACHE``  ``0``: compile offline every time instead of reading cached reports
========================  ===========================================================================
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping


# The kernels whose DV form (MLA's v read at its own head_dim) runs, by RAWFLASH_DV_FORM's value.
DV_FORWARD = ("fa3_fwd_sm90",)
DV_BOTH = ("fa3_fwd_sm90", "fa3_bwd_sm90")
DV_FORMS = {"0": (), "fwd": DV_FORWARD, "1": DV_BOTH}


def _dv_form(env: Mapping[str, str]) -> tuple[str, ...]:
    """RAWFLASH_DV_FORM's kernels (ValueError naming the variable for a value it does not take)."""
    value = env.get("RAWFLASH_DV_FORM", "1")
    if value not in DV_FORMS:
        raise ValueError(f"RAWFLASH_DV_FORM must be one of {', '.join(DV_FORMS)}; got {value!r}")
    return DV_FORMS[value]


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the environment asks of rawflash (defaults: everything on, nothing overridden)."""

    wgmma: bool = True
    warp_specialize: bool = True
    tile_arch: str | None = None
    tile_gpu: str | None = None
    dv_form: tuple[str, ...] = DV_BOTH
    cuda_dir: str | None = None
    debug: bool = False
    progress: str = ""
    cache_dir: str | None = None
    compile_cache: bool = True


def load(environ: Mapping[str, str] | None = None) -> Settings:
    """The settings the environment (``os.environ`` by default) asks for."""
    env = os.environ if environ is None else environ
    return Settings(wgmma=env.get("RAWFLASH_WGMMA", "1") != "0", warp_specialize=env.get("RAWFLASH_FA3", "1") != "0",
                    tile_arch=env.get("RAWFLASH_TILE_ARCH") or None, tile_gpu=env.get("RAWFLASH_TILE_GPU") or None,
                    dv_form=_dv_form(env),
                    cuda_dir=env.get("RAWFLASH_CUDA_DIR") or None, debug=bool(env.get("RAWFLASH_DEBUG")),
                    progress=env.get("RAWFLASH_PROGRESS", ""), cache_dir=env.get("RAWFLASH_CACHE_DIR") or None,
                    compile_cache=env.get("RAWFLASH_COMPILE_CACHE", "1") != "0")
