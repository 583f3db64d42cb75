"""The Numba twins on Numba's CUDA simulator (CPU), against the float64 reference by flash-attn's rule.

Run in a process of its own with the simulator switched on before numba is imported::

    NUMBA_ENABLE_CUDASIM=1 python -m pytest -m sim tests/test_numba_sim.py

Anywhere else the module skips itself. The simulator runs every thread as a Python thread (about 1 us per
multiply-add), so the shapes are small; they still cross ragged lengths, seqlen_q != seqlen_k both ways, MHA / GQA /
MQA, causal on and off, odd and large head dims, float16 / bfloat16 / float32, every kernel and switch, and every
feature (windows, soft-capping, ALiBi, sinks, packed variable lengths, seqused_k) forward and backward, alone and
combined. The twins' block ranges are checked against brute force, and their launch shapes against an H200.
"""
from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"

pytestmark = [
    pytest.mark.sim,
    pytest.mark.skipif(not SIMULATOR, reason="needs NUMBA_ENABLE_CUDASIM=1 set before numba is imported "
                                             "(run this file in its own process)"),
]

import rawflash  # noqa: E402
from rawflash import reference  # noqa: E402
from conftest import random_qkv  # noqa: E402

# (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim)
MHA_SQUARE = (1, 64, 64, 2, 2, 32)
GQA_SHORT_Q = (1, 17, 40, 4, 2, 40)      # seqlen_q < seqlen_k, odd head_dim (runs as D = 64)
MQA_LONG_Q = (2, 40, 17, 2, 1, 32)       # seqlen_q > seqlen_k: causal hides the first 23 query rows
TINY_ODD = (1, 1, 1, 1, 1, 59)           # head_dim padded to 64 as on the CUDA C path
LARGE_D = (1, 5, 7, 2, 1, 200)           # D = 256
MANY_BLOCKS = (1, 70, 150, 2, 1, 32)     # several key blocks per query block for every tile row


def _problem_id(shape):
    b, sq, sk, h, hk, d = shape
    return f"b{b}-{sq}x{sk}-h{h}/{hk}-d{d}"


def _inputs(shape, dtype, seed=0):
    b, sq, sk, h, hk, d = shape
    return random_qkv(b, sq, sk, h, hk, d, dtype, seed=seed)


def _dout(q, seed=1):
    return np.random.default_rng(seed).standard_normal(q.shape).astype(q.dtype)


def _forward(q, k, v, causal, kernel="fa2", **options):
    return rawflash.forward(q, k, v, causal=causal, kernel=kernel, backend="numba", **options)


def _check(name, ours, ref, base, dtype, factor):
    """flash-attn's rule; for float32 also 4 ulps of the largest value (tests/test_gpu_features.py's _check: a row
    with one visible key gets P = 1 - O(ulp) from a float32 lse where a naive float32 softmax gets exactly 1)."""
    ok, err, base_err, bound = reference.error_ratio_ok(ours, ref, base, dtype, factor)
    if not ok and np.dtype(dtype) == np.float32 and np.isfinite(np.asarray(ours, np.float64)).all():
        ulps = 4 * np.finfo(np.float32).eps * float(np.max(np.abs(ref[np.isfinite(ref)]), initial=0.0))
        ok, bound = err <= max(bound, ulps), max(bound, ulps)
    assert ok, f"{name}: max error {err:.3g} > bound {bound:.3g} (naive {np.dtype(dtype)} error {base_err:.3g})"


def _assert_forward_ok(q, k, v, out, lse, **features):
    assert out.shape == q.shape and out.dtype == q.dtype
    varlen = "cu_seqlens_q" in features
    want = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    assert lse.shape == want and lse.dtype == np.float32
    ref_out, ref_lse = reference.forward(q, k, v, **features)
    base_out, base_lse = reference.forward(q, k, v, upcast=False, **features)
    _check("out", out, ref_out, base_out, q.dtype, 2)
    _check("lse", lse, ref_lse, base_lse, q.dtype, 2)
    assert np.isfinite(out.astype(np.float32)).all()


