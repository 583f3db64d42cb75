"""Launch formulas: the only place grids, blocks, shared-memory sizes and template arguments are computed.

Which form runs (mma.sync or wgmma, which tile row) is chosen in ``forms.py``; this module turns a chosen form,
its tile row and a call's ``Problem`` (``rawflash/problem.py``) into a :class:`Launch`. Both backends use these:
the CUDA C kernels take ``Launch.template_args`` as template arguments and the Numba factories take the same tile
sizes. Every shared-memory formula here is checked against the kernel's own layout at compile time (a
``static_assert`` on the ``SMEM_BYTES`` template argument), so the two cannot drift apart silently. The call's
compile-time mask mode (:func:`mask_mode`) is a launch fact too; which softmax reference it takes is a choice
(``forms.softmax_ref``).
"""
from __future__ import annotations

import dataclasses

from ..problem import Problem, cdiv
from . import configs
from .configs import TileConfig

CUDA_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float8_e4m3fn": "rf::e4m3"}
ELEMENTWISE_THREADS = 256
ELEMENTWISE_MAX_BLOCKS = 132 * 16  # grid-stride loops: enough CTAs to fill an H200 several times over
MAX_GRID_YZ = 65535
NO_MASK, CAUSAL, WINDOW = 0, 1, 2  # policy.cuh's Mask: the compile-time mask mode of a kernel
# Where each tiled kernel's template arguments hold its mask mode (the general-policy bool follows it, except in
# fa1_fwd, which has only the plain policy): the formulas below build them in this order.
MASK_ARG = {"fa2_fwd": 7, "fa2_fwd_sm90": 5, "fa3_fwd_sm90": 5, "fa3_fwd_sm90_fp8": 5, "fa3_bwd_sm90": 5,
            "fa2_bwd": 8, "fa2_bwd_sm90": 5, "fa2_bwd_dq": 7, "fa1_fwd": 6}


def mask_mode(p: Problem) -> int:
    """The kernels' compile-time mask mode of a call: plain calls NO_MASK or CAUSAL, general ones NO_MASK or
    WINDOW."""
    if p.general:
        return WINDOW if p.window_bounds != (-1, -1) else NO_MASK
    return CAUSAL if p.causal else NO_MASK


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
    cluster: tuple[int, int, int] = (1, 1, 1)  # the kernel's __cluster_dims__ (compiled in; the launch only reports it)

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


