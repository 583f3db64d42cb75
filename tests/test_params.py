"""The parameter structs of cuda/params.cuh and their NumPy twins in rawflash/kernels/params.py agree field for field.

A kernel reads its FwdParams / BwdParams from the bytes of a one-element NumPy structured array, so the two
layouts must match exactly: same fields, same order, same C types (8-byte fields first, so neither side pads).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from rawflash.kernels import params
from rawflash.problem import Problem

HEADER = Path(__file__).resolve().parents[1] / "cuda" / "params.cuh"
CTYPES = {"const void*": "ptr", "void*": "ptr", "float*": "ptr", "const float*": "ptr", "const int*": "ptr",
          "int*": "ptr", "long long": "i64", "int": "i32", "float": "f32"}


def _struct_fields(name: str) -> list[tuple[str, str]]:
    text = HEADER.read_text()
    body = re.search(rf"struct {name} \{{(.*?)\n\}};", text, re.S).group(1)
    fields = []
    for line in body.splitlines():
        line = line.split("//")[0].strip()
        if not line:
            continue
        ctype = next((c for c in sorted(CTYPES, key=len, reverse=True) if line.startswith(c + " ")), None)
        assert ctype and line.endswith(";"), f"cannot read this field line of {name}: {line!r}"
        for field in line[len(ctype):-1].split(","):
            fields.append((field.strip(), CTYPES[ctype]))
    return fields


@pytest.mark.parametrize("name, fields", [("FwdParams", params.FWD_FIELDS), ("BwdParams", params.BWD_FIELDS)])
def test_fields_match_the_header(name, fields):
    assert _struct_fields(name) == list(fields)


@pytest.mark.parametrize("dtype", [params.FWD_DTYPE, params.BWD_DTYPE])
def test_no_padding(dtype):
    size = sum(np.dtype(dtype.fields[n][0]).itemsize for n in dtype.names)
    assert dtype.itemsize == size, "8-byte fields first, 4-byte fields after, an even number of those"


class _Dev:
    """A stand-in for a CuPy array: a device address and strides in bytes."""

    def __init__(self, shape, itemsize=2, ptr=4096):
        self.shape, self.ndim = shape, len(shape)
        self.dtype = np.dtype(np.float16 if itemsize == 2 else np.float32)
        strides, acc = [], itemsize
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
        self.strides = tuple(strides)
        self.data = type("Ptr", (), {"ptr": ptr})()


def test_fixed_and_packed_strides_and_rows():
    p = Problem(2, 5, 7, 4, 2, 64, "float16", True, window=(3, -1))
    q, k = _Dev((2, 5, 4, 64)), _Dev((2, 7, 2, 64), ptr=8192)
    rec = params.fwd_params(p, q, k, k, q, _Dev((2, 4, 5), 4), 0.125)[0]
    assert (rec["q_sb"], rec["q_ss"], rec["q_sh"]) == (5 * 4 * 64, 4 * 64, 64)
    assert (rec["lse_sb"], rec["lse_sh"]) == (4 * 5, 5) and (rec["window_left"], rec["window_right"]) == (3, 0)
    assert rec["k"] == 8192 and rec["cu_seqlens_q"] == 0 and np.isclose(rec["scale_log2"], 0.125 / np.log(2))
    pv = Problem(3, 9, 11, 4, 2, 64, "float16", False, varlen=True, total_q=20, total_k=25)
    qv = _Dev((20, 4, 64))
    rec = params.fwd_params(pv, qv, _Dev((25, 2, 64)), _Dev((25, 2, 64)), qv, _Dev((4, 20), 4), 0.125)[0]
    assert (rec["q_sb"], rec["q_ss"], rec["q_sh"]) == (0, 4 * 64, 64) and (rec["lse_sb"], rec["lse_sh"]) == (0, 20)