def _assert_backward_ok(dout, q, k, v, grads, out=None, lse=None, **features):
    given = {} if out is None else {"out": out, "lse": lse}
    refs = reference.backward(dout, q, k, v, **features, **given)
    bases = reference.backward_bases(dout, q, k, v, refs, **features, **given)
    assert len(grads) == len(refs) == (4 if "sinks" in features else 3)
    for name, ours, ref, base, like in zip(("dq", "dk", "dv", "dsinks"), grads, refs, bases, (q, k, v, None)):
        if like is None:
            assert ours.shape == ref.shape and ours.dtype == np.float32, name
        else:
            assert ours.shape == like.shape and ours.dtype == like.dtype, name
        _check(name, ours, ref, base, q.dtype if like is not None else np.float32, 3)
        assert np.isfinite(ours.astype(np.float32)).all(), name


def _hidden_rows(shape, causal):
    """Query rows that see no key (bottom-right causal alignment with seqlen_q > seqlen_k)."""
    _, sq, sk, _, _, _ = shape
    return max(0, sq - sk) if causal else 0


# ---------------------------------------------------------------- forward
FORWARD_CASES = [
    pytest.param(MHA_SQUARE, "float32", False, "fa2", id="fa2-float32-full-" + _problem_id(MHA_SQUARE)),
    pytest.param(GQA_SHORT_Q, "float16", True, "fa2", id="fa2-float16-causal-" + _problem_id(GQA_SHORT_Q)),
    pytest.param(MQA_LONG_Q, "float32", True, "fa2", id="fa2-float32-causal-" + _problem_id(MQA_LONG_Q)),
    pytest.param(TINY_ODD, "float32", False, "fa2", id="fa2-float32-full-" + _problem_id(TINY_ODD)),
    pytest.param(LARGE_D, "float16", True, "fa2", id="fa2-float16-causal-" + _problem_id(LARGE_D)),
    pytest.param(MANY_BLOCKS, "float16", True, "fa2", id="fa2-float16-causal-" + _problem_id(MANY_BLOCKS)),
    pytest.param((1, 31, 31, 2, 2, 96), "float32", True, "fa2", id="fa2-float32-causal-b1-31x31-h2/2-d96"),
    pytest.param(GQA_SHORT_Q, "float32", True, "fa1", id="fa1-float32-causal-" + _problem_id(GQA_SHORT_Q)),
    pytest.param(MQA_LONG_Q, "float16", False, "fa1", id="fa1-float16-full-" + _problem_id(MQA_LONG_Q)),
    pytest.param(MQA_LONG_Q, "float16", True, "fa1", id="fa1-float16-causal-" + _problem_id(MQA_LONG_Q)),
    pytest.param(MANY_BLOCKS, "float16", True, "fa1", id="fa1-float16-causal-" + _problem_id(MANY_BLOCKS)),
]


@pytest.mark.parametrize("shape, dtype, causal, kernel", FORWARD_CASES)
def test_forward(shape, dtype, causal, kernel):
    q, k, v = _inputs(shape, dtype)
    out, lse = _forward(q, k, v, causal, kernel)
    _assert_forward_ok(q, k, v, out, lse, causal=causal)
    hidden = _hidden_rows(shape, causal)
    assert np.all(out[:, :hidden] == 0) and np.all(lse[:, :, :hidden] == -np.inf)
    assert np.all(np.isfinite(lse[:, :, hidden:]))


ABLATIONS = [
    {"defer_norm": False},
    {"seq_parallel": False},
    {"split_q": False},
    {"defer_norm": False, "seq_parallel": False, "split_q": False},
]


@pytest.mark.parametrize("switches", ABLATIONS, ids=lambda sw: "+".join(f"no-{k}" for k in sw))
def test_forward_ablation(switches):
    shape, dtype = (1, 33, 45, 4, 2, 32), "float16"
    q, k, v = _inputs(shape, dtype, seed=3)
    out, lse = _forward(q, k, v, True, "fa2", **switches)
    _assert_forward_ok(q, k, v, out, lse, causal=True)


def test_wgmma_has_no_twin():
    q, k, v = _inputs((1, 4, 4, 1, 1, 32), "float16")
    with pytest.raises(ValueError, match="no Numba twin"):
        _forward(q, k, v, False, wgmma=True)


