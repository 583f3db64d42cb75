"""The host side of the TMA tensor maps (rawflash/kernels/tma.py) without a GPU: how an array becomes the 4-d (head_dim,
rows, heads, batch) description the driver encodes, and which arrays TMA cannot describe. The encoding itself
needs the driver; tests/test_gpu_fa3.py runs it (strided views included)."""
from __future__ import annotations

import numpy as np
import pytest

from rawflash.kernels import tma


class FakeArray:
    """Shape, strides and dtype of a device array (what layout_4d reads)."""

    def __init__(self, shape, dtype="float16", strides=None):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        item = self.dtype.itemsize
        if strides is None:
            strides, acc = [], item
            for n in reversed(self.shape):
                strides.insert(0, acc)
                acc *= n
        self.strides = tuple(strides)
        self.nbytes = int(np.prod(self.shape)) * item


def test_contiguous_bshd_is_d_rows_heads_batch():
    x = FakeArray((2, 300, 8, 128))
    dims, strides = tma.layout_4d(x, packed=False)
    assert dims == (128, 300, 8, 2)
    assert strides == (8 * 128 * 2, 128 * 2, 300 * 8 * 128 * 2)


def test_packed_sequences_are_one_batch():
    x = FakeArray((777, 4, 64))
    dims, strides = tma.layout_4d(x, packed=True)
    assert dims == (64, 777, 4, 1)
    assert strides[:2] == (4 * 64 * 2, 64 * 2) and strides[2] % 16 == 0 and strides[2] >= x.nbytes


def test_a_view_into_packed_qkv_keeps_its_strides():
    # q = qkv[:, :, 0] of a (b, s, 3, h, d) tensor: row stride 3 h d
    x = FakeArray((2, 100, 4, 128), strides=(100 * 3 * 4 * 128 * 2, 3 * 4 * 128 * 2, 128 * 2, 2))
    assert tma.layout_4d(x, packed=False)[1] == (3 * 4 * 128 * 2, 128 * 2, 100 * 3 * 4 * 128 * 2)


def test_size_one_dimensions_get_a_valid_stride():
    x = FakeArray((1, 5, 1, 64), strides=(0, 128, 0, 2))
    dims, strides = tma.layout_4d(x, packed=False)
    assert dims == (64, 5, 1, 1) and all(s > 0 and s % 16 == 0 for s in strides)


@pytest.mark.parametrize("strides", [(0, 256, 64, 2), (6400, 200, 40, 2), (-6400, 256, 64, 2), (6400, 256, 64, 4)])
def test_strides_tma_cannot_express_are_refused(strides):
    x = FakeArray((2, 25, 4, 32), strides=strides)
    with pytest.raises(tma.TmaUnavailable):
        tma.layout_4d(x, packed=False)


def test_the_parameter_is_four_128_byte_maps():
    assert tma.FWD_DTYPE.itemsize == 4 * tma.DESC_BYTES == 512
    assert tma.FWD_DTYPE.names == ("q", "k", "v", "o")


def test_the_backward_parameter_adds_the_dq_rows():
    assert tma.BWD_DTYPE.itemsize == 5 * tma.DESC_BYTES and tma.BWD_DTYPE.names == ("q", "k", "v", "dout", "dq")


def test_float32_and_oversized_boxes_are_refused_before_the_driver():
    with pytest.raises(tma.TmaUnavailable, match="float16 or bfloat16"):
        tma.encode(FakeArray((1, 8, 1, 64), "float32"), 64, False)
    with pytest.raises(tma.TmaUnavailable, match="at most 256"):
        tma.encode(FakeArray((1, 8, 1, 64)), 512, False)


def test_empty_tensors_are_refused_before_the_driver():
    with pytest.raises(tma.TmaUnavailable, match="empty"):
        tma.layout_4d(FakeArray((1, 0, 2, 96)), packed=False)


@pytest.mark.parametrize("d,expected", [(128, "fa2_fwd_sm90"), (96, "fa2_fwd"), (40, "fa2_fwd_sm90")])
def test_a_call_tma_cannot_describe_runs_another_form(d, expected):
    from rawflash.kernels import forms
    from rawflash.problem import Problem

    p = Problem(1, 4, 0, 2, 2, d, "float16", False, "sm_90")
    assert forms.forward_plan(p)[0].kernel == "fa3_fwd_sm90"
    assert forms.forward_plan_without_tma(p)[0].kernel == expected
