"""rawflash.cli.occupancy against NVIDIA's header-only calculator, hand-checked cases, and refused input."""
from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rawflash.cli.occupancy import ARCHS, arch_from_capability, occupancy

pytestmark = pytest.mark.compile

THREADS = (32, 64, 96, 128, 256, 384, 512, 1024)
REGS = (16, 32, 40, 64, 72, 96, 128, 168, 200, 255)
SMEM = (0, 1, 1000, 16384, 32768, 49152, 65536, 99000, 101376, 131072, 166912, 200000, 232448)
# Sizes that are not multiples of a warp or of an allocation unit, and a kernel with no registers.
ODD_THREADS = (1, 33, 100, 160, 200, 640, 1000)
ODD_REGS = (0, 1, 24, 56, 80, 254)
ODD_SMEM = (47, 128, 129, 3071, 49153)

# Device properties typed in from the CUDA docs (not taken from rawflash), so a wrong value in
# ArchLimits shows up as a disagreement. Only the header's own includes are needed to build it.
HARNESS = r"""
#include <cstdio>
#include "cuda_occupancy.h"

static cudaOccDeviceProp props_for(int major, int minor) {
    cudaOccDeviceProp p;
    p.computeMajor = major;
    p.computeMinor = minor;
    p.maxThreadsPerBlock = 1024;
    p.regsPerBlock = 65536;
    p.regsPerMultiprocessor = 65536;
    p.warpSize = 32;
    p.sharedMemPerBlock = 49152;
    p.numSms = 1;
    p.reservedSharedMemPerBlock = 1024;
    if (major == 8 && minor == 0) {
        p.maxThreadsPerMultiprocessor = 2048;
        p.sharedMemPerMultiprocessor = 167936;
        p.sharedMemPerBlockOptin = 166912;
    } else if (major == 8) {  /* 8.6 and 8.9 */
        p.maxThreadsPerMultiprocessor = 1536;
        p.sharedMemPerMultiprocessor = 102400;
        p.sharedMemPerBlockOptin = 101376;
    } else {                  /* 9.0 */
        p.maxThreadsPerMultiprocessor = 2048;
        p.sharedMemPerMultiprocessor = 233472;
        p.sharedMemPerBlockOptin = 232448;
    }
    return p;
}

/* stdin: "major minor threads regs smem" lines; stdout: one result line each. */
int main() {
    int major, minor, threads, regs;
    size_t smem;
    while (std::scanf("%d %d %d %d %zu", &major, &minor, &threads, &regs, &smem) == 5) {
        cudaOccDeviceProp prop = props_for(major, minor);
        cudaOccFuncAttributes attr;             /* what cudaFuncGetAttributes would give: */
        attr.maxThreadsPerBlock = 1024;
        attr.numRegs = regs;
        attr.sharedSizeBytes = 0;               /* all of it passed as dynamic shared memory */
        attr.shmemLimitConfig = FUNC_SHMEM_LIMIT_OPTIN;
        attr.maxDynamicSharedSizeBytes = prop.sharedMemPerBlockOptin;  /* the kernel opted in */
        attr.numBlockBarriers = 1;
        cudaOccDeviceState state;               /* no cache or carveout preference */
        cudaOccResult r;
        cudaOccError err = cudaOccMaxActiveBlocksPerMultiprocessor(&r, &prop, &attr, &state, threads, smem);
        std::printf("%d %d %d %d %d %d %u\n", (int)err, r.activeBlocksPerMultiprocessor, r.blockLimitWarps,
                    r.blockLimitRegs, r.blockLimitSharedMem, r.blockLimitBlocks, r.limitingFactors);
    }
    return 0;
}
"""

INT_MAX = 2**31 - 1
LIMITER_BITS = {"warps": 0x1, "registers": 0x2, "shared memory": 0x4, "blocks": 0x8}


def _header_dirs():
    """Yield directories that may hold cuda_occupancy.h, in the order CI should prefer them."""
    try:
        import cuda.pathfinder

        found = cuda.pathfinder.find_nvidia_header_directory("cudart")
        if found:
            yield Path(found)
    except Exception:  # the wheel is optional: fall through to a toolkit install
        pass
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            yield Path(os.environ[var]) / "include"
    yield Path("/usr/local/cuda/include")


def _find_header_dir():
    return next((d for d in _header_dirs() if (d / "cuda_occupancy.h").is_file()), None)


def _configs(threads, regs, smem):
    """Every (arch, threads, regs, smem) whose shared memory fits the arch's per-block opt-in limit."""
    for arch, t, r, s in itertools.product(ARCHS.values(), threads, regs, smem):
        if s <= arch.smem_per_block_optin:
            yield arch, t, r, s


@pytest.fixture(scope="module")
def header_calculator(tmp_path_factory):
    """Build the C++ harness once; return a function from a config list to the header's result rows."""
    gxx = shutil.which("g++")
    include = _find_header_dir()
    if gxx is None:
        pytest.skip("g++ not found: cannot build the cuda_occupancy.h harness")
    if include is None:
        pytest.skip("cuda_occupancy.h not found (cuda.pathfinder 'cudart', CUDA_HOME, CUDA_PATH, /usr/local/cuda)")
    build = tmp_path_factory.mktemp("occupancy")
    (build / "harness.cpp").write_text(HARNESS)
    exe = build / "harness"
    subprocess.run([gxx, "-std=c++11", "-O1", "-Wall", "-I", str(include), "harness.cpp", "-o", str(exe)],
                   cwd=build, check=True, capture_output=True, text=True)

    def run(configs):
        lines = "".join(f"{a.capability[0]} {a.capability[1]} {t} {r} {s}\n" for a, t, r, s in configs)
        out = subprocess.run([str(exe)], input=lines, check=True, capture_output=True, text=True).stdout
        return [tuple(int(x) for x in line.split()) for line in out.splitlines()]

    return run