def test_bfloat16_upcast_on_host():
    q, k, v = _inputs((1, 17, 23, 2, 1, 32), "bfloat16", seed=4)
    out, lse = _forward(q, k, v, True)
    _assert_forward_ok(q, k, v, out, lse, causal=True)
    dout = _dout(q)
    grads = rawflash.backward(dout, q, k, v, out, lse, causal=True, backend="numba")
    _assert_backward_ok(dout, q, k, v, grads, causal=True)


def test_forward_strided_views():
    """q, k, v given as (batch, heads, seqlen, head_dim) arrays viewed through transpose(0, 2, 1, 3)."""
    q, k, v = _inputs((1, 20, 30, 2, 1, 32), "float32", seed=5)
    views = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in (q, k, v)]
    assert not views[0].flags.c_contiguous
    out, lse = _forward(*views, False)
    _assert_forward_ok(q, k, v, out, lse, causal=False)


def test_naive_has_no_numba_twin():
    q, k, v = _inputs((1, 4, 4, 1, 1, 32), "float32")
    with pytest.raises(NotImplementedError, match="naive"):
        rawflash.forward(q, k, v, kernel="naive", backend="numba")


# ---------------------------------------------------------------- backward
BACKWARD_CASES = [
    pytest.param((1, 40, 17, 4, 2, 32), "float32", True, False, id="atomic-float32-causal-b1-40x17-h4/2-d32"),
    pytest.param(GQA_SHORT_Q, "float16", True, True, id="deterministic-float16-causal-" + _problem_id(GQA_SHORT_Q)),
    pytest.param((1, 24, 48, 2, 2, 64), "float32", False, True, id="deterministic-float32-full-b1-24x48-h2/2-d64"),
    pytest.param((1, 33, 33, 2, 1, 32), "float16", False, False, id="atomic-float16-full-b1-33x33-h2/1-d32"),
    pytest.param(LARGE_D, "float32", True, False, id="atomic-float32-causal-" + _problem_id(LARGE_D)),
    pytest.param((1, 70, 100, 2, 1, 32), "float16", True, False, id="atomic-float16-causal-b1-70x100-h2/1-d32"),
    pytest.param((1, 70, 100, 2, 1, 32), "float32", True, True, id="deterministic-float32-causal-b1-70x100-h2/1-d32"),
]


@pytest.mark.parametrize("shape, dtype, causal, deterministic", BACKWARD_CASES)
def test_backward(shape, dtype, causal, deterministic):
    q, k, v = _inputs(shape, dtype, seed=6)
    dout = _dout(q)
    out, lse = _forward(q, k, v, causal)
    grads = rawflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic, backend="numba")
    _assert_backward_ok(dout, q, k, v, grads, causal=causal)
    hidden = _hidden_rows(shape, causal)
    assert np.all(grads[0][:, :hidden] == 0)


MLA_CASES = [  # (shape with head_dim_qk, head_dim_v, dtype, causal, deterministic)
    pytest.param(GQA_SHORT_Q, 24, "float16", True, False, id="float16-causal-" + _problem_id(GQA_SHORT_Q) + "-dv24"),
    pytest.param((2, 9, 13, 2, 1, 32), 8, "float32", False, True, id="float32-full-b2-9x13-h2/1-d32-dv8"),
    pytest.param((1, 20, 11, 2, 2, 40), 33, "float32", True, False, id="float32-causal-b1-20x11-h2/2-d40-dv33"),
]


@pytest.mark.parametrize("shape, head_dim_v, dtype, causal, deterministic", MLA_CASES)
def test_mla_value_head_dim(shape, head_dim_v, dtype, causal, deterministic):
    """v narrower than q and k (MLA): out, dout and dv take v's head_dim; the twins run v zero-padded to q's."""
    q, k, v = _inputs(shape, dtype, seed=9)
    v = np.ascontiguousarray(v[..., :head_dim_v])
    out, lse = _forward(q, k, v, causal)
    assert out.shape == (*q.shape[:3], head_dim_v) and out.dtype == q.dtype
    ref_out, ref_lse = reference.forward(q, k, v, causal=causal)
    base_out, base_lse = reference.forward(q, k, v, causal=causal, upcast=False)
    _check("out", out, ref_out, base_out, q.dtype, 2)
    _check("lse", lse, ref_lse, base_lse, q.dtype, 2)
    dout = _dout(out)
    grads = rawflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic, backend="numba")
    _assert_backward_ok(dout, q, k, v, grads, out=out, lse=lse, causal=causal)


