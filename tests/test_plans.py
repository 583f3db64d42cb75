"""The plan cache without a GPU: signatures tell apart what validation tells apart, and hold packed calls'
offsets, lengths and page tables by their layouts and maxima, so new lengths share a plan while a hit checks their
values as the full path does (each array read once a call); a prepacked parameter struct rewritten with another
call's addresses is byte for byte the struct that call binds (a paged forward's too, its TMA descriptors given the
new page pool's address), and the cache is bounded."""
from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from rawflash import api, arrays, signature
from rawflash.kernels import forms, params, plans, tma
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


class FakeHostValues(FakeDeviceArray):
    """A fake device array whose values the host can read (``get``, counted), as a call reads its offsets, lengths
    and page table."""

    def __init__(self, values: np.ndarray, ptr: int):
        super().__init__(values.shape, values.dtype, ptr)
        self.values, self.reads = values, 0

    def get(self):
        self.reads += 1
        return self.values.copy()


# A paged call (pages of 16 rows, 6 pages, tables 3 pages wide: 48 keys a sequence at most) and a packed call on
# contiguous keys, as host arrays; max_seqlen_q / _k 7 / 40 by their values.
PAGED_HOST = dict(q=((12, 2, 64), np.float16), k=((6, 16, 2, 64), np.float16), v=((6, 16, 2, 64), np.float16),
                  cu_seqlens_q=np.array([0, 5, 12], np.int32), seqused_k=np.array([40, 7], np.int32),
                  block_table=np.array([[3, 0, 5], [1, 2, 4]], np.int32))
PACKED_HOST = dict(q=((12, 2, 64), np.float16), k=((50, 2, 64), np.float16), v=((50, 2, 64), np.float16),
                   cu_seqlens_q=np.array([0, 5, 12], np.int32), cu_seqlens_k=np.array([0, 40, 50], np.int32),
                   seqused_k=np.array([40, 7], np.int32))
FIXED_HOST = dict(q=((2, 8, 2, 64), np.float16), k=((2, 16, 2, 64), np.float16), v=((2, 16, 2, 64), np.float16),
                  seqused_k=np.array([16, 3], np.int32))
CASES = {"paged": PAGED_HOST, "packed": PACKED_HOST, "fixed": FIXED_HOST}


def _host(case: str, **values) -> dict:
    """A case's arguments as NumPy arrays (q, k, v zeros), ``values`` replacing its int32 arrays."""
    args = {n: np.zeros(*x) if isinstance(x, tuple) else x.copy() for n, x in CASES[case].items()}
    args.update({n: np.asarray(x, np.int32) for n, x in values.items()})
    return args


def _device(args: dict) -> dict:
    """The fake device twins of a case's host arguments (values readable for the int32 arrays)."""
    return {n: FakeDeviceArray(x.shape, x.dtype, (i + 1) << 20) if n in ("q", "k", "v") else
            FakeHostValues(x, (i + 1) << 20) for i, (n, x) in enumerate(args.items())}


class _Planned:
    """A planned call: the facts of the full path's check of ``args``, and its runs recorded."""

    def __init__(self, args: dict, **options):
        from rawflash import validation

        feats = validation.Features(**{n: x for n, x in {**args, **options}.items() if n not in ("q", "k", "v")})
        self.facts = validation.check_forward(args["q"], args["k"], args["v"], True, None, "fa2", "reference",
                                              feats).facts
        self.runs = []

    def run(self, *args):
        self.runs.append(args)
        return "out", "lse"


class _Cache:
    """PLANS' stand-in: every lookup a hit on ``plan``; the keys looked up, recorded."""

    def __init__(self, plan):
        self.plan, self.keys = plan, []

    def get(self, key):
        self.keys.append(key)
        return self.plan


@pytest.fixture
def fast_path(monkeypatch):
    """The public calls' fast path over FakeDeviceArrays (cupy.ndarray's stand-in), on a cache that always hits."""
    fake = lambda x: isinstance(x, FakeDeviceArray)  # noqa: E731
    monkeypatch.setattr(signature, "is_cupy_array", fake)
    monkeypatch.setattr(arrays, "is_cupy_array", fake)
    monkeypatch.setattr(api, "_on", lambda x, fn, *args: fn(*args))

    def install(case: str, **options) -> _Cache:
        cache = _Cache(_Planned(_host(case), **options))
        monkeypatch.setattr(api, "PLANS", cache)
        return cache

    return install


