"""Planned calls on a GPU: a call of a known signature (CuPy arrays, the plan cache hit) launches exactly what the
full path binds, writes into caller-provided outputs, survives threads and CUDA graph capture, and still refuses
what the full path refuses."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import rawflash
from rawflash import api, reference
from conftest import random_qkv

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")


def _device(*xs):
    return [cupy.asarray(x) for x in xs]


def _features(case: str, batch: int, sq: int, sk: int, h: int) -> dict:
    rng = np.random.default_rng(1)
    if case == "plain":
        return {}
    if case == "window-softcap":
        return {"window": (37, 5), "softcap": 20.0}
    if case == "alibi-sinks":
        return {"alibi_slopes": cupy.asarray(rng.uniform(0.1, 1.0, h).astype(np.float32)),
                "sinks": cupy.asarray(rng.standard_normal(h).astype(np.float32))}
    if case == "seqused":
        return {"seqused_k": cupy.asarray(np.array([sk, sk // 2][:batch], dtype=np.int32))}
    raise ValueError(case)


FORWARD_CASES = [
    # (batch, sq, sk, h, hk, d, dtype, causal, features)
    (2, 203, 113, 4, 2, 128, "bfloat16", True, "plain"),
    (2, 113, 203, 4, 1, 64, "float16", False, "plain"),
    (2, 128, 256, 4, 4, 256, "bfloat16", True, "window-softcap"),
    (2, 96, 160, 4, 2, 128, "bfloat16", False, "alibi-sinks"),
    (2, 77, 131, 4, 2, 64, "float16", True, "seqused"),
    (2, 65, 65, 2, 2, 59, "float16", False, "plain"),      # head_dim padded
    (1, 100, 100, 2, 1, 96, "float32", True, "plain"),     # the mma.sync form
]


def _ids(cases):
    return [f"{c[6]}-d{c[5]}-{'causal' if c[7] else 'full'}-{c[8]}-{c[1]}x{c[2]}-h{c[3]}/{c[4]}" for c in cases]


def _bound_forward(q, k, v, causal, **options):
    """The full path's binding launched by CuPy (``Bound.launch``): what a planned call must equal bit for bit."""
    from rawflash import settings, validation
    from rawflash.kernels import cupy_backend, forms

    feats = api._features(options.get("window", (-1, -1)), options.get("softcap", 0.0),
                          options.get("alibi_slopes"), options.get("sinks"), None, None, None, None,
                          options.get("seqused_k"))
    c = validation.check_forward(q, k, v, causal, None, "fa2", "cupy", feats)
    bound = cupy_backend.bind_forward(c.problem, q, k, v, c.scale, "fa2", forms.Switches(), c.extras,
                                      settings.load())
    bound.launch()
    return bound.result()


@pytest.mark.parametrize("batch,sq,sk,h,hk,d,dtype,causal,case", FORWARD_CASES, ids=_ids(FORWARD_CASES))
def test_planned_forward_equals_the_bound_launches(batch, sq, sk, h, hk, d, dtype, causal, case):
    rawflash.clear_cache()
    options = _features(case, batch, sq, sk, h)
    q, k, v = _device(*random_qkv(batch, sq, sk, h, hk, d, dtype, seed=3))
    first = rawflash.forward(q, k, v, causal=causal, **options)  # a miss: planned, then run as planned
    hits = api.PLANS.hits
    q2, k2, v2 = _device(*random_qkv(batch, sq, sk, h, hk, d, dtype, seed=4))
    second = rawflash.forward(q2, k2, v2, causal=causal, **options)
    assert api.PLANS.hits == hits + 1, "the second call of a signature is a hit"
    for got, (q_, k_, v_) in ((first, (q, k, v)), (second, (q2, k2, v2))):
        want = _bound_forward(q_, k_, v_, causal, **options)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            assert bool(cupy.all((g == w) | (cupy.isnan(g) & cupy.isnan(w)))), "planned != bound launches"
    ref_out, _ = reference.forward(q2.get(), k2.get(), v2.get(), causal=causal,
                                   **{n: (x.get() if hasattr(x, "get") else x) for n, x in options.items()})
    base, _ = reference.forward(q2.get(), k2.get(), v2.get(), causal=causal, upcast=False,
                                **{n: (x.get() if hasattr(x, "get") else x) for n, x in options.items()})
    ok, err, base_err, bound = reference.error_ratio_ok(second[0].get(), ref_out, base, q.dtype, 2)
    assert ok, f"out: max error {err:.3g} > bound {bound:.3g}"