WIDE_CASES = [  # head_dim 512 and a head_dim that pads to it
    pytest.param((1, 5, 7, 2, 1, 512), "float16", True, id="float16-causal-b1-5x7-h2/1-d512"),
    pytest.param((1, 40, 17, 2, 1, 300), "bfloat16", True, id="bfloat16-causal-b1-40x17-h2/1-d300"),
    pytest.param((1, 17, 40, 4, 2, 512), "float16", False, id="float16-full-b1-17x40-h4/2-d512"),
]


@pytest.mark.parametrize("shape, dtype, causal", WIDE_CASES)
def test_head_dim_512(shape, dtype, causal):
    """The twins of the head_dim 512 forms (the CUDA C's warps split the head columns; a twin thread holds its
    row's whole O, dK, dV or dQ): forward, and both backwards."""
    q, k, v = _inputs(shape, dtype, seed=11)
    out, lse = _forward(q, k, v, causal)
    _assert_forward_ok(q, k, v, out, lse, causal=causal)
    dout = _dout(q)
    for deterministic in (False, True):
        grads = rawflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic,
                                  backend="numba")
        _assert_backward_ok(dout, q, k, v, grads, causal=causal)


def test_head_dim_512_packed_sequences():
    check_feature((1, 9, 11, 2, 1, 512), "float16", dict(varlen=True, causal=True), deterministic=True)


def test_backward_writes_every_element_of_its_uninitialised_buffers(monkeypatch):
    """The backend takes dQ's float32 rows, D, L in log2 units and the gradients from empty(): here empty() fills
    them with NaN, so the result is right only if the preprocess twin zeroes the dQ rows before the main pass adds
    into them (as fa2_bwd_preprocess does on the GPU) and the kernels write every element they return."""
    from rawflash.kernels import numba_backend

    real = numba_backend._xp()

    class NanEmpty:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def empty(shape, dtype=np.float64):
            return real.full(shape, np.nan, dtype)

    monkeypatch.setattr(numba_backend, "_xp", lambda: NanEmpty())
    shape, causal = (1, 24, 20, 2, 1, 40), True  # 3 blocks of 16 columns: a row's group of 4 threads, one idle
    q, k, v = _inputs(shape, "float32", seed=8)
    dout = _dout(q)
    out, lse = _forward(q, k, v, causal)
    grads = rawflash.backward(dout, q, k, v, out, lse, causal=causal, backend="numba")
    assert all(np.isfinite(g).all() for g in grads)
    _assert_backward_ok(dout, q, k, v, grads, causal=causal)


def test_backward_atomic_and_deterministic_agree():
    shape, causal = MQA_LONG_Q, True
    q, k, v = _inputs(shape, "float32", seed=7)
    dout = _dout(q)
    out, lse = _forward(q, k, v, causal)
    atomic = rawflash.backward(dout, q, k, v, out, lse, causal=causal, backend="numba")
    deterministic = rawflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, backend="numba")
    for name, a, d in zip(("dq", "dk", "dv"), atomic, deterministic):
        np.testing.assert_allclose(a, d, rtol=1e-5, atol=1e-6, err_msg=name)


# ---------------------------------------------------------------- features, forward and backward
VARLEN_Q = [0, 1, 9, 17]   # a zero-length query sequence first,
VARLEN_K = [5, 0, 12, 20]  # a zero-length key sequence second (its query row sees nothing)