def _forward(args: dict, **options):
    import rawflash

    return rawflash.forward(args["q"], args["k"], args["v"], causal=True, **options,
                            **{n: x for n, x in args.items() if n not in ("q", "k", "v")})


def _key(case: str, **values):
    """The key a forward of ``case`` with ``values`` looks up (max_seqlen_q / _k in ``values`` as options)."""
    options = {n: values.pop(n) for n in ("max_seqlen_q", "max_seqlen_k") if n in values}
    cache = api.PLANS
    _forward(_device(_host(case, **values)), **options)
    return cache.keys[-1]


@pytest.mark.parametrize("case", ["paged", "packed"])
def test_new_lengths_share_a_key_and_new_maxima_do_not(fast_path, case):
    """A packed call's key holds its offsets', lengths' and table's layouts and the maxima it runs with, not their
    values: new values of the same maxima share the planned key; another maximum (of the queries or of the keys:
    seqused_k's for paged keys, the offsets' otherwise) gives another; a max_seqlen given fixes it."""
    fast_path(case)
    key = _key(case)
    assert key is not None and hash(key) == hash(_key(case))
    same = [dict(cu_seqlens_q=[0, 7, 12])]
    same += [dict(seqused_k=[40, 2]), dict(block_table=[[5, 4, 3], [0, 1, 2]])] if case == "paged" else \
        [dict(seqused_k=[33, 2]), dict(cu_seqlens_k=[0, 10, 50], seqused_k=[3, 40])]
    for values in same:
        assert _key(case, **values) == key, values
    assert _key(case, cu_seqlens_q=[0, 4, 12]) != key, "the longest query sequence 8"
    longer = dict(seqused_k=[41, 7]) if case == "paged" else dict(cu_seqlens_k=[0, 41, 50])
    assert _key(case, **longer) != key, "the longest key sequence 41"
    assert _key(case, max_seqlen_k=48, **longer) == _key(case, max_seqlen_k=48) != key
    assert _key(case, max_seqlen_q=12, cu_seqlens_q=[0, 4, 12]) == _key(case, max_seqlen_q=12) != key


def test_a_fixed_length_key_holds_no_lengths(fast_path):
    """seqused_k of fixed-length sequences enters the key by its layout alone (the shapes fix the maxima)."""
    fast_path("fixed")
    assert _key("fixed") == _key("fixed", seqused_k=[1, 16]) == _key("fixed", seqused_k=[0, 0])


def test_the_maxima_are_the_checked_calls():
    """validation.maxima (the key's) gives the max_seqlen_q / _k the full path's checked problem runs with."""
    from rawflash import validation

    for case, options in (("paged", {}), ("packed", {}), ("packed", {"max_seqlen_q": 9}),
                          ("paged", {"max_seqlen_k": 48}), ("packed", {"seqused_k": None})):
        args = {n: x for n, x in {**_host(case), **options}.items() if x is not None}
        feats = validation.Features(**{n: x for n, x in args.items() if n not in ("q", "k", "v")})
        p = validation.check_forward(args["q"], args["k"], args["v"], True, None, "fa2", "reference", feats).problem
        values = validation.read_values(*[args.get(n) for n in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k",
                                                                 "block_table")])
        got = validation.maxima(values, options.get("max_seqlen_q"), options.get("max_seqlen_k"))
        assert got == (p.seqlen_q, p.seqlen_k), (case, options)
    assert validation.maxima(validation.read_values(None, None, np.array([3], np.int32)), None, None) is None