BACKWARD_CASES = [c for c in FORWARD_CASES if c[6] != "float32"] + [(1, 100, 100, 2, 1, 96, "float32", True, "plain")]


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic"])
@pytest.mark.parametrize("batch,sq,sk,h,hk,d,dtype,causal,case", BACKWARD_CASES, ids=_ids(BACKWARD_CASES))
def test_planned_backward_matches(batch, sq, sk, h, hk, d, dtype, causal, case, deterministic):
    rawflash.clear_cache()
    options = _features(case, batch, sq, sk, h)
    q, k, v = _device(*random_qkv(batch, sq, sk, h, hk, d, dtype, seed=5))
    dout = cupy.asarray(random_qkv(batch, sq, sk, h, hk, d, dtype, seed=6)[0])
    out, lse = rawflash.forward(q, k, v, causal=causal, **options)
    grads = [rawflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic, **options)
             for _ in range(3)]  # a miss, then two hits
    assert api.PLANS.hits >= 2
    host = {n: (x.get() if hasattr(x, "get") else x) for n, x in options.items()}
    want = reference.backward(dout.get(), q.get(), k.get(), v.get(), causal=causal, **host)
    base = reference.backward(dout.get(), q.get(), k.get(), v.get(), causal=causal, upcast=False, **host)
    for g, w, b in zip(grads[-1], want, base):
        ok, err, base_err, bound = reference.error_ratio_ok(g.get(), w, b, q.dtype, 3)
        assert ok, f"gradient: max error {err:.3g} > bound {bound:.3g}"
    if deterministic:
        for a, b in zip(grads[0], grads[2]):
            assert bool(cupy.all(a == b)), "deterministic=True repeats bit for bit through the plan"


def test_outputs_are_written_in_place():
    rawflash.clear_cache()
    q, k, v = _device(*random_qkv(2, 130, 190, 4, 2, 128, "bfloat16", seed=7))
    want_out, want_lse = rawflash.forward(q, k, v, causal=True)
    for _ in range(2):  # a miss, then a hit of the signature with out= and lse=
        out, lse = cupy.empty_like(q), cupy.empty((2, 4, 130), cupy.float32)
        got = rawflash.forward(q, k, v, causal=True, out=out, lse=lse)
        assert got[0] is out and got[1] is lse
        assert bool(cupy.all(out == want_out)) and bool(cupy.all(lse == want_lse))
    strided = cupy.empty((2, 4, 130, 128), q.dtype).transpose(0, 2, 1, 3)  # another layout: written, or copied in
    assert rawflash.forward(q, k, v, causal=True, out=strided)[0] is strided
    assert bool(cupy.all(strided == want_out))
    dout = cupy.asarray(random_qkv(2, 130, 190, 4, 2, 128, "bfloat16", seed=8)[0])
    want = rawflash.backward(dout, q, k, v, want_out, want_lse, causal=True, deterministic=True)
    for _ in range(2):
        dq, dk, dv = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)
        got = rawflash.backward(dout, q, k, v, want_out, want_lse, causal=True, deterministic=True, dq=dq, dk=dk,
                                dv=dv)
        assert got[0] is dq and got[1] is dk and got[2] is dv
        for g, w in zip(got, want):
            assert bool(cupy.all(g == w))
    with pytest.raises(ValueError, match="lse must be C-contiguous"):
        rawflash.forward(q, k, v, out=out, lse=cupy.empty((2, 130, 4), cupy.float32).transpose(0, 2, 1))
    with pytest.raises(TypeError, match="out must have dtype bfloat16"):
        rawflash.forward(q, k, v, out=cupy.empty(q.shape, cupy.float16))


