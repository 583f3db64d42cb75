"""How far a decode step on an FP8 KV cache lands from exact attention over the 16-bit cache it was made from: the
numbers behind the README's FP8-cache accuracy paragraph. For normal keys and values (N(0, 1)) and for outlier
channels (4 of the 128 key and value channels 20x larger, as LLM caches have), it quantises the bf16 cache with
``rawflash.fp8.quantize_cache`` per (sequence, kv head) and per tensor, runs ``rawflash.decode`` on it (one new
key and value appended, quantised with the same descales) and compares the output with the float64 reference of
the bf16 cache (the new key and value unquantised); the bf16 cache's own decode is the first row. Errors are the
largest absolute difference and the RMS of the difference over the RMS of the reference. ``--backend reference``
(the default, no GPU) computes rawflash.decode's semantics in float64; ``--backend cupy`` runs the kernels.

    python3 tools/fp8_cache_accuracy.py [--backend cupy] [--keys 2048] [--seed 0]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import rawflash  # noqa: E402
from rawflash import fp8, reference  # noqa: E402

BATCH, HEADS, KV_HEADS, HEAD_DIM = 4, 32, 8, 128
OUTLIER_CHANNELS, OUTLIER_GAIN = (3, 40, 77, 120), 20.0


def inputs(keys: int, outliers: bool, seed: int) -> dict:
    """bf16 q, caches of ``keys`` keys (one row more for the append), the new key and value."""
    rng = np.random.default_rng(seed)
    bf16 = ml_dtypes.bfloat16

    def draw(*shape, gain=False):
        x = rng.standard_normal(shape)
        if gain:
            x[..., list(OUTLIER_CHANNELS)] *= OUTLIER_GAIN
        return x.astype(bf16)

    kv = (BATCH, keys + 1, KV_HEADS, HEAD_DIM)
    return dict(q=draw(BATCH, 1, HEADS, HEAD_DIM), k_cache=draw(*kv, gain=outliers), v_cache=draw(*kv, gain=outliers),
                k_new=draw(BATCH, 1, KV_HEADS, HEAD_DIM, gain=outliers),
                v_new=draw(BATCH, 1, KV_HEADS, HEAD_DIM, gain=outliers))


def run(x: dict, keys: int, backend: str, granularity: str | None) -> np.ndarray:
    """rawflash.decode's output on the bf16 cache (granularity None) or its FP8 quantisation."""
    args = {n: v.copy() for n, v in x.items()}
    opts = {}
    if granularity:
        (args["k_cache"], opts["k_descale"]), (args["v_cache"], opts["v_descale"]) = (
            fp8.quantize_cache(args[n], granularity) for n in ("k_cache", "v_cache"))
    lens = np.full(BATCH, keys, np.int32)
    if backend == "cupy":
        import cupy

        args = {n: cupy.asarray(v.view(np.uint8)).view(v.dtype) if v.dtype.itemsize == 1 else cupy.asarray(v)
                for n, v in args.items()}
        opts = {n: cupy.asarray(v) for n, v in opts.items()}
        lens = cupy.asarray(lens)
    out = rawflash.decode(**args, cache_seqlens=lens, **opts, backend=backend)
    return np.asarray(out.get() if hasattr(out, "get") else out, np.float64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("reference", "cupy"), default="reference")
    ap.add_argument("--keys", type=int, default=2048, help="keys already in each sequence's cache")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"decode, b {BATCH} x {args.keys} keys, h {HEADS}/{KV_HEADS}, d {HEAD_DIM}, bf16 q, backend "
          f"{args.backend}: error against float64 attention over the bf16 cache")
    print(f"{'inputs':<18} {'cache':<22} {'max abs error':>14} {'rms error / rms':>16}")
    for outliers in (False, True):
        x = inputs(args.keys, outliers, args.seed)
        exact, _ = reference.decode(x["q"], x["k_cache"], x["v_cache"], np.full(BATCH, args.keys), k_new=x["k_new"],
                                    v_new=x["v_new"])
        for name, gran in (("bf16", None), ("fp8, per (seq, kv head)", "head"), ("fp8, per tensor", "tensor")):
            got = run(x, args.keys, args.backend, gran)
            diff = got - exact
            rel = np.sqrt(np.mean(diff ** 2)) / np.sqrt(np.mean(exact ** 2))
            print(f"{'outlier channels' if outliers else 'normal':<18} {name:<22} {np.abs(diff).max():>14.3g} "
                  f"{rel:>16.3g}")


if __name__ == "__main__":
    main()
