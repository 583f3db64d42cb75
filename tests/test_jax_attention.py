"""rawflash.jax.attention: lowering for CUDA and validation at trace time (CPU), results and gradients (GPU)."""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
pytest.importorskip("cupy")

from rawflash import reference  # noqa: E402
from rawflash.jax import ops as jattention  # noqa: E402
from rawflash.jax import targets  # noqa: E402


def _lowered(fn, *avals) -> str:
    return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()


def _custom_calls(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if "stablehlo.custom_call" in line]


BF16 = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)


def test_forward_lowers_to_one_custom_call_with_the_options():
    calls = _custom_calls(_lowered(lambda q, k, v: jattention.attention(q, k, v, causal=True, window=(32, 0)),
                                   BF16, BF16, BF16))
    assert len(calls) == 1 and "@rawflash_forward(%arg0, %arg1, %arg2)" in calls[0]
    for attr in ("causal = true", "window_left = 32 : i64", "window_right = 0 : i64", "scale = 1.250000e-01",
                 "sinks = false"):
        assert attr in calls[0], attr


def test_gradient_lowers_to_forward_and_backward_with_the_sinks():
    def loss(q, k, v):
        return jattention.attention(q, k, v, sinks=jnp.zeros(4), softcap=30.0).astype(jnp.float32).sum()

    calls = _custom_calls(_lowered(jax.grad(loss, argnums=(0, 1, 2)), BF16, BF16, BF16))
    assert [c.split("@")[1].split("(")[0] for c in calls] == ["rawflash_forward", "rawflash_backward"]
    backward = calls[1]
    assert backward.count("%") >= 7  # dout, q, k, v, out, lse, sinks
    assert "sinks = true" in backward and "softcap = 3.000000e+01" in backward
    # results: dq, dk, dv, the workspace and the sinks' per-row terms
    assert backward.split("=")[0].strip().endswith(":5")


def test_mla_pads_v_and_cuts_out_and_dv():
    """v narrower than q (MLA): out has v's head_dim; the custom calls run v zero-padded to q's, and dv comes back
    at v's head_dim (the pad's gradient)."""
    qa = jax.ShapeDtypeStruct((1, 64, 4, 192), jnp.bfloat16)
    va = jax.ShapeDtypeStruct((1, 64, 4, 128), jnp.bfloat16)
    assert jax.eval_shape(lambda q, v: jattention.attention(q, q, v, causal=True), qa, va).shape == (1, 64, 4, 128)

    def loss(q, k, v):
        return jattention.attention(q, k, v, causal=True).astype(jnp.float32).sum()

    grads = jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), qa, qa, va)
    assert [g.shape for g in grads] == [(1, 64, 4, 192), (1, 64, 4, 192), (1, 64, 4, 128)]
    text = _lowered(jax.grad(loss, argnums=(0, 1, 2)), qa, qa, va)
    calls = _custom_calls(text)
    assert [c.split("@")[1].split("(")[0] for c in calls] == ["rawflash_forward", "rawflash_backward"]
    assert "tensor<1x64x4x192xbf16>" in calls[0] and "tensor<1x64x4x128xbf16>" not in calls[0]
    with pytest.raises(ValueError, match=r"v's head_dim must be between 1 and q's head_dim 128, got 192"):
        jax.eval_shape(lambda q, v: jattention.attention(q, q, v), va, qa)


def test_padded_head_dim_pads_and_cuts():
    aval = jax.ShapeDtypeStruct((1, 64, 2, 36), jnp.float16)
    out = jax.eval_shape(lambda q: jattention.attention(q, q, q), aval)
    assert out.shape == (1, 64, 2, 36)
    text = _lowered(lambda q: jattention.attention(q, q, q), aval)
    assert "tensor<1x64x2x40xf16>" in text