def test_a_hit_refuses_what_the_full_path_refuses():
    rawflash.clear_cache()
    q, k, v = _device(*random_qkv(1, 64, 64, 2, 2, 64, "float16", seed=9))
    rawflash.forward(q, k, v, causal=True)
    with pytest.raises(TypeError, match="causal must be a bool"):
        rawflash.forward(q, k, v, causal=1)  # equal to True as a dict key, refused by its type
    with pytest.raises(TypeError, match="scale must be"):
        rawflash.forward(q, k, v, causal=True, scale=True)
    kc = cupy.asarray(random_qkv(2, 1, 64, 4, 1, 64, "bfloat16")[1])
    q1 = cupy.asarray(random_qkv(2, 1, 64, 4, 1, 64, "bfloat16")[0])
    rawflash.decode(q1, kc, kc.copy(), cache_seqlens=10)
    rawflash.decode(q1, kc, kc.copy(), cache_seqlens=64)  # a hit with another int
    with pytest.raises(ValueError, match="cache_seqlens"):
        rawflash.decode(q1, kc, kc.copy(), cache_seqlens=65)
    misaligned = cupy.empty(q.size + 1, q.dtype)[1:].reshape(q.shape)  # another alignment: another plan
    misaligned[...] = q
    a = rawflash.forward(misaligned, k, v, causal=True)[0]
    assert bool(cupy.all(a == rawflash.forward(q, k, v, causal=True)[0]))


