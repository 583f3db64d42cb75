"""Tile sizes: the only place they live.

One row per (kernel, head_dim, dtype). A head_dim without a row of its own runs on the next specialised one
(``padded_head_dim``) with the extra columns zero-filled on load and never stored. Each row's ``why`` says what
chose it (``rawflash list`` prints it); ``bench/NOTES.md`` keeps the measurements behind the figures. TFLOP/s
pairs are full / causal; quadruples are full / causal at the shorter length, then at the longer one.

The table's rows (and ``SITUATION_ROWS``') were chosen for the H200 and serve every Hopper GPU. A row that another
tuned GPU measures differently lives beside them in ``GPU_ROWS`` (or ``GPU_SITUATION_ROWS`` for a situation's row),
keyed by the GPU's name (``TUNED_GPUS``; a device is told by its arch and L2 size, ``gpu_name``); ``tile_config``
takes the GPU's row on that GPU only, and ``rawflash list --gpu h100`` marks it. ``tools/tune.py`` and
``tools/tune_decode.py`` print such an entry, with the figures that chose it, for the GPU they run on.

Kernels here are the CUDA templates: ``fa1_fwd``, ``fa2_fwd``, ``fa2_fwd_splitk`` (fa2_fwd with its split-Q
partition switched off, for the ablation), ``fa2_fwd_sm90`` (fa2_fwd on Hopper's wgmma, 16-bit, sm_90 only),
``fa3_fwd_sm90`` (FA3's warp-specialised TMA forward, 16-bit, sm_90 only), ``fa3_fwd_sm90_fp8`` (the same form on
e4m3 inputs), ``fa2_bwd``, ``fa3_bwd_sm90`` (FA3's warp-specialised backward, 16-bit, sm_90 only),
``fa2_bwd_sm90`` (fa2_bwd's atomic-dQ pass on wgmma, 16-bit, sm_90 only), ``fa2_bwd_dq`` (the deterministic dQ
pass) and ``decode_split`` (the decode step's split pass).
"""
from __future__ import annotations

import dataclasses

