"""Launch formulas: the only place grids, blocks, shared-memory sizes and template arguments are computed.

Both backends use these: the CUDA C kernels take ``Launch.template_args`` as template arguments and the Numba
factories take the same tile sizes as arguments. Every shared-memory formula here is checked against the
kernel's own layout at compile time (a ``static_assert`` on the ``SMEM_BYTES`` template argument), so the two
cannot drift apart silently.
"""
from __future__ import annotations

import dataclasses
import os

from . import configs
from .configs import TileConfig

CUDA_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
ELEMENTWISE_THREADS = 256
ELEMENTWISE_MAX_BLOCKS = 132 * 16  # grid-stride loops: enough CTAs to fill an H200 several times over
MAX_GRID_YZ = 65535


@dataclasses.dataclass(frozen=True)
class Problem:
    """The shape of one attention call after validation (head_dim is the caller's, not the padded one)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    causal: bool
    arch: str = "sm_90"

    @property
    def padded_head_dim(self) -> int:
        return configs.padded_head_dim(self.head_dim)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch: which template instantiation, and with what grid, block and dynamic shared memory."""

    kernel: str
    source: str
    template_args: tuple
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    config: TileConfig | None = None
    target: str | None = None  # a compile target other than the GPU's own (sm_90a for wgmma), else None

    def compile_arch(self, arch: str) -> str:
        """The NVRTC target this launch compiles for when the GPU (or the offline check) is ``arch``."""
        return self.target or arch

    @property
    def name_expression(self) -> str:
        args = ", ".join(_cxx(a) for a in self.template_args)
        return f"{self.kernel}<{args}>"

    @property
    def ctas(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]