def test_threads_share_plans():
    rawflash.clear_cache()
    inputs = [_device(*random_qkv(2, 150, 150, 4, 2, 64, "bfloat16", seed=s)) for s in range(4)]
    want = [rawflash.forward(*x, causal=True)[0] for x in inputs]
    cupy.cuda.Device().synchronize()
    errors = []

    def work(i):
        try:
            stream = cupy.cuda.Stream(non_blocking=True)
            with stream:
                for _ in range(20):
                    got = rawflash.forward(*inputs[i], causal=True)[0]
                stream.synchronize()
            if not bool(cupy.all(got == want[i])):
                errors.append(f"thread {i}: wrong result")
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(f"thread {i}: {e!r}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def _capture(fn):
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()  # planned (and compiled) outside the capture
        stream.synchronize()
        stream.begin_capture()
        result = fn()
        graph = stream.end_capture()
    return stream, graph, result


def test_forward_and_backward_replay_from_a_graph():
    rawflash.clear_cache()
    shape = (2, 256, 4, 2, 128)
    q, k, v = _device(*random_qkv(2, 256, 256, 4, 2, 128, "bfloat16", seed=10))
    dout = cupy.asarray(random_qkv(2, 256, 256, 4, 2, 128, "bfloat16", seed=11)[0])
    out, lse = cupy.empty_like(q), cupy.empty((2, 4, 256), cupy.float32)
    dq, dk, dv = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)

    def step():
        rawflash.forward(q, k, v, causal=True, out=out, lse=lse)
        return rawflash.backward(dout, q, k, v, out, lse, causal=True, deterministic=True, dq=dq, dk=dk, dv=dv)

    stream, graph, _ = _capture(step)
    for seed in (12, 13):
        new = random_qkv(2, 256, 256, 4, 2, 128, "bfloat16", seed=seed)
        for dst, src in zip((q, k, v), new):
            dst[...] = cupy.asarray(src)
        with stream:
            graph.launch()
            stream.synchronize()
        want_out, want_lse = rawflash.forward(q, k, v, causal=True)
        assert bool(cupy.all(out == want_out)) and bool(cupy.all(lse == want_lse))
        want = rawflash.backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
        for g, w in zip((dq, dk, dv), want):
            assert bool(cupy.all(g == w))
    assert shape


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_a_64_step_decode_loop_replays_from_one_graph(paged):
    """64 decode steps (append one key and value, attend, advance cache_seqlens on the device) captured once; the
    replay's outputs and caches equal the same steps run eagerly on a copy of the caches."""
    rawflash.clear_cache()
    rng = np.random.default_rng(14)
    batch, heads, kv_heads, d, capacity, steps, page = 3, 8, 2, 128, 256, 64, 64
    bf16 = random_qkv(1, 1, 1, 1, 1, 1, "bfloat16")[0].dtype
    start = np.array([5, 70, 130], dtype=np.int32)

    def fresh_cache():
        if paged:
            pages = batch * capacity // page
            table = rng.permutation(pages).astype(np.int32).reshape(batch, capacity // page)
            shape = (pages, page, kv_heads, d)
        else:
            table, shape = None, (batch, capacity, kv_heads, d)
        k = rng.standard_normal(shape).astype(bf16)
        v = rng.standard_normal(shape).astype(bf16)
        return cupy.asarray(k), cupy.asarray(v), None if table is None else cupy.asarray(table)

    k_cache, v_cache, table = fresh_cache()
    k_eager, v_eager = k_cache.copy(), v_cache.copy()
    qs = cupy.asarray(rng.standard_normal((steps, batch, 1, heads, d)).astype(bf16))
    k_news = cupy.asarray(rng.standard_normal((steps, batch, 1, kv_heads, d)).astype(bf16))
    v_news = cupy.asarray(rng.standard_normal((steps, batch, 1, kv_heads, d)).astype(bf16))
    q, k_new, v_new = qs[0].copy(), k_news[0].copy(), v_news[0].copy()
    lens = cupy.asarray(start)
    outs = cupy.empty((steps, batch, 1, heads, d), bf16)

    def loop():
        for t in range(steps):
            q[...], k_new[...], v_new[...] = qs[t], k_news[t], v_news[t]
            rawflash.decode(q, k_cache, v_cache, cache_seqlens=lens, k_new=k_new, v_new=v_new, block_table=table,
                            out=outs[t])
            cupy.add(lens, 1, out=lens)

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        rawflash.decode(q, k_eager.copy(), v_eager.copy(), cache_seqlens=lens, k_new=k_new, v_new=v_new,
                        block_table=table, out=outs[0])  # plan and compile outside the capture
        stream.synchronize()
        stream.begin_capture()
        loop()
        graph = stream.end_capture()
        lens[...] = cupy.asarray(start)
        graph.launch()
        stream.synchronize()
    eager_lens = cupy.asarray(start)
    for t in range(steps):
        want = rawflash.decode(qs[t], k_eager, v_eager, cache_seqlens=eager_lens, k_new=k_news[t],
                               v_new=v_news[t], block_table=table)
        assert bool(cupy.all(outs[t] == want)), f"step {t}"
        eager_lens += 1
    assert bool(cupy.all(lens == eager_lens))
    assert bool(cupy.all(k_cache == k_eager)) and bool(cupy.all(v_cache == v_eager))


def test_decode_step_replays_while_cache_seqlens_grows():
    """One captured step replayed 64 times, cache_seqlens advanced on the device between replays."""
    rawflash.clear_cache()
    rng = np.random.default_rng(15)
    bf16 = random_qkv(1, 1, 1, 1, 1, 1, "bfloat16")[0].dtype
    k_cache = cupy.asarray(rng.standard_normal((2, 128, 1, 64)).astype(bf16))
    v_cache = cupy.asarray(rng.standard_normal((2, 128, 1, 64)).astype(bf16))
    q = cupy.asarray(rng.standard_normal((2, 1, 8, 64)).astype(bf16))
    lens = cupy.asarray(np.array([1, 40], dtype=np.int32))
    out = cupy.empty_like(q)
    stream, graph, _ = _capture(lambda: rawflash.decode(q, k_cache, v_cache, cache_seqlens=lens, out=out))
    for _ in range(64):
        with stream:
            graph.launch()
            stream.synchronize()
        want = rawflash.decode(q, k_cache, v_cache, cache_seqlens=lens)
        assert bool(cupy.all(out == want))
        lens += 1


def test_explicit_plans_run_what_the_calls_run():
    rawflash.clear_cache()
    q, k, v = _device(*random_qkv(2, 140, 200, 4, 2, 64, "bfloat16", seed=16))
    plan = rawflash.plan_forward(q, k, v, causal=True, window=(50, 0))
    want = rawflash.forward(q, k, v, causal=True, window=(50, 0))
    got = plan.run(q, k, v)
    assert bool(cupy.all(got[0] == want[0])) and bool(cupy.all(got[1] == want[1]))
    with pytest.raises(ValueError, match="do not match the plan"):
        plan.run(q[:, :100], k, v)
    rng = np.random.default_rng(17)
    bf16 = q.dtype
    k_cache = cupy.asarray(rng.standard_normal((2, 96, 2, 64)).astype(bf16))
    v_cache = cupy.asarray(rng.standard_normal((2, 96, 2, 64)).astype(bf16))
    q1 = cupy.asarray(rng.standard_normal((2, 1, 4, 64)).astype(bf16))
    step = rawflash.plan_decode(q1, k_cache, v_cache, cache_seqlens=7, return_lse=True)
    for lens in (7, 50, 96):
        out, lse = step.run(q1, k_cache, v_cache, lens)
        want_out, want_lse = rawflash.decode(q1, k_cache, v_cache, cache_seqlens=lens, return_lse=True)
        assert bool(cupy.all(out == want_out)) and bool(cupy.all(lse == want_lse))
    with pytest.raises(ValueError, match="cache_seqlens"):
        step.run(q1, k_cache, v_cache, 97)


def test_the_readme_decode_graph_pattern():
    """README's "Calls in a loop": a planned step run once eagerly, one step captured, replayed 63 times with the
    step's q, k1, v1 written in place between replays; equal to 64 eager decode calls on a copy of the cache."""
    rawflash.clear_cache()
    rng = np.random.default_rng(18)
    bf16 = random_qkv(1, 1, 1, 1, 1, 1, "bfloat16")[0].dtype
    k_cache = cupy.asarray(rng.standard_normal((2, 128, 2, 64)).astype(bf16))
    v_cache = cupy.asarray(rng.standard_normal((2, 128, 2, 64)).astype(bf16))
    k_eager, v_eager = k_cache.copy(), v_cache.copy()
    qs, k1s, v1s = (cupy.asarray(rng.standard_normal((64, 2, 1, h, 64)).astype(bf16)) for h in (8, 2, 2))
    q, k1, v1, out = qs[0].copy(), k1s[0].copy(), v1s[0].copy(), cupy.empty((2, 1, 8, 64), bf16)
    lens = cupy.asarray(np.array([3, 20], dtype=np.int32))
    eager_lens = lens.copy()
    step = rawflash.plan_decode(q, k_cache, v_cache, cache_seqlens=lens, k_new=k1, v_new=v1, out=out)
    stream = cupy.cuda.Stream(non_blocking=True)
    outs = []
    with stream:
        step.run(q, k_cache, v_cache, lens, k_new=k1, v_new=v1, out=out)
        lens += 1
        outs.append(out.copy())
        stream.begin_capture()
        step.run(q, k_cache, v_cache, lens, k_new=k1, v_new=v1, out=out)
        lens += 1
        graph = stream.end_capture()
        for t in range(1, 64):
            q[...], k1[...], v1[...] = qs[t], k1s[t], v1s[t]
            graph.launch(stream)
            outs.append(out.copy())
        stream.synchronize()
    for t in range(64):
        want = rawflash.decode(qs[t], k_eager, v_eager, cache_seqlens=eager_lens, k_new=k1s[t], v_new=v1s[t])
        eager_lens += 1
        assert bool(cupy.all(outs[t] == want)), f"step {t}"
    assert bool(cupy.all(k_cache == k_eager)) and bool(cupy.all(lens == eager_lens))


# Packed calls of one layout with new offsets and seqused_k each call: 3 sequences, 300 query and 420 key rows in
# all, the longest always 160 queries and 200 keys (so the same maxima).
PACKED_LENGTHS = [((100, 40, 160), (200, 20, 200), (150, 20, 0)),
                  ((160, 140, 0), (20, 200, 200), (20, 199, 200)),
                  ((40, 160, 100), (200, 200, 20), (1, 200, 7))]


def _packed_call(qlens, klens, used, seed):
    """Host q, k, v, dout (bfloat16, 4 heads over 2 kv heads, d = 128) and the call's offsets and seqused_k."""
    q, k, v = random_qkv(1, sum(qlens), sum(klens), 4, 2, 128, "bfloat16", seed=seed)
    dout = random_qkv(1, sum(qlens), sum(klens), 4, 2, 128, "bfloat16", seed=seed + 1)[0][0]
    offsets = {"cu_seqlens_q": np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32),
               "cu_seqlens_k": np.concatenate([[0], np.cumsum(klens)]).astype(np.int32),
               "seqused_k": np.asarray(used, np.int32)}
    return (q[0], k[0], v[0], dout), offsets


