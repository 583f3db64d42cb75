"""rawflash.jax.attention: lowering for CUDA and validation at trace time (CPU), results and gradients (GPU)."""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
pytest.importorskip("cupy")

from rawflash import reference  # noqa: E402
from rawflash.jax import attention as jattention  # noqa: E402


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


def test_workspace_bound_covers_the_semaphores_and_rows():
    b, s, h, d = 2, 1000, 4, 72
    rows = b * h * s
    assert jattention.backward_workspace_bytes(b, s, h, d) >= rows * (3 * 4 + 72 * 4) + (rows // 16) * 4


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
