"""How many blocks of a kernel fit on one SM, computed without a GPU.

A pure-Python port of the rules in NVIDIA's header-only calculator
``cuda_occupancy.h`` (``cudaOccMaxActiveBlocksPerMultiprocessor``) for the
architectures rawflash targets: sm_80 (A100), sm_86 (RTX 30), sm_89 (RTX 40,
L4, L40) and sm_90 (H100, H200). ``tests/test_occupancy.py`` compiles the header
with g++ and checks that both agree on a grid of launches.

A block is resident on an SM only if four resources all have room for it; the
number of resident blocks is the smallest of four per-resource limits:

- warps: the SM holds ``max_threads_per_sm / 32`` warps;
- registers: each sub-partition (4 per SM) holds a quarter of the register
  file, and a warp's registers come from a single sub-partition;
- shared memory: each block takes its static + dynamic bytes plus 1 KB that
  the driver reserves, rounded up to 128 B;
- blocks: a fixed number of block slots per SM.

Shared-memory carveout: the L1 / shared-memory split is configurable per
kernel. A kernel that sets no preference (``cudaFuncAttributePreferred
SharedMemoryCarveout`` left at its default, as rawflash does) gets the
occupancy of the *largest* shared-memory configuration: the header assumes
``sharedMemPerMultiprocessor`` in that case, which is what the runtime's
``cudaOccupancyMaxActiveBlocksPerMultiprocessor`` reports, and at launch the
driver picks a carveout large enough not to lower that occupancy. This module
always uses that default; there is no carveout argument.

Blocks above 48 KB of shared memory must opt in at run time (raise
``cudaFuncAttributeMaxDynamicSharedMemorySize``, CuPy's
``max_dynamic_shared_size_bytes``); the calculator assumes they did, up to
the architecture's opt-in limit.

Examples
--------
>>> occupancy("sm_90", threads_per_block=128, regs_per_thread=255,
...           smem_per_block=96 * 1024).blocks_per_sm
2
"""
from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass

__all__ = ["ARCHS", "ArchLimits", "Occupancy", "arch_from_capability", "occupancy"]

LIMITERS = ("warps", "registers", "shared memory", "blocks")
"""Resource names, in the order used to break ties for ``Occupancy.limiter``."""


@dataclass(frozen=True)
class ArchLimits:
    """Per-SM resources of one compute capability (values from the CUDA docs and ``cuda_occupancy.h``).

    Attributes
    ----------
    name : str
        Target name, e.g. ``'sm_90'``.
    capability : tuple of int
        ``(major, minor)`` compute capability.
    max_threads_per_sm, max_blocks_per_sm : int
        Resident threads and blocks one SM can hold.
    smem_per_sm : int
        Shared memory of one SM in its largest configuration, bytes.
    smem_per_block_optin : int
        Largest static + dynamic shared memory of one block, bytes, after opting in.
    regs_per_sm : int
        32-bit registers of one SM (also the per-block maximum on these architectures).
    max_regs_per_thread, reg_alloc_unit : int
        ptxas' per-thread ceiling, and the granularity (registers per warp) of allocation.
    smem_alloc_unit, smem_reserved_per_block : int
        Granularity of shared-memory allocation and the bytes the driver reserves per block.
    warp_size, max_threads_per_block, sub_partitions : int
        Threads per warp, threads per block, and register-file sub-partitions per SM.
    """

    name: str
    capability: tuple[int, int]
    max_threads_per_sm: int
    max_blocks_per_sm: int
    smem_per_sm: int
    smem_per_block_optin: int
    regs_per_sm: int = 65536
    max_regs_per_thread: int = 255
    reg_alloc_unit: int = 256
    smem_alloc_unit: int = 128
    smem_reserved_per_block: int = 1024
    warp_size: int = 32
    max_threads_per_block: int = 1024
    sub_partitions: int = 4

    @property
    def max_warps_per_sm(self) -> int:
        """Resident warps one SM can hold."""
        return self.max_threads_per_sm // self.warp_size


ARCHS: dict[str, ArchLimits] = {
    arch.name: arch
    for arch in (
        ArchLimits("sm_80", (8, 0), 2048, 32, 167936, 166912),
        ArchLimits("sm_86", (8, 6), 1536, 16, 102400, 101376),
        ArchLimits("sm_89", (8, 9), 1536, 24, 102400, 101376),
        ArchLimits("sm_90", (9, 0), 2048, 32, 233472, 232448),
    )
}


@dataclass(frozen=True)
class Occupancy:
    """Resident blocks of one launch on one SM, and which resource bounds them.

    Attributes
    ----------
    blocks_per_sm, warps_per_sm, threads_per_sm : int
        Resident blocks, their warps and their threads (``blocks * threads_per_block``).
        ``blocks_per_sm == 0`` means the launch cannot run (too many registers).
    occupancy : float
        Resident warps / the SM's maximum warps, in 0..1.
    limiter : str
        The resource whose limit equals ``blocks_per_sm``: 'warps', 'registers',
        'shared memory' or 'blocks'. When several tie, the first in that order.
    by_warps, by_registers, by_shared_memory, by_blocks : int or None
        Blocks each resource alone would allow. ``by_registers`` is None for a
        kernel that uses no registers (the header reports INT_MAX).
    """

    blocks_per_sm: int
    warps_per_sm: int
    threads_per_sm: int
    occupancy: float
    limiter: str
    by_warps: int
    by_registers: int | None
    by_shared_memory: int
    by_blocks: int

    def as_dict(self) -> dict:
        """Return the fields as a plain dict (JSON-ready)."""
        return asdict(self)