GIVEN = {"max_seqlen_q": 7, "max_seqlen_k": 40}  # the maxima given: every value below keeps the planned key
BAD_VALUES = [
    # (case, values, error, message)
    ("paged", dict(cu_seqlens_q=[1, 5, 12]), ValueError, r"cu_seqlens_q must start at 0, got 1"),
    ("paged", dict(cu_seqlens_q=[0, 13, 12]), ValueError, r"cu_seqlens_q must be non-decreasing"),
    ("paged", dict(cu_seqlens_q=[0, 5, 13]), ValueError, r"cu_seqlens_q\[-1\] must equal the packed length of q"),
    ("paged", dict(cu_seqlens_q=[0, 3, 12]), ValueError, r"max_seqlen_q must be at least the longest sequence \(9\)"),
    ("paged", dict(seqused_k=[49, 7]), ValueError, r"seqused_k must be between 0 and each sequence's key count"),
    ("paged", dict(seqused_k=[-1, 7]), ValueError, r"seqused_k must be between 0"),
    ("paged", dict(seqused_k=[41, 7]), ValueError, r"max_seqlen_k must be at least the longest sequence \(41\)"),
    ("paged", dict(block_table=[[3, 0, 6], [1, 2, 4]]), ValueError, r"block_table\[0\] must name pages of k"),
    ("paged", dict(block_table=[[3, 0, 5], [-1, 2, 4]]), ValueError, r"block_table\[1\] must name pages of k"),
    ("packed", dict(cu_seqlens_k=[2, 40, 50]), ValueError, r"cu_seqlens_k must start at 0"),
    ("packed", dict(cu_seqlens_k=[0, 51, 50]), ValueError, r"cu_seqlens_k must be non-decreasing"),
    ("packed", dict(cu_seqlens_k=[0, 40, 51]), ValueError, r"cu_seqlens_k\[-1\] must equal the packed length of k"),
    ("packed", dict(cu_seqlens_k=[0, 9, 50]), ValueError, r"max_seqlen_k must be at least the longest sequence"),
    ("packed", dict(seqused_k=[41, 7]), ValueError, r"seqused_k must be between 0 and each sequence's key count"),
    ("packed", dict(cu_seqlens_q=[0, 13, 12]), ValueError, r"cu_seqlens_q must be non-decreasing"),
    ("fixed", dict(seqused_k=[17, 3]), ValueError, r"seqused_k must be between 0 and each sequence's key count"),
]


@pytest.mark.parametrize("case, values, err, match", BAD_VALUES,
                         ids=[f"{c}-{'-'.join(v)}-{m[:24]}" for c, v, _, m in BAD_VALUES])
def test_a_hit_refuses_bad_values_as_the_full_path_does(fast_path, case, values, err, match):
    """Values the full path refuses (NumPy arrays on the reference backend: validation) are refused by a hit on
    the plan of good values of the same layouts and maxima, with the same message, and nothing runs."""
    given = {} if case == "fixed" else GIVEN
    with pytest.raises(err, match=match):
        _forward(_host(case, **values), backend="reference", **given)
    cache = fast_path(case, **given)
    _forward(_device(_host(case)), **given)
    assert len(cache.plan.runs) == 1
    with pytest.raises(err, match=match):
        _forward(_device(_host(case, **values)), **given)
    assert cache.keys[-1] == cache.keys[0], "a hit: the planned call's key"
    assert len(cache.plan.runs) == 1, "nothing ran"


@pytest.mark.parametrize("case, values, match", [
    ("paged", dict(block_table=[[3, 0, 6], [1, 2, 4]]), r"block_table\[0\] must name pages of k"),
    ("packed", dict(seqused_k=[41, 7]), r"seqused_k must be between 0 and each sequence's key count")])
def test_a_hit_of_computed_maxima_refuses_bad_values(fast_path, case, values, match):
    """Without max_seqlen given, bad values whose maxima are the planned ones (a table entry outside the pool;
    seqused_k past its sequence's keys, where the offsets give the maximum) hit, and are refused."""
    cache = fast_path(case)
    _forward(_device(_host(case)))
    with pytest.raises(ValueError, match=match):
        _forward(_device(_host(case, **values)))
    assert cache.keys[-1] == cache.keys[0] and len(cache.plan.runs) == 1