def _feature_inputs(shape, dtype, opts, seed):
    """q, k, v (packed when opts has 'varlen') and the feature arguments of one case, as host arrays."""
    b, sq, sk, h, hk, d = shape
    rng = np.random.default_rng(seed + 100)
    scale_in = 8.0 if "softcap" in opts else 1.0  # large logits: the cap bites
    extra = {}
    if opts.get("varlen"):
        q, k, v = random_qkv(1, sum(VARLEN_Q), sum(VARLEN_K), h, hk, d, dtype, seed=seed, scale=scale_in)
        q, k, v = q[0], k[0], v[0]
        extra.update(cu_seqlens_q=np.cumsum([0] + VARLEN_Q).astype(np.int32),
                     cu_seqlens_k=np.cumsum([0] + VARLEN_K).astype(np.int32))
        b = len(VARLEN_Q)
    else:
        q, k, v = random_qkv(b, sq, sk, h, hk, d, dtype, seed=seed, scale=scale_in)
    if opts.get("seqused"):
        lengths = VARLEN_K if opts.get("varlen") else [sk] * b
        extra["seqused_k"] = np.array([max(0, n - 3 * i - 2) for i, n in enumerate(lengths)], np.int32)
    if opts.get("alibi"):
        extra["alibi_slopes"] = rng.uniform(0.01, 0.5, (h,) if opts["alibi"] == "heads" else (b, h)).astype(np.float32)
    if "sinks" in opts:
        s = opts["sinks"]
        extra["sinks"] = (rng.standard_normal(h) * 2 if s == "random" else np.full(h, s)).astype(np.float32)
    for name in ("window", "softcap", "causal", "scale"):
        if name in opts:
            extra[name] = opts[name]
    return q, k, v, extra


def check_feature(shape, dtype, opts, seed=0, deterministic=False):
    q, k, v, extra = _feature_inputs(shape, dtype, opts, seed)
    out, lse = rawflash.forward(q, k, v, backend="numba", **extra)
    _assert_forward_ok(q, k, v, out, lse, **extra)
    if "sinks" in extra:
        assert np.isfinite(lse).all(), "with sinks every row has a finite lse"
    dout = np.random.default_rng(seed + 7).standard_normal(q.shape).astype(q.dtype)
    grads = rawflash.backward(dout, q, k, v, out, lse, backend="numba", deterministic=deterministic, **extra)
    _assert_backward_ok(dout, q, k, v, grads, **extra)
    return q, k, v, extra, out, lse, grads


F32 = (2, 13, 21, 2, 1, 32)      # one key block per query block at the float32 tile rows
F32_LONG_Q = (1, 21, 13, 2, 2, 32)
SMALL16 = (1, 13, 21, 2, 1, 16)  # float16 / bfloat16 (128-row tiles: 128 simulated threads per CTA)
BLOCKS = (1, 100, 130, 1, 1, 16)  # several query and key blocks: interior blocks, edge blocks and skipped blocks
FEATURES = [  # (id, shape, dtype, options, deterministic)
    ("window-diag", F32, "float32", dict(window=(0, 0)), False),
    ("window-1-causal", F32_LONG_Q, "float32", dict(window=(1, 0), causal=True), True),
    ("window-two-sided", SMALL16, "float16", dict(window=(3, 2)), False),
    ("window-wider", F32, "float32", dict(window=(5000, 5000)), False),
    ("window-right-only", F32_LONG_Q, "bfloat16", dict(window=(-1, 4)), False),
    ("window-blocks-causal", BLOCKS, "float32", dict(window=(20, 0), causal=True), False),
    ("window-blocks-two-sided", BLOCKS, "float32", dict(window=(10, 40)), True),
    ("softcap", F32, "float32", dict(softcap=5.0, scale=1.0), False),
    ("softcap-causal", SMALL16, "bfloat16", dict(softcap=5.0, scale=1.0, causal=True), True),
    ("alibi", F32, "float32", dict(alibi="heads"), False),
    ("alibi-batch-causal", (2, 9, 15, 2, 2, 16), "float16", dict(alibi="batch", causal=True), True),
    ("sinks", F32, "float32", dict(sinks="random"), False),
    ("sinks-negative", SMALL16, "float16", dict(sinks=-30.0), False),
    ("varlen", F32, "float32", dict(varlen=True), False),
    ("varlen-causal", F32, "float32", dict(varlen=True, causal=True), True),
    ("seqused", F32, "float32", dict(seqused=True, causal=True), False),
    ("seqused-deterministic", F32_LONG_Q, "float16", dict(seqused=True), True),
    ("varlen+window+sinks+causal", SMALL16, "bfloat16",
     dict(varlen=True, window=(4, 0), causal=True, sinks="random"), False),
    ("softcap+alibi+window", F32, "float32", dict(softcap=20.0, alibi="batch", window=(6, 6)), True),
    ("varlen+seqused+softcap", F32, "float32", dict(varlen=True, seqused=True, softcap=10.0, causal=True), False),
]


@pytest.mark.parametrize("shape, dtype, opts, deterministic", [pytest.param(*c[1:], id=c[0]) for c in FEATURES])
def test_feature(shape, dtype, opts, deterministic):
    check_feature(shape, dtype, opts, deterministic=deterministic)


