"""Find the CUDA sources, instantiate kernel templates through NVRTC name expressions, and cache the result.

Two paths share one source assembly and one option list, so what CI compiles offline is byte for byte what a
GPU user loads:

* ``get_kernel`` (needs a GPU): ``cupy.RawModule(code=..., name_expressions=[...])``, cached in memory per
  process and on disk by CuPy across processes;
* ``compile_offline`` (no GPU needed): the low-level NVRTC bindings for an explicit target (``sm_80``,
  ``sm_90``, ``sm_90a``) with ``--ptxas-options=-v``, returning registers, spills and shared memory. The reports
  are cached on disk (``report_cache_dir``), keyed by the assembled source's hash, the NVRTC version, the options
  and the instantiation, so a second ``rawflash occupancy --all`` compiles nothing.

A compile that takes more than a second says so on ``progress`` (the command line prints it on stderr).

Local ``#include "x.cuh"`` lines are inlined before compiling: CuPy's disk cache keys on the source string, so
inlining makes the key cover every byte of every file a kernel includes.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from .. import settings

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$", re.M)


def cuda_dir(override: str | None = None) -> Path:
    """The folder holding the ``.cu``/``.cuh`` sources: ``override`` when given (``settings.cuda_dir``, from
    ``RAWFLASH_CUDA_DIR``: to try a kernel change without reinstalling), else inside an installed wheel, else
    ``cuda/`` of a checkout."""
    here = Path(__file__).resolve().parents[1]  # the rawflash package folder (this file is in rawflash/kernels/)
    candidates = [Path(override)] if override else [here / "cuda", here.parent / "cuda"]
    for candidate in candidates:
        if (candidate / "core.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"rawflash CUDA sources not found next to {here} (looked in cuda/ and ../cuda/)")


def assemble(source: str, root: Path | None = None) -> str:
    """Return ``source`` (a file name in the CUDA folder) with its local includes inlined, each file once."""
    root = cuda_dir() if root is None else Path(root)
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = _PRAGMA_ONCE.sub("", (root / name).read_text())
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return f"// rawflash: {source} with local includes inlined\n" + expand(source)


def source_hash(source: str, root: Path | None = None) -> str:
    """SHA-256 of the assembled source: changes whenever any byte of any included file changes."""
    return hashlib.sha256(assemble(source, root).encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def cuda_include_dir() -> str:
    """Directory with ``cuda_fp16.h``: the NVIDIA runtime wheel (via cuda-pathfinder), else CUDA_PATH/CUDA_HOME."""
    try:
        from cuda import pathfinder

        found = pathfinder.find_nvidia_header_directory("cudart")
        if found:
            return str(found)
    except Exception:  # pathfinder missing or too old: fall back to a toolkit install
        pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env) and Path(os.environ[env], "include", "cuda_fp16.h").is_file():
            return str(Path(os.environ[env], "include"))
    if Path("/usr/local/cuda/include/cuda_fp16.h").is_file():
        return "/usr/local/cuda/include"
    raise FileNotFoundError(
        "cuda_fp16.h not found: install rawflash[cuda13] (or [cuda12]) so the CUDA runtime headers wheel is "
        "present, or set CUDA_PATH to a CUDA toolkit"
    )


def base_options() -> tuple[str, ...]:
    """NVRTC options of every kernel, minus the target (CuPy adds -arch for the current device)."""
    return ("-std=c++17", "-ftz=true", "--device-as-default-execution-space", f"-I{cuda_include_dir()}")


# ---------------------------------------------------------------- progress of slow compiles
SLOW_COMPILE_S = 1.0
"""A compile still running after this many seconds is announced on ``progress``, and its end too."""


def _default_progress(message: str) -> None:
    """stderr when it is a terminal or ``RAWFLASH_PROGRESS=1``; nothing when ``RAWFLASH_PROGRESS=0``."""
    setting = settings.load().progress
    if setting == "1" or (setting != "0" and sys.stderr.isatty()):
        print(message, file=sys.stderr, flush=True)


progress: Callable[[str], None] | None = _default_progress
"""Where slow compiles are announced (one line each at start and end); None: nowhere. ``rawflash`` sets it."""


class _SlowNotice:
    """Announce ``what`` on ``progress`` if it is still running after ``SLOW_COMPILE_S``, then how long it took."""

    def __init__(self, what: str):
        self.what, self.fired, self.t0 = what, False, 0.0
        self.timer = threading.Timer(SLOW_COMPILE_S, self._fire)
        self.timer.daemon = True

    def _fire(self) -> None:
        self.fired = True
        if progress:
            progress(f"compiling {self.what} (NVRTC) ...")

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.timer.start()
        return self

    def __exit__(self, *exc):
        self.timer.cancel()
        if self.fired and progress:
            progress(f"compiled {self.what} in {time.perf_counter() - self.t0:.1f} s")
        return False


# ---------------------------------------------------------------- GPU path (CuPy RawModule)
@functools.lru_cache(maxsize=None)
def _module(source: str, name_expression: str, target: str | None, device: int, root: str | None):
    import cupy

    options = base_options() + ((f"-arch={target}",) if target else ())
    with _SlowNotice(f"{name_expression}" + (f" for {target}" if target else "")):
        module = cupy.RawModule(code=assemble(source, cuda_dir(root)), options=options,
                                name_expressions=[name_expression])
        module.get_function(name_expression)  # CuPy compiles here (or loads its disk cache)
    return module


def get_kernel(source: str, name_expression: str, target: str | None = None, root: str | None = None):
    """The ``cupy.RawKernel`` for one template instantiation, compiled at first use and cached. ``target``
    (e.g. ``sm_90a`` for wgmma) replaces the GPU's own architecture, which CuPy passes otherwise; ``root`` is
    another source folder (``settings.cuda_dir``)."""
    import cupy

    device = cupy.cuda.Device().id
    return _module(source, name_expression, target, device, root).get_function(name_expression)


def cache_dir() -> Path:
    """CuPy's on-disk kernel cache, where compiled rawflash kernels persist across processes."""
    return Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))


