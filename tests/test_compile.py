"""Offline NVRTC compiles of every kernel instantiation, for sm_80 and sm_90, without a GPU (marker `compile`).

Each instantiation must compile (its static_asserts include launch.py's shared-memory size, so a compile is also
the check that launch.py and the kernel agree on shared memory), use no more registers than launch.py's
__launch_bounds__ cap, and spill nothing, except the spills recorded with a reason in configs.KNOWN_SPILLS.
"""
from __future__ import annotations

import os

import pytest

from rawflash.cli.occupancy import ARCHS as ARCHS_LIMITS
from rawflash.kernels import compile, configs, forms, launch
from rawflash.kernels.launch import Launch
from rawflash.problem import Problem
from conftest import SELECTED

pytestmark = pytest.mark.compile
ARCHS = ("sm_80", "sm_90")
INSTANTIATIONS = [(arch, lau) for arch in ARCHS for lau in forms.all_instantiations(arch)]
IDS = [f"{arch}:{lau.name_expression}" for arch, lau in INSTANTIATIONS]


def _nvrtc_available() -> bool:
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
        compile.cuda_include_dir()
        return True
    except Exception:
        return False


def _selected(items: list) -> list[tuple[str, Launch]]:
    """The instantiations the run's selected tests read (``-k`` filters compile only theirs): those of the
    selected per-instantiation tests, and every one of KNOWN_SPILLS when its test is selected."""
    names = {item.name for item in items if item.module.__name__ == __name__}
    known = ({(expr, arch) for expr, arch in configs.KNOWN_SPILLS} if "test_known_spills_are_still_real" in names
             else set())
    return [(arch, lau) for (arch, lau), case in zip(INSTANTIATIONS, IDS)
            if f"test_instantiation_compiles_within_its_launch_bounds[{case}]" in names
            or (lau.name_expression, arch) in known]


@pytest.fixture(scope="module")
def reports(request):
    if not _nvrtc_available():
        pytest.skip("NVRTC or the CUDA headers are missing (install rawflash[cuda13] or [cuda12])")
    items = [(lau.source, lau.name_expression, lau.compile_arch(arch)) for arch, lau in
             _selected(request.config.stash[SELECTED])]
    return compile.compile_offline_many(items, max(1, os.cpu_count() or 1))


@pytest.mark.parametrize("arch,lau", INSTANTIATIONS, ids=IDS)
def test_instantiation_compiles_within_its_launch_bounds(reports, arch, lau):
    rep = reports[(lau.name_expression, lau.compile_arch(arch))]
    if isinstance(rep, Exception):
        pytest.fail(str(rep))
    cap = launch.register_cap(lau.config) if lau.config else 255
    assert rep.registers <= cap, f"{rep.registers} registers > cap {cap}"
    allowed = configs.KNOWN_SPILLS.get((lau.name_expression, arch), 0)
    assert rep.spills <= allowed, f"{rep.spill_stores} B spill stores, {rep.spill_loads} B spill loads\n{rep.log}"
    assert rep.static_smem == 0, "shared memory is dynamic only (launch.py sizes it)"
    assert "serialized" not in rep.log, f"ptxas serialises the wgmma pipeline (every product waits):\n{rep.log}"
    limit = ARCHS_LIMITS[arch].smem_per_block_optin
    assert lau.smem <= limit, f"{lau.smem} B of shared memory > the {limit} B a block may have on {arch}"


def test_known_spills_are_still_real(reports):
    """An exception in KNOWN_SPILLS that no longer spills must be removed, so the list stays honest. (Keyed by the
    table's arch; the report by the arch it compiles for, sm_90a for the Hopper-only forms.)"""
    compiled_for = {(lau.name_expression, arch): lau.compile_arch(arch) for arch, lau in INSTANTIATIONS}
    for (expr, arch), allowed in configs.KNOWN_SPILLS.items():
        rep = reports.get((expr, compiled_for.get((expr, arch), arch)))
        assert rep is not None and not isinstance(rep, Exception), f"{expr} ({arch}) is not an instantiation"
        assert 0 < rep.spills <= allowed, f"{expr} ({arch}) now spills {rep.spills} B: update KNOWN_SPILLS"


def test_smem_mismatch_fails_to_compile():
    """The SMEM_BYTES static_assert is live: a wrong size is refused by the compiler."""
    if not _nvrtc_available():
        pytest.skip("NVRTC missing")
    lau = forms.fa2_forward(Problem(1, 1, 1, 1, 1, 64, "float16", False), forms.Switches(wgmma=False))
    wrong = lau.name_expression.replace(f", {lau.smem}>", f", {lau.smem + 16}>")
    with pytest.raises(RuntimeError, match="disagree on shared memory"):
        compile.compile_offline(lau.source, wrong, "sm_90")


def test_source_hash_covers_every_included_byte(tmp_path):
    """The cache key is the assembled source: one changed byte in an included header changes it."""
    import shutil

    src = compile.cuda_dir()
    copy = tmp_path / "cuda"
    shutil.copytree(src, copy)
    before = compile.source_hash("fa2_fwd.cu", copy)
    assert before == compile.source_hash("fa2_fwd.cu", src)
    header = copy / "core.cuh"  # included by every kernel, through its headers
    header.write_text(header.read_text() + "\n// one more byte\n")
    assert compile.source_hash("fa2_fwd.cu", copy) != before
    splitk = copy / "splitk.cuh"
    text = compile.assemble("fa2_fwd.cu", copy)
    assert splitk.read_text().splitlines()[-2] in text and '#include "' not in text


def test_ptxas_log_parsing():
    log = ("ptxas info    : Used 168 registers, used 1 barriers, 512 bytes smem, 400 bytes cmem[0]\n"
           "ptxas info    : Function properties for k\n"
           "    24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n")
    got = compile.parse_ptxas(log)
    assert got == dict(registers=168, static_smem=512, stack_bytes=24, spill_stores=8, spill_loads=12)
    with pytest.raises(ValueError):
        compile.parse_ptxas("nothing here")


def test_l2_reduce_tool_compiles_and_counts():
    """tools/l2_reduce.py's kernels compile for sm_90a (red.global.add.v4.f32, cp.reduce.async.bulk), and the
    counts it checks each kernel against add up to one block per CTA-iteration."""
    if not _nvrtc_available():
        pytest.skip("NVRTC missing")
    import importlib.util
    from pathlib import Path

    from cupy.cuda import nvrtc

    spec = importlib.util.spec_from_file_location("l2_reduce", Path(__file__).parents[1] / "tools" / "l2_reduce.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    prog = nvrtc.createProgram(tool.SOURCE, "l2_reduce.cu", [], [])
    try:
        nvrtc.compileProgram(prog, list(tool.OPTIONS))
        assert len(nvrtc.getCUBIN(prog)) > 0
    finally:
        nvrtc.destroyProgram(prog)
    assert tool.expected_counts(grid=528, share=16, iters=3).sum() == 528 * 3
    once = tool.expected_counts(grid=528, share=16)  # one iteration: 33 groups of 16 CTAs, on distinct blocks
    assert once.max() == 16 and (once > 0).sum() == 33