def _cxx(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def register_cap(cfg: TileConfig) -> int:
    """Registers per thread the compiler may use under ``__launch_bounds__(threads, min_blocks)``."""
    per_thread = 65536 // (cfg.threads * cfg.min_blocks)
    return min(255, per_thread // 8 * 8)


# ---------------------------------------------------------------- shared memory (mirrors the *Smem structs)
def splitk_bytes(br: int, d: int, warps: int) -> int:
    """splitk.cuh SplitK::BYTES: red_max, red_sum (warps x BR), acc (BR x D), alpha, beta (BR), float32."""
    return (2 * warps * br + br * d + 2 * br) * 4


def smem_fa2_fwd(cfg: TileConfig, d: int, itemsize: int, split_q: bool = True) -> int:
    tiles = (cfg.br + 2 * cfg.bc) * d * itemsize
    return tiles if split_q else tiles + splitk_bytes(cfg.br, d, cfg.warps) + (cfg.br * d + 2 * cfg.br) * 4


def smem_fa1_fwd(cfg: TileConfig, d: int, itemsize: int) -> int:
    return (cfg.br + 2 * cfg.bc) * d * itemsize + splitk_bytes(cfg.br, d, cfg.warps)


def smem_fa2_bwd(cfg: TileConfig, d: int, itemsize: int, atomic_dq: bool) -> int:
    """K_j, V_j; two stages of Q_i, dO_i; dS^T (atomic dQ only); two stages of L_i, D_i (float32)."""
    ds = cfg.bc * cfg.br * itemsize if atomic_dq else 0
    return (2 * cfg.bc + 4 * cfg.br) * d * itemsize + ds + 4 * cfg.br * 4


def smem_fa2_bwd_dq(cfg: TileConfig, d: int, itemsize: int) -> int:
    return (2 * cfg.bc + 2 * cfg.br) * d * itemsize + 2 * cfg.br * 4


# ---------------------------------------------------------------- launches
def _check_grid(grid: tuple[int, int, int], what: str) -> tuple[int, int, int]:
    if grid[1] > MAX_GRID_YZ or grid[2] > MAX_GRID_YZ:
        raise ValueError(f"{what}: grid {grid} exceeds CUDA's limit of {MAX_GRID_YZ} on y and z "
                         "(heads and batch must each be at most 65535)")
    return grid


def _elementwise(kernel: str, source: str, dtype: str, n: int) -> Launch:
    blocks = max(1, min(cdiv(n, ELEMENTWISE_THREADS), ELEMENTWISE_MAX_BLOCKS))
    return Launch(kernel, source, (CUDA_TYPES[dtype],), (blocks, 1, 1), (ELEMENTWISE_THREADS, 1, 1), 0)


def _rows_of_warps(kernel: str, source: str, dtype: str, rows: int) -> Launch:
    """One warp per row, 8 warps per CTA."""
    blocks = max(1, cdiv(rows, 8))
    return Launch(kernel, source, (CUDA_TYPES[dtype],), (blocks, 1, 1), (256, 1, 1), 0)


def smem_fa2_fwd_sm90(cfg: TileConfig, d: int) -> int:
    """1024 B of alignment slack, Q_i, and two stages each of K_j and V_j (16-bit)."""
    return 1024 + (cfg.br + 4 * cfg.bc) * d * 2


def _has_sm90_row(kernel: str, p: Problem) -> bool:
    """Whether the wgmma kernel ``kernel`` can run ``p``: an sm_90 GPU (wgmma is sm_90a code) and a tile row for
    its dtype and specialised head_dim."""
    return p.arch == "sm_90" and (kernel, p.padded_head_dim, p.dtype) in configs.TABLE


def _use_wgmma(wgmma: bool | None, eligible: bool, kernel: str, also: str, got: str) -> bool:
    """The kernel choice of a ``wgmma`` switch: None picks ``kernel`` wherever it is ``eligible`` unless the
    environment sets ``RAWFLASH_WGMMA=0``; True demands it (ValueError where it cannot run); False refuses it."""
    if wgmma is None:
        return eligible and os.environ.get("RAWFLASH_WGMMA", "1") != "0"
    if wgmma and not eligible:
        dims = sorted(d for (k, d, dt) in configs.TABLE if k == kernel and dt == "bfloat16")
        what = " (backward)" if kernel.startswith("fa2_bwd") else ""
        raise ValueError(f"wgmma=True{what} needs an sm_90 GPU, float16 or bfloat16, a head_dim that pads to one of "
                         f"{dims}{also}; got {got}")
    return wgmma


def wgmma_supported(p: Problem) -> bool:
    """Whether ``fa2_fwd_sm90`` can run ``p`` (float16 / bfloat16, head_dim padded to 64, 128, 192 or 256)."""
    return _has_sm90_row("fa2_fwd_sm90", p)


def fa2_fwd_sm90(p: Problem, *, overlap: bool = True) -> Launch:
    """FA2 forward with wgmma (sm_90a); ``overlap`` is FA3's softmax / P V overlap inside a warpgroup."""
    d = p.padded_head_dim
    cfg = configs.tile_config("fa2_fwd_sm90", d, p.dtype, p.arch)
    smem = smem_fa2_fwd_sm90(cfg, d)
    args = (CUDA_TYPES[p.dtype], d, cfg.br, cfg.bc, cfg.min_blocks, p.causal, overlap, smem)
    grid = _check_grid((cdiv(p.seqlen_q, cfg.br), p.heads, p.batch), "fa2_fwd_sm90")
    return Launch("fa2_fwd_sm90", "fa2_fwd_sm90.cu", args, grid, (cfg.threads, 1, 1), smem, cfg, target="sm_90a")


def fa2_fwd(p: Problem, *, defer_norm: bool = True, seq_parallel: bool = True, split_q: bool = True,
            wgmma: bool | None = None, overlap: bool = True) -> Launch:
    """FA2 forward. The first three switches are the FA2 ideas the ablation turns off one by one.

    ``wgmma``: None (default) runs ``fa2_fwd_sm90`` wherever ``wgmma_supported`` and every FA2 idea is on,
    unless the environment sets ``RAWFLASH_WGMMA=0``; False forces the mma.sync kernel; True demands wgmma.
    ``overlap`` (wgmma only): FA3's overlap of the softmax with P V inside a warpgroup.
    """
    ideas_on = defer_norm and seq_parallel and split_q
    if _use_wgmma(wgmma, ideas_on and wgmma_supported(p), "fa2_fwd_sm90", " and every FA2 switch on",
                  f"arch {p.arch}, {p.dtype}, head_dim {p.head_dim}, defer_norm={defer_norm}, "
                  f"seq_parallel={seq_parallel}, split_q={split_q}"):
        return fa2_fwd_sm90(p, overlap=overlap)
    d = p.padded_head_dim
    cfg = configs.tile_config("fa2_fwd" if split_q else "fa2_fwd_splitk", d, p.dtype, p.arch)
    smem = smem_fa2_fwd(cfg, d, p.itemsize, split_q)
    tr = cdiv(p.seqlen_q, cfg.br) if seq_parallel else 1
    args = (CUDA_TYPES[p.dtype], d, cfg.br, cfg.bc, cfg.warps, cfg.min_blocks, cfg.kunroll, p.causal, defer_norm,
            seq_parallel, split_q, smem)
    grid = _check_grid((tr, p.heads, p.batch), "fa2_fwd")
    return Launch("fa2_fwd", "fa2_fwd.cu", args, grid, (cfg.threads, 1, 1), smem, cfg)


def fa1_fwd(p: Problem) -> Launch:
    d = p.padded_head_dim
    cfg = configs.tile_config("fa1_fwd", d, p.dtype, p.arch)
    smem = smem_fa1_fwd(cfg, d, p.itemsize)
    args = (CUDA_TYPES[p.dtype], d, cfg.br, cfg.bc, cfg.warps, cfg.min_blocks, p.causal, smem)
    grid = (p.heads, p.batch, 1)
    if p.batch > MAX_GRID_YZ:
        raise ValueError(f"fa1_fwd: batch must be at most {MAX_GRID_YZ}, got {p.batch}")
    return Launch("fa1_fwd", "fa1_fwd.cu", args, grid, (cfg.threads, 1, 1), smem, cfg)


def fa1_finalize(p: Problem) -> Launch:
    return _elementwise("fa1_finalize", "fa1_fwd.cu", p.dtype, p.batch * p.heads * p.seqlen_q * p.head_dim)


def naive_softmax(p: Problem) -> Launch:
    return _rows_of_warps("naive_softmax", "naive.cu", p.dtype, p.batch * p.heads * p.seqlen_q)


def fa2_bwd_preprocess(p: Problem) -> Launch:
    """One thread per query row."""
    rows = p.batch * p.heads * p.seqlen_q
    return Launch("fa2_bwd_preprocess", "fa2_bwd.cu", (CUDA_TYPES[p.dtype],), (max(1, cdiv(rows, 128)), 1, 1),
                  (128, 1, 1), 0)


def bwd_sm90_split_d(cfg: TileConfig) -> bool:
    """fa2_bwd_sm90's SPLIT_D form: more warpgroups than 64-key slices, so the warpgroups split dK, dV's columns."""
    return cfg.threads // 128 > cfg.bc // 64


def smem_fa2_bwd_sm90(cfg: TileConfig, d: int) -> int:
    """1024 B of alignment slack; K_j, V_j; two stages of Q_i, dO_i; dS^T (and with SPLIT_D P^T, float32 dP^T);
    two stages of L_i, D_i (float32)."""
    split = bwd_sm90_split_d(cfg)
    ds = cfg.bc * cfg.br * 2
    return 1024 + (2 * cfg.bc + 4 * cfg.br) * d * 2 + ds * (2 if split else 1) + (2 * ds if split else 0) + \
        4 * cfg.br * 4


def wgmma_bwd_supported(p: Problem) -> bool:
    """Whether ``fa2_bwd_sm90`` can run ``p`` (float16 / bfloat16, head_dim padded to 64, 128 or 256)."""
    return _has_sm90_row("fa2_bwd_sm90", p)


def fa2_bwd_sm90(p: Problem) -> Launch:
    """FA2 backward main pass with wgmma (sm_90a, atomic dQ): one CTA per (key block, kv head, batch)."""
    d = p.padded_head_dim
    cfg = configs.tile_config("fa2_bwd_sm90", d, p.dtype, p.arch)
    smem = smem_fa2_bwd_sm90(cfg, d)
    args = (CUDA_TYPES[p.dtype], d, cfg.br, cfg.bc, cfg.min_blocks, p.causal, bwd_sm90_split_d(cfg), smem)
    grid = _check_grid((cdiv(p.seqlen_k, cfg.bc), p.kv_heads, p.batch), "fa2_bwd_sm90")
    return Launch("fa2_bwd_sm90", "fa2_bwd_sm90.cu", args, grid, (cfg.threads, 1, 1), smem, cfg, target="sm_90a")


def fa2_bwd(p: Problem, *, atomic_dq: bool = True, wgmma: bool | None = None) -> Launch:
    """FA2 backward main pass: one CTA per (key block, kv head, batch). ``wgmma`` None picks ``fa2_bwd_sm90`` for
    the atomic-dQ pass where ``wgmma_bwd_supported`` (unless ``RAWFLASH_WGMMA=0``); False forces mma.sync."""
    if _use_wgmma(wgmma, atomic_dq and wgmma_bwd_supported(p), "fa2_bwd_sm90", " and the atomic dQ pass",
                  f"arch {p.arch}, {p.dtype}, head_dim {p.head_dim}, atomic_dq={atomic_dq}"):
        return fa2_bwd_sm90(p)
    d = p.padded_head_dim
    cfg = configs.tile_config("fa2_bwd", d, p.dtype, p.arch)
    smem = smem_fa2_bwd(cfg, d, p.itemsize, atomic_dq)
    args = (CUDA_TYPES[p.dtype], d, cfg.br, cfg.bc, cfg.warps, cfg.wc, cfg.min_blocks, cfg.kunroll, p.causal, atomic_dq,
            smem)
    grid = _check_grid((cdiv(p.seqlen_k, cfg.bc), p.kv_heads, p.batch), "fa2_bwd")
    return Launch("fa2_bwd", "fa2_bwd.cu", args, grid, (cfg.threads, 1, 1), smem, cfg)


def fa2_bwd_dq(p: Problem) -> Launch:
    """Deterministic dQ pass: one CTA per (query block, head, batch)."""
    d = p.padded_head_dim
    cfg = configs.tile_config("fa2_bwd_dq", d, p.dtype, p.arch)
    smem = smem_fa2_bwd_dq(cfg, d, p.itemsize)
    args = (CUDA_TYPES[p.dtype], d, cfg.br, cfg.bc, cfg.warps, cfg.min_blocks, cfg.kunroll, p.causal, smem)
    grid = _check_grid((cdiv(p.seqlen_q, cfg.br), p.heads, p.batch), "fa2_bwd_dq")
    return Launch("fa2_bwd_dq", "fa2_bwd.cu", args, grid, (cfg.threads, 1, 1), smem, cfg)


def fa2_bwd_convert_dq(p: Problem) -> Launch:
    """8 columns per thread (head_dim is a multiple of 8 in the kernels)."""
    return _elementwise("fa2_bwd_convert_dq", "fa2_bwd.cu", p.dtype,
                        p.batch * p.heads * p.seqlen_q * cdiv(p.head_dim, 8))


def forward_launches(p: Problem, kernel: str = "fa2", **switches) -> list[Launch]:
    """Every launch a forward call makes, in order (the naive matrix products are cuBLAS calls, not listed)."""
    if kernel == "fa2":
        return [fa2_fwd(p, **switches)]
    if kernel == "fa1":
        return [fa1_fwd(p), fa1_finalize(p)]
    if kernel == "naive":
        return [naive_softmax(p)]
    raise ValueError(f"kernel must be one of 'fa2', 'fa1', 'naive', got {kernel!r}")


def backward_launches(p: Problem, deterministic: bool = False) -> list[Launch]:
    """Every launch a backward call makes, in order."""
    if deterministic:
        return [fa2_bwd_preprocess(p), fa2_bwd(p, atomic_dq=False), fa2_bwd_dq(p)]
    return [fa2_bwd_preprocess(p), fa2_bwd(p, atomic_dq=True), fa2_bwd_convert_dq(p)]


def waves(launch: Launch, ctas_per_sm: int, sms: int = 132) -> float:
    """How many full waves of CTAs the grid makes on ``sms`` multiprocessors."""
    return launch.ctas / max(1, ctas_per_sm * sms)


def all_instantiations(arch: str = "sm_90") -> list[Launch]:
    """Every template instantiation the library can launch on ``arch`` (for the compile tests and pre-compiling)."""
    out: dict[str, Launch] = {}
    for dtype in configs.DTYPES:
        for d in configs.SPECIALISED_HEAD_DIMS:
            for causal in (False, True):
                p = Problem(1, 1, 1, 1, 1, d, dtype, causal, arch)
                launches = [fa2_fwd(p, wgmma=False), fa1_fwd(p), fa2_bwd(p, atomic_dq=True, wgmma=False),
                             fa2_bwd(p, atomic_dq=False),
                            fa2_bwd_dq(p), naive_softmax(p), fa1_finalize(p), fa2_bwd_preprocess(p),
                            fa2_bwd_convert_dq(p)]
                if wgmma_supported(p):
                    launches += [fa2_fwd_sm90(p, overlap=True), fa2_fwd_sm90(p, overlap=False)]
                if wgmma_bwd_supported(p):
                    launches.append(fa2_bwd_sm90(p))
                if d in (64, 128):  # the ablation runs at the head dims of the FA2 paper's figures
                    launches += [fa2_fwd(p, **sw) for sw in ABLATIONS.values() if not sw.get("wgmma")]
                for launch in launches:
                    out.setdefault(launch.name_expression, launch)
    return list(out.values())


ABLATIONS: dict[str, dict[str, bool]] = {  # FA2's ideas, measured on the mma.sync kernel that has switches for them
    "fa2": {"wgmma": False},
    "no-deferred-norm": {"defer_norm": False},
    "no-seq-parallel": {"seq_parallel": False},
    "no-split-q": {"split_q": False},
    "none (all three off)": {"defer_norm": False, "seq_parallel": False, "split_q": False},
    # and what Hopper's warpgroup products add on top of full FA2 (sm_90 only), with and without FA3's overlap
    "wgmma": {"wgmma": True},
    "wgmma, no overlap": {"wgmma": True, "overlap": False},
}