def test_new_packed_lengths_each_call_run_one_plan():
    """A loop of packed forwards and backwards with new cu_seqlens_q / _k and seqused_k each call (same layouts and
    maxima) makes one plan a direction: every later call hits it, and each result is its own lengths' (the float64
    reference, by flash-attn's rule)."""
    rawflash.clear_cache()
    for i, (qlens, klens, used) in enumerate(PACKED_LENGTHS):
        (q, k, v, dout), offsets = _packed_call(qlens, klens, used, seed=20 + 2 * i)
        dev = {n: cupy.asarray(x) for n, x in offsets.items()}
        gq, gk, gv, gdout = _device(q, k, v, dout)
        out, lse = rawflash.forward(gq, gk, gv, causal=True, **dev)
        grads = rawflash.backward(gdout, gq, gk, gv, out, lse, causal=True, **dev)
        assert (len(api.PLANS), api.PLANS.hits) == (2, 2 * i), "one plan a direction, every later call a hit"
        ref = reference.forward(q, k, v, causal=True, **offsets)
        base = reference.forward(q, k, v, causal=True, upcast=False, **offsets)
        for what, got, want, plain in zip(("out", "lse"), (out, lse), ref, base):
            ok, err, _, bound = reference.error_ratio_ok(got.get(), want, plain, q.dtype, 2)
            assert ok, f"call {i} {what}: max error {err:.3g} > bound {bound:.3g}"
        want = reference.backward(dout, q, k, v, causal=True, **offsets)
        plain = reference.backward(dout, q, k, v, causal=True, upcast=False, **offsets)
        for name, g, w, b in zip(("dq", "dk", "dv"), grads, want, plain):
            ok, err, _, bound = reference.error_ratio_ok(g.get(), w, b, q.dtype, 3)
            assert ok, f"call {i} {name}: max error {err:.3g} > bound {bound:.3g}"