def register_cap(cfg: TileConfig) -> int:
    """Registers per thread the compiler may use under ``__launch_bounds__(threads, min_blocks)``."""
    per_thread = 65536 // (cfg.threads * cfg.min_blocks)
    return min(255, per_thread // 8 * 8)


def waves(launch: Launch, ctas_per_sm: int, sms: int = 132) -> float:
    """How many full waves of CTAs the grid makes on ``sms`` multiprocessors."""
    return launch.ctas / max(1, ctas_per_sm * sms)


# ---------------------------------------------------------------- grids
def _check_grid(grid: tuple[int, int, int], what: str) -> tuple[int, int, int]:
    if grid[1] > MAX_GRID_YZ or grid[2] > MAX_GRID_YZ:
        raise ValueError(f"{what}: grid {grid} exceeds CUDA's limit of {MAX_GRID_YZ} on y and z "
                         "(heads and batch must each be at most 65535)")
    return grid


def query_tile_grid(p: Problem, br: int, what: str) -> tuple[int, int, int]:
    """scheduler.cuh's QTileScheduler: (query tiles, heads, batch), or (tiles of all sequences, heads, 1)."""
    return _check_grid((p.q_tiles(br), p.heads, 1 if p.varlen else p.batch), what)


def key_tile_grid(p: Problem, bc: int, what: str) -> tuple[int, int, int]:
    """scheduler.cuh's KTileScheduler: (key tiles, kv heads, batch), or (tiles of all sequences, kv heads, 1)."""
    return _check_grid((p.k_tiles(bc), p.kv_heads, 1 if p.varlen else p.batch), what)


def pair_key_tile_grid(p: Problem, bc: int, what: str) -> tuple[int, int, int]:
    """KTileScheduler with PAIR: two CTAs (a cluster) per pair of key tiles of 2 bc keys, an odd count's last tile
    past the keys; packed sequences: an upper bound on the pairs of all sequences."""
    return _check_grid((2 * p.k_tiles(2 * bc), p.kv_heads, 1 if p.varlen else p.batch), what)


def _elementwise(kernel: str, source: str, dtype: str, n: int) -> Launch:
    blocks = max(1, min(cdiv(n, ELEMENTWISE_THREADS), ELEMENTWISE_MAX_BLOCKS))
    return Launch(kernel, source, (CUDA_TYPES[dtype],), (blocks, 1, 1), (ELEMENTWISE_THREADS, 1, 1), 0)


# ---------------------------------------------------------------- shared memory (mirrors the mainloops' SMEM_BYTES)
def splitk_bytes(br: int, d: int, warps: int) -> int:
    """splitk.cuh SplitK::BYTES: each warp's slot of partial O (BR x D), row max and row sum (BR), float32."""
    return (warps * br * d + 2 * warps * br) * 4


def smem_fa2_fwd(cfg: TileConfig, d: int, itemsize: int, split_q: bool = True) -> int:
    """Q_i, K_j, V_j; with split-K also the warps' slots (the running O, m, l stay in registers)."""
    tiles = (cfg.br + 2 * cfg.bc) * d * itemsize
    return tiles if split_q else tiles + splitk_bytes(cfg.br, d, cfg.warps)


def smem_fa2_fwd_sm90(cfg: TileConfig, d: int) -> int:
    """1024 B of alignment slack, Q_i, and two stages each of K_j and V_j (16-bit)."""
    return 1024 + (cfg.br + 4 * cfg.bc) * d * 2


def smem_fa3_fwd_sm90(cfg: TileConfig, d: int, item: int = 2, dv: int = 0) -> int:
    """mainloop_fwd_sm90_ws.cuh Fa3FwdPipeline::SMEM_BYTES: 1024 B of alignment slack, `q_stages` Q_i buffers,
    `stages` stages each of K_j and V_j (elements of `item` bytes; V_j of ``dv`` columns in the DV form, else d),
    2 q_stages + 4 stages mbarriers of 8 B and 16 B for the tile indices (the dynamic schedule's) and the paged keys'
    V-landed mbarrier."""
    return (1024 + (cfg.q_stages * cfg.br * d + cfg.stages * cfg.bc * (d + (dv or d))) * item
            + 8 * (2 * cfg.q_stages + 4 * cfg.stages) + 16)


def smem_fa3_fwd_sm90_fp8(cfg: TileConfig, d: int) -> int:
    """Fa3FwdPipeline::SMEM_BYTES of mainloop_fwd_sm90_fp8.cuh: the same as FA3's 16-bit forward with 1-byte
    elements (Q_i, `stages` stages of K_j and V_j^T)."""
    return smem_fa3_fwd_sm90(cfg, d, 1)


def fa3_bwd_split_d(cfg: TileConfig) -> bool:
    """fa3_bwd_sm90's column split (mainloop_bwd_sm90_ws_split_d.cuh): its two consumer warpgroups share a key block
    of 64 and split dK, dV and dQ's columns (fa3_bwd_sm90.cu's Fa3BwdMainloop picks it by the same BC == 64); 128
    keys are 64 per consumer warpgroup (mainloop_bwd_sm90_ws.cuh)."""
    return cfg.bc == 64


def fa3_bwd_ds_buffers(cfg: TileConfig) -> int:
    """The dS^T tiles of mainloop_bwd_sm90_ws.cuh (its DS_BUFS): two at 64 and 80 query rows a step, one at 128
    (ROW_SPLIT: the consumer warpgroups split dQ_i's rows; two would not fit in shared memory)."""
    return 1 if cfg.br == 128 else 2


def fa3_bwd_dq_buffers(cfg: TileConfig) -> int:
    """The float32 dQ_i tiles of mainloop_bwd_sm90_ws.cuh (its DQ_BUFS): two, or one at 80 query rows (SWAP_DQ:
    dQ_i^T by the warpgroups' products; a second would not fit beside two dS tiles)."""
    return 1 if cfg.br == FA3_BWD_SWAP_ROWS else 2


FA3_BWD_SWAP_ROWS = 80  # mainloop_bwd_sm90_ws.cuh's SWAP_DQ tile (head_dim 128, not deterministic)


def fa3_bwd_pair(cfg: TileConfig, d: int) -> bool:
    """fa3_bwd_sm90's column split (head_dim 192, 256) runs in clusters of two neighbouring key blocks that sum dQ_i
    between them (mainloop_bwd_sm90_ws_split_d.cuh's PAIR; fa3_bwd_sm90.cu's __cluster_dims__ by the same rule):
    the grid covers pairs of key tiles (``pair_key_tile_grid``), and the shared-memory map has dO_i in one stage of
    its own, the partner's dS^T twice and 128 of its K_j' columns, at head_dim 192 also each consumer warpgroup's
    float32 dQ_i panel for the TMA reduce-add (every policy, packed sequences too)."""
    return fa3_bwd_split_d(cfg) and d in (192, 256)


def smem_fa3_bwd_sm90(cfg: TileConfig, d: int, dv: int = 0) -> int:
    """SMEM_BYTES of mainloop_bwd_sm90_ws.cuh: 1024 B of slack; K_j, V_j; `stages` x (Q_i, dO_i) (V_j and dO_i of
    ``dv`` columns in the DV form, else d); ``fa3_bwd_ds_buffers`` dS^T; ``fa3_bwd_dq_buffers`` float32 dQ_i tiles
    (all warpgroups' slices, br x d floats each); `stages` x (L_i, D_i) float32;
    1 + 2 stages mbarriers. The column split (``fa3_bwd_split_d``, mainloop_bwd_sm90_ws_split_d.cuh, always in
    pairs: ``fa3_bwd_pair``) has one dO_i stage, two each of P^T, dS^T and the partner's dS^T and no dQ_i tiles
    of that kind, 128 columns of the partner's K_j', 2 + 4 mbarriers more and at d = 192 two 64 x 64 float32 dQ_i
    tiles."""
    pair = fa3_bwd_pair(cfg, d)  # (the column split always pairs: fa3_bwd_sm90 refuses it at other head dims)
    do_stages = 1 if pair else cfg.stages
    tight = pair and d == 256  # (one P^T and one partner's dS^T buffer, a 32-column float32 tile per warpgroup)
    dsx = (1 if tight else 2) if pair else 0
    tiles = cfg.bc * cfg.br * 2 * ((1 if tight else 2) + 2 + dsx if pair else fa3_bwd_ds_buffers(cfg))
    kx = cfg.bc * 128 * 2 if pair else 0  # the partner's K_j' columns: 128 of them at d = 192 and at d = 256
    bulk = 2 * 64 * (32 if tight else 64) * 4 if pair else 0  # (each consumer warpgroup's float32 dQ_i tile)
    mid = tiles + kx + bulk + (0 if pair else fa3_bwd_dq_buffers(cfg) * cfg.br * d * 4)
    barriers = 1 + 2 * cfg.stages + (2 + 2 * dsx if pair else 0)  # (the pair: dO_i's ring, xfull, xfree)
    tiles_kq = (cfg.bc + cfg.stages * cfg.br) * d + (cfg.bc + do_stages * cfg.br) * (dv or d)  # K, Q; V, dO
    return 1024 + tiles_kq * 2 + mid + 2 * cfg.stages * cfg.br * 4 + 8 * barriers


def smem_fa1_fwd(cfg: TileConfig, d: int, itemsize: int) -> int:
    """Two Q_i buffers, K_j, V_j and the split-K slots."""
    return (2 * cfg.br + 2 * cfg.bc) * d * itemsize + splitk_bytes(cfg.br, d, cfg.warps)


FA1_MAX_SPLITS = 30  # flash-attn 1.x's cap on num_splits


def fa1_splits(p: Problem, cfg: TileConfig, sms: int | None = None) -> int:
    """How many CTAs share the query blocks of one (batch, head) in fa1_fwd: flash-attn 1.x's num_splits heuristic
    (num_splits_heuristic_fwd). With w(s) = batch * heads * s / (sms * CTAs per SM) waves, the efficiency of s splits
    is w / ceil(w); the smallest s within 95 % of the best one up to min(30, query blocks). CTAs per SM: what shared
    memory and the row's ``min_blocks`` both allow. ``sms``: the GPU's multiprocessors (default ``p.sms``)."""
    smem = smem_fa1_fwd(cfg, configs.padded_head_dim(p.head_dim), p.itemsize)
    per_sm = max(1, min(cfg.min_blocks, 233472 // (smem + 1024), 2048 // cfg.threads))
    most = max(1, min(FA1_MAX_SPLITS, cdiv(p.seqlen_q, cfg.br)))
    slots = (p.sms if sms is None else sms) * per_sm
    eff = [(p.batch * p.heads * s / slots) / cdiv(p.batch * p.heads * s, slots) for s in range(1, most + 1)]
    best = max(eff)
    return next(s for s, e in enumerate(eff, start=1) if e > 0.95 * best)


def smem_fa2_bwd(cfg: TileConfig, d: int, itemsize: int, atomic_dq: bool) -> int:
    """K_j, V_j; two stages of Q_i, dO_i; dS^T (atomic dQ only); two stages of L_i, D_i (float32)."""
    ds = cfg.bc * cfg.br * itemsize if atomic_dq else 0
    return (2 * cfg.bc + 4 * cfg.br) * d * itemsize + ds + 4 * cfg.br * 4


def smem_fa2_bwd_dq(cfg: TileConfig, d: int, itemsize: int) -> int:
    return (2 * cfg.bc + 2 * cfg.br) * d * itemsize + 2 * cfg.br * 4


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


# ---------------------------------------------------------------- launches
def _column_split(cfg: TileConfig) -> tuple:
    """fa2_fwd's, fa2_bwd_dq's and fa3_fwd_sm90's last template argument, WC (warps, or FA3's consumer warpgroups,
    that share rows and split the head columns), where the row has one: the template's default of 1 is left out of
    the name expression."""
    return (cfg.wc,) if cfg.wc > 1 else ()


def fa2_fwd(p: Problem, cfg: TileConfig, *, defer_norm: bool = True, seq_parallel: bool = True,
            split_q: bool = True) -> Launch:
    """FA2 forward on mma.sync; the three switches are the FA2 ideas the ablation turns off one by one."""
    d = configs.padded_head_dim(p.head_dim)
    smem = smem_fa2_fwd(cfg, d, p.itemsize, split_q)
    args = (CUDA_TYPES[p.dtype], d, cfg.br, cfg.bc, cfg.warps, cfg.min_blocks, cfg.kunroll, mask_mode(p),
            p.general, defer_norm, seq_parallel, split_q, cfg.opaque_tile, smem) + _column_split(cfg)
    grid = query_tile_grid(p, cfg.br, "fa2_fwd") if seq_parallel else _check_grid((1, p.heads, p.batch), "fa2_fwd")
    return Launch("fa2_fwd", "fa2_fwd.cu", args, grid, (cfg.threads, 1, 1), smem, cfg)


def fa2_fwd_sm90(p: Problem, cfg: TileConfig, *, overlap: bool = True) -> Launch:
    """FA2 forward on wgmma (sm_90a); ``overlap`` is FA3's softmax / P V overlap inside a warpgroup."""
    d = configs.padded_head_dim(p.head_dim)
    smem = smem_fa2_fwd_sm90(cfg, d)
    args = (CUDA_TYPES[p.dtype], d, cfg.br, cfg.bc, cfg.min_blocks, mask_mode(p), p.general, overlap, smem)
    return Launch("fa2_fwd_sm90", "fa2_fwd_sm90.cu", args, query_tile_grid(p, cfg.br, "fa2_fwd_sm90"),
                  (cfg.threads, 1, 1), smem, cfg, target="sm_90a")


def tma_head_dim(p: Problem) -> int:
    """The head_dim a TMA form is compiled for: the specialised one rounded up to whole 64-column panels (the
    columns past the caller's are zero-filled by the copies, in shared memory only)."""
    return cdiv(configs.padded_head_dim(p.head_dim), 64) * 64


def tma_value_head_dim(p: Problem) -> int:
    """The columns of V and O (the backward's V, dO and dV) the FA3 forms are compiled for: v's head_dim as
    :func:`tma_head_dim` rounds q's (the DV form, MLA's narrower v: ``Problem.head_dim_v``), else q's."""
    return cdiv(configs.padded_head_dim(p.head_dim_v), 64) * 64 if p.head_dim_v else tma_head_dim(p)


def linear_tile_grid(p: Problem, br: int, persistent: bool) -> tuple[int, int, int]:
    """scheduler.cuh's LinearTileScheduler: every query tile of every head in one index (packed sequences: the
    upper bound of ``Problem.q_tiles`` per head); persistent grids take one CTA per multiprocessor."""
    tiles = p.q_tiles(br) * p.heads * (1 if p.varlen else p.batch)
    return (max(1, min(tiles, p.sms) if persistent else tiles), 1, 1)


# fa3_fwd_sm90.cu's SCHEDULE: one tile per CTA, or a persistent grid (one CTA per SM) walking the tiles by the
# static schedule (tile t on CTA t % grid) or taking them from a counter as each CTA gets ready (dynamic).
SCHEDULES = {"one tile per CTA": 0, "persistent, static": 1, "persistent, dynamic": 2}
SCHEDULE_ARG = {"fa3_fwd_sm90": 10, "fa3_fwd_sm90_fp8": 9}  # SCHEDULE's position among the template arguments
STAGE_O_ARG = 12  # fa3_fwd_sm90's STAGE_O among its template arguments (fa3_fwd_sm90.cu)
D_ARG = 1  # the FA3 forms' D: Q's and K's columns
# ... and their DV: V's and O's (the backward's dO and dV too) columns, D unless the DV form (MLA's narrower v)
DV_ARG = {"fa3_fwd_sm90": 13, "fa3_bwd_sm90": 8}
REF_ARG = 7   # fa3_fwd_sm90's REF (forms.softmax_ref)
# softmax.cuh's SoftmaxRef: what the FA3 16-bit forward's softmax subtracts in the exponent
REF_RUNNING, REF_BOUNDED, REF_FIRST = 0, 1, 2


def schedule_of(lau: "Launch") -> str | None:
    """The name of an FA3 forward launch's grid (a key of SCHEDULES); None for other kernels."""
    pos = SCHEDULE_ARG.get(lau.kernel)
    return None if pos is None else {v: k for k, v in SCHEDULES.items()}[lau.template_args[pos]]


def stages_o(lau: "Launch") -> bool:
    """Whether a launch is an FA3 16-bit forward storing O through shared memory and TMA (fa3_fwd_stage_o)."""
    return lau.kernel == "fa3_fwd_sm90" and lau.template_args[STAGE_O_ARG] is True


def fa3_schedule(persistent: bool, dynamic: bool) -> int:
    return SCHEDULES["persistent, dynamic" if dynamic else "persistent, static"] if persistent else 0


def fa3_fwd_stage_o(p: Problem, cfg: TileConfig, d: int) -> bool:
    """Whether fa3_fwd_sm90 stores O through shared memory and a TMA store (STAGE_O: each consumer warpgroup stages
    its rows in the tile's Q_i buffer; mainloop_fwd_sm90_ws.cuh) rather than from registers: on rows with two Q_i
    buffers, and at head_dim 256 with one (the next tile's Q_i then waits for the store; a d = 256 tile is long
    enough for that). H200, bf16, kernels alone, against the registers' epilogue (bench/NOTES.md): d = 256 +15 % at N =
    512, +9 - 11 % at 1024, +2 % at 4096, even at 16384; d = 64's
    short causal row (one buffer) -7 - 9 %; d = 128's 128 x 176 even (+-1 %). The general policy at d = 256 keeps
    the registers (staging spills 8 B there); d = 192 is unmeasured and keeps them too; so does the column split
    (d = 512, ``cfg.wc`` 2), whose warpgroups share Q_i's buffer while either may still be reading it."""
    return cfg.wc == 1 and (cfg.q_stages == 2 or (d == 256 and not p.general))


def fa3_fwd_sm90(p: Problem, cfg: TileConfig, *, ref: int, overlap: bool = True, pingpong: bool = True,
                 persistent: bool = True, dynamic: bool = True) -> Launch:
    """FA3 forward (sm_90a): TMA copies by a producer warpgroup, wc * br / 64 consumer warpgroups (the column
    split, wc = 2 at head_dim 512: two on 64 rows, each holding half of O's columns); ``overlap`` inside a
    warpgroup, ``pingpong`` between them, ``persistent`` a grid of one CTA per SM walking the tiles (``dynamic``:
    each CTA takes the next tile from a counter; else the static schedule). ``ref``: what the softmax subtracts
    (SoftmaxRef: REF_RUNNING, REF_BOUNDED or REF_FIRST; ``forms.softmax_ref`` chooses it). A ``p.head_dim_v``
    (MLA's narrower v, ``forms.value_form``) compiles the DV form: V_j and O of its columns."""
    d, dv = tma_head_dim(p), tma_value_head_dim(p)
    smem = smem_fa3_fwd_sm90(cfg, d, dv=dv)
    args = (CUDA_TYPES[p.dtype], d, cfg.br, cfg.bc, cfg.stages, mask_mode(p), p.general, ref, overlap,
            pingpong, fa3_schedule(persistent, dynamic), cfg.q_stages, fa3_fwd_stage_o(p, cfg, d), dv,
            smem) + _column_split(cfg)
    return Launch("fa3_fwd_sm90", "fa3_fwd_sm90.cu", args, linear_tile_grid(p, cfg.br, persistent),
                  (cfg.threads, 1, 1), smem, cfg, target="sm_90a")


def fp8_head_dim(p: Problem) -> int:
    """The head_dim the FP8 form is compiled for: whole 128-byte panels (128 or 256)."""
    return cdiv(configs.padded_head_dim(p.head_dim), 128) * 128


def vt_key0(row0: int, b: int) -> int:
    """Packed sequences: the first key of sequence b (its first row row0 = cu_seqlens_k[b]) in the V^T workspace's
    row (mainloop_fwd_sm90_fp8.cuh's vt_key0, fp8_prep.cu's out_key0): a multiple of 128, at least the previous
    sequence's start plus its keys rounded up to 128."""
    return 128 * (row0 // 128 + b)


def vt_keys(p: Problem, bc: int) -> int:
    """Keys per (batch, kv head) row of the FP8 form's V^T workspace: seqlen_k padded to the key block; packed
    sequences share one row per kv head, sequence b's keys from 128 (cu_seqlens_k[b] // 128 + b)
    (mainloop_fwd_sm90_fp8.cuh's vt_key0), so the row ends by 128 (cdiv(total_k, 128) + batch)."""
    if p.varlen:
        return 128 * (cdiv(max(1, p.total_k), 128) + p.batch)
    return cdiv(max(1, p.seqlen_k), bc) * bc


def fa3_fwd_sm90_fp8(p: Problem, cfg: TileConfig, out_dtype: str = "bfloat16", *, overlap: bool = True,
                     pingpong: bool = True, persistent: bool = True, dynamic: bool = True) -> Launch:
    """FA3 forward on e4m3 inputs (sm_90a), output in ``out_dtype``; the switches as for :func:`fa3_fwd_sm90`."""
    d = fp8_head_dim(p)
    smem = smem_fa3_fwd_sm90_fp8(cfg, d)
    args = (CUDA_TYPES[out_dtype], d, cfg.br, cfg.bc, cfg.stages, mask_mode(p), p.general, overlap, pingpong,
            fa3_schedule(persistent, dynamic), cfg.q_stages, smem)
    return Launch("fa3_fwd_sm90_fp8", "fa3_fwd_sm90.cu", args, linear_tile_grid(p, cfg.br, persistent),
                  (cfg.threads, 1, 1), smem, cfg, target="sm_90a")


VT_KEYS, VT_THREADS = 64, 256  # fp8_prep.cu's fp8_vt_permute: keys per CTA, threads


def fp8_vt_permute(p: Problem, bc: int) -> Launch:
    """The FP8 forward's pre-pass: V^T of every (batch, kv head) with the fragment order of its keys (packed
    sequences: the CTAs of sequence b past its keys exit)."""
    keys = cdiv(max(1, p.seqlen_k), VT_KEYS) * VT_KEYS if p.varlen else vt_keys(p, bc)
    grid = _check_grid((keys // VT_KEYS, p.kv_heads, p.batch), "fp8_vt_permute")
    smem = VT_KEYS * (p.head_dim + 4)  # the tile of V in shared memory, rows padded by 4 bytes against conflicts
    return Launch("fp8_vt_permute", "fp8_prep.cu", (VT_KEYS,), grid, (VT_THREADS, 1, 1), smem)


def fp8_quantize(p: Problem, rows: int, in_dtype: str, rotate: bool, pass_: int) -> Launch:
    """fp8_prep.cu's fp8_quantize over ``rows`` rows of head_dim (one warp each): PASS 0 the amax, 1 the bytes."""
    args = (CUDA_TYPES[in_dtype], rotate, pass_)
    return Launch("fp8_quantize", "fp8_prep.cu", args, (max(1, cdiv(rows, 8)), 1, 1), (256, 1, 1), 0)


def fa1_fwd(p: Problem, cfg: TileConfig, sms: int | None = None) -> Launch:
    """FA1 forward: one CTA per (head, batch, split) (``fa1_splits``)."""
    d = configs.padded_head_dim(p.head_dim)
    smem = smem_fa1_fwd(cfg, d, p.itemsize)
    args = (CUDA_TYPES[p.dtype], d, cfg.br, cfg.bc, cfg.warps, cfg.min_blocks, mask_mode(p), smem)
    if p.batch > MAX_GRID_YZ:
        raise ValueError(f"fa1_fwd: batch must be at most {MAX_GRID_YZ}, got {p.batch}")
    return Launch("fa1_fwd", "fa1_fwd.cu", args, (p.heads, p.batch, fa1_splits(p, cfg, sms)), (cfg.threads, 1, 1),
                  smem, cfg)


def fa1_finalize(p: Problem) -> Launch:
    return _elementwise("fa1_finalize", "fa1_fwd.cu", p.dtype, p.batch * p.heads * p.seqlen_q * p.head_dim)


def naive_softmax(p: Problem) -> Launch:
    """One warp per row of S, 8 warps per CTA."""
    blocks = max(1, cdiv(p.batch * p.heads * p.seqlen_q, 8))
    return Launch("naive_softmax", "naive.cu", (CUDA_TYPES[p.dtype],), (blocks, 1, 1), (256, 1, 1), 0)


def preprocess_lanes(head_dim: int) -> int:
    """fa2_bwd_preprocess's threads per query row: one per 16-column block of D's ordered sum, rounded up to a power
    of two (fa2_bwd.cu's preprocess_lanes, the kernel's own copy of this formula: its grid-stride loop is right for
    any grid, so a disagreement would cost time, not results)."""
    return 1 << (cdiv(head_dim, 16) - 1).bit_length()


def fa2_bwd_preprocess(p: Problem) -> Launch:
    """preprocess_lanes threads per query row (of every head), in a grid-stride loop."""
    b, s = p.rows
    return _elementwise("fa2_bwd_preprocess", "fa2_bwd.cu", p.dtype, b * p.heads * s * preprocess_lanes(p.head_dim))


def fa2_bwd(p: Problem, cfg: TileConfig, *, atomic_dq: bool = True) -> Launch:
    """FA2 backward main pass on mma.sync: one CTA per (key block, kv head, batch)."""
    d = configs.padded_head_dim(p.head_dim)
    smem = smem_fa2_bwd(cfg, d, p.itemsize, atomic_dq)
    args = (CUDA_TYPES[p.dtype], d, cfg.br, cfg.bc, cfg.warps, cfg.wc, cfg.min_blocks, cfg.kunroll, mask_mode(p),
            p.general, atomic_dq, cfg.early_dv, smem)
    return Launch("fa2_bwd", "fa2_bwd.cu", args, key_tile_grid(p, cfg.bc, "fa2_bwd"), (cfg.threads, 1, 1), smem, cfg)


def fa2_bwd_sm90(p: Problem, cfg: TileConfig) -> Launch:
    """FA2 backward main pass on wgmma (sm_90a, atomic dQ): one CTA per (key block, kv head, batch)."""
    d = configs.padded_head_dim(p.head_dim)
    smem = smem_fa2_bwd_sm90(cfg, d)
    args = (CUDA_TYPES[p.dtype], d, cfg.br, cfg.bc, cfg.min_blocks, mask_mode(p), p.general, bwd_sm90_split_d(cfg),
            smem)
    return Launch("fa2_bwd_sm90", "fa2_bwd_sm90.cu", args, key_tile_grid(p, cfg.bc, "fa2_bwd_sm90"),
                  (cfg.threads, 1, 1), smem, cfg, target="sm_90a")


def fa3_bwd_sm90(p: Problem, cfg: TileConfig, deterministic: bool = False) -> Launch:
    """FA3's backward main pass (sm_90a): a TMA producer warpgroup and two consumer warpgroups, one CTA per (key
    block, kv head, batch); 64 keys per consumer and dQ by TMA reduce-add, or at bc = 64 the column split
    (``fa3_bwd_split_d``, head_dim 192 / 256, in key-block pairs). ``deterministic`` (not the column split): the
    reduce-adds into each query block's dQ rows in a fixed order (``dq_semaphores`` int32 counters, zeroed before
    the launch); the grid is the same, its key tiles taken last-first under a mask bounded on the right
    (scheduler.cuh's KTileScheduler). A ``p.head_dim_v`` (MLA's narrower v, ``forms.value_form``) compiles the DV
    form: V_j, dO_i and dV_j of its columns."""
    if deterministic and fa3_bwd_split_d(cfg):
        raise ValueError("fa3_bwd_sm90's column split (head_dim > 128) has no deterministic form")
    rows = (64,) if fa3_bwd_split_d(cfg) else (64, 80, 128)
    if cfg.threads != 384 or cfg.bc not in (64, 128) or cfg.br not in rows:
        raise ValueError(f"fa3_bwd_sm90 runs a producer and two consumer warpgroups (12 warps) on 64 or 128 keys "
                         f"and 64 query rows (80 or 128 with 128 keys); got {cfg.warps} warps, bc = {cfg.bc}, "
                         f"br = {cfg.br}")
    d = tma_head_dim(p)
    if fa3_bwd_split_d(cfg) and d not in (192, 256):
        raise ValueError(f"fa3_bwd_sm90's column split (64 keys a block) runs head_dim 192 and 256 in key-block "
                         f"pairs; got head_dim {d}")
    if cfg.br == FA3_BWD_SWAP_ROWS and (d != 128 or deterministic):
        raise ValueError(f"fa3_bwd_sm90's {cfg.br}-row tile runs head_dim 128 (padded) without deterministic=True; "
                         f"got head_dim {d}, deterministic={deterministic}")
    dv = tma_value_head_dim(p)
    smem = smem_fa3_bwd_sm90(cfg, d, dv)
    args = (CUDA_TYPES[p.dtype], d, cfg.br, cfg.bc, cfg.stages, mask_mode(p), p.general, deterministic, dv, smem)
    grid = (pair_key_tile_grid(p, cfg.bc, "fa3_bwd_sm90") if fa3_bwd_pair(cfg, d)
            else key_tile_grid(p, cfg.bc, "fa3_bwd_sm90"))
    return Launch("fa3_bwd_sm90", "fa3_bwd_sm90.cu", args, grid, (cfg.threads, 1, 1), smem, cfg, target="sm_90a",
                  cluster=(2, 1, 1) if fa3_bwd_pair(cfg, d) else (1, 1, 1))


def fa3_bwd_dq_rotates(p: Problem, cfg: TileConfig, sms: int) -> bool:
    """Whether the deterministic fa3_bwd_sm90 walks its query blocks in the rotated order (BwdParams::dq_rotate,
    policy.cuh's dq_start / dq_rank_rotated): without a mask bound (every key block sees every query block),
    where a (sequence, kv head)'s key blocks number at most half the SMs. In the ascending order key block j's
    additions wait on key block j - 1's of the same step, a chain as long as the key blocks; rotated, each waits on
    additions of earlier steps. A CTA may then wait on one of higher block index, so all key blocks of a group must
    be resident at once (one CTA per SM; half the SMs leaves room for a neighbouring group's CTAs)."""
    return mask_mode(p) == NO_MASK and cdiv(p.seqlen_k, cfg.bc) <= sms // 2  # (packed: seqlen_k is the longest)


def fa3_bwd_longest_first(p: Problem, cfg: TileConfig, sms: int) -> bool:
    """Whether the default (not deterministic) fa3_bwd_sm90 dispatches its key tiles longest first
    (BwdParams::longest_first, scheduler.cuh's KTileScheduler): tile 0 of every (batch, kv head), then tile 1 of
    every one, ... Under a mask bounded on the right (causal; a window with a right bound) tile j's walk shortens
    with j, so the longest walks no longer start in the last waves; but the CTAs that run at once then belong to
    different (batch, kv head)s and share Q_i, dO_i and the dQ rows in L2 only with the few CTAs of their own
    pair, so only where pairs are few: each must run at least the GPU's ``longest_first_ctas`` CTAs at a time
    (configs.GATES: 2 on the H200, 8 on the H100, whose misses in L2 cost more). Fixed lengths only; not the
    column split's pairs (d = 192 / 256)."""
    return (p.bounded_right and not p.varlen and not fa3_bwd_pair(cfg, configs.padded_head_dim(p.head_dim))
            and p.batch * p.kv_heads * configs.gates(p.gpu).longest_first_ctas <= sms)


def dq_semaphores(p: Problem, br: int) -> int:
    """How many int32 semaphores the deterministic fa3_bwd_sm90 indexes (mainloop_bwd_sm90_ws.cuh's semaphore():
    (first row + row of the block) / br + the (sequence, head)'s index): every query block of every (sequence,
    head) has its own below cdiv(all rows, br) + sequences x heads."""
    b, s = p.rows
    return cdiv(b * p.heads * s, br) + p.batch * p.heads


def fa2_bwd_dq(p: Problem, cfg: TileConfig) -> Launch:
    """Deterministic dQ pass: one CTA per (query block, head, batch)."""
    d = configs.padded_head_dim(p.head_dim)
    smem = smem_fa2_bwd_dq(cfg, d, p.itemsize)
    args = (CUDA_TYPES[p.dtype], d, cfg.br, cfg.bc, cfg.warps, cfg.min_blocks, cfg.kunroll, mask_mode(p), p.general,
            smem) + _column_split(cfg)
    return Launch("fa2_bwd_dq", "fa2_bwd.cu", args, query_tile_grid(p, cfg.br, "fa2_bwd_dq"), (cfg.threads, 1, 1),
                  smem, cfg)


def decode_rows(p: Problem, cfg: TileConfig) -> tuple[int, int]:
    """(packed query rows of one kv head, row groups of cfg.br rows): GQA packing of decode."""
    rows = (p.heads // p.kv_heads) * p.seqlen_q
    return rows, cdiv(rows, cfg.br)


def latent_decode(p: Problem) -> bool:
    """Whether a decode problem reads the latent cache (MLA's absorbed decode): one cache whose first head_dim_v
    columns are the values (a decode ``Problem`` has a head_dim_v only then)."""
    return bool(p.head_dim_v)


def decode_head_dims(p: Problem) -> tuple[int, int]:
    """(D, DV) of decode_split: the specialised head_dim twice, or the latent cache's head_dim and head_dim_v as
    given (576 and 512: validation admits no other pair on the GPU backends)."""
    if latent_decode(p):
        return p.head_dim, p.head_dim_v
    d = configs.padded_head_dim(p.head_dim)
    return d, d


def smem_decode_split(cfg: TileConfig, d: int, itemsize: int, kv_itemsize: int | None = None, dv: int = 0,
                      wgmma: bool = False) -> int:
    """The packed Q tile, for an FP8 cache (``kv_itemsize`` below ``itemsize``) its rows' largest |q| (whole
    128-byte lines), and per warp `stages` tiles of K_j and V_j of the cache's elements. The latent cache (``dv``
    below ``d``): the Q tile, the CTA's `stages` K tiles (V is their first dv columns), P (br x bc) and a float per
    warp and row (mainloop_decode.cuh's MainloopDecodeLatent); ``wgmma`` (mainloop_decode_sm90.cuh's
    MainloopDecodeLatentWg): a float per warpgroup and row instead, after 1024 bytes of slack that align the
    swizzled tiles."""
    kv = itemsize if kv_itemsize is None else kv_itemsize
    if dv and dv != d:
        return ((1024 if wgmma else 0) + cfg.br * d * itemsize + cfg.stages * cfg.bc * d * kv
                + cfg.br * cfg.bc * itemsize + (cfg.warps // 4 if wgmma else cfg.warps) * cfg.br * 4)
    qmax = 128 * cdiv(cfg.br * 4, 128) if kv < itemsize else 0
    return cfg.br * d * itemsize + qmax + cfg.warps * cfg.stages * 2 * cfg.bc * d * kv


def decode_splits_per_cta(cfg: TileConfig) -> int:
    """Splits one CTA of decode_split runs: one per warp, or one per ``wc`` warps (the latent form's row: all)."""
    return cfg.warps // cfg.wc


def decode_split(p: Problem, cfg: TileConfig, num_splits: int, wgmma: bool = False) -> Launch:
    """Split-KV decode: grid (cdiv(num_splits, splits per CTA), kv_heads x row groups, batch), one split per warp
    (the latent cache: per CTA), one partial result per CTA (``decode_partials``). The latent form's DV follows
    the defaults' place (left out of the name expression where it is D), then ``wgmma`` (its warpgroup form,
    compiled for sm_90a; only with the latent cache)."""
    d, dv = decode_head_dims(p)
    if wgmma and dv == d:
        raise ValueError("decode_split's warpgroup form is the latent cache's (head_dim_v below head_dim)")
    smem = smem_decode_split(cfg, d, p.itemsize, p.kv_itemsize, dv, wgmma)
    args = (CUDA_TYPES[p.dtype], CUDA_TYPES[p.kv_dtype or p.dtype], d, cfg.br // 16, cfg.bc, cfg.stages, cfg.warps,
            smem) + ((dv,) if dv != d else ()) + ((True,) if wgmma else ())
    grid = _check_grid((decode_partials(cfg, num_splits), p.kv_heads * decode_rows(p, cfg)[1], p.batch),
                       "decode_split")
    return Launch("decode_split", "decode.cu", args, grid, (cfg.threads, 1, 1), smem, cfg,
                  target="sm_90a" if wgmma else None)


def decode_partials(cfg: TileConfig, num_splits: int) -> int:
    """Partial results per output row: decode_split merges its CTA's splits into one."""
    return cdiv(num_splits, decode_splits_per_cta(cfg))


def _latent_arg(p: Problem, value: bool) -> tuple:
    """The last template argument of decode_append (VALUES, False) and of the combines (NARROW_V, True) for the
    latent cache; elsewhere their defaults, left out of the name expression."""
    return (value,) if latent_decode(p) else ()


def decode_append(p: Problem) -> Launch:
    """8 columns of one appended key (K and V; the latent cache's K alone) per thread."""
    lau = _elementwise("decode_append", "decode.cu", p.dtype, p.batch * p.new_keys * p.kv_heads * cdiv(p.head_dim, 8))
    args = (*lau.template_args, CUDA_TYPES[p.kv_dtype or p.dtype], *_latent_arg(p, False))
    return dataclasses.replace(lau, template_args=args)


DECODE_COMBINE_THREADS = 256  # one CTA per (batch, query, head) row; lanes over splits, then 4-column chunks
DECODE_MAX_SPLITS = 256       # the combine's shared weights (one float per split); forms.MAX_SPLITS


def decode_combine(p: Problem) -> Launch:
    """One CTA of DECODE_COMBINE_THREADS per (batch, query, head) row: the splits' lse reduced across the threads,
    then each thread sums 4 columns over every (threads / (head_dim / 4))-th split."""
    rows = p.batch * p.seqlen_q * p.heads
    smem = smem_decode_combine(DECODE_COMBINE_THREADS, DECODE_MAX_SPLITS)
    args = (CUDA_TYPES[p.dtype], DECODE_COMBINE_THREADS, DECODE_MAX_SPLITS, smem, *_latent_arg(p, True))
    return Launch("decode_combine", "decode.cu", args, (max(1, rows), 1, 1), (DECODE_COMBINE_THREADS, 1, 1), smem)


def smem_decode_combine(threads: int, max_splits: int) -> int:
    """A float4 partial sum per thread, a weight per split, a float per warp."""
    return threads * 16 + max_splits * 4 + threads // 32 * 4


DECODE_COMBINE_WARP_ROWS = 4         # decode_combine_warp: (batch, query, head) rows per CTA, one warp each
#                                      (its __launch_bounds__ asks for 16 / rows CTAs per SM: 16 warps)
DECODE_COMBINE_WARP_MAX_SPLITS = 32  # its lse: one split per lane (forms.decode_combine picks it up to this)


def decode_combine_warp(p: Problem) -> Launch:
    """One warp per (batch, query, head) row, DECODE_COMBINE_WARP_ROWS rows per CTA (num_splits <= 32): a lane per
    split for the lse, 4-column chunks per lane for out; no shared memory."""
    rows = p.batch * p.seqlen_q * p.heads
    args = (CUDA_TYPES[p.dtype], DECODE_COMBINE_WARP_ROWS, *_latent_arg(p, True))
    return Launch("decode_combine_warp", "decode.cu", args, (max(1, cdiv(rows, DECODE_COMBINE_WARP_ROWS)), 1, 1),
                  (32 * DECODE_COMBINE_WARP_ROWS, 1, 1), 0)


def fa2_bwd_convert_dq(p: Problem) -> Launch:
    """8 columns per thread (head_dim is a multiple of 8 in the kernels)."""
    b, s = p.rows
    return _elementwise("fa2_bwd_convert_dq", "fa2_bwd.cu", p.dtype, b * p.heads * s * cdiv(p.head_dim, 8))
