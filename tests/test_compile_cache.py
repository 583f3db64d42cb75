"""Offline compile reports are cached on disk by source hash, NVRTC version, options and instantiation; slow
compiles are announced (marker `compile`: needs NVRTC, no GPU)."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from rawflash.cli import commands
from rawflash.kernels import compile, launch
from rawflash.problem import Problem

pytestmark = pytest.mark.compile
SMALL = launch.fa2_bwd_preprocess(Problem(1, 1, 1, 1, 1, 64, "float16", False))  # an elementwise kernel: quick


def _nvrtc_or_skip():
    try:
        compile.nvrtc_version()
        compile.cuda_include_dir()
    except Exception as err:
        pytest.skip(f"NVRTC or the CUDA headers are missing: {err}")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    _nvrtc_or_skip()
    monkeypatch.setenv("RAWFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("RAWFLASH_COMPILE_CACHE", raising=False)
    return tmp_path / "compile-reports"


def test_second_compile_comes_from_the_cache(cache_dir, monkeypatch):
    first = compile.compile_offline(SMALL.source, SMALL.name_expression, "sm_80")
    files = list(cache_dir.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["registers"] == first.registers
    from cupy.cuda import nvrtc

    def refuse(*args, **kw):
        raise AssertionError("compiled again although the report is cached")

    monkeypatch.setattr(nvrtc, "compileProgram", refuse)
    assert compile.compile_offline(SMALL.source, SMALL.name_expression, "sm_80") == first
    with pytest.raises(AssertionError, match="compiled again"):  # another target is another key
        compile.compile_offline(SMALL.source, SMALL.name_expression, "sm_90")
    with pytest.raises(AssertionError, match="compiled again"):  # cache=False always compiles
        compile.compile_offline(SMALL.source, SMALL.name_expression, "sm_80", cache=False)
    monkeypatch.setenv("RAWFLASH_COMPILE_CACHE", "0")
    with pytest.raises(AssertionError, match="compiled again"):
        compile.compile_offline(SMALL.source, SMALL.name_expression, "sm_80")


def test_a_corrupt_report_is_compiled_again(cache_dir):
    first = compile.compile_offline(SMALL.source, SMALL.name_expression, "sm_80")
    (path,) = cache_dir.glob("*.json")
    path.write_text("{not json")
    again = compile.compile_offline(SMALL.source, SMALL.name_expression, "sm_80")
    assert (again.registers, again.spills, again.static_smem) == (first.registers, first.spills, first.static_smem)
    assert json.loads(path.read_text())["name_expression"] == SMALL.name_expression


def test_key_covers_source_version_options_and_instantiation():
    base = ("code", "k<1>", ("-a", "--gpu-architecture=sm_80"), "13.0")
    key = compile.report_key(*base)
    for i, other in enumerate(("code ", "k<2>", ("-a", "--gpu-architecture=sm_90"), "12.9")):
        changed = list(base)
        changed[i] = other
        assert compile.report_key(*changed) != key
    assert compile.report_key(*base) == key


def test_the_cache_is_in_rawflash_info(cache_dir):
    compile.compile_offline(SMALL.source, SMALL.name_expression, "sm_80")
    report = json.loads(CliRunner().invoke(commands.main, ["info", "--json"]).stdout)
    assert report["compile report cache"] == {"path": str(cache_dir), "enabled": True, "reports": 1,
                                              "bytes": next(cache_dir.glob("*.json")).stat().st_size}
    assert str(cache_dir) in CliRunner().invoke(commands.main, ["info"]).output


def test_a_slow_compile_is_announced(cache_dir, monkeypatch):
    lines = []
    monkeypatch.setattr(compile, "SLOW_COMPILE_S", 0.0)
    monkeypatch.setattr(compile, "progress", lines.append)
    compile.compile_offline(SMALL.source, SMALL.name_expression, "sm_80", cache=False)
    assert lines[0] == f"compiling {SMALL.name_expression} for sm_80 (NVRTC) ..."
    assert lines[1].startswith(f"compiled {SMALL.name_expression} for sm_80 in ")
    lines.clear()
    compile.compile_offline(SMALL.source, SMALL.name_expression, "sm_80")  # cache=False stored nothing: compiles
    compile.compile_offline(SMALL.source, SMALL.name_expression, "sm_80")  # from the cache: nothing to say
    assert len(lines) == 2