@pytest.mark.parametrize("kwargs, message", [
    (dict(k=(2, 128, 3, 64)), "same number of kv heads"),
    (dict(causal=1), "causal"),
    (dict(window=(-2, 0)), "window"),
    (dict(softcap=-1.0), "softcap"),
    (dict(deterministic="yes"), "deterministic"),
])
def test_invalid_input_is_refused_at_trace_time(kwargs, message):
    shape_k = kwargs.pop("k", (2, 128, 4, 64))
    q = jnp.zeros((2, 128, 4, 64), jnp.bfloat16)
    k = jnp.zeros(shape_k, jnp.bfloat16)
    with pytest.raises((ValueError, TypeError), match=message):
        jax.eval_shape(lambda q, k: jattention.attention(q, k, q, **kwargs), q, k)


def test_vmap_and_leading_axes_fold_into_one_launch():
    aval = jax.ShapeDtypeStruct((3, 2, 128, 4, 64), jnp.bfloat16)
    for fn in (jax.vmap(lambda q, k, v: jattention.attention(q, k, v, causal=True)),
               lambda q, k, v: jattention.attention(q, k, v, causal=True)):
        calls = _custom_calls(_lowered(fn, aval, aval, aval))
        assert len(calls) == 1 and "tensor<6x128x4x64xbf16>" in calls[0]


def test_vmap_over_sinks_is_refused():
    q = jax.ShapeDtypeStruct((3, 1, 64, 4, 64), jnp.bfloat16)
    sinks = jax.ShapeDtypeStruct((3, 4), jnp.float32)
    with pytest.raises(ValueError, match="vmap over sinks"):
        jax.eval_shape(jax.vmap(lambda q, s: jattention.attention(q, q, q, sinks=s)), q, sinks)


def test_lse_cotangent_runs_the_backward_one_column_wider():
    def loss(q, k, v):
        out, lse = jattention.attention(q, k, v, causal=True, return_lse=True)
        return out.astype(jnp.float32).sum() + lse.sum()

    calls = _custom_calls(_lowered(jax.grad(loss, argnums=(0, 1, 2)), BF16, BF16, BF16))
    backward = [c for c in calls if "@rawflash_backward" in c]
    assert len(backward) == 1 and "tensor<2x128x4x72xbf16>" in backward[0]  # 64 + 1 rounded up to 72
    plain = _custom_calls(_lowered(jax.grad(lambda q, k, v: jattention.attention(q, k, v).astype(jnp.float32).sum(),
                                            argnums=(0, 1, 2)), BF16, BF16, BF16))
    assert "tensor<2x128x4x72xbf16>" not in plain[1]


def test_decode_lowers_with_the_caches_aliased():
    q = jax.ShapeDtypeStruct((4, 1, 8, 128), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((4, 1024, 2, 128), jnp.bfloat16)
    new = jax.ShapeDtypeStruct((4, 1, 2, 128), jnp.bfloat16)
    lens = jax.ShapeDtypeStruct((4,), jnp.int32)
    text = _lowered(lambda q, kc, vc, n, lens: jattention.decode(q, kc, vc, lens, k_new=n, v_new=n), q, cache, cache,
                    new, lens)
    calls = _custom_calls(text)
    assert len(calls) == 1 and "@rawflash_decode" in calls[0] and "appends = true" in calls[0]
    assert "output_operand_aliases" in calls[0]
    with pytest.raises(ValueError, match="k_cache and v_cache"):
        jax.eval_shape(lambda q, kc, lens: jattention.decode(q, kc, kc[:, :512], lens), q, cache, lens)


def test_packed_sequences_lower_with_their_offsets_and_maxima():
    q = jax.ShapeDtypeStruct((300, 4, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((500, 2, 64), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((4,), jnp.int32)

    def loss(q, k, v, cu_q, cu_k):
        out = jattention.attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=200,
                                   max_seqlen_k=300)
        return out.astype(jnp.float32).sum()

    calls = _custom_calls(_lowered(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, cu, cu))
    assert [c.split("@")[1].split("(")[0] for c in calls] == ["rawflash_forward", "rawflash_backward"]
    for call in calls:
        assert "varlen = true" in call and "max_seqlen_q = 200" in call and "max_seqlen_k = 300" in call
    assert "%arg3, %arg4" in calls[0]  # the offsets are operands: device values the kernels read
    assert "tensor<4x300xf32>" in calls[0]  # lse (heads, total_q)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_seqlen_q=None), "max_seqlen_q"),
    (dict(max_seqlen_q=50), "cannot hold"),
    (dict(max_seqlen_k=2.5), "max_seqlen_k must be a Python int"),
])
def test_packed_sequences_refused_at_trace_time(kwargs, message):
    q = jnp.zeros((300, 4, 64), jnp.bfloat16)
    k = jnp.zeros((500, 2, 64), jnp.bfloat16)
    cu = jnp.zeros(4, jnp.int32)
    opts = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=200, max_seqlen_k=300, **{})
    opts.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=message):
        jax.eval_shape(lambda q, k: jattention.attention(q, k, k, **opts), q, k)


