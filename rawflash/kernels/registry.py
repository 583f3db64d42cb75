"""The registry of variants and their forms: what exists, where it lives, and what the dispatch may choose.

A *variant* is one algorithm (FA2's forward, FA2's backward, FA1's forward, standard attention). Its one name is
its ``.cu`` file, its main CUDA template, its Numba module and factory (``make_<name>``), its registry key and its
command-line value. A *form* is one implementation of a variant for an architecture: a ``__global__`` template in
its own ``.cu`` file, built from the variant's skeleton with one mainloop (``cuda/mainloop_*.cuh``), with its own
tile rows in ``configs.py`` and its own launch formula in ``launch.py``. ``forms.py`` chooses among a variant's
forms for a call; the backends run what it chose; the inspection tools read names from here.

Adding a variant or a form is one entry here plus its files (the architecture document says which).
"""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from . import configs

ALL_DTYPES = configs.DTYPES
HALF_DTYPES = ("float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Form:
    """One architecture form of a variant.

    Attributes
    ----------
    kernel : str
        Its ``__global__`` template, which is also its tile-row name in ``configs.TABLE`` and its launch function in
        ``launch.py``.
    source : str
        The ``.cu`` file defining the template.
    mainloop : str
        The CUDA header holding its mainloop (what differs between the forms of one variant).
    arch : str
        ``'sm_80'``: any GPU from sm_80 on; ``'sm_90'``: Hopper only (compiled for sm_90a).
    dtypes : tuple of str
        The dtypes it runs.
    twin : str or None
        The Numba twin that mirrors it (``rawflash/numba_kernels/<twin>.py``), or None.
    no_twin : str
        Why there is no twin (when ``twin`` is None), and which twin computes the same results instead.
    rows : tuple of str
        Its rows in ``configs.TABLE`` (default: ``(kernel,)``).
    more_mainloops : tuple of str
        Other mainloop headers of the same ``__global__`` template, picked by its tile row (fa3_bwd_sm90's column
        split at head_dim 192 / 256).
    """

    kernel: str
    source: str
    mainloop: str
    arch: str
    dtypes: tuple[str, ...]
    twin: str | None
    no_twin: str = ""
    rows: tuple[str, ...] = ()
    more_mainloops: tuple[str, ...] = ()

    @property
    def mainloops(self) -> tuple[str, ...]:
        """Every mainloop header of the form, ``mainloop`` first."""
        return (self.mainloop, *self.more_mainloops)

    @property
    def tile_rows(self) -> tuple[str, ...]:
        return self.rows or (self.kernel,)

    @property
    def target(self) -> str | None:
        """The NVRTC target that replaces the GPU's own (sm_90a for the wgmma forms), else None."""
        return "sm_90a" if self.arch == "sm_90" else None


@dataclasses.dataclass(frozen=True)
class Helper:
    """A kernel of a variant's file that is not one of its forms (pre- and post-passes)."""

    kernel: str
    source: str
    role: str
    twin: str | None


@dataclasses.dataclass(frozen=True)
class Variant:
    """One variant of attention: its algorithm, its forms and its helper kernels."""

    name: str
    direction: str
    api_kernel: str
    paper_algorithm: str
    warp_partition: str
    forms: tuple[Form, ...]
    helpers: tuple[Helper, ...] = ()
    supports: tuple[str, ...] = ()

    @property
    def source(self) -> str:
        return f"{self.name}.cu"

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(f.source for f in (*self.forms, *self.helpers)))

    @property
    def numba_factory(self) -> str:
        return f"make_{self.name}"

    @property
    def numba_module(self) -> str:
        return f"rawflash.numba_kernels.{self.name}"

    def form(self, kernel: str) -> Form:
        for f in self.forms:
            if f.kernel == kernel:
                return f
        raise KeyError(f"variant {self.name!r} has no form {kernel!r}; forms: {[f.kernel for f in self.forms]}")

    def has_numba_twin(self) -> bool:
        """Whether ``rawflash/numba_kernels/<name>.py`` is present; nothing is imported (importing the twins
        imports numba, which must not happen before the caller chose whether to use its CUDA simulator)."""
        package = importlib.util.find_spec("rawflash.numba_kernels")
        folders = package.submodule_search_locations if package else None
        return any((Path(folder) / f"{self.name}.py").is_file() for folder in folders or ())