# ---------------------------------------------------------------- offline path (no GPU)
@dataclasses.dataclass(frozen=True)
class CompileReport:
    """What ptxas said about one instantiation compiled for one target."""

    name_expression: str
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    static_smem: int
    cubin_size: int
    log: str

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(log: str) -> dict:
    """Registers, static shared memory, stack and spills from a ``--ptxas-options=-v`` log."""
    regs = _PTXAS_REGS.findall(log)
    smem = _PTXAS_SMEM.findall(log)
    stack = _PTXAS_STACK.findall(log)
    if not regs:
        raise ValueError(f"no 'Used N registers' line in the ptxas log:\n{log}")
    frame, stores, loads = (int(x) for x in stack[-1]) if stack else (0, 0, 0)
    return dict(registers=int(regs[-1]), static_smem=int(smem[-1]) if smem else 0, stack_bytes=frame,
                spill_stores=stores, spill_loads=loads)


def offline_options(arch: str) -> tuple[str, ...]:
    """NVRTC options of an offline compile for ``arch``."""
    return base_options() + (f"--gpu-architecture={arch}", "--ptxas-options=-v")


def nvrtc_version() -> str:
    from cupy.cuda import nvrtc

    return "{}.{}".format(*nvrtc.getVersion())


def report_cache_dir() -> Path:
    """Where offline compile reports persist: ``settings.cache_dir`` (``$RAWFLASH_CACHE_DIR``), else
    ``$XDG_CACHE_HOME/rawflash``, else ``~/.cache/rawflash``; reports go in its ``compile-reports`` folder, one small
    JSON file each."""
    root = settings.load().cache_dir or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "rawflash")
    return Path(root) / "compile-reports"


def report_cache_enabled() -> bool:
    """False when ``settings.compile_cache`` is off (``RAWFLASH_COMPILE_CACHE=0``)."""
    return settings.load().compile_cache


def report_key(code: str, name_expression: str, options: tuple[str, ...], version: str) -> str:
    """The cache key of one offline report: SHA-256 over the assembled source's hash, the NVRTC version, the
    options (target included) and the instantiation."""
    parts = [hashlib.sha256(code.encode()).hexdigest(), version, list(options), name_expression]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def _load_report(path: Path) -> CompileReport | None:
    try:
        return CompileReport(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):  # absent, unreadable or from another layout: compile again
        return None


def _store_report(path: Path, report: CompileReport) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(report)))
        os.replace(tmp, path)  # atomic: parallel compiles of the same key never leave half a file
    except OSError:  # a read-only home is no reason to fail a compile
        pass


def compile_offline(source: str, name_expression: str, arch: str = "sm_90", root: str | None = None, *,
                    cache: bool = True) -> CompileReport:
    """Compile one instantiation with NVRTC for ``arch`` without a GPU and return ptxas's resource report.

    With ``cache`` (and unless ``RAWFLASH_COMPILE_CACHE=0``) a report compiled before for the same assembled
    source, NVRTC version, options and instantiation is read from ``report_cache_dir`` instead.
    """
    code = assemble(source, cuda_dir(root))
    options = offline_options(arch)
    path = None
    if cache and report_cache_enabled():
        path = report_cache_dir() / f"{report_key(code, name_expression, options, nvrtc_version())}.json"
        hit = _load_report(path)
        if hit is not None and hit.name_expression == name_expression and hit.arch == arch:
            return hit
    with _SlowNotice(f"{name_expression} for {arch}"):
        report = _compile_offline(code, source, name_expression, arch, options)
    if path is not None:
        _store_report(path, report)
    return report


def compile_offline_many(items, workers: int) -> dict:
    """:func:`compile_offline` of many instantiations side by side: ``items`` of (source, name_expression, arch),
    ``workers`` processes; ``{(name_expression, arch): CompileReport, or the exception it raised}``. The workers
    start from a fork server, not by forking the caller: a caller that has imported JAX (a test run) holds threads,
    and a fork copies their locks mid-use."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("forkserver")) as pool:
        return dict(pool.map(_offline_or_error, items, chunksize=4))


def _offline_or_error(item):
    source, expr, arch = item
    try:
        return (expr, arch), compile_offline(source, expr, arch)
    except Exception as err:  # reported per instantiation by the caller
        return (expr, arch), err


def _compile_offline(code: str, source: str, name_expression: str, arch: str, options: tuple[str, ...]):
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(code, source, [], [])
    try:
        nvrtc.addNameExpression(prog, name_expression)
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError as err:
            raise RuntimeError(f"NVRTC failed on {name_expression} for {arch}:\n{nvrtc.getProgramLog(prog)}") from err
        log = nvrtc.getProgramLog(prog)
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return CompileReport(name_expression=name_expression, arch=arch, cubin_size=len(cubin), log=log,
                         **parse_ptxas(log))


def report_cache_summary() -> dict:
    """Where offline compile reports are cached, whether caching is on, and how many there are."""
    path = report_cache_dir()
    files = list(path.glob("*.json")) if path.is_dir() else []
    return {"path": str(path), "enabled": report_cache_enabled(), "reports": len(files),
            "bytes": sum(f.stat().st_size for f in files)}