def _readme_example() -> str:
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    return next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "from rawflash.jax import" in b)


def test_readme_example_lowers_for_cuda():
    code = _readme_example()
    names: dict = {}
    exec(code.rsplit("\nw, l = step(", 1)[0], names)  # everything but the call: no GPU here
    w, step = names["w"], names["step"]
    x = jax.ShapeDtypeStruct((4, 2048, 1024), jnp.float32)
    calls = _custom_calls(step.trace(w, x).lower(lowering_platforms=("cuda",)).as_text())
    assert [c.split("@")[1].split("(")[0] for c in calls] == ["rawflash_forward", "rawflash_backward"]
    assert "window_left = 1024" in calls[0]


def test_workspace_bound_covers_the_semaphores_and_rows():
    b, s, h, d = 2, 1000, 4, 72
    rows = b * h * s
    assert targets.backward_workspace_bytes(rows, b * h, d) >= rows * (3 * 4 + 72 * 4) + (rows // 16) * 4


# ---------------------------------------------------------------- on the GPU

def _gpu_jax():
    try:
        return [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        return []


def _inputs(b, sq, sk, h, hk, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, sq, h, d)).astype(np.float32)
    k = rng.standard_normal((b, sk, hk, d)).astype(np.float32)
    v = rng.standard_normal((b, sk, hk, d)).astype(np.float32)
    return [jnp.asarray(x, dtype) for x in (q, k, v)]


def _f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), dtype=np.float64)


