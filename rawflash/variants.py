"""The registry of variants: one entry per CUDA source file, keyed by the variant's one name (DESIGN.md section 2).

A variant's name is its ``.cu`` file, its main CUDA template, its Numba module and factory (``make_<name>``), its
registry key and its command-line value. Tile sizes are not here (``configs.py``) and neither are grids or shared
memory (``launch.py``): an entry only says what a variant is, where it lives and what it supports.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from . import configs


@dataclasses.dataclass(frozen=True)
class Variant:
    """One variant of attention.

    Attributes
    ----------
    name : str
        The one name (``fa2_fwd``); ``source`` is ``<name>.cu`` and the Numba factory ``make_<name>``.
    direction : {'fwd', 'bwd'}
    api_kernel : str
        The ``kernel=`` value of ``rawflash.forward`` that selects it ('fa2', 'fa1', 'naive'); the backward is 'fa2'.
    paper_algorithm : str
        The algorithm it implements, as the papers number them.
    warp_partition : str
        How the warps of a CTA share a tile.
    kernels : tuple of str
        The CUDA templates its file defines, in launch order, with what each does.
    tile_rows : tuple of str
        Kernel names of its rows in ``configs.TABLE`` (empty for variants without tiles).
    supports : tuple of str
        What it supports beyond the common contract (every dtype, head_dim up to 256, GQA/MQA, causal).
    more_sources : tuple of str
        Other ``.cu`` files holding a form of the same algorithm for one architecture (fa2_fwd_sm90.cu: the
        wgmma form of fa2_fwd); their Numba twin is the variant's.
    """

    name: str
    direction: str
    api_kernel: str
    paper_algorithm: str
    warp_partition: str
    kernels: tuple[str, ...]
    tile_rows: tuple[str, ...]
    supports: tuple[str, ...]
    more_sources: tuple[str, ...] = ()

    @property
    def source(self) -> str:
        return f"{self.name}.cu"

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.source, *self.more_sources)

    @property
    def numba_factory(self) -> str:
        return f"make_{self.name}"

    @property
    def numba_module(self) -> str:
        return f"rawflash.numba_kernels.{self.name}"

    def has_numba_twin(self) -> bool:
        """Whether ``rawflash/numba_kernels/<name>.py`` is present; nothing is imported (importing the twins
        imports numba, which must not happen before the caller chose whether to use its CUDA simulator)."""
        package = importlib.util.find_spec("rawflash.numba_kernels")
        folders = package.submodule_search_locations if package else None
        return any((Path(folder) / f"{self.name}.py").is_file() for folder in folders or ())


COMMON = ("float16, bfloat16, float32", f"head_dim 1..{configs.MAX_HEAD_DIM}", "causal (bottom-right)", "GQA/MQA")

REGISTRY: dict[str, Variant] = {v.name: v for v in (
    Variant("naive", "fwd", "naive", "standard attention (FA1 paper, Algorithm 0): S and P written to HBM",
            "one warp per row of S (softmax); products by cuBLAS",
            ("naive_softmax: P = softmax(S * scale) and lse, between two cuBLAS products",), (), COMMON),
    Variant("fa1_fwd", "fwd", "fa1", "FlashAttention-1 forward (FA1 paper, Algorithm 1): K/V outer loop, O, l, m in HBM",
            "split-K: warps split the Bc keys of a block and combine through shared memory",
            ("fa1_fwd: one CTA per (head, batch)", "fa1_finalize: out and lse from the float32 state"),
            ("fa1_fwd",), COMMON),
    Variant("fa2_fwd", "fwd", "fa2", "FlashAttention-2 forward (FA2 paper, Algorithm 1)",
            "split-Q: each warp owns whole query rows, no inter-warp exchange",
            ("fa2_fwd: one CTA per (Q block, head, batch)",
             "fa2_fwd_sm90: the same with wgmma, one warpgroup per 64 query rows (sm_90, 16-bit, head_dim <= 256)"),
            ("fa2_fwd", "fa2_fwd_splitk", "fa2_fwd_sm90"),
            COMMON + ("ablation switches: defer_norm, seq_parallel, split_q; wgmma, overlap",),
            more_sources=("fa2_fwd_sm90.cu",)),
    Variant("fa2_bwd", "bwd", "fa2", "FlashAttention-2 backward (FA2 paper, Algorithm 2)",
            "warps split the Bc keys (and with wc > 1 the head_dim columns of dK, dV)",
            ("fa2_bwd_preprocess: D = rowsum(dO * O)", "fa2_bwd: one CTA per (K block, kv head, batch)",
             "fa2_bwd_convert_dq: float32 dQ to the input dtype (default: atomicAdd dQ)",
             "fa2_bwd_dq: dQ without atomics, one CTA per Q block (deterministic=True)",
             "fa2_bwd_sm90: the atomic-dQ pass with wgmma, a warpgroup per 64 keys, or per half of the columns at "
             "head_dim > 128 (sm_90, 16-bit)"),
            ("fa2_bwd", "fa2_bwd_dq", "fa2_bwd_sm90"), COMMON + ("deterministic=True (bitwise repeatable)",),
            more_sources=("fa2_bwd_sm90.cu",)),
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
    raise ValueError(f"kernel must be one of 'fa2', 'fa1', 'naive', got {kernel!r}")