@pytest.mark.parametrize("grid", [(THREADS, REGS, SMEM), (ODD_THREADS, ODD_REGS, ODD_SMEM)], ids=["grid", "odd"])
def test_agrees_with_cuda_occupancy_h(header_calculator, grid):
    configs = list(_configs(*grid))
    rows = header_calculator(configs)
    assert len(rows) == len(configs)
    mismatches = []
    for (arch, t, r, s), (err, blocks, warps, regs, smem, slots, factors) in zip(configs, rows):
        occ = occupancy(arch, t, r, s)
        ours = (0, occ.blocks_per_sm, occ.by_warps, INT_MAX if occ.by_registers is None else occ.by_registers,
                occ.by_shared_memory, occ.by_blocks)
        # The header flags every tied resource; ours is the first of them in bit order.
        first_factor = factors & -factors & 0xF
        if ours != (err, blocks, warps, regs, smem, slots) or LIMITER_BITS[occ.limiter] != first_factor:
            mismatches.append((arch.name, t, r, s, occ, (err, blocks, warps, regs, smem, slots, factors)))
    assert not mismatches, f"{len(mismatches)} of {len(configs)} differ, first: {mismatches[:3]}"


def test_grid_size():
    # sm_80 drops 200000 and 232448; sm_86 and sm_89 drop the four sizes above 101376.
    assert len(list(_configs(THREADS, REGS, SMEM))) == 8 * 10 * (11 + 9 + 9 + 13)


@pytest.mark.parametrize(
    "arch, threads, regs, smem, blocks, limiter, occ",
    [
        # 255 regs * 32 = 8160 -> 8192 per warp; 16384 per sub-partition / 8192 = 2 warps, x4 = 8 warps = 2 blocks
        # of 4 warps. Shared: 98304 + 1024 = 99328 B; 233472 // 99328 = 2. Tie -> 'registers' (comes first).
        ("sm_90", 128, 255, 96 * 1024, 2, "registers", 8 / 64),
        # 200 * 32 = 6400 per warp; 16384 // 6400 = 2 warps per sub-partition -> 8 warps -> 8 // 3 = 2 blocks
        # (the whole register file, 65536 // 6400 = 10 warps, would wrongly give 3).
        ("sm_86", 96, 200, 0, 2, "registers", 6 / 48),
        # 49152 + 1024 = 50176 B (392 units of 128); 167936 // 50176 = 3. Warps 64 // 4 = 16, registers 16.
        ("sm_80", 128, 32, 49152, 3, "shared memory", 12 / 64),
        # Shared: 1 + 1024 = 1025 -> 1152 B, 102400 // 1152 = 88; warps 48 // 2 = 24; block slots 24. Tie -> 'warps'.
        ("sm_89", 64, 16, 1, 24, "warps", 48 / 48),
        # 48 one-warp blocks fit the warp slots, registers 128, shared 100, but only 16 block slots.
        ("sm_86", 32, 16, 0, 16, "blocks", 16 / 48),
        # 72 * 32 = 2304 per warp; 16384 // 2304 = 7 -> 28 warps per SM < 32 warps of the block: cannot run.
        ("sm_90", 1024, 72, 0, 0, "registers", 0.0),
        # The opt-in maximum: 166912 + 1024 = 167936 B = the whole SM.
        ("sm_80", 256, 64, 166912, 1, "shared memory", 8 / 64),
    ],
)
def test_hand_checked(arch, threads, regs, smem, blocks, limiter, occ):
    result = occupancy(arch, threads, regs, smem)
    assert (result.blocks_per_sm, result.limiter) == (blocks, limiter)
    assert result.occupancy == pytest.approx(occ)
    assert result.warps_per_sm == blocks * -(-threads // 32)
    assert result.threads_per_sm == blocks * threads
    assert result.as_dict()["blocks_per_sm"] == blocks


def test_accepts_arch_limits_and_capability():
    assert arch_from_capability(9, 0) is ARCHS["sm_90"]
    assert occupancy(ARCHS["sm_89"], 256, 64, 0) == occupancy("sm_89", 256, 64, 0)


@pytest.mark.parametrize(
    "args, pattern",
    [
        (("sm_90", 0, 32, 0), r"threads_per_block: expected .*1\.\.1024.*got 0"),
        (("sm_90", 1025, 32, 0), r"threads_per_block: expected .*1\.\.1024.*got 1025"),
        (("sm_90", 128, 256, 0), r"regs_per_thread: expected .*0\.\.255.*got 256"),
        (("sm_90", 128, -1, 0), r"regs_per_thread: expected .*got -1"),
        (("sm_90", 128, 32, -1), r"smem_per_block: expected .*got -1"),
        (("sm_80", 128, 32, 166913), r"smem_per_block: expected .*166912 bytes.*got 166913"),
        (("sm_86", 128, 32, 101377), r"smem_per_block: expected .*101376 bytes.*got 101377"),
        (("sm_75", 128, 32, 0), r"arch: expected one of .*'sm_90'.*got 'sm_75'"),
    ],
)
def test_refuses_bad_input(args, pattern):
    with pytest.raises(ValueError, match=pattern):
        occupancy(*args)


def test_refuses_non_integers():
    with pytest.raises(TypeError, match=r"threads_per_block: expected an integer, got 128\.0"):
        occupancy("sm_90", 128.0, 32, 0)


@pytest.mark.parametrize("major, minor, pattern", [(7, 5, r"major: expected .*got 7"), (8, 7, r"minor: .*got 7")])
def test_refuses_unknown_capability(major, minor, pattern):
    with pytest.raises(ValueError, match=pattern):
        arch_from_capability(major, minor)