def test_sink_only_rows_give_zero_and_the_sink():
    """Causal with more queries than keys: the top rows see no key; with sinks they get out 0 and lse = sink, and
    the sink gradient still counts them (D_i = 0 there, so their term is 0)."""
    q, k, v, extra, out, lse, grads = check_feature((1, 20, 7, 2, 2, 16), "float32", dict(sinks="random", causal=True))
    sinks = extra["sinks"]
    assert not out[0, :13].any(), "rows that see no key have out 0"
    np.testing.assert_allclose(lse[0, :, :13], np.repeat(sinks[:, None], 13, 1), rtol=1e-6)
    assert not grads[0][0, :13].any(), "and dq 0"


def test_varlen_zero_length_sequences_and_seqused_keys():
    """A zero-length query sequence, a zero-length key sequence (its row sees nothing: out 0, lse -inf, dq 0), and
    keys past seqused_k (dk = dv = 0)."""
    q, k, v, extra, out, lse, grads = check_feature(F32, "float32", dict(varlen=True, seqused=True))
    cq, ck, used = extra["cu_seqlens_q"], extra["cu_seqlens_k"], extra["seqused_k"]
    assert lse.shape == (q.shape[1], q.shape[0])
    row = cq[1]  # the one query of the sequence with no keys
    assert not out[row].any() and np.all(lse[:, row] == -np.inf) and not grads[0][row].any()
    for b in range(len(cq) - 1):
        unused = slice(ck[b] + used[b], ck[b + 1])
        assert not grads[1][unused].any() and not grads[2][unused].any(), f"sequence {b}: keys past seqused_k"


# ---------------------------------------------------------------- the policy's block ranges against brute force
def _visible(sq, sk, left, right):
    diag = np.arange(sq)[:, None] + sk - sq
    j = np.arange(sk)[None, :]
    vis = np.ones((sq, sk), bool)
    if right >= 0:
        vis &= j <= diag + right
    if left >= 0:
        vis &= j >= diag - left
    return vis


def _policy(sq, sk, left, right, mask):
    from rawflash.numba_kernels import policy

    one = np.float32(1.0)
    return policy.Policy(mask, mask == policy.WINDOW, False, sq, sk, sk - sq, left, right, one, np.float32(0), one,
                         np.float32(0), one)


def _steps(r):
    from rawflash.numba_kernels import policy

    return [(policy.block(r, s), bool(policy.is_edge(r, s))) for s in range(policy.range_n(r))]


WINDOWS = [(-1, -1, 0), (-1, 0, 1), (-1, 0, 2), (0, 0, 2), (3, 0, 2), (5, 7, 2), (-1, 6, 2), (40, 40, 2), (0, 9, 2)]