def arch_from_capability(major: int, minor: int) -> ArchLimits:
    """Return the limits of compute capability ``major.minor``.

    Parameters
    ----------
    major, minor : int
        Compute capability, e.g. ``(9, 0)`` for an H100 or H200.

    Returns
    -------
    ArchLimits

    Raises
    ------
    ValueError
        If the capability is not one of 8.0, 8.6, 8.9, 9.0.
    """
    known = {arch.capability: arch for arch in ARCHS.values()}
    if (major, minor) in known:
        return known[(major, minor)]
    minors = sorted(m for (ma, m) in known if ma == major)
    if minors:
        raise ValueError(f"minor: expected one of {minors} for major {major}, got {minor!r}")
    majors = sorted({ma for (ma, _) in known})
    raise ValueError(f"major: expected one of {majors}, got {major!r}")


def occupancy(arch: str | ArchLimits, threads_per_block: int, regs_per_thread: int,
              smem_per_block: int) -> Occupancy:
    """Compute how many blocks of a launch are resident on one SM.

    Parameters
    ----------
    arch : str or ArchLimits
        A key of ``ARCHS`` ('sm_80', 'sm_86', 'sm_89', 'sm_90') or its limits.
    threads_per_block : int
        Threads of one block, 1..1024.
    regs_per_thread : int
        Registers per thread as ptxas reports them (``num_regs``), 0..255.
    smem_per_block : int
        Static + dynamic shared memory of one block in bytes, without the
        driver's reserved 1 KB; 0..the arch's opt-in limit.

    Returns
    -------
    Occupancy

    Raises
    ------
    TypeError
        If a count is not an integer or ``arch`` is neither a str nor an ArchLimits.
    ValueError
        If ``arch`` is unknown or a count is out of range.
    """
    arch = _resolve_arch(arch)
    threads = _check_count("threads_per_block", threads_per_block, 1, arch.max_threads_per_block)
    regs = _check_count("regs_per_thread", regs_per_thread, 0, arch.max_regs_per_thread)
    smem = _check_count("smem_per_block", smem_per_block, 0, arch.smem_per_block_optin,
                        f" bytes ({arch.name}'s opt-in limit per block)")
    warps = _ceil_div(threads, arch.warp_size)  # a partial warp occupies a whole warp slot
    limits = {
        "warps": arch.max_warps_per_sm // warps,
        "registers": _blocks_by_registers(arch, warps, regs),
        "shared memory": _blocks_by_shared_memory(arch, smem),
        "blocks": arch.max_blocks_per_sm,
    }
    return _summarise(arch, threads, warps, limits)


def _blocks_by_registers(arch: ArchLimits, warps: int, regs: int) -> int | None:
    """Blocks the register file holds, or None when the kernel uses no registers."""
    regs_per_warp = _round_up(regs * arch.warp_size, arch.reg_alloc_unit)  # warps get whole 256-register units
    if regs_per_warp == 0:
        return None
    per_sub_partition = arch.regs_per_sm // arch.sub_partitions
    warps_per_sm = arch.sub_partitions * (per_sub_partition // regs_per_warp)  # a warp never spans two sub-partitions
    # The header's per-block checks (regs_per_warp * warps, and with warps rounded up to a multiple of 4,
    # against 65536) are implied by this line because registers per block == registers per SM here.
    return warps_per_sm // warps


def _blocks_by_shared_memory(arch: ArchLimits, smem: int) -> int:
    """Blocks the largest shared-memory configuration holds (see the module docstring on carveout)."""
    per_block = _round_up(smem + arch.smem_reserved_per_block, arch.smem_alloc_unit)  # reserve, then 128 B units
    return arch.smem_per_sm // per_block


def _summarise(arch: ArchLimits, threads: int, warps: int, limits: dict) -> Occupancy:
    """Take the smallest per-resource limit and name the first resource that reaches it."""
    blocks = min(limit for limit in limits.values() if limit is not None)
    limiter = next(name for name in LIMITERS if limits[name] == blocks)
    return Occupancy(
        blocks_per_sm=blocks,
        warps_per_sm=blocks * warps,
        threads_per_sm=blocks * threads,
        occupancy=blocks * warps / arch.max_warps_per_sm,
        limiter=limiter,
        by_warps=limits["warps"],
        by_registers=limits["registers"],
        by_shared_memory=limits["shared memory"],
        by_blocks=limits["blocks"],
    )


def _resolve_arch(arch: str | ArchLimits) -> ArchLimits:
    """Return ``arch`` itself, or the ``ARCHS`` entry it names."""
    if isinstance(arch, ArchLimits):
        return arch
    if not isinstance(arch, str):
        raise TypeError(f"arch: expected an arch name or an ArchLimits, got {type(arch).__name__}")
    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {sorted(ARCHS)}, got {arch!r}")
    return ARCHS[arch]


def _check_count(name: str, value: int, low: int, high: int, unit: str = "") -> int:
    """Return ``value`` as an int after checking that it is an integer in ``low..high``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an integer, got {value!r} ({type(value).__name__})")
    if not low <= value <= high:
        raise ValueError(f"{name}: expected an integer in {low}..{high}{unit}, got {value}")
    return int(value)


def _ceil_div(x: int, y: int) -> int:
    """Return ``x / y`` rounded up."""
    return -(-x // y)


def _round_up(x: int, unit: int) -> int:
    """Return the smallest multiple of ``unit`` that is >= ``x``."""
    return _ceil_div(x, unit) * unit