def test_a_bad_packed_value_after_a_good_plan_launches_nothing():
    """A hit whose seqused_k runs past a sequence's keys, or whose offsets decrease, is refused with the full
    path's message before anything is launched (``out`` keeps what it held)."""
    rawflash.clear_cache()
    (q, k, v, _), offsets = _packed_call(*PACKED_LENGTHS[0], seed=30)
    dev = {n: cupy.asarray(x) for n, x in offsets.items()}
    gq, gk, gv = _device(q, k, v)
    out = cupy.empty(gq.shape, gq.dtype)
    rawflash.forward(gq, gk, gv, causal=True, out=out, **dev)
    sentinel = cupy.asarray(np.full(q.shape, 7, q.dtype))
    out[...] = sentinel
    bad = [("seqused_k", [150, 21, 0], "seqused_k must be between 0 and each sequence's key count"),
           ("cu_seqlens_q", [0, 150, 140, 300], "cu_seqlens_q must be non-decreasing")]
    for name, values, match in bad:
        given = dict(dev, **{name: cupy.asarray(np.asarray(values, np.int32))})
        hits = api.PLANS.hits
        with pytest.raises(ValueError, match=match):
            rawflash.forward(gq, gk, gv, causal=True, out=out, **given)
        assert api.PLANS.hits == hits + 1 and len(api.PLANS) == 1, "refused on a hit"
    cupy.cuda.get_current_stream().synchronize()
    assert bool(cupy.all(out.view(cupy.uint16) == sentinel.view(cupy.uint16))), "nothing launched"
