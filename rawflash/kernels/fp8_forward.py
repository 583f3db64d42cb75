"""The FP8 forward's call path (``rawflash.forward`` with float8_e4m3fn inputs, or fp8=True / incoherent=True).

16-bit and float32 inputs are quantised first (``fp8.quantize``, per (batch, kv head), q and k rotated when
``incoherent``) and then take the path of e4m3 inputs: ``validation.check_fp8``, then the reference backend
(dequantised to float64) or the CUDA C plan (``forms.fp8_forward``: the V^T pre-pass and FA3's FP8 form).
"""
from __future__ import annotations

import numpy as np

from .. import arrays, fp8, reference, validation
from ..validation import Checked, Features
from . import configs


def forward(q, k, v, c: Checked, feats: Features, descales: dict, out_dtype, use_fp8, incoherent, kernel: str,
            backend: str, switches, env):
    p = c.problem
    if p.dtype != configs.FP8:
        return _quantised(q, k, v, c, feats, descales, out_dtype, use_fp8, incoherent, kernel, backend, switches, env)
    c, ds = validation.check_fp8(c, kernel, backend, feats, descales, out_dtype, incoherent)
    p = c.problem
    to_numpy = c.kind == "numpy"
    if backend == "reference":
        qf, kf, vf = (fp8.dequantize(x, d, cu_seqlens=cu) for x, d, cu in
                      zip((q, k, v), ds, (feats.cu_seqlens_q, feats.cu_seqlens_k, feats.cu_seqlens_k)))
        out, lse = reference.forward(qf, kf, vf, **validation.reference_features(c, feats))
        out_np = out.astype(np.float32).astype(_np_dtype(p.out_dtype))
        return _export(out_np, to_numpy), _export(lse.astype(np.float32), to_numpy)
    import cupy

    from . import cupy_backend

    if p.batch == 0 or p.seqlen_q == 0 or p.heads == 0 or p.seqlen_k == 0:
        out = cupy.zeros(tuple(q.shape), dtype=_np_dtype(p.out_dtype))
        lse = cupy.full(cupy_backend._rows(p), -np.inf, dtype=cupy.float32)
        if "sinks" in c.extras:  # (heads is lse's first axis when packed, its second otherwise)
            sinks = cupy.asarray(c.extras["sinks"], dtype=cupy.float32)
            lse[...] = sinks[:, None] if p.varlen else sinks[None, :, None]
        return arrays.export(out, to_numpy), arrays.export(lse, to_numpy)
    with cupy.cuda.Device(c.device if isinstance(c.device, int) else cupy.cuda.runtime.getDevice()):
        out, lse = cupy_backend.forward_fp8(p, q, k, v, c.scale, ds, switches, c.extras, env)
    return arrays.export(out, to_numpy), arrays.export(lse, to_numpy)


def _quantised(q, k, v, c, feats, descales, out_dtype, use_fp8, incoherent, kernel, backend, switches, env):
    """fp8=True / incoherent=True on 16-bit or float32 inputs: quantise (and rotate q, k), then run FP8."""
    p = c.problem
    validation.check_flag(use_fp8, "fp8")
    validation.check_flag(incoherent, "incoherent")
    given = [n for n, x in descales.items() if x is not None]
    if given:
        raise ValueError(f"{given[0]} goes with float8_e4m3fn q, k, v; with fp8=True / incoherent=True rawflash "
                         f"computes the descales itself (got {given[0]} with {p.dtype} inputs)")
    if p.varlen:
        raise ValueError("fp8=True / incoherent=True takes fixed-length q, k, v; got cu_seqlens_q")
    if incoherent:
        fp8.check_rotatable(p.head_dim)
    if out_dtype is None:
        out_dtype = p.dtype if p.dtype in validation.OUT_DTYPES else "bfloat16"
    q8, qd = fp8.quantize(q, "head", kv_heads=p.kv_heads, incoherent=incoherent)
    k8, kd = fp8.quantize(k, "head", incoherent=incoherent)
    v8, vd = fp8.quantize(v, "head")
    c8 = validation.check_forward(q8, k8, v8, p.causal, c.scale, kernel, backend, feats)
    ds = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    return forward(q8, k8, v8, c8, feats, ds, out_dtype, False, False, kernel, backend, switches, env)


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _export(x: np.ndarray, to_numpy: bool):
    if to_numpy:
        return x
    import cupy

    return cupy.asarray(x)