FEATURES = ("causal", "window", "softcap", "alibi_slopes", "sinks", "varlen")
COMMON = ("float16, bfloat16, float32", f"head_dim 1..{configs.COMMON_MAX_HEAD_DIM}", "causal (bottom-right)",
          "GQA/MQA")
# FA2's forward and backward (and standard attention) also run the head dims up to configs.MAX_HEAD_DIM
WIDE = (f"head_dim {configs.COMMON_MAX_HEAD_DIM + 1}..{configs.MAX_HEAD_DIM} in float16 / bfloat16 (the mma.sync "
        f"forms' warps, and on Hopper the FA3 forward's consumer warpgroups, split the head columns)",)
_NO_TWIN_SM90 = ("wgmma and the Hopper pipeline have no Numba counterpart; the twin of the variant's mma.sync form "
                 "computes the same results")

REGISTRY: dict[str, Variant] = {v.name: v for v in (
    Variant("naive", "fwd", "naive", "standard attention (FA1 paper, Algorithm 0): S and P written to HBM",
            "one warp per row of S (softmax); products by cuBLAS",
            (Form("naive_softmax", "naive.cu", "-", "sm_80", ALL_DTYPES, None,
                  "cuBLAS products through CuPy around one softmax kernel: nothing to mirror"),),
            supports=COMMON + WIDE + ("window",)),
    Variant("fa1_fwd", "fwd", "fa1",
            "FlashAttention-1 forward (FA1 paper, Algorithm 1): K/V outer loop, O, l, m in HBM",
            "split-K: warps split the Bc keys of a block and combine through shared memory",
            (Form("fa1_fwd", "fa1_fwd.cu", "splitk.cuh", "sm_80", ALL_DTYPES, "fa1_fwd"),),
            (Helper("fa1_finalize", "fa1_fwd.cu", "out and lse from the float32 state", "fa1_fwd"),),
            supports=COMMON),
    Variant("fa2_fwd", "fwd", "fa2", "FlashAttention-2 forward (FA2 paper, Algorithm 1)",
            "split-Q: each warp owns whole query rows, no inter-warp exchange (at head_dim 512 two warps share rows "
            "and split O's columns, each computing the rows' softmax)",
            (Form("fa2_fwd", "fa2_fwd.cu", "mainloop_fwd_sm80.cuh", "sm_80", ALL_DTYPES, "fa2_fwd",
                  rows=("fa2_fwd", "fa2_fwd_splitk")),
             Form("fa2_fwd_sm90", "fa2_fwd_sm90.cu", "mainloop_fwd_sm90.cuh", "sm_90", HALF_DTYPES, None,
                  _NO_TWIN_SM90),
             Form("fa3_fwd_sm90", "fa3_fwd_sm90.cu", "mainloop_fwd_sm90_ws.cuh", "sm_90", HALF_DTYPES, None,
                  _NO_TWIN_SM90),
             Form("fa3_fwd_sm90_fp8", "fa3_fwd_sm90.cu", "mainloop_fwd_sm90_fp8.cuh", "sm_90", (configs.FP8,), None,
                  "FP8 wgmma has no Numba counterpart (nor do e4m3 numbers); the reference backend dequantises the "
                  "inputs and computes what it should")),
            (Helper("fp8_vt_permute", "fp8_prep.cu", "FP8: V^T with the fragment order of the keys", None),
             Helper("fp8_quantize", "fp8_prep.cu", "FP8: inputs to e4m3 with descales (and the Hadamard rotation)",
                    None)),
            supports=COMMON + WIDE + FEATURES[1:] + ("ablation switches: defer_norm, seq_parallel, split_q; wgmma, "
                                                     "overlap; warp_specialize, pingpong, persistent",
                                                     "float8_e4m3fn on sm_90 (FA3's form; causal, windows, varlen, "
                                                     "seqused_k, GQA, sinks)")),
    Variant("fa2_bwd", "bwd", "fa2", "FlashAttention-2 backward (FA2 paper, Algorithm 2)",
            "warps split the Bc keys (and with wc > 1 the head_dim columns of dK, dV, and in fa2_bwd_dq of dQ)",
            (Form("fa2_bwd", "fa2_bwd.cu", "mainloop_bwd_sm80.cuh", "sm_80", ALL_DTYPES, "fa2_bwd"),
             Form("fa2_bwd_sm90", "fa2_bwd_sm90.cu", "mainloop_bwd_sm90.cuh", "sm_90", HALF_DTYPES, None,
                  _NO_TWIN_SM90),
             Form("fa3_bwd_sm90", "fa3_bwd_sm90.cu", "mainloop_bwd_sm90_ws.cuh", "sm_90", HALF_DTYPES, None,
                  _NO_TWIN_SM90, more_mainloops=("mainloop_bwd_sm90_ws_split_d.cuh",))),
            (Helper("fa2_bwd_preprocess", "fa2_bwd.cu",
                    "D = rowsum(dO * O), L in log2 units, sink terms, dQ rows zeroed", "fa2_bwd"),
             Helper("fa2_bwd_convert_dq", "fa2_bwd.cu", "float32 dQ to the input dtype (atomic dQ)", "fa2_bwd"),
             Helper("fa2_bwd_dq", "fa2_bwd.cu", "dQ without atomics, one CTA per Q block (deterministic=True)",
                    "fa2_bwd")),
            supports=COMMON + WIDE + FEATURES[1:] + ("deterministic=True (bitwise repeatable; fa3_bwd_sm90 in order "
                                                     "on Hopper, else the fa2_bwd_dq pass)",)),
    Variant("decode", "decode", "decode", "Flash-Decoding: split-KV attention of a few query rows against a KV cache",
            "one split of the keys per warp; the GQA group's query heads and rows packed into one tile",
            (Form("decode_split", "decode.cu", "mainloop_decode.cuh", "sm_80", ALL_DTYPES, "decode"),
             Form("decode_split", "decode.cu", "mainloop_decode_sm90.cuh", "sm_90", HALF_DTYPES, None,
                  "the latent cache's warpgroup form (MainloopDecodeLatentWg, template argument WG): the decode "
                  "twin runs the latent cache's mma.sync form (MainloopDecodeLatent), which computes the same "
                  "results and which RAWFLASH_WGMMA=0 runs on the GPU")),
            (Helper("decode_append", "decode.cu", "k_new / v_new into the cache (contiguous or paged) where "
                    "decode_split cannot (several row groups read the same keys)", "decode"),
             Helper("decode_combine_warp", "decode.cu", "the splits merged by their lse, the sink added: one warp "
                    "per output row (up to 32 splits)", "decode"),
             Helper("decode_combine", "decode.cu", "the splits merged by their lse, the sink added: one CTA per "
                    "output row (more than 32 splits)", "decode")),
            supports=COMMON + ("window", "softcap", "alibi_slopes", "sinks", "paged KV cache", "in-place append",
                               "float8_e4m3fn cache with k_descale / v_descale (no Numba twin: the twins read "
                               "16-bit and float32 caches)",
                               "latent cache (MLA: head_dim 576, head_dim_v 512, float16 / bfloat16, sm_90; its "
                               "8 warps share a split)")),
)}