SPECIALISED_HEAD_DIMS = (32, 64, 96, 128, 192, 256, 512)
MAX_HEAD_DIM = SPECIALISED_HEAD_DIMS[-1]
# The largest head_dim every form, dtype and kind of call runs. Head dims above it (257 - 512, Gemma's global layers)
# run on the rows at 512 (WIDE_HEAD_DIM) only: float16 / bfloat16 forwards and backwards of kernel='fa2' on the
# mma.sync forms, whose warps split the head columns (``TileConfig.wc``), and on Hopper FA3's forward, whose consumer
# warpgroups split them; no decode, paged keys, FP8, float32, fa1 or ablation switch.
COMMON_MAX_HEAD_DIM = 256
WIDE_HEAD_DIM = 512
# decode's latent cache (MLA's absorbed decode, DeepSeek-V3 / R1): keys of 576 columns (512 latent + 64 rotary),
# values their first 512; the one pair of head dims decode_split's latent form compiles (VALUE_ROWS' row).
LATENT_HEAD_DIM, LATENT_HEAD_DIM_V = 576, 512
COMMON_HEAD_DIMS = tuple(d for d in SPECIALISED_HEAD_DIMS if d <= COMMON_MAX_HEAD_DIM)
DTYPES = ("float16", "bfloat16", "float32")
FP8 = "float8_e4m3fn"  # the FP8 forward's inputs and FP8 decode caches (their rows only; not in DTYPES)
KERNELS = ("fa1_fwd", "fa2_fwd", "fa2_fwd_splitk", "fa2_fwd_sm90", "fa3_fwd_sm90", "fa3_fwd_sm90_fp8", "fa2_bwd",
           "fa3_bwd_sm90", "fa2_bwd_sm90", "fa2_bwd_dq", "decode_split")


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tile shape of one kernel instantiation.

    Attributes
    ----------
    br, bc : int
        Query rows and key rows of a block (the papers' Br, Bc). For ``decode_split``: the packed query rows of one
        CTA (16 per m-tile) and the keys of one warp tile.
    warps : int
        Warps per CTA (for ``decode_split``: the splits one CTA runs).
    min_blocks : int
        CTAs per SM promised to the compiler through ``__launch_bounds__``; it caps registers at
        65536 / (32 * warps * min_blocks).
    wc : int
        Warps that split the head_dim columns: of dK, dV (fa2_bwd); of O (fa2_fwd) and dQ (fa2_bwd_dq), where the
        ``wc`` warps that share rows each compute those rows' scores themselves (head_dim 512); (fa3_fwd_sm90)
        consumer warpgroups that share the tile's 64 rows the same way, each holding O's d / wc columns.
    kunroll : int
        k-steps of 16 unrolled together in the S = Q K^T style products (ILP against registers).
    stages : int
        (decode_split) Depth of each warp's cp.async ring of key tiles; (FA3 forwards) stages of the K_j / V_j
        ring; (FA3 backward) stages of the Q_i, dO_i ring.
    q_stages : int
        (FA3 forwards) Q_i buffers: 2 copy a persistent CTA's next Q_i while its tile runs.
    general_min_blocks : int
        ``min_blocks`` of the general policy's instantiations where it is lower (0: ``min_blocks``).
    early_dv, opaque_tile : bool
        Register switches: they change the code ptxas allocates for and nothing it computes. ``early_dv``
        (fa2_bwd, plain policy): P^T and dV_j += P^T dO_i before dP^T (mainloop_bwd_sm80.cuh's EARLY_DV).
        ``opaque_tile`` (fa2_fwd's serial walk, the ablation's SEQ_PARALLEL = false): each tile's coordinates
        hidden from the optimiser (fwd.cuh's OPAQUE_TILE).
    why : str
        What chose the row, in one line.
    """

    br: int
    bc: int
    warps: int
    min_blocks: int = 1
    wc: int = 1
    kunroll: int = 1
    stages: int = 1
    q_stages: int = 1
    general_min_blocks: int = 0  # min_blocks of the general policy's instantiations when lower (0: min_blocks)
    early_dv: bool = False
    opaque_tile: bool = False
    why: str = ""

    @property
    def threads(self) -> int:
        return 32 * self.warps


_16BIT = ("float16", "bfloat16")


def _rows() -> dict[tuple[str, int, str], TileConfig]:
    rows: dict[tuple[str, int, str], TileConfig] = {}

    def put(kernel, dims, dtypes, cfg):
        for d in dims:
            for dt in dtypes:
                rows[(kernel, d, dt)] = cfg

    # fa2_fwd, 16-bit: 4 warps own 32 rows each (MT = 2 m-tiles, so every K/V fragment read from shared memory
    # feeds two mma); 128 x 64 is flash-attn 2's sm80 choice.
    put("fa2_fwd", (32, 64), _16BIT,
        TileConfig(128, 64, 4, kunroll=4, why="kunroll 4 at d 64, N 4k: 232/215 TFLOP/s (H200 bf16); 128x128 spills"))
    put("fa2_fwd", (96,), _16BIT, TileConfig(128, 64, 4,
                                             why="280/240 vs 247/216 TFLOP/s at 128x32 (H200 bf16, d 128, N 4k)"))
    # d = 128: 128 x 64 needs about 254 registers, and with the parameter struct and the general policy ptxas spills
    # 16-32 B of it (offline compile), so the row is 128 x 32, which fits. On Hopper this kernel runs at d = 128
    # only with wgmma=False.
    put("fa2_fwd", (128,), _16BIT, TileConfig(128, 32, 4, why="no spill at 128 x 32; 128 x 64 spills 16-32 B"))
    put("fa2_fwd", (192, 256), _16BIT, TileConfig(64, 64, 4, why="O accumulator of 16 x d per warp fits registers"))
    # d = 512: O of 16 x 512 per warp would be 256 registers a thread, so two warps share 16 rows and hold 256
    # columns each (wc = 2), both computing the rows' S; 32 x 32 is 96 KB (the Numba twin's float32 tiles 192 KB).
    put("fa2_fwd", (512,), _16BIT, TileConfig(32, 32, 4, wc=2, why="O of 16 x 256 per warp (wc 2); 96 KB; not run"))
    # fa2_fwd_sm90 (wgmma, sm_90a): warps = 4 per warpgroup of 64 query rows; registers hold O (d/2), S (bc/2) and
    # P (bc/4) per thread; shared memory Q_i and two stages of K_j, V_j. Several independent CTAs per SM overlap
    # one CTA's softmax with another's products better than two warpgroups of one CTA (which share barriers).
    # d = 64: 3 CTAs of one warpgroup per SM; the general policy spills 236 B under 3 (168 registers), so 2 there.
    # Figures: H200 bf16, N = 1024 / 4096, against 128 x 128 (one CTA of two warpgroups).
    put("fa2_fwd_sm90", (64,), _16BIT, TileConfig(64, 128, 4, min_blocks=3, general_min_blocks=2,
                                                  why="3 CTAs per SM: 359/392 vs 267/305 TFLOP/s at 128x128 (H200)"))
    put("fa2_fwd_sm90", (128,), _16BIT, TileConfig(64, 96, 4, min_blocks=2,
                                                   why="373/435 vs 358/417 TFLOP/s at 128x128 (H200 bf16, N 1k/4k)"))
    put("fa2_fwd_sm90", (192, 256), _16BIT, TileConfig(128, 64, 8, why="O of d/2 registers leaves room for 64 keys"))
    # float32 runs the same body with emulated mma (FMA + shuffles): one m-tile per warp, narrow key blocks.
    put("fa2_fwd", (32, 96, 128, 192), ("float32",), TileConfig(64, 32, 4, why="fp32 FMA path: keep registers low"))
    # d = 64 asks for 3 CTAs per SM (168 registers). Allowed 255, ptxas spends 180 - 199 (2 CTAs per SM); every
    # sm_90 instantiation (plain, general, the ablation's) fits 168 without a spill. sm_80 keeps 1 (ARCH_ROWS).
    # H200, tools/tune.py, N = 1024 / 4096, TFLOP/s.
    put("fa2_fwd", (64,), ("float32",), TileConfig(64, 32, 4, min_blocks=3,
                                                  why="fp32 FMA path; 3 CTAs per SM: 13/12/13/12 vs 11/10/11/11 at 2"))
    put("fa2_fwd", (256,), ("float32",), TileConfig(64, 16, 4, why="fp32 FMA path: O of 16 x 256 per warp"))
    # Split-K (splitk.cuh): all warps share BR rows and take BC / warps keys each; per block every warp writes a
    # partial O of BR x d float32 to its slot and reads a d / warps slice of all slots back, so shared traffic per
    # FLOP is about 2.5 / (keys per warp) + 1 / BR bytes and the slots take warps x BR x d x 4 bytes. The ablation
    # rows (FA2 without split-Q) keep 32+ keys per warp and several CTAs per SM with 2 warps; fa1 keeps flash-attn
    # 1.x's steps (16 query rows, 4 warps, 256 keys at d <= 64 and 128 at d = 128).
    put("fa2_fwd_splitk", (32, 64), _16BIT, TileConfig(32, 128, 2, min_blocks=4, why="64 keys per warp, 53 KB: 4 CTAs"))
    put("fa2_fwd_splitk", (96, 128), _16BIT, TileConfig(32, 64, 2, min_blocks=3, why="32 keys per warp, 73 KB: 3 CTAs"))
    put("fa2_fwd_splitk", (192, 256), _16BIT, TileConfig(16, 32, 2, min_blocks=2, why="O slice of 16 x 128 per warp"))
    put("fa2_fwd_splitk", COMMON_HEAD_DIMS, ("float32",),
        TileConfig(16, 32, 2, why="fp32 FMA path; 112 KB at d 256"))
    put("fa1_fwd", (32, 64), _16BIT, TileConfig(16, 256, 4, min_blocks=2, why="flash-attn 1.x d<=64: 16 x 256 steps"))
    put("fa1_fwd", (96, 128), _16BIT, TileConfig(16, 128, 4, min_blocks=2, why="flash-attn 1.x d=128: 16 x 128 steps"))
    put("fa1_fwd", (192, 256), _16BIT, TileConfig(16, 64, 4, why="16 keys per warp; 145 KB at d = 256"))
    put("fa1_fwd", COMMON_HEAD_DIMS, ("float32",), TileConfig(16, 32, 2, why="fp32 FMA path; 129 KB at d = 256"))
    # fa2_bwd: 8 warps own 16 keys each; K_j, V_j of 128 keys stay in shared memory for the whole query loop.
    put("fa2_bwd", (32, 64), _16BIT, TileConfig(64, 128, 8, why="FA2 sm80 d<=64 shape"))
    put("fa2_bwd", (96,), _16BIT,
        TileConfig(64, 128, 8, why="162/145 vs 146/132 TFLOP/s at Br = 32 (H200 bf16, d 128, N 4k)"))
    # d = 128 (on Hopper the deterministic backward only): Br = 64 spills 52-112 B (offline compile), Br = 32 fits.
    put("fa2_bwd", (128,), _16BIT, TileConfig(32, 128, 8, why="no spill at Br = 32; Br = 64 spills 52-112 B"))
    put("fa2_bwd", (192,), _16BIT, TileConfig(32, 64, 8, wc=2, why="warps also split d: 16 x d/2 per warp"))
    put("fa2_bwd", (256,), _16BIT, TileConfig(32, 64, 8, wc=2, why="16 x 128 dK, dV per warp"))
    # d = 512: 16 keys x 128 columns of dK, dV per warp as at d = 256 (wc = 4: 4 warps on 16 keys); 32 query rows
    # a step (the fewest dS^T's 16-byte swizzle takes) keep two stages of Q_i, dO_i within sm_80's 163 KB: 161.5 KB
    # (the twin's float32 tiles 194 KB).
    put("fa2_bwd", (512,), _16BIT, TileConfig(32, 16, 4, wc=4, why="16 x 128 dK, dV a warp (wc 4); 161.5 KB; not run"))
    # fa3_fwd_sm90 (TMA + warp specialisation, sm_90a): wc * br / 64 consumer warpgroups and one producer warpgroup
    # (warps = 4 * (wc * br / 64 + 1)), `stages` stages of K_j and V_j. A consumer holds O (d / 2 / wc floats), S
    # (bc / 2) and P (bc / 4) of its 64 rows in the registers setmaxnreg gives it (232 with two consumer
    # warpgroups, 160 with three). The rows come from tools/tune.py --which fwd_fa3 (H200 bf16, N = 2048 / 8192,
    # full and causal). Two Q_i buffers (q_stages) copy a persistent CTA's next Q_i while its tile runs; they fit
    # beside 2 stages of 128 keys at d <= 64 (115 KB), where they add up to 4 % at N = 1024 and are even at 4096,
    # not beside d = 128's 176 keys.
    put("fa3_fwd_sm90", (32, 64), _16BIT,
        TileConfig(192, 128, 16, stages=2, q_stages=2, why="fastest of 128x128 / 128x176 / 192x128 at N 2k/8k (H200)"))
    put("fa3_fwd_sm90", (96, 128), _16BIT,
        TileConfig(128, 176, 12, stages=2, why="fastest of 128x128 / 128x160 / 128x176, N 2k/8k, bar 2k causal"))
    put("fa3_fwd_sm90", (192,), _16BIT, TileConfig(128, 96, 12, stages=2, why="FA3's shape at d = 192; not tuned"))
    put("fa3_fwd_sm90", (256,), _16BIT, TileConfig(128, 80, 12, stages=2,
                                                   why="3-7 % over 128x64 at N 2k/8k (H200 bf16); 226 KB"))
    # d = 512, the column split (wc = 2; mainloop_fwd_sm90_ws.cuh): two consumer warpgroups share 64 query rows, each
    # forming all of S and holding O's 64 x 256 (128 registers, as at d = 256). Q_i is 64 KB and K_j, V_j 1 KB a
    # key each, so 227 KB holds 64 keys in one stage or 32 keys in two (both 193 KB): two stages keep a block's
    # copy from L2 in flight while the other is read (one stage of 64 waits for V_j's copy every step), at the
    # price of S's products at N = 32 (3 KB of shared memory per 16 k of a wgmma, 1.5x 128 B a cycle).
    put("fa3_fwd_sm90", (512,), _16BIT, TileConfig(64, 32, 12, wc=2, stages=2,
                                                   why="64 rows, O's columns split (wc 2); 193 KB; not run"))
    # fa3_fwd_sm90_fp8 (FA3's form on e4m3 inputs): tiles are bytes in 128-column panels, so head_dim runs as 128
    # or 256 (d <= 128 computes 128 columns: d = 64 pays for 128), and a key block is whole panels of V^T. Two
    # consumer warpgroups at 240 registers hold O (d / 2), S (bc / 2) and P (32 registers of e4m3 at 128 keys);
    # three consumer warpgroups (160 registers) spill 288 B at d = 128 (offline). At d <= 128: 192 keys (V^T in
    # 64-byte panels), 3 stages and 2 Q_i buffers, from tools/tune.py --which fwd_fp8 (H200, N = 4096 / 16384,
    # full / causal); at d = 256, FA3's FP8 shape, 128 x 128.
    put("fa3_fwd_sm90_fp8", (32, 64, 96, 128), (FP8,), TileConfig(128, 192, 12, stages=3, q_stages=2,
                                                                  why="2-9 % over 128x128, 0-2 % over 1 Q_i buffer "
                                                                      "(H200, N 4k/16k); 177 KB"))
    put("fa3_fwd_sm90_fp8", (192, 256), (FP8,), TileConfig(128, 128, 12, stages=2,
                                                           why="FA3's FP8 shape; not tuned: 161 KB"))
    # fa3_bwd_sm90 (TMA + warp specialisation, sm_90a): 2 consumer warpgroups x 64 keys and a producer warpgroup;
    # 64 query rows per step, `stages` stages of Q_i, dO_i, L_i, D_i. The shape of fa2_bwd_sm90's d <= 128 row.
    put("fa3_bwd_sm90", (96, 128), _16BIT, TileConfig(64, 128, 12, stages=2, why="fa2_bwd_sm90's shape; untuned"))
    # d <= 64: 128 query rows a step (FlashAttention-3's hdim-64 tile): the consumers split dQ_i's rows instead of
    # its columns, with one dS^T buffer (two do not fit in 227 KB beside the rest).
    put("fa3_bwd_sm90", (32, 64), _16BIT, TileConfig(128, 128, 12, stages=2,
                                                     why="20-29 % over 64x128 at N 4k/16k (H200 bf16); 195 KB"))
    # d = 192, 256: the column split (launch.fa3_bwd_split_d, mainloop_bwd_sm90_ws_split_d.cuh): both consumer
    # warpgroups share 64 keys (dK, dV of 64 x d do not fit one warpgroup), each holding dK, dV for half of the
    # columns; 2 stages of Q_i, dO_i fit beside K_j, V_j at d = 256 (231464 B) only with dQ by atomics.
    put("fa3_bwd_sm90", (192, 256), _16BIT, TileConfig(64, 64, 12, stages=2,
                                                       why="dK, dV of 64 x d/2 per consumer warpgroup; 231 KB at "
                                                           "d = 256; not measured"))
    # fa2_bwd_sm90 (wgmma, sm_90a): a warpgroup per 64 keys, 64 query rows per step (one wgmma of dQ_i).
    put("fa2_bwd_sm90", (64, 128), _16BIT, TileConfig(64, 128, 8, why="FA3's d<=128 shape: 2 warpgroups x 64 keys"))
    # d 256: 8 warps on 64 keys = SPLIT_D, each warpgroup holds dK, dV for half of the columns (2 x 64 registers):
    # 2.4-2.8x fa2_bwd (mma.sync) at N = 1024 - 16384 (H200 bf16). No d = 192 row: its halves of 96 columns would
    # straddle 64-column panels (the kernel's static_assert).
    put("fa2_bwd_sm90", (256,), _16BIT, TileConfig(64, 64, 8, why="dK, dV of 64 x 128 per warpgroup"))
    put("fa2_bwd", (64,), ("float32",), TileConfig(32, 64, 4, why="fp32 FMA path"))
    # d = 32: 3 CTAs per SM (168 registers). Allowed 255, ptxas takes 178 - 230 (2 CTAs); all 8 sm_90
    # instantiations fit 168 without a spill; on sm_80 the atomic ones spill 24 - 68 B under it, so ARCH_ROWS keeps
    # 1 there. TFLOP/s at N = 1024 / 4096, which tools/tune.py rounds to integers (the d = 64 forward's too).
    put("fa2_bwd", (32,), ("float32",), TileConfig(32, 64, 4, min_blocks=3,
                                                  why="fp32 FMA path; 3 CTAs per SM: 9/9/9/9 vs 9/8/9/8 at 2 (H200)"))
    put("fa2_bwd", (96, 128), ("float32",), TileConfig(32, 64, 8, wc=2, why="fp32 FMA path; warps split d"))
    put("fa2_bwd", (192, 256), ("float32",), TileConfig(32, 32, 8, wc=4, why="fp32 FMA path; 16 x d/4 dK, dV per warp"))
    put("fa2_bwd_dq", (32, 64, 96, 128), _16BIT, TileConfig(64, 64, 4, why="split-Q, 16 rows per warp"))
    put("fa2_bwd_dq", (192, 256), _16BIT, TileConfig(64, 16, 4, why="dQ of 16 x d per warp leaves room for 16 x 16 S"))
    put("fa2_bwd_dq", (512,), _16BIT, TileConfig(32, 16, 4, wc=2, why="dQ of 16 x 256 per warp (wc 2); 96 KB; not run"))
    put("fa2_bwd_dq", (32, 64, 96, 128, 192), ("float32",), TileConfig(64, 32, 4, why="fp32 FMA path"))
    put("fa2_bwd_dq", (256,), ("float32",), TileConfig(64, 16, 4, why="fp32 FMA path: dQ of 16 x 256 per warp"))
    # decode_split: a warp streams its split of the cache through a ring of `stages` tiles of bc keys; br packed
    # query rows (GQA group x query rows) per CTA, 16 (one m-tile) except at d = 32; calls that pack more than 16
    # rows take MANY_ROWS_DECODE's row at d = 128. A CTA stays under 99 KB (2-3 CTAs per SM, 8-12 warps: 2 stages,
    # 16 or 32 keys): one CTA of 4 warps per SM (4 warps x 3 stages x 32 keys at d = 128, 196 KB) reads the cache
    # at 18 % of the copy bandwidth, too few warps to hide the latency of the per-tile work (H200; bench/NOTES.md).
    put("decode_split", (32,), _16BIT, TileConfig(32, 32, 4, stages=3, why="2 m-tiles: 126 registers, 51 KB"))
    put("decode_split", (64, 96), _16BIT, TileConfig(16, 32, 4, stages=2, why="1 m-tile, 32 keys, 2 deep: 67 / 99 KB"))
    put("decode_split", (128,), _16BIT, TileConfig(16, 16, 4, stages=2, why="1 m-tile, 16 keys, 2 deep: 68 KB"))
    put("decode_split", (192, 256), _16BIT, TileConfig(16, 16, 4, stages=2, why="16-key tiles, 2 deep: 102 / 136 KB"))
    put("decode_split", (32, 64, 96, 128), ("float32",), TileConfig(16, 16, 4, stages=2, why="fp32: half the keys"))
    # FP8 caches (16-bit queries; keyed by the cache's dtype): a tile of e4m3 keys is half the bytes of a 16-bit
    # one and the products read it from the ring (mainloop_decode.cuh). At d = 128, 3 stages (52 KB: 4 CTAs per
    # SM, as many as 127 registers a thread allow) beat 4 and 6 on an H100 (tools/tune_decode.py --dtype
    # float8_e4m3fn); the other head dims' rows are not measured. Head dims whose tile rows are 2 or 6 16-byte
    # chunks (32, 96) have no row (the swizzle needs 4, 8k or 8k + 4).
    put("decode_split", (64,), (FP8,), TileConfig(16, 32, 4, stages=4, why="FP8 cache: 32 keys, 4 deep: 66 KB"))
    put("decode_split", (128,), (FP8,), TileConfig(16, 16, 4, stages=3, why="FP8 cache: 16 keys, 3 deep: 52 KB"))
    put("decode_split", (192,), (FP8,), TileConfig(16, 16, 4, stages=4, why="FP8 cache: 16 keys, 4 deep: 102 KB"))
    put("decode_split", (256,), (FP8,), TileConfig(16, 16, 4, stages=3, why="FP8 cache: 16 keys, 3 deep: 104 KB"))
    put("decode_split", (192, 256), ("float32",), TileConfig(16, 16, 2, stages=2, why="fp32: 2 warps fit 163 KB"))
    return rows


TABLE: dict[tuple[str, int, str], TileConfig] = _rows()

# Rows that differ on other architectures (ptxas allocates differently for sm_80: these tiles spill there).
ARCH_ROWS: dict[str, dict[tuple[str, int, str], TileConfig]] = {
    "sm_80": {
        **{("fa2_fwd", d, dt): TileConfig(128, 32, 4, why="sm_80: 128 x 64 spills 16 B")
           for d in (96, 128) for dt in _16BIT},
        # The register switches (early_dv, opaque_tile) are on in sm_80 rows only, where they lower the registers of
        # most instantiations they change, without a spill (offline compile; each row's why gives the change). They
        # are not timed (the test GPU is an H200); the sm_90 rows keep them off.
        **{("fa2_bwd", 96, dt): TileConfig(32, 128, 8, early_dv=True,
                                           why="sm_80: Br = 64 spills; 106 KB; early dV: 1-6 fewer registers")
           for dt in _16BIT},
        **{("fa2_bwd", 128, dt): TileConfig(32, 128, 8, why="sm_80: Br = 64 spills; 106 KB of shared memory")
           for dt in _16BIT},
        **{("fa2_bwd", 192, dt): TileConfig(32, 64, 8, wc=2, early_dv=True,
                                            why="warps also split d: 16 x d/2 per warp; early dV: 4-8 fewer registers")
           for dt in _16BIT},
        ("fa2_bwd", 192, "float32"): TileConfig(16, 32, 8, wc=4, early_dv=True,
                                                why="sm_80: 163 KB; Br = 32 spills; early dV: 5-6 fewer registers "
                                                    "atomic, 3-5 more deterministic"),
        ("fa2_bwd", 256, "float32"): TileConfig(16, 32, 8, wc=4, why="sm_80: 163 KB per block; Br = 32 spills"),
        # opaque_tile acts on the float32 forwards' serial walk (the ablation's no-seq-parallel); the other
        # instantiations of these rows do not walk tiles, and their code is the same with it or without.
        ("fa2_fwd", 64, "float32"): TileConfig(64, 32, 4, opaque_tile=True,
                                               why="fp32 FMA path; sm_80: 168 registers without min_blocks; opaque "
                                                   "serial tiles: 5-8 fewer registers"),
        ("fa2_fwd", 128, "float32"): TileConfig(64, 32, 4, opaque_tile=True,
                                                why="fp32 FMA path; opaque serial tiles: 4 fewer registers, 3 more "
                                                    "causal"),
        ("fa2_bwd", 32, "float32"): TileConfig(32, 64, 4, why="fp32 FMA path (sm_80: min_blocks=3 spills 24-68 B)"),
        **{("fa1_fwd", 128, dt): TileConfig(16, 64, 4, min_blocks=2, why="73 KB: fits sm_86 / sm_89's 99 KB")
           for dt in _16BIT},
        **{("fa1_fwd", 192, dt): TileConfig(16, 64, 2, why="2 warps: 85 KB fits sm_86 / sm_89's 99 KB")
           for dt in _16BIT},
    },
}

# Causal forwards of short sequences (plain policy, seqlen_k <= SHORT_CAUSAL_SEQLEN): every query tile meets the
# diagonal within a few key blocks, where 128-row tiles mask less than d = 64's 192-row ones and d = 128's 176-key
# blocks. At N = 4096 the table's rows are as fast or faster (tools/tune.py --which fwd_fa3, H200 bf16, causal:
# d = 64 434 vs 397 TFLOP/s, d = 128 579 vs 581), hence the bound.
SHORT_CAUSAL_SEQLEN = 1024
SHORT_CAUSAL_ROWS: dict[tuple[str, int, str], TileConfig] = {
    **{("fa3_fwd_sm90", d, dt): TileConfig(128, 128, 12, stages=3,
                                           why="causal N 1k: 294 vs the table row's 273 TFLOP/s (H200 bf16)")
       for d in (32, 64) for dt in _16BIT},
    **{("fa3_fwd_sm90", d, dt): TileConfig(128, 128, 12, stages=2, q_stages=2,
                                           why="causal N 1k: 393 vs the table row's 368 TFLOP/s (H200 bf16)")
       for d in (96, 128) for dt in _16BIT},
}

# Non-causal forwards of short sequences (plain policy, seqlen_k <= SHORT_FULL_SEQLEN): a query tile meets few key
# blocks, so the tile's epilogue weighs more; 128 x 128 with two Q_i buffers stores O through shared memory and a
# TMA store (launch.fa3_fwd_stage_o), the table's 128 x 176 (one buffer) from registers. H200 bf16, d = 128,
# kernels alone: ahead of 128 x 176 up to N = 1024, even at 2048, 3 % behind at 4096, hence the bound
# (bench/NOTES.md). d = 96 shares the rows (not measured).
SHORT_FULL_SEQLEN = 1024
SHORT_FULL_ROWS: dict[tuple[str, int, str], TileConfig] = {
    ("fa3_fwd_sm90", d, dt): TileConfig(128, 128, 12, stages=2, q_stages=2,
                                        why="N 512 / 1k: 488 / 566 vs the table row's 425 / 542 TFLOP/s (H200 bf16)")
    for d in (96, 128) for dt in _16BIT
}

# Sliding windows of at most SHORT_WINDOW_SPAN keys (left + right, the diagonal's key aside; the general policy):
# a query tile sees a band of keys whose two ends are partly masked, and 128-key blocks waste less of it than the
# table's 176 (bf16) or 192 (FP8). tools/tune.py --features window,dense (H200, d = 128, N = 16384, window
# (1024, 0), TFLOP/s over the visible pairs): 128 x 128 with 2 Q_i buffers is the fastest candidate for both
# (bf16 against 128 x 112 / 128 / 160 / 176; FP8 against 128 x 128 with 1 Q_i buffer or 3 stages and 128 x 192
# with 2 or 3 stages). Measured at d = 128 only; d = 96 shares the bf16 rows. Wider windows keep the table's rows
# (not measured: they approach dense attention).
SHORT_WINDOW_SPAN = 1024
WINDOW_ROWS: dict[tuple[str, int, str], TileConfig] = {
    **{("fa3_fwd_sm90", d, dt): TileConfig(128, 128, 12, stages=2, q_stages=2,
                                           why="window (1024, 0), N 16k: 463 vs the table row's 420 TFLOP/s (H200)")
       for d in (96, 128) for dt in _16BIT},
    ("fa3_fwd_sm90_fp8", 128, FP8): TileConfig(128, 128, 12, stages=2, q_stages=2,
                                               why="window (1024, 0), N 16k: 495 vs the table row's 463 TFLOP/s"),
}

# Decode calls that pack more than 16 query rows per kv head (the GQA group x seqlen_q: MQA 32 / 1, speculative
# chunks): with the table's 16-row row every 16 rows are a row group of their own, and each row group's CTAs read
# the whole cache again; 32 rows read it once per 32. At d = 128 the 32-row tile takes 220 registers without a
# spill (offline). tools/tune_decode.py (H200 bf16, batch 8, N = 32768, MQA 32 / 1, d = 128, the model's split
# counts): 32 x 16 with 4 warps and 2 stages is the fastest candidate (3 stages or 2 warps are slower). Measured at
# d = 128 only. An FP8 cache's 32-row row keeps 4 stages (with 3 the CTA's merge outgrows the ring's bytes).
MANY_DECODE_ROWS = 16
MANY_ROWS_DECODE: dict[tuple[str, int, str], TileConfig] = {
    **{("decode_split", 128, dt): TileConfig(32, 16, 4, stages=2,
                                             why="MQA 32/1, b 8, N 32k: 0.0629 vs the table row's 0.0727 ms (H200)")
       for dt in _16BIT},
    ("decode_split", 128, FP8): TileConfig(32, 16, 4, stages=4, why="FP8 cache: 32 rows, 16 keys, 4 deep: 72 KB"),
}

# Backwards of plain attention over at least long_bwd_seqlen query rows without a mask, long_causal_bwd_seqlen
# causal (the GPU's Gates; FlashAttention-3's non-causal tile at head_dim 128): 80 query rows a step instead of 64,
# each consumer warpgroup computing dQ_i^T for 64 head columns (mainloop_bwd_sm90_ws.cuh's SWAP_DQ), so a step's
# fixed costs (the barriers, L_i / D_i, the dQ_i reduce-add) are spread over 25 % more rows. 231720 B of shared
# memory. The deterministic backward keeps the table's 64 rows (forms.ordered_dq_config: one dQ_i buffer cannot
# serve its two writer warps). 80 query blocks waste more of the diagonal's blocks on short causal walks, hence the
# causal bound, which differs per GPU (GATES).
LONG_BWD_ROWS: dict[tuple[str, int, str], TileConfig] = {
    ("fa3_bwd_sm90", d, dt): TileConfig(80, 128, 12, stages=2,
                                        why="N 16k: 561/549 vs the table row's 525/517 TFLOP/s (H200 bf16)")
    for d in (96, 128) for dt in _16BIT
}

# Paged forwards in FA3's form (forms.paged_keys): a key block arrives as boxes of gcd(block, page) rows, one page
# each (mainloop_fwd_sm90_ws.cuh's produce_paged), and the TMA unit's time per box, not its bytes, sets the pace of
# small boxes: 128-key blocks read pages of 64 in 64-row boxes where the table's 176 needs 16-row ones.
# Measured (H200 bf16, 16 sequences of 256 - 8192 tokens, causal, GQA 32/8, d = 128, kernels): pages of 64
# 2.36 ms against 2.92 with the table's 128 x 176 (the contiguous call: 2.42); pages of 16 3.09 against 3.03.
# Measured at d = 128 only; d = 96 shares it. d = 64 (192 x 128) and 256 (128 x 80) keep their table rows.
PAGED_ROWS: dict[tuple[str, int, str], TileConfig] = {
    ("fa3_fwd_sm90", d, dt): TileConfig(128, 128, 12, stages=2, q_stages=2,
                                        why="paged 64: 2.36 vs the table row's 2.92 ms (H200 bf16)")
    for d in (96, 128) for dt in _16BIT
}

# MLA's narrower v in FA3's forward and backward (the DV form, forms.value_form: V_j and O of head_dim_v columns,
# so P V and V's ring cost head_dim_v's FLOPs and bytes; in the backward V_j, dO_i and dV_j, so dP^T and dV_j's
# products, V's tile and dO's stages), keyed by (kernel, head_dim, head_dim_v, dtype) as the kernel is compiled
# (whole 64-column panels, launch.tma_head_dim / tma_value_head_dim). Other pairs run v zero-padded to q's
# head_dim on the table's rows. Forward: 192 / 128 (DeepSeek-V3's prefill) takes the d = 128 row's 128-key blocks,
# as many as fit beside Q_i of 192 columns; 128 / 64 the d = 128 row. Backward: each pair its q head_dim's table
# row (192: the column split in key-block pairs; 128: 64 rows by 128 keys, also for the deterministic form), so
# the DV form differs from the padded backward in its columns only.
VALUE_ROWS: dict[tuple[str, int, int, str], TileConfig] = {
    **{("fa3_fwd_sm90", 192, 128, dt): TileConfig(128, 128, 12, stages=2,
                                                  why="192 / 128: 128 keys a block, 2 stages in 214,112 B; not tuned")
       for dt in _16BIT},
    **{("fa3_fwd_sm90", 128, 64, dt): TileConfig(128, 176, 12, stages=2,
                                                 why="128 / 64: the d = 128 row, 169,056 B; not tuned")
       for dt in _16BIT},
    **{("fa3_bwd_sm90", 192, 128, dt): TileConfig(64, 64, 12, stages=2,
                                                  why="192 / 128: the d = 192 row, 206,936 B; not measured")
       for dt in _16BIT},
    **{("fa3_bwd_sm90", 128, 64, dt): TileConfig(64, 128, 12, stages=2,
                                                 why="128 / 64: the d = 128 row, 198,696 B; not measured")
       for dt in _16BIT},
    # decode's latent cache (MLA's absorbed decode: keys of 576 columns, values their first 512; MQA, 16 - 128
    # heads): 64 packed rows a CTA, whose 8 warps share one split and its ring of 64-key tiles, S split by keys (8
    # each), O by columns (64 each: 128 registers), P through shared memory (mainloop_decode.cuh's
    # MainloopDecodeLatent). 231,424 B: Q, 2 stages of K, P, the row maxima; one CTA per SM.
    **{("decode_split", LATENT_HEAD_DIM, LATENT_HEAD_DIM_V, dt): TileConfig(
        64, 64, 8, wc=8, stages=2, why="576 / 512: 64 rows, 8 warps on one split, 64 keys, 2 deep; not run")
       for dt in _16BIT},
}


def value_row(kernel: str, head_dim: int, head_dim_v: int, dtype: str) -> TileConfig | None:
    """The DV form's row for head dims as the kernel is compiled (None: v runs zero-padded to q's head_dim)."""
    return VALUE_ROWS.get((kernel, head_dim, head_dim_v, dtype))


# The rows of a situation (forms.situations names the ones that hold for a call), before the table's.
SITUATION_ROWS: dict[str, dict[tuple[str, int, str], TileConfig]] = {
    "short_causal": SHORT_CAUSAL_ROWS, "short_full": SHORT_FULL_ROWS, "short_window": WINDOW_ROWS,
    "many_decode_rows": MANY_ROWS_DECODE, "long_bwd": LONG_BWD_ROWS, "paged_keys": PAGED_ROWS,
}

# ---- the GPUs the sm_90 rows and gates are tuned for ----
# The table's rows were chosen on an H200 and serve every Hopper GPU; where an H100 measures differently, the
# difference is a row of its own (GPU_ROWS, GPU_SITUATION_ROWS) or a gate of its own (Gates), so each GPU's choices
# sit side by side. A GPU is told apart by its L2 (H100: 50 MB, H200: 60 MB): where the two differ, the H100's lower
# HBM bandwidth (3.0 against 4.3 TB/s copied) makes misses in L2 cost more. RAWFLASH_TILE_GPU names one instead (how
# a GPU runs the other's choices).
TUNED_GPUS = ("h200", "h100")
DEFAULT_GPU = "h200"  # a Hopper GPU unlike both, and the command line's offline target
H100_L2_MAX_BYTES = 56 << 20  # between the H100's 50 MB and the H200's 60 MB

# Tile rows that differ on one tuned GPU, keyed like TABLE (tools/tune.py and tools/tune_decode.py print an entry,
# with the figures that chose it, for the GPU they run on). The H200's entry stays empty: the table is its own.
GPU_ROWS: dict[str, dict[tuple[str, int, str], TileConfig]] = {"h200": {}, "h100": {
    # tools/tune.py --which fwd_fa3 (H100 bf16, kernels, N 2k / 4k / 8k): 128 x 160 with two Q_i buffers 691 / 764 /
    # 785 TFLOP/s full and 564 / 665 / 716 causal against the table's 128 x 176 at 651 / 727 / 764 and 521 / 633 /
    # 681; rawflash bench in a later H100 run (5 repeats): +4 - 9 % at N 2k / 4k, -2 - 3 % at 8k. 160 keys leave room
    # for a second Q_i buffer, which 176 do not; the H200 keeps the table's row.
    ("fa3_fwd_sm90", 128, "bfloat16"): TileConfig(128, 160, 12, stages=2, q_stages=2,
                                                  why="+4 - 9 % over 128x176 at N 2k/4k, even at 8k (H100 bf16)"),
}}
# A situation's rows that differ on one tuned GPU: GPU -> situation (SITUATION_ROWS' names) -> rows keyed like
# TABLE. None is measured on either GPU.
GPU_SITUATION_ROWS: dict[str, dict[str, dict[tuple[str, int, str], TileConfig]]] = {"h200": {}, "h100": {}}
# Table rows chosen by a measurement on a tuned GPU other than the H200 (the comment above each row gives it); they
# serve both GPUs, as the rest of the table does.
TABLE_CHOSEN_ON: dict[tuple[str, int, str], str] = {("decode_split", 128, FP8): "h100"}


@dataclasses.dataclass(frozen=True)
class Gates:
    """Where a GPU's schedule changes with the call (``rawflash list --gpu`` prints them).

    Attributes
    ----------
    long_bwd_seqlen, long_causal_bwd_seqlen : int
        Query rows from which plain attention's backward takes LONG_BWD_ROWS' 80-row tile, without a mask and
        causal (``forms.long_bwd``).
    longest_first_ctas : int
        The default FA3 backward under a right bound dispatches its key tiles longest first
        (``launch.fa3_bwd_longest_first``) only where each (batch, kv head) then runs at least this many CTAs at
        once (pairs x this <= SMs): the CTAs running together share that pair's Q_i, dO_i and dQ rows in L2.
    why : str
        What chose the gates, in one line (the figures: bench/NOTES.md).
    """

    long_bwd_seqlen: int
    long_causal_bwd_seqlen: int
    longest_first_ctas: int
    why: str = ""


GATES: dict[str, Gates] = {
    # H200, bf16, d = 128, kernels alone. 80 rows against 64: without a mask 4 - 7 % faster from N = 1024 to 16384;
    # causal 1 - 2 % slower up to N = 2048, even at 4096, 6 % faster at 16384. Longest first: GQA 4:1 +7 - 20 %
    # (16 - 64 pairs), MHA 1.0x at 16 - 64 pairs and 0.78 - 0.89x at 128 - 512 (d = 64 / 128, N 1024 - 4096).
    "h200": Gates(1024, 8192, 2, why="80 causal rows pay from N 8k; longest first at <= 64 pairs (H200 bf16)"),
    # H100, bf16, kernels alone against cuDNN in one process (tools/tune_bwd_order.py, two machines): causal 80 rows
    # against 64 -1 .. +15 % at N = 4096 (GQA 8:1 the most), -2 .. +2 % at 2048; longest first against key order at
    # 64 pairs 0.74 - 0.80x (MHA d = 128 N = 4096, d = 64 N = 8192, GQA 4:1 d = 64 N = 2048), at 32 pairs 0.88 -
    # 1.08x, at 8 - 16 pairs 0.99 - 1.25x.
    "h100": Gates(1024, 4096, 8, why="80 causal rows from N 4k; longest first at <= 16 pairs (H100 bf16)"),
}


def gpu_name(arch: str, l2_bytes: int) -> str:
    """The tuned GPU whose rows and gates a device takes: 'h100' for a Hopper GPU with an H100's L2, else 'h200'
    (the rows' own GPU, for every other architecture too: their calls never reach the gated forms, and GPU_ROWS
    apply to the sm_90 family only)."""
    return "h100" if arch_family(arch) == "sm_90" and 0 < l2_bytes <= H100_L2_MAX_BYTES else DEFAULT_GPU


def _tuned(gpu: str) -> str:
    """``gpu``, refused unless it is one of ``TUNED_GPUS``."""
    if gpu not in TUNED_GPUS:
        raise ValueError(f"gpu must be one of {', '.join(TUNED_GPUS)}, got {gpu!r}")
    return gpu


def gates(gpu: str) -> Gates:
    """The gates of a tuned GPU (``TUNED_GPUS``)."""
    return GATES[_tuned(gpu)]


# Instantiations allowed to spill: (name expression, arch) -> the bytes of spill stores + loads ptxas reports, each
# with its reason. tests/test_compile.py fails if anything else spills, or if one of these stops spilling.
KNOWN_SPILLS: dict[tuple[str, str], int] = {
    # float32 (the accuracy path, scalar FMA products; sm80.cuh's fma_gemm does not unroll its k loop): only the
    # d = 256 general forward with a window on sm_80 spills.
    ("fa2_fwd<float, 256, 64, 16, 4, 1, 1, 2, true, true, true, true, false, 98304>", "sm_80"): 12,
    # FA3's deterministic backward at d = 64 (128 query rows a step; setmaxnreg gives the producer warpgroup 24
    # registers and the consumers 240, as 40 / 232 spills 148 B in the consumers' general policy): the plain causal
    # one spills the walk's bounds in the producer warpgroup (its dQ writer warps), outside the consumers' products
    # (SASS). Its other instantiations do not spill.
    **{(f"fa3_bwd_sm90<{t}, 64, 128, 128, 2, 1, false, true, 64, 199720>", "sm_90"): 40
       for t in ("__half", "__nv_bfloat16")},
    # The FP8 forward under a window (the general policy, dynamic schedule): 4 B in the producer warpgroup's 24
    # registers (the walk's bounds), after its setmaxnreg, outside the consumers' key loop (SASS; WINDOW_ROWS'
    # 128 x 128 row at d = 128 too); with a float16 output at d = 256, 176 B in the consumers (about 11 words of the
    # tile's state, spilled once a tile and a few reloaded a step; its speed is not measured).
    **{(f"fa3_fwd_sm90_fp8<{t}, {d}, 128, {bc}, {st}, 2, true, true, true, 2, {qs}, {smem}>", "sm_90"):
       176 if (t, d) == ("__half", 256) else 8
       for t in ("__half", "__nv_bfloat16") for d, bc, st, qs, smem in ((128, 192, 3, 2, 181392),
                                                                         (128, 128, 2, 2, 99440),
                                                                         (256, 128, 2, 1, 164960))},
}


def padded_head_dim(head_dim: int) -> int:
    """The specialised head_dim a kernel runs with: the smallest one >= head_dim."""
    for d in SPECIALISED_HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}, got {head_dim}")


def arch_family(arch: str) -> str:
    """The table a GPU uses: 'sm_90' rows for Hopper (the default, tuned on the H200), 'sm_80' rows otherwise."""
    return "sm_90" if arch.startswith("sm_9") or arch.startswith("sm_1") else "sm_80"


def tile_config(kernel: str, head_dim: int, dtype: str, arch: str = "sm_90",
                override: dict[tuple[str, int, str], TileConfig] | None = None, general: bool = False,
                situations: tuple[str, ...] = (), gpu: str = DEFAULT_GPU) -> TileConfig:
    """The row for ``kernel`` at the specialised head_dim covering ``head_dim``, for ``dtype`` on ``arch``.

    Parameters
    ----------
    kernel, head_dim, dtype : str, int, str
        The kernel template, the call's head_dim (padded to a specialised one) and the dtype's name.
    arch : str
        The target; ``arch_family`` picks the sm_90 table or the sm_80 one (``ARCH_ROWS`` over ``TABLE``).
    override : dict, optional
        Rows keyed like the table (tools/tune.py's candidates); they take precedence over everything else.
    general : bool
        For the general policy's instantiations: a row's ``general_min_blocks`` then applies.
    situations : tuple of str
        Names of ``SITUATION_ROWS`` that hold for the call (``rawflash.kernels.forms.situations`` decides); on the
        sm_90 family the first with a row for the key gives it, the GPU's own (``GPU_SITUATION_ROWS``) before the
        shared one. They are measured on Hopper GPUs, so other architectures keep their table rows.
    gpu : str
        The tuned GPU (``TUNED_GPUS``; ``Problem.gpu``): on the sm_90 family its ``GPU_ROWS`` replace the table's
        rows. A situation's row comes first: it is chosen against the table's row for a kind of call (its mask,
        pages, rows per kv head), for a reason of the call's shape that holds on every Hopper GPU, where a GPU's row
        re-tunes the general case (tools/tune.py's sweep) and so replaces only the table's row.

    Returns
    -------
    TileConfig
    """
    return _lookup(kernel, head_dim, dtype, arch, override, general, situations, gpu)[0]


def tile_source(kernel: str, head_dim: int, dtype: str, arch: str = "sm_90", situations: tuple[str, ...] = (),
                gpu: str = DEFAULT_GPU) -> tuple[str, str]:
    """Where ``tile_config``'s row comes from: 'GPU_SITUATION_ROWS', 'SITUATION_ROWS', 'GPU_ROWS', 'ARCH_ROWS' or
    'TABLE', and the situation whose row it is ('' for the others)."""
    return _lookup(kernel, head_dim, dtype, arch, None, False, situations, gpu)[1:]


def chosen_on(kernel: str, head_dim: int, dtype: str, gpu: str = DEFAULT_GPU) -> str:
    """The tuned GPU whose measurement chose the sm_90 row ``gpu`` takes without a situation: ``gpu`` for a row of
    its ``GPU_ROWS``, else the table's (``TABLE_CHOSEN_ON``, else the H200). A row chosen without a measurement (a
    register or shared-memory bound, flash-attn's shape) says so in its ``why``."""
    if tile_source(kernel, head_dim, dtype, "sm_90", (), gpu)[0] == "GPU_ROWS":
        return gpu
    return TABLE_CHOSEN_ON.get((kernel, padded_head_dim(head_dim), dtype), DEFAULT_GPU)


def _lookup(kernel: str, head_dim: int, dtype: str, arch: str, override: dict | None, general: bool,
            situations: tuple[str, ...], gpu: str) -> tuple[TileConfig, str, str]:
    """``tile_config``'s row, the name of what gave it and its situation (``tile_source``)."""
    key = (kernel, padded_head_dim(head_dim), dtype)
    if override and key in override:
        return override[key], "override", ""
    if key not in TABLE:
        raise KeyError(f"no tile configuration for kernel={kernel!r}, head_dim={head_dim}, dtype={dtype!r}")
    own = GPU_SITUATION_ROWS[_tuned(gpu)]
    hopper = arch_family(arch) == "sm_90"
    for name in situations if hopper else ():  # measured on Hopper GPUs only
        if key in own.get(name, {}):
            return own[name][key], "GPU_SITUATION_ROWS", name
        if key in SITUATION_ROWS[name]:
            return SITUATION_ROWS[name][key], "SITUATION_ROWS", name
    if hopper and key in GPU_ROWS[gpu]:
        row, source = GPU_ROWS[gpu][key], "GPU_ROWS"
    elif key in ARCH_ROWS.get(arch_family(arch), {}):
        row, source = ARCH_ROWS[arch_family(arch)][key], "ARCH_ROWS"
    else:
        row, source = TABLE[key], "TABLE"
    if general and row.general_min_blocks:
        row = dataclasses.replace(row, min_blocks=row.general_min_blocks)
    return row, source, ""


def has_row(kernel: str, head_dim: int, dtype: str) -> bool:
    """Whether the table has a row for ``kernel`` at the specialised head_dim covering ``head_dim``."""
    return head_dim <= MAX_HEAD_DIM and (kernel, padded_head_dim(head_dim), dtype) in TABLE
