"""The plan cache without a GPU: signatures tell apart what validation tells apart, a prepacked parameter struct
rewritten with another call's addresses is byte for byte the struct that call binds, and the cache is bounded."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from rawflash import api, signature
from rawflash.kernels import params, plans
from rawflash.problem import Problem


class FakeDeviceArray:
    """What params.py reads of a CuPy array: an address, a shape, strides and a dtype."""

    __module__ = "cupy.fake"

    def __init__(self, shape, dtype, ptr, strides=None):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.ndim, self.size = len(shape), int(np.prod(shape))
        self.strides = strides or tuple(int(s) for s in np.empty(shape, dtype).strides)

        class _Data:
            pass

        self.data = _Data()
        self.data.ptr, self.data.device_id = ptr, 0


def _call(base: int, p: Problem):
    """The arrays of one forward call whose addresses start at ``base``."""
    shape_q = (p.batch, p.seqlen_q, p.heads, p.head_dim)
    shape_k = (p.batch, p.seqlen_k, p.kv_heads, p.head_dim)
    names = {"q": shape_q, "k": shape_k, "v": shape_k, "o": shape_q, "lse": (p.batch, p.heads, p.seqlen_q)}
    arrays = {n: FakeDeviceArray(s, np.float32 if n == "lse" else np.float16, base + 4096 * i)
              for i, (n, s) in enumerate(names.items())}
    arrays["alibi_slopes"] = FakeDeviceArray((p.heads,), np.float32, base + 100_000)
    arrays["tile_counter"] = FakeDeviceArray((2,), np.int32, base + 200_000)
    arrays["ref_flag"] = FakeDeviceArray((1,), np.int32, base + 300_000)
    return arrays


def _record(arrays: dict, p: Problem, ref_gen: int):
    a = arrays
    return params.fwd_params(p, a["q"], a["k"], a["v"], a["o"], a["lse"], 0.125, alibi_slopes=a["alibi_slopes"],
                             tile_counter=a["tile_counter"], ref_flag=a["ref_flag"], ref_gen=ref_gen)


def test_a_rewritten_struct_is_the_struct_the_call_binds():
    p = Problem(2, 300, 500, 8, 2, 128, "float16", True, alibi=True)
    first, second = _call(1 << 32, p), _call(3 << 32, p)
    packed = plans._Struct(_record(first, p, 7))
    assert sorted(packed.roles) == sorted(first)
    packed.write({n: x.data.ptr for n, x in second.items()}, {"ref_gen": 8})
    want = _record(second, p, 8)
    assert packed.buf.tobytes() == want.view(np.uint8).tobytes()
    assert packed.buf.ctypes.data % plans._ALIGN == 0


def test_a_struct_keeps_its_fixed_words_and_refuses_a_missing_role():
    p = Problem(1, 64, 64, 2, 2, 64, "float16", False)
    arrays = _call(1 << 32, p)
    packed = plans._Struct(_record(arrays, p, 0))
    before = packed.buf.copy()
    ptrs = {n: x.data.ptr for n, x in arrays.items()}
    packed.write(ptrs, {})
    assert packed.buf.tobytes() == before.tobytes(), "same addresses, no per-call word: the same bytes"
    del ptrs["lse"]
    with pytest.raises(KeyError):
        packed.write(ptrs, {})


def test_signatures_tell_apart_what_validation_does(monkeypatch):
    monkeypatch.setattr(signature, "is_cupy_array", lambda x: isinstance(x, FakeDeviceArray))  # cupy.ndarray's stand-in
    q = FakeDeviceArray((1, 8, 2, 64), np.float16, 1 << 20)
    k = FakeDeviceArray((1, 8, 2, 64), np.float16, 2 << 20)
    none = (None,) * 5

    def key(causal=True, scale=None, window=(-1, -1), q=q, switches=()):
        return signature.forward(q, k, k, (causal, scale, window, 0.0, None, None, switches), none, None, None)

    assert key() == key() and key() is not None
    assert key(causal=1) != key(causal=True), "1 == True in Python; validation refuses causal=1"
    assert key(scale=1) != key(scale=1.0)
    assert key(window=[4, 0]) != key(window=(4, 0))
    misaligned = FakeDeviceArray((1, 8, 2, 64), np.float16, (1 << 20) + 8)
    assert key(q=misaligned) != key()
    strided = FakeDeviceArray((1, 8, 2, 64), np.float16, 1 << 20, strides=(4096, 512, 128, 2))
    assert key(q=strided) != key()
    assert key(switches=(("wgmma", int, 1),)) != key(switches=(("wgmma", bool, True),))
    assert key(window={"left": 1}) is None, "an unhashable option takes the full path"
    assert signature.forward(np.zeros((1, 8, 2, 64)), k, k, (True,), none, None, None) is None
    empty = FakeDeviceArray((1, 0, 2, 64), np.float16, 1 << 20)
    assert key(q=empty) is None


def test_the_cache_is_bounded_and_thread_safe():
    cache = plans.PlanCache(size=4)
    for i in range(10):
        cache.put(i, f"plan {i}")
    assert len(cache) == 4 and cache.get(0) is None and cache.get(9) == "plan 9"
    cache.get(6)
    cache.put(10, "plan 10")  # 7 goes: 6 was used after it
    assert cache.get(7) is None and cache.get(6) == "plan 6"

    def hammer(offset):
        for i in range(2000):
            cache.put((offset, i % 7), i)
            cache.get((offset, (i + 3) % 7))

    threads = [threading.Thread(target=hammer, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cache) == 4
    cache.clear()
    assert len(cache) == 0 and cache.hits == 0


def test_clear_cache_empties_the_api_cache():
    api.PLANS.put("a key", "a plan")
    api.clear_cache()
    assert len(api.PLANS) == 0


def test_untemplated_arguments_are_not_packed():
    class Lau:
        name_expression = "k<1>"

    with pytest.raises(plans.NotPackable):
        plans.CallPlan([(Lau(), (np.int32(3),))], {}, lambda lau: None)


def test_plans_take_cupy_arrays_and_check_their_arguments():
    import rawflash

    q = np.zeros((1, 8, 2, 64), np.float16)
    with pytest.raises(ValueError, match="a plan takes"):
        rawflash.plan_forward(q, q, q)
    with pytest.raises(TypeError, match="causal must be a bool"):
        rawflash.plan_forward(q, q, q, causal=1)
    with pytest.raises(ValueError, match="num_splits"):
        rawflash.plan_decode(q, q, q, cache_seqlens=1, num_splits=0)