CASES = [
    dict(shape=(2, 128, 128, 4, 4, 64), causal=True),
    dict(shape=(1, 100, 300, 8, 2, 128), causal=True),
    dict(shape=(2, 257, 129, 4, 1, 96), causal=False, window=(40, 8)),
    dict(shape=(1, 128, 128, 4, 4, 128), causal=False, softcap=20.0, sinks=True),
    dict(shape=(1, 64, 64, 2, 2, 36), causal=True, alibi=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}" for k in c))
def test_forward_and_gradients_against_the_reference(case, dtype):
    if not _gpu_jax():
        pytest.skip("JAX sees no GPU")
    b, sq, sk, h, hk, d = case["shape"]
    q, k, v = _inputs(b, sq, sk, h, hk, d, getattr(jnp, dtype))
    rng = np.random.default_rng(1)
    feats = {}
    if case.get("sinks"):
        feats["sinks"] = jnp.asarray(rng.standard_normal(h), jnp.float32)
    if case.get("alibi"):
        feats["alibi_slopes"] = jnp.asarray(rng.uniform(0.05, 0.5, h), jnp.float32)
    opts = dict(causal=case["causal"], window=case.get("window", (-1, -1)), softcap=case.get("softcap", 0.0))
    dout = jnp.asarray(rng.standard_normal((b, sq, h, d)), getattr(jnp, dtype))

    def f(q, k, v, sinks):
        extra = dict(feats, sinks=sinks) if "sinks" in feats else feats
        return jattention.attention(q, k, v, **opts, **extra)

    out, pullback = jax.vjp(jax.jit(f), q, k, v, feats.get("sinks"))
    eager = f(q, k, v, feats.get("sinks"))
    assert np.array_equal(np.asarray(out), np.asarray(eager))  # jit and eager run the same kernels
    grads = jax.jit(pullback)(dout)
    ref_feats = {n: np.asarray(x, np.float64) for n, x in feats.items()}
    want, _ = reference.forward(_f64(q), _f64(k), _f64(v), **opts, **ref_feats)
    # flash-attn's rule: within twice the error of the exact result rounded to the inputs' dtype, plus an ulp
    rounded = _f64(jnp.asarray(want, q.dtype))
    ulp = 2.0 ** (-8 if dtype == "bfloat16" else -11) * max(1.0, float(np.max(np.abs(want))))
    assert np.max(np.abs(_f64(out) - want)) <= 2 * np.max(np.abs(rounded - want)) + ulp
    wants = reference.backward(_f64(dout), _f64(q), _f64(k), _f64(v), **opts, **ref_feats)
    for g, w, name in zip(grads, wants, ("dq", "dk", "dv", "dsinks")):
        if g is None:
            continue
        err = np.max(np.abs(_f64(g) - w))
        scale = max(1.0, float(np.max(np.abs(w))))
        assert err <= 3e-2 * scale, (name, err)


@pytest.mark.gpu
@pytest.mark.parametrize("d, dv, causal", [(192, 128, True), (128, 64, False), (96, 40, True)])
def test_mla_forward_and_gradients_against_the_reference(d, dv, causal):
    """v narrower than q (MLA) under jax.jit: out and dv at v's head_dim, by the rule of the test above."""
    if not _gpu_jax():
        pytest.skip("JAX sees no GPU")
    rng = np.random.default_rng(3)
    q, k = (jnp.asarray(rng.standard_normal((1, 130, 4, d)), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((1, 130, 4, dv)), jnp.bfloat16)
    dout = jnp.asarray(rng.standard_normal((1, 130, 4, dv)), jnp.bfloat16)
    out, pullback = jax.vjp(jax.jit(lambda q, k, v: jattention.attention(q, k, v, causal=causal)), q, k, v)
    grads = jax.jit(pullback)(dout)
    assert out.shape == v.shape[:3] + (dv,) and [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    want, _ = reference.forward(_f64(q), _f64(k), _f64(v), causal=causal)
    rounded = _f64(jnp.asarray(want, q.dtype))
    ulp = 2.0 ** -8 * max(1.0, float(np.max(np.abs(want))))
    assert np.max(np.abs(_f64(out) - want)) <= 2 * np.max(np.abs(rounded - want)) + ulp
    for g, w, name in zip(grads, reference.backward(_f64(dout), _f64(q), _f64(k), _f64(v), causal=causal),
                          ("dq", "dk", "dv")):
        assert np.max(np.abs(_f64(g) - w)) <= 3e-2 * max(1.0, float(np.max(np.abs(w)))), name


@pytest.mark.gpu
def test_training_step_matches_jax_xla_attention():
    if not _gpu_jax():
        pytest.skip("JAX sees no GPU")
    b, s, h, d = 2, 256, 4, 64
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((b, s, h * d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((h * d, 3 * h * d)) / np.sqrt(h * d), jnp.float32)

    def loss(w, attend):
        qkv = (x @ w).astype(jnp.bfloat16).reshape(b, s, 3, h, d)
        out = attend(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
        return jnp.mean(out.astype(jnp.float32) ** 2)

    ours = jax.jit(jax.value_and_grad(lambda w: loss(w, lambda q, k, v: jattention.attention(q, k, v, causal=True))))
    xla = jax.jit(jax.value_and_grad(lambda w: loss(w, lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="xla"))))
    (l1, g1), (l2, g2) = ours(w), xla(w)
    assert abs(float(l1) - float(l2)) <= 1e-2 * abs(float(l2))
    assert float(jnp.max(jnp.abs(g1 - g2))) <= 5e-2 * float(jnp.max(jnp.abs(g2)))


@pytest.mark.gpu
def test_vmap_and_leading_axes_equal_a_loop_and_the_gradient():
    if not _gpu_jax():
        pytest.skip("JAX sees no GPU")
    q, k, v = _inputs(6, 96, 96, 4, 2, 64, jnp.bfloat16)
    q, k, v = (x.reshape((3, 2) + x.shape[1:]) for x in (q, k, v))
    f = jax.jit(lambda q, k, v: jattention.attention(q, k, v, causal=True))
    batched = jax.vmap(lambda q, k, v: jattention.attention(q, k, v, causal=True))(q, k, v)
    looped = jnp.stack([f(q[i], k[i], v[i]) for i in range(3)])
    assert np.array_equal(np.asarray(batched), np.asarray(looped))
    assert np.array_equal(np.asarray(f(q, k, v)), np.asarray(looped))
    loss = lambda q, k, v: jattention.attention(q, k, v, causal=True).astype(jnp.float32).sum()  # noqa: E731
    g_vmap = jax.jit(jax.vmap(jax.grad(loss)))(q, k, v)
    g_loop = jnp.stack([jax.jit(jax.grad(loss))(q[i], k[i], v[i]) for i in range(3)])
    np.testing.assert_allclose(_f64(g_vmap), _f64(g_loop), atol=2e-2)


@pytest.mark.gpu
def test_lse_gradient_matches_jax():
    if not _gpu_jax():
        pytest.skip("JAX sees no GPU")
    q, k, v = _inputs(2, 80, 120, 4, 2, 64, jnp.float16)
    w = jnp.asarray(np.random.default_rng(3).standard_normal((2, 4, 80)), jnp.float32)

    def ours(q, k, v):
        out, lse = jattention.attention(q, k, v, causal=True, return_lse=True)
        return out.astype(jnp.float32).sum() + (lse * w).sum()

    def exact(q, k, v):
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        kk, vv = (jnp.repeat(x, 2, axis=2) for x in (k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kk) / 8.0
        mask = jnp.arange(120)[None, :] <= jnp.arange(80)[:, None] + 40
        s = jnp.where(mask, s, -jnp.inf)
        lse = jax.nn.logsumexp(s, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), vv)
        return out.sum() + (lse * w).sum()

    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(exact, argnums=(0, 1, 2)))(q, k, v)
    for g, x in zip(got, want):
        assert float(jnp.max(jnp.abs(g.astype(jnp.float32) - x))) <= 2e-2 * max(1.0, float(jnp.max(jnp.abs(x))))


@pytest.mark.gpu
def test_shard_map_over_a_one_device_mesh():
    if not _gpu_jax():
        pytest.skip("JAX sees no GPU")
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("heads",))
    q, k, v = _inputs(2, 128, 128, 4, 4, 64, jnp.bfloat16)
    spec = P(None, None, "heads", None)
    sharded = jax.jit(jax.shard_map(lambda q, k, v: jattention.attention(q, k, v, causal=True), mesh=mesh,
                                    in_specs=(spec, spec, spec), out_specs=spec))
    assert np.array_equal(np.asarray(sharded(q, k, v)), np.asarray(jattention.attention(q, k, v, causal=True)))


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_decode_appends_in_place_and_matches_the_reference(paged):
    if not _gpu_jax():
        pytest.skip("JAX sees no GPU")
    b, h, hk, d, cap = 3, 8, 2, 128, 512
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.bfloat16)
    kn, vn = (jnp.asarray(rng.standard_normal((b, 1, hk, d)), jnp.bfloat16) for _ in range(2))
    lens_host = np.array([0, 100, 511], np.int32)
    if paged:
        page, pages = 64, b * cap // 64
        kc, vc = (jnp.asarray(rng.standard_normal((pages, page, hk, d)), jnp.bfloat16) for _ in range(2))
        table = jnp.asarray(rng.permutation(pages).reshape(b, cap // page).astype(np.int32))
    else:
        kc, vc = (jnp.asarray(rng.standard_normal((b, cap, hk, d)), jnp.bfloat16) for _ in range(2))
        table = None
    want_out, _ = reference.decode(*(_f64(x) for x in (q, kc, vc)), lens_host, k_new=_f64(kn), v_new=_f64(vn),
                                   block_table=None if table is None else np.asarray(table))
    step = jax.jit(lambda q, kc, vc, lens, kn, vn: jattention.decode(q, kc, vc, lens, k_new=kn, v_new=vn,
                                                                       block_table=table), donate_argnums=(1, 2))
    out, kc2, vc2 = step(q, kc, vc, jnp.asarray(lens_host), kn, vn)
    assert np.max(np.abs(_f64(out) - want_out)) <= 2e-2
    rows = np.asarray(table)[np.arange(b), lens_host // 64] * 64 + lens_host % 64 if paged else None
    for cache, new in ((kc2, kn), (vc2, vn)):
        got = np.asarray(cache).reshape(-1, hk, d)[rows] if paged else np.asarray(cache)[np.arange(b), lens_host]
        assert np.array_equal(got, np.asarray(new)[:, 0])


GRAPH_SCRIPT = """
import os, numpy as np, jax, jax.numpy as jnp
from rawflash.jax import ops as A, targets
calls = []
original = targets._forward_target
def counting(frame):
    calls.append(1)
    original(frame)
targets._forward_target = counting
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((2, 256, 4, 64)), jnp.bfloat16) for _ in range(3))
f = jax.jit(lambda q, k, v: A.attention(q, k, v, causal=True) * 2)
first = np.asarray(f(q, k, v))
before = len(calls)
outs = [np.asarray(f(q * (i + 1), k, v)) for i in range(6)]
during = len(calls) - before
want = [np.asarray(A.attention(q * (i + 1), k, v, causal=True) * 2) for i in range(6)]
print("CALLS", during, "EQUAL", all(np.array_equal(a, b) for a, b in zip(outs, want)))
"""


@pytest.mark.gpu
def test_a_jitted_step_replays_from_a_cuda_graph(tmp_path):
    """XLA captures the custom call into a command buffer (a CUDA graph): the handler runs when it is captured,
    the replays compute with new inputs."""
    if not _gpu_jax():
        pytest.skip("JAX sees no GPU")
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_gpu_enable_command_buffer=CUSTOM_CALL --xla_gpu_graph_min_graph_size=1",
               XLA_PYTHON_CLIENT_PREALLOCATE="false")
    res = subprocess.run([sys.executable, "-c", GRAPH_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    line = [x for x in res.stdout.splitlines() if x.startswith("CALLS")]
    assert line, res.stdout + res.stderr
    _, calls, _, equal = line[0].split()
    assert equal == "True"
    assert int(calls) < 6  # fewer handler runs than calls: the graph's replays skip Python


@pytest.mark.gpu
def test_readme_example_runs():
    if not _gpu_jax():
        pytest.skip("JAX sees no GPU")
    names: dict = {}
    exec(_readme_example(), names)
    assert np.isfinite(float(names["l"]))


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [True, False])
def test_packed_sequences_and_seqused_k_against_the_reference(packed):
    if not _gpu_jax():
        pytest.skip("JAX sees no GPU")
    rng = np.random.default_rng(7)
    h, hk, d = 4, 2, 64
    if packed:
        lq, lk = np.array([37, 200, 63]), np.array([50, 300, 63])
        cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
        q = rng.standard_normal((cu_q[-1], h, d))
        k, v = (rng.standard_normal((cu_k[-1], hk, d)) for _ in range(2))
        used = np.array([50, 120, 0], np.int32)
        extra = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=200, max_seqlen_k=300, seqused_k=used)
    else:
        q = rng.standard_normal((3, 96, h, d))
        k, v = (rng.standard_normal((3, 160, hk, d)) for _ in range(2))
        extra = dict(seqused_k=np.array([160, 17, 90], np.int32))
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    dout = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
    jextra = {n: (jnp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in extra.items()}
    f = jax.jit(lambda q, k, v: jattention.attention(q, k, v, causal=True, **jextra))
    out, pullback = jax.vjp(f, q, k, v)
    grads = pullback(dout)
    ref_extra = {n: x for n, x in extra.items() if not n.startswith("max_")}
    want, _ = reference.forward(_f64(q), _f64(k), _f64(v), causal=True, **ref_extra)
    assert np.max(np.abs(_f64(out) - want)) <= 2e-2
    wants = reference.backward(_f64(dout), _f64(q), _f64(k), _f64(v), causal=True, **ref_extra)
    for g, w, name in zip(grads, wants, ("dq", "dk", "dv")):
        assert np.max(np.abs(_f64(g) - w)) <= 3e-2 * max(1.0, float(np.max(np.abs(w)))), name