def test_a_backward_hit_refuses_bad_values(monkeypatch, fast_path):
    """The backward's key holds the same layouts and maxima; a hit checks the values as its full path does."""
    import rawflash

    cache = fast_path("packed")
    host = _host("packed")
    rows = FakeDeviceArray((2, 12), np.float32, 9 << 20)

    def backward(dev):
        return rawflash.backward(dev["q"], dev["q"], dev["k"], dev["v"], dev["q"], rows, causal=True,
                                 cu_seqlens_q=dev["cu_seqlens_q"], cu_seqlens_k=dev["cu_seqlens_k"],
                                 seqused_k=dev["seqused_k"])

    backward(_device(host))
    backward(_device(_host("packed", cu_seqlens_k=[0, 10, 50], seqused_k=[3, 40])))
    assert cache.keys[0] == cache.keys[1] and len(cache.plan.runs) == 2
    with pytest.raises(ValueError, match="seqused_k must be between 0 and each sequence's key count"):
        backward(_device(_host("packed", cu_seqlens_k=[0, 10, 50], seqused_k=[40, 3])))
    assert cache.keys[2] == cache.keys[0] and len(cache.plan.runs) == 2


def test_each_value_array_is_read_once_a_call(monkeypatch, fast_path):
    """A hit copies each of its offsets, lengths and table to the host once (the key's maxima and the checks read
    the same copy); a miss hands that copy to validation, which reads none of its own."""
    from rawflash import validation

    cache = fast_path("paged")
    dev = _device(_host("paged"))
    _forward(dev)
    assert len(cache.plan.runs) == 1
    assert {n: x.reads for n, x in dev.items() if isinstance(x, FakeHostValues)} == \
        {"cu_seqlens_q": 1, "seqused_k": 1, "block_table": 1}
    cache.plan = None  # a miss: the full path
    seen = []

    def check_forward(q, k, v, causal, scale, kernel, backend, features):
        seen.append(features.values)
        raise RuntimeError("validated")

    monkeypatch.setattr(validation, "check_forward", check_forward)
    dev = _device(_host("paged"))
    with pytest.raises(RuntimeError, match="validated"):
        _forward(dev)
    assert [x.reads for x in dev.values() if isinstance(x, FakeHostValues)] == [1, 1, 1]
    np.testing.assert_array_equal(seen[0].block_table, PAGED_HOST["block_table"])


def test_validation_checks_the_values_it_is_handed():
    """check_forward checks the host copies a caller hands it (Features.values), not the arrays again."""
    from rawflash import validation

    args = _host("paged")
    feats = {n: x for n, x in args.items() if n not in ("q", "k", "v")}
    bad = validation.read_values(args["cu_seqlens_q"], None, np.array([49, 7], np.int32), args["block_table"])
    with pytest.raises(ValueError, match="seqused_k must be between"):
        validation.check_forward(args["q"], args["k"], args["v"], True, None, "fa2", "reference",
                                 validation.Features(**feats, values=bad))


def test_the_launches_read_no_lengths():
    """Problem.lengths (each packed sequence's, known on the host) is introspection's: the plans and parameter
    structs of problems that differ only there are equal, so a planned call's launches hold for new lengths."""
    p = dataclasses.replace(PAGED, lengths=((5, 40), (7, 7)))
    other = dataclasses.replace(p, lengths=((7, 33), (5, 2)))
    assert forms.forward_plan(p) == forms.forward_plan(other)
    packed = Problem(2, 7, 40, 4, 2, 64, "bfloat16", True, varlen=True, total_q=12, total_k=50, seqused_k=True,
                     lengths=((5, 40), (7, 7)))
    again = dataclasses.replace(packed, lengths=((7, 10), (5, 40)))
    assert forms.forward_plan(packed) == forms.forward_plan(again)
    assert forms.backward_plan(packed) == forms.backward_plan(again)
    a = _paged_call(1 << 32)
    feats = {n: a[n] for n in ("cu_seqlens_q", "seqused_k", "block_table", "tile_counter")}
    assert params.fwd_params(p, a["q"], a["k"], a["v"], a["o"], a["lse"], 0.125, **feats).tobytes() == \
        params.fwd_params(other, a["q"], a["k"], a["v"], a["o"], a["lse"], 0.125, **feats).tobytes()


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
