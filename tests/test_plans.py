"""The plan cache without a GPU: signatures tell apart what validation tells apart (a paged forward's page table
by its values), a prepacked parameter struct rewritten with another call's addresses is byte for byte the struct
that call binds (a paged forward's too, its TMA descriptors given the new page pool's address), and the cache is
bounded."""
from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from rawflash import api, arrays, signature
from rawflash.kernels import params, plans, tma
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


class FakeHostValues(FakeDeviceArray):
    """A fake device array whose values the host can read (``get``), as the signature reads offsets and tables."""

    def __init__(self, values: np.ndarray, ptr: int):
        super().__init__(values.shape, values.dtype, ptr)
        self.values = values

    def get(self):
        return self.values.copy()


def _paged_key(table, used=(40, 7)):
    q = FakeDeviceArray((12, 2, 64), np.float16, 1 << 20)
    pool = FakeDeviceArray((6, 16, 2, 64), np.float16, 2 << 20)
    cu = FakeHostValues(np.array([0, 5, 12], np.int32), 3 << 20)
    lens = FakeHostValues(np.asarray(used, np.int32), 4 << 20)
    return signature.forward(q, pool, pool, (True, None, (-1, -1), 0.0, None, None, ()),
                             (None, None, cu, None, lens), None, None, table)


def test_a_paged_signature_holds_the_tables_values(monkeypatch):
    """Validation checks the used entries of block_table against the page pool, so the key holds its values: equal
    values at another address share a key, another value, shape or no table gives another key, and a host table
    (validated on every call) gives none."""
    monkeypatch.setattr(signature, "is_cupy_array", lambda x: isinstance(x, FakeDeviceArray))
    table = np.array([[3, 0, 5], [1, 2, 4]], np.int32)
    key = _paged_key(FakeHostValues(table, 5 << 20))
    assert key is not None and key == _paged_key(FakeHostValues(table.copy(), 6 << 20))
    assert hash(key) == hash(_paged_key(FakeHostValues(table.copy(), 6 << 20)))
    bad = table.copy()
    bad[0, 2] = 10_000  # a used entry outside the pool: refused by validation, so never the planned key
    assert _paged_key(FakeHostValues(bad, 5 << 20)) != key
    swapped = table[::-1].copy()
    assert _paged_key(FakeHostValues(swapped, 5 << 20)) != key
    assert _paged_key(FakeHostValues(table[:, :2].copy(), 5 << 20)) != key
    assert _paged_key(None) != key
    assert _paged_key(FakeHostValues(table, 5 << 20), used=(40, 8)) != key, "seqused_k's values too"
    assert _paged_key(table) is None, "a NumPy table takes the full path"


def test_the_fast_path_keys_a_paged_call_on_its_table(monkeypatch):
    """rawflash.forward with block_table looks its plan up under a key that holds the table's values, and a hit
    hands the table to the plan's run among the features (its address is a role of the plan)."""
    import rawflash

    fake = lambda x: isinstance(x, FakeDeviceArray)  # noqa: E731  (cupy.ndarray's stand-in)
    monkeypatch.setattr(signature, "is_cupy_array", fake)
    monkeypatch.setattr(arrays, "is_cupy_array", fake)
    monkeypatch.setattr(api, "_on", lambda x, fn, *args: fn(*args))
    looked_up, runs = [], []

    class Planned:
        def run(self, q, k, v, features, out, lse):
            runs.append(features)
            return "out", "lse"

    class Cache:
        def get(self, key):
            looked_up.append(key)
            return Planned()

    monkeypatch.setattr(api, "PLANS", Cache())
    q = FakeDeviceArray((12, 2, 64), np.float16, 1 << 20)
    pool = FakeDeviceArray((6, 16, 2, 64), np.float16, 2 << 20)
    cu = FakeHostValues(np.array([0, 5, 12], np.int32), 3 << 20)
    lens = FakeHostValues(np.array([40, 7], np.int32), 4 << 20)
    tables = [FakeHostValues(np.array([[3, 0, 5], [1, 2, 4]], np.int32), 5 << 20),
              FakeHostValues(np.array([[3, 0, 5], [1, 2, 4]], np.int32), 6 << 20),
              FakeHostValues(np.array([[3, 0, 4], [1, 2, 5]], np.int32), 7 << 20)]
    for table in tables:
        assert rawflash.forward(q, pool, pool, cu_seqlens_q=cu, seqused_k=lens, block_table=table,
                                causal=True) == ("out", "lse")
    assert looked_up[0] == looked_up[1] != looked_up[2]
    assert looked_up[0] == _paged_key(tables[0])
    assert [r["block_table"] for r in runs] == tables
    assert all(r["seqused_k"] is lens and r["cu_seqlens_q"] is cu for r in runs)