def get(name: str) -> Variant:
    """The registry entry called ``name``; ValueError naming the known ones otherwise."""
    if name not in REGISTRY:
        raise ValueError(f"variant must be one of {', '.join(map(repr, REGISTRY))}, got {name!r}")
    return REGISTRY[name]


def for_call(kernel: str, direction: str) -> Variant:
    """The variant a ``rawflash.forward(kernel=...)`` (direction 'fwd') or ``rawflash.backward`` ('bwd') runs."""
    if direction == "bwd":
        return REGISTRY["fa2_bwd"]
    for variant in REGISTRY.values():
        if variant.direction == "fwd" and variant.api_kernel == kernel:
            return variant
    raise ValueError(f"kernel must be one of {', '.join(repr(k) for k in api_kernels())}, got {kernel!r}")


def api_kernels() -> tuple[str, ...]:
    """The ``kernel=`` values of the forward API, in registry order of preference (fa2 first)."""
    order = [v.api_kernel for v in REGISTRY.values() if v.direction == "fwd"]
    return tuple(sorted(order, key=lambda k: (k != "fa2", k != "fa1")))


def form(kernel: str) -> Form:
    """The form whose template is ``kernel``."""
    for variant in REGISTRY.values():
        for f in variant.forms:
            if f.kernel == kernel:
                return f
    raise KeyError(f"no form {kernel!r} in the registry")


def kernels() -> dict[str, str]:
    """Every CUDA template the registry knows (forms and helpers) -> its source file."""
    out = {}
    for variant in REGISTRY.values():
        for k in (*variant.forms, *variant.helpers):
            out[k.kernel] = k.source
    return out
