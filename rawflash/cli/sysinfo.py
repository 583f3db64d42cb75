"""What this machine offers rawflash: GPUs, CUDA versions, library versions, the kernel and compile-report caches.

Nothing here needs a GPU: every probe that can fail without one reports ``None`` and why.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import shutil
from pathlib import Path

from ..kernels import compile

H200_SMS = 132
"""SMs of the H200 test machine: the default for wave counts where no GPU is visible."""

PACKAGES = ("numpy", "ml-dtypes", "click", "numba", "numba-cuda", "matplotlib", "torch")


@dataclasses.dataclass(frozen=True)
class GpuInfo:
    """One visible CUDA device."""

    index: int
    name: str
    capability: tuple[int, int]
    sms: int
    memory_bytes: int

    @property
    def arch(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    """``cupy.cuda.is_available()``, False when CuPy is missing or broken."""
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:
        return False


def gpus() -> list[GpuInfo]:
    """Every visible device (empty without a GPU)."""
    if not gpu_available():
        return []
    from cupy.cuda import runtime

    out = []
    for i in range(runtime.getDeviceCount()):
        prop = runtime.getDeviceProperties(i)
        name = prop["name"].decode() if isinstance(prop["name"], bytes) else str(prop["name"])
        out.append(GpuInfo(i, name, (prop["major"], prop["minor"]), prop["multiProcessorCount"],
                           prop["totalGlobalMem"]))
    return out


def current_gpu() -> GpuInfo | None:
    """CuPy's current device, or None without a GPU."""
    if not gpu_available():
        return None
    import cupy

    return gpus()[cupy.cuda.Device().id]


def _cuda_version(code: int) -> str:
    return f"{code // 1000}.{code % 1000 // 10}" if code else "none"


def cuda_versions() -> dict:
    """CUDA driver, CuPy's runtime and NVRTC versions; a probe that fails says why instead."""
    out = {}
    try:
        from cupy.cuda import runtime

        out["driver"] = _cuda_version(runtime.driverGetVersion())
        out["runtime (CuPy)"] = _cuda_version(runtime.runtimeGetVersion())
    except Exception as err:
        out["driver"] = f"unavailable ({type(err).__name__}: {err})"
    try:
        from cupy.cuda import nvrtc

        out["nvrtc"] = "{}.{}".format(*nvrtc.getVersion())
    except Exception as err:
        out["nvrtc"] = f"unavailable ({type(err).__name__}: {err})"
    return out


def package_versions() -> dict:
    """Versions of CuPy and the packages rawflash uses or compares against, without importing them."""
    from .. import __version__

    out = {"rawflash": __version__}
    try:
        import cupy

        out["cupy"] = cupy.__version__
    except Exception as err:
        out["cupy"] = f"not importable ({type(err).__name__})"
    out.update({name: _version(name) for name in PACKAGES})
    return out


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cache_summary() -> dict:
    """Where compiled kernels persist (CuPy's disk cache, used on a GPU) and how much is there."""
    path = compile.cache_dir()
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else []
    return {"path": str(path), "exists": path.is_dir(), "files": len(files),
            "bytes": sum(p.stat().st_size for p in files)}


def tools() -> dict:
    """Command-line tools rawflash can use when they are on PATH."""
    return {name: shutil.which(name) or "not on PATH" for name in ("ncu", "nvcc", "compute-sanitizer")}


def sources() -> dict:
    """Where the CUDA sources and the CUDA headers NVRTC compiles against were found."""
    out = {}
    for key, probe in (("cuda sources", compile.cuda_dir), ("cuda headers", compile.cuda_include_dir)):
        try:
            out[key] = str(probe())
        except Exception as err:
            out[key] = f"not found ({err})"
    return out


def child_env(**extra: str) -> dict:
    """This process's environment for a ``python -m rawflash.<module>`` child, with this rawflash importable."""
    root = str(Path(__file__).resolve().parents[2])  # the folder holding the rawflash package
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=root + (os.pathsep + path if path else ""), **extra)


def summary() -> dict:
    """Everything ``rawflash info`` prints."""
    devices = [dict(index=g.index, name=g.name, cc=f"{g.capability[0]}.{g.capability[1]}", sms=g.sms,
                    memory_gib=round(g.memory_bytes / 2**30, 1)) for g in gpus()]
    return {"gpus": devices or "none visible (cupy.cuda.is_available() is False): GPU commands are unavailable; "
                               "offline compiles, models, the reference and the Numba simulator still work",
            "cuda": cuda_versions(), "packages": package_versions(), "kernel cache": cache_summary(),
            "compile report cache": compile.report_cache_summary(), "paths": sources(), "tools": tools()}