@dataclasses.dataclass
class FakeLaunch:
    name_expression: str
    grid: tuple = (4, 8, 1)
    block: tuple = (384, 1, 1)
    smem: int = 1024


class FakeHandle:
    class kernel:
        ptr = 0


PAGED = Problem(2, 7, 96, 4, 2, 64, "bfloat16", True, varlen=True, total_q=12, total_k=12, seqused_k=True,
                page_size=16)


def _paged_call(base: int):
    """The arrays of one paged forward call whose addresses start at ``base`` (pages of 16 rows, 6 pages)."""
    p = PAGED
    named = {"q": ((p.total_q, p.heads, p.head_dim), np.float16), "k": ((6, 16, p.kv_heads, p.head_dim), np.float16),
             "v": ((6, 16, p.kv_heads, p.head_dim), np.float16), "o": ((p.total_q, p.heads, p.head_dim), np.float16),
             "lse": ((p.heads, p.total_q), np.float32), "cu_seqlens_q": ((3,), np.int32),
             "seqused_k": ((2,), np.int32), "block_table": ((2, 6), np.int32), "tile_counter": ((2,), np.int32)}
    return {n: FakeDeviceArray(shape, dtype, base + 4096 * i) for i, (n, (shape, dtype)) in enumerate(named.items())}


def _paged_record(a: dict):
    feats = {n: a[n] for n in ("cu_seqlens_q", "seqused_k", "block_table", "tile_counter")}
    return params.fwd_params(PAGED, a["q"], a["k"], a["v"], a["o"], a["lse"], 0.125, **feats)


def _fake_maps(a: dict):
    """A TmaFwd parameter as tma.fwd_maps lays it out (the descriptors' bytes stand-ins: only the driver reads
    them)."""
    rec = np.zeros(1, tma.FWD_DTYPE)
    for i, name in enumerate(("q", "k", "v", "o")):
        rec[name] = np.arange(16, dtype=np.uint64) + a[name].data.ptr + i
    return rec


@pytest.mark.parametrize("form", ["tma", "cp_async"])
def test_a_paged_plan_rewrites_every_address(monkeypatch, form):
    """A paged forward's template packs: its struct's roles are the page table, the lengths and the offsets
    beside q, k, v, o, lse; a later call's addresses give the struct that call binds; FA3's form (``tma``) asks
    the driver to replace each descriptor's address (the page pool's for k and v) when it changed, and only
    then. The cp.async form reads block_table by pointer alone."""
    replaced = []
    monkeypatch.setattr(plans, "_replace_address", lambda: lambda address, ptr: replaced.append((address, ptr)) or 0)
    first, second = _paged_call(1 << 32), _paged_call(3 << 32)
    rec = _paged_record(first)
    args = (rec, _fake_maps(first)) if form == "tma" else (rec,)
    plan = plans.CallPlan([(FakeLaunch("fa3_fwd_sm90<...>"), args)], first, lambda lau: FakeHandle())
    assert plan.roles == sorted(first)
    launched = []
    plan.launches = [launched.append]
    ptrs = {n: x.data.ptr for n, x in second.items()}
    plan.run(ptrs, {}, 7)
    assert launched == [7]
    struct = plan.parts[0]
    assert struct.buf.tobytes() == _paged_record(second).view(np.uint8).tobytes()
    if form == "tma":
        maps = plan.parts[1]
        offsets = {n: tma.FWD_DTYPE.fields[n][1] for n in ("q", "k", "v", "o")}
        assert replaced == [(maps.buf.ctypes.data + offsets[n], ptrs[n]) for n in ("q", "k", "v", "o")]
        replaced.clear()
        plan.run(ptrs, {}, 7)
        assert replaced == [], "unchanged addresses leave the descriptors as they are"
        moved = dict(ptrs, k=ptrs["k"] + (1 << 20))
        plan.run(moved, {}, 7)
        assert replaced == [(maps.buf.ctypes.data + offsets["k"], moved["k"])]
    else:
        assert replaced == []


def test_a_paged_template_without_a_table_role_is_not_packed():
    """A template whose struct holds the table's address but names no role for it refuses to plan (the call then
    runs through its bound launches)."""
    first = _paged_call(1 << 32)
    roles = {n: x for n, x in first.items() if n != "block_table"}
    with pytest.raises(plans.NotPackable, match="block_table"):
        plans.CallPlan([(FakeLaunch("fa2_fwd_sm90<...>"), (_paged_record(first),))], roles, lambda lau: FakeHandle())


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