@pytest.mark.parametrize("left, right, mask", WINDOWS)
def test_block_ranges_visit_exactly_the_visible_blocks(left, right, mask):
    """kv_blocks / q_blocks visit every block holding a visible element once, interior blocks first, no block
    wholly outside the window, and call a block interior only when every element of it is visible (elements of
    rows past seqlen_q do not count: their L is +inf, so P = 0 there whatever the mask)."""
    from rawflash.numba_kernels import policy

    for sq, sk, br, bc in itertools.product((1, 7, 33), (1, 9, 40), (8, 16), (8, 16)):
        vis = _visible(sq, sk, left if mask == policy.WINDOW else -1, right if mask != policy.NO_MASK else -1)
        pol = _policy(sq, sk, left, right, mask)
        tr, tc = -(-sq // br), -(-sk // bc)
        for i in range(tr):  # the forward: key blocks of query tile i
            r0, nr = i * br, min(br, sq - i * br)
            rows = vis[r0:r0 + nr]
            steps = _steps(policy.kv_blocks(pol, r0, nr, bc))
            seen = [rows[:, j * bc:(j + 1) * bc].any() for j in range(tc)]
            assert sorted(b for b, _ in steps) == [j for j in range(tc) if seen[j]], (sq, sk, br, bc, i, steps)
            for b, edge in steps:
                full = b * bc + bc <= sk and rows[:, b * bc:b * bc + bc].all()
                assert edge or full, (sq, sk, br, bc, i, b)
            assert [e for _, e in steps] == sorted(e for _, e in steps), "interior blocks first"
        for j in range(tc):  # the backward: query blocks of key tile j
            cols = vis[:, j * bc:(j + 1) * bc]
            steps = _steps(policy.q_blocks(pol, j * bc, bc, br, tr))
            seen = [cols[i * br:(i + 1) * br].any() for i in range(tr)]
            assert sorted(b for b, _ in steps) == [i for i in range(tr) if seen[i]], (sq, sk, br, bc, j, steps)
            for b, edge in steps:
                full = (j + 1) * bc <= sk and cols[b * br:b * br + br].all()  # over the block's rows < seqlen_q
                assert edge or full, (sq, sk, br, bc, j, b)


@pytest.mark.parametrize("left, right, mask", WINDOWS + [(4, -1, 2), (0, -1, 2)])
def test_dq_ranks_order_the_key_blocks_of_every_query_block(left, right, mask):
    """The deterministic FA3 backward's order (Policy::dq_rank): the key blocks whose walk holds query block i get
    the ranks 0 .. n - 1, each once (a missing rank would leave its successors waiting); under a mask bounded on
    the right the ranks run from the last key block down (the scheduler dispatches key tiles last-first there), so
    in dispatch order every rank comes after the ones it waits for; and in the ascending walk (QIterAscending)
    a lower rank reaches the query block in no more steps than a higher one."""
    from rawflash.numba_kernels import policy

    for sq, sk, br, bc in itertools.product((1, 7, 33, 64), (1, 9, 40, 64), (8, 16), (8, 16)):
        pol = _policy(sq, sk, left, right, mask)
        tr, tc = -(-sq // br), -(-sk // bc)
        walks = [policy.q_blocks(pol, j * bc, bc, br, tr) for j in range(tc)]
        reverse = bool(policy.bounded_right(pol))
        for i in range(tr):
            seeing = [j for j in range(tc) if walks[j].lo <= i < walks[j].hi]
            ranks = {j: policy.dq_rank(pol, i * br, br, bc, j) for j in seeing}
            where = (sq, sk, br, bc, i, ranks)
            assert sorted(ranks.values()) == list(range(len(seeing))), where
            dispatch = sorted(seeing, reverse=reverse)  # the order of their CTAs' block indices
            assert [ranks[j] for j in dispatch] == list(range(len(seeing))), where
            arrival = [i - walks[j].lo for j in dispatch]
            assert arrival == sorted(arrival), where


@pytest.mark.parametrize("sq, sk, br, bc", [(1, 1, 8, 8), (7, 64, 8, 8), (64, 9, 16, 8), (33, 40, 8, 16),
                                            (100, 100, 8, 8), (40, 300, 8, 16), (300, 40, 16, 8), (129, 257, 16, 16)])
def test_rotated_dq_ranks_follow_the_walks(sq, sk, br, bc):
    """deterministic=True without a mask, the rotated order (Policy::dq_start / dq_rank_rotated): key block j walks
    the query blocks from dq_start(j) around; at every query block the ranks are 0 .. nk - 1, each once, in the
    order of (the step at which each key block arrives, j), so a key block waits only for additions its
    neighbours made at earlier steps of their walks (or at the same step with a lower index): no cycle. A protocol
    run with every CTA resident (one step a round; a CTA adds only when its rank is up) finishes in nq rounds when
    nk <= nq, where the ascending order needs nq + nk - 1."""
    from rawflash.numba_kernels import policy

    pol = _policy(sq, sk, -1, -1, 0)
    nq, nk = -(-sq // br), -(-sk // bc)
    starts = [policy.dq_start(j, nq, nk) for j in range(nk)]
    assert starts == sorted(starts) and all(0 <= s < nq for s in starts)
    for i in range(nq):
        ranks = {j: policy.dq_rank_rotated(pol, i * br, br, bc, j) for j in range(nk)}
        assert sorted(ranks.values()) == list(range(nk)), (i, ranks)
        order = sorted(range(nk), key=lambda j: ((i - starts[j]) % nq, j))
        assert [ranks[j] for j in order] == list(range(nk)), (i, ranks)

    def rounds(step_block, rank):  # all CTAs at once: in a round each adds if its turn had come by the round's start
        step, count, n = [0] * nk, [0] * nq, 0
        while min(step) < nq:
            ready = [j for j in range(nk)
                     if step[j] < nq and count[step_block(j, step[j])] == rank(step_block(j, step[j]), j)]
            assert ready, "deadlock"
            for j in ready:
                count[step_block(j, step[j])] += 1
                step[j] += 1
            n += 1
        return n

    rotated = rounds(lambda j, t: (starts[j] + t) % nq, lambda i, j: policy.dq_rank_rotated(pol, i * br, br, bc, j))
    assert rounds(lambda j, t: t, lambda i, j: policy.dq_rank(pol, i * br, br, bc, j)) == nq + nk - 1
    assert rotated == nq if nk <= nq else rotated <= nq + nk - 1


# ---------------------------------------------------------------- the package
def test_numpy_row_stack_shim():
    import numpy

    import rawflash.numba_kernels  # noqa: F401
    from rawflash.numba_kernels import _shim

    assert hasattr(numpy, "row_stack")
    saved = numpy.__dict__.pop("row_stack", None)
    try:
        _shim.apply()                                        # what happens on numpy >= 2.5
        assert numpy.row_stack is numpy.vstack
    finally:
        if saved is not None:
            numpy.row_stack = saved


def _planned():
    """Every launch the backend plans over dtypes, head dims, both policies, switches and both backwards."""
    import dataclasses

    from rawflash.kernels import configs, forms, numba_backend
    from rawflash.problem import Problem

    out = {}
    for dtype, d, arch in itertools.product(configs.DTYPES, configs.SPECIALISED_HEAD_DIMS, ("sm_90", "sm_80")):
        if not forms.runs_head_dim(d, dtype):
            continue
        base = Problem(1, 100, 100, 2, 1, d, dtype, False, arch)
        for p in (base, dataclasses.replace(base, causal=True), dataclasses.replace(base, window=(8, 0))):
            every = forms.runs_head_dim(d, dtype, "fa1")  # (above 256: neither fa1 nor the ablation)
            plans = [numba_backend.forward_plan(p, "fa1")] if not p.general and every else []
            switches = [forms.Switches()] + ([forms.Switches(split_q=False)] if not p.general and every else [])
            plans += [numba_backend.forward_plan(p, "fa2", sw) for sw in switches]
            plans += [numba_backend.backward_plan(p, det) for det in (False, True)]
            for lau in itertools.chain(*plans):
                out.setdefault(lau.name_expression, lau)
    return list(out.values())


def test_twins_run_the_planned_forms_and_fit_an_h200():
    """Every launch planned for the twins is an mma.sync form or helper with a twin; its twin CTA has at most 1024
    threads and 227 KB of shared memory; the twins' shared memory is the CUDA C's layout with float32 tiles (the
    backward keeps one stage of Q_i, dO_i, L_i, D_i where the CUDA C has two)."""
    from rawflash.kernels import launch, numba_backend

    limit = 232448
    kinds = set()
    for lau in _planned():
        twin = numba_backend.twin_of(lau)
        threads = lau.block[0] if twin.threads is None else twin.threads
        assert threads <= 1024 and twin.smem <= limit, (lau.name_expression, threads, twin.smem)
        kinds.add(lau.kernel)
        cfg, d = lau.config, lau.template_args[1] if lau.config else None
        if lau.kernel == "fa2_fwd":
            assert twin.smem == launch.smem_fa2_fwd(cfg, d, 4, lau.template_args[11])
        elif lau.kernel == "fa1_fwd":
            assert twin.smem == launch.smem_fa1_fwd(cfg, d, 4)
        elif lau.kernel == "fa2_bwd_dq":
            assert twin.smem == launch.smem_fa2_bwd_dq(cfg, d, 4)
        elif lau.kernel == "fa2_bwd":
            assert twin.smem == launch.smem_fa2_bwd(cfg, d, 4, lau.template_args[10]) - 2 * cfg.br * (d + 1) * 4
        else:
            assert lau.config is None and twin.smem == 0 and twin.threads is None, lau.kernel
    assert kinds == {"fa1_fwd", "fa1_finalize", "fa2_fwd", "fa2_bwd_preprocess", "fa2_bwd", "fa2_bwd_dq",
                     "fa2_bwd_convert_dq"}
