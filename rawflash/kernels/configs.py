"""Tile sizes: the only place they live.

One row per (kernel, head_dim, dtype). A head_dim without a row of its own runs on the next specialised one
(``padded_head_dim``) with the extra columns zero-filled on load and never stored. Each row says why it was
chosen; ``bench/results/NOTES.md`` keeps the measurements.

Kernels here are the CUDA templates: ``fa1_fwd``, ``fa2_fwd``, ``fa2_fwd_splitk`` (fa2_fwd with its split-Q
partition switched off, for the ablation), ``fa2_fwd_sm90`` (fa2_fwd on Hopper's wgmma, 16-bit, sm_90 only),
``fa3_fwd_sm90`` (FA3's warp-specialised TMA forward, 16-bit, sm_90 only), ``fa2_bwd``, ``fa2_bwd_sm90`` (fa2_bwd's atomic-dQ pass on wgmma, 16-bit, sm_90 only) and
``fa2_bwd_dq`` (the deterministic dQ pass).
"""
from __future__ import annotations

import dataclasses

SPECIALISED_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
MAX_HEAD_DIM = SPECIALISED_HEAD_DIMS[-1]
DTYPES = ("float16", "bfloat16", "float32")
FP8 = "float8_e4m3fn"  # the FP8 forward's input dtype (fa3_fwd_sm90_fp8 rows only; not in DTYPES)
KERNELS = ("fa1_fwd", "fa2_fwd", "fa2_fwd_splitk", "fa2_fwd_sm90", "fa3_fwd_sm90", "fa3_fwd_sm90_fp8", "fa2_bwd", "fa3_bwd_sm90", "fa2_bwd_sm90", "fa2_bwd_dq",
           "decode_split")


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tile shape of one kernel instantiation.

    br, bc: query rows and key rows of a block (the papers' Br, Bc); warps: warps per CTA; min_blocks: the
    CTAs per SM promised to the compiler through ``__launch_bounds__`` (it caps registers at
    65536 / (32 * warps * min_blocks)); wc: (fa2_bwd) warps that split the head_dim columns of dK, dV;
    kunroll: k-steps of 16 unrolled together in the S = Q K^T style products (ILP against registers);
    stages: (decode_split) depth of each warp's cp.async ring of key tiles; (FA3 forms) stages of the K_j / V_j
    ring; q_stages: (FA3 forwards) Q_i buffers, 2 to copy a persistent CTA's next Q_i while its tile runs. For
    decode_split, br is the packed query rows of one CTA (16 per m-tile), bc the keys of one warp tile, warps the
    splits one CTA runs. Register switches, which change the code ptxas allocates for and nothing it computes:
    early_dv: (fa2_bwd, plain policy) P^T and dV_j += P^T dO_i before dP^T (mainloop_bwd_sm80.cuh's EARLY_DV);
    opaque_tile: (fa2_fwd's serial walk, the ablation's SEQ_PARALLEL = false) each tile's coordinates hidden from
    the optimiser (fwd.cuh's OPAQUE_TILE).
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
    # feeds two mma); 128 x 64 is flash-attn 2's sm80 choice. 255 registers at d = 128, 1 CTA of 4 warps...
    put("fa2_fwd", (32, 64), _16BIT, TileConfig(128, 64, 4, kunroll=4, why="H200 d=64 N=4096: 232/215 TF; 128x128 spills"))
    put("fa2_fwd", (96,), _16BIT, TileConfig(128, 64, 4, why="H200 N=4096 d=128: 280/240 TF vs 247/216 at 128x32"))
    # d = 128: 128 x 64 sat at 254 registers; with the parameter struct and the general policy's skeleton ptxas
    # spills 16-32 B there (offline, session 3), so the sm_80 row that fits (measured 247/216 TF at N = 4096 on
    # the H200 in session 1). On an H200 this kernel runs at d = 128 only with wgmma=False.
    put("fa2_fwd", (128,), _16BIT, TileConfig(128, 32, 4, why="no spill at 128 x 32; 128 x 64 spills 16-32 B"))
    put("fa2_fwd", (192, 256), _16BIT, TileConfig(64, 64, 4, why="O accumulator of 16 x d per warp fits registers"))
    # fa2_fwd_sm90 (wgmma, sm_90a): warps = 4 per warpgroup of 64 query rows; registers hold O (d/2), S (bc/2) and
    # P (bc/4) per thread; shared memory Q_i and two stages of K_j, V_j. Several independent CTAs per SM overlap
    # one CTA's softmax with another's products better than two warpgroups of one CTA (which share barriers).
    put("fa2_fwd_sm90", (64,), _16BIT, TileConfig(64, 128, 4, min_blocks=3, general_min_blocks=2,
                                                  why="H200 N=1024/4096: 359/392 TF vs 267/305 at 128x128x8 (3 CTAs "
                                                      "of 1 WG per SM); the general policy spills 236 B under 3 "
                                                      "(168 registers), so 2 there"))
    put("fa2_fwd_sm90", (128,), _16BIT, TileConfig(64, 96, 4, min_blocks=2, why="H200 N=1024/4096: 373/435 TF vs "
                                                                                  "358/417 at 128x128x8"))
    put("fa2_fwd_sm90", (192, 256), _16BIT, TileConfig(128, 64, 8, why="O of d/2 registers leaves room for 64 keys"))
    # float32 runs the same body with emulated mma (FMA + shuffles): one m-tile per warp, narrow key blocks.
    put("fa2_fwd", (32, 96, 128, 192), ("float32",), TileConfig(64, 32, 4, why="fp32 FMA path: keep registers low"))
    # d = 64 asks for the 3 CTAs per SM the pre-skeleton kernel had at 168 registers: under the skeleton ptxas
    # spends 180 - 199 when allowed 255 (2 CTAs per SM, offline NVRTC 13.0, session 6), and fits every sm_90
    # instantiation (plain, general, the ablation's) in 168 without a spill (sm_80 keeps 1: ARCH_ROWS). Session 7,
    # H200, tools/tune.py, N = 1024 / 4096, full / causal: 13/12/13/12 TFLOP/s against 11/10/11/11 at 2 CTAs.
    put("fa2_fwd", (64,), ("float32",), TileConfig(64, 32, 4, min_blocks=3,
                                                  why="fp32 FMA path; 3 CTAs per SM at 168 registers: 13/12/13/12 "
                                                      "vs 11/10/11/11 TFLOP/s"))
    put("fa2_fwd", (256,), ("float32",), TileConfig(64, 16, 4, why="fp32 FMA path: O of 16 x 256 per warp"))
    # Split-K (splitk.cuh): all warps share BR rows and take BC / warps keys each; per block every warp writes a
    # partial O of BR x d float32 to its slot and reads a d / warps slice of all slots back, so shared traffic per
    # FLOP is about 2.5 / (keys per warp) + 1 / BR bytes and the slots take warps x BR x d x 4 bytes. The ablation
    # rows (FA2 without split-Q) keep 32+ keys per warp and several CTAs per SM with 2 warps; fa1 keeps flash-attn
    # 1.x's steps (16 query rows, 4 warps, 256 keys at d <= 64 and 128 at d = 128).
    put("fa2_fwd_splitk", (32, 64), _16BIT, TileConfig(32, 128, 2, min_blocks=4, why="64 keys per warp, 53 KB: 4 CTAs"))
    put("fa2_fwd_splitk", (96, 128), _16BIT, TileConfig(32, 64, 2, min_blocks=3, why="32 keys per warp, 73 KB: 3 CTAs"))
    put("fa2_fwd_splitk", (192, 256), _16BIT, TileConfig(16, 32, 2, min_blocks=2, why="O slice of 16 x 128 per warp"))
    put("fa2_fwd_splitk", SPECIALISED_HEAD_DIMS, ("float32",), TileConfig(16, 32, 2, why="fp32 FMA path; 112 KB at d 256"))
    put("fa1_fwd", (32, 64), _16BIT, TileConfig(16, 256, 4, min_blocks=2, why="flash-attn 1.x d<=64: 16 x 256 steps"))
    put("fa1_fwd", (96, 128), _16BIT, TileConfig(16, 128, 4, min_blocks=2, why="flash-attn 1.x d=128: 16 x 128 steps"))
    put("fa1_fwd", (192, 256), _16BIT, TileConfig(16, 64, 4, why="16 keys per warp; 145 KB at d = 256"))
    put("fa1_fwd", SPECIALISED_HEAD_DIMS, ("float32",), TileConfig(16, 32, 2, why="fp32 FMA path; 129 KB at d = 256"))
    # fa2_bwd: 8 warps own 16 keys each; K_j, V_j of 128 keys stay in shared memory for the whole query loop.
    put("fa2_bwd", (32, 64), _16BIT, TileConfig(64, 128, 8, why="FA2 sm80 d<=64 shape"))
    put("fa2_bwd", (96,), _16BIT, TileConfig(64, 128, 8, why="H200 N=4096 d=128: 162/145 TF vs 146/132 at Br=32"))
    # d = 128 (on an H200: the deterministic backward only): Br = 64 spills 52-112 B since session 3 (see fa2_fwd).
    put("fa2_bwd", (128,), _16BIT, TileConfig(32, 128, 8, why="no spill at Br = 32; Br = 64 spills 52-112 B"))
    put("fa2_bwd", (192,), _16BIT, TileConfig(32, 64, 8, wc=2, why="warps also split d: 16 x d/2 per warp"))
    put("fa2_bwd", (256,), _16BIT, TileConfig(32, 64, 8, wc=2, why="16 x 128 dK, dV per warp"))
    # fa3_fwd_sm90 (TMA + warp specialisation, sm_90a): br / 64 consumer warpgroups and one producer warpgroup
    # (warps = 4 * (br / 64 + 1)), `stages` stages of K_j and V_j. A consumer holds O (d / 2 floats), S (bc / 2) and
    # P (bc / 4) of its 64 rows in the registers setmaxnreg gives it (232 with two consumer warpgroups, 160 with
    # three). tools/tune.py --which fwd_fa3, H200 bf16, N = 2048 / 8192, full and causal, TFLOP/s (session 4):
    # Two Q_i buffers (q_stages) copy a persistent CTA's next Q_i while its tile runs; they fit beside 2 stages of
    # 128 keys at d <= 64 (115 KB), not beside d = 128's 176 keys. Session 7 (H200, bf16, N = 1024 / 4096, full /
    # causal): 192 x 128 with 2 Q_i buffers 407/273/506/434 vs 1: 393/265/503/436, 128 x 128: 373/288/415/392.
    put("fa3_fwd_sm90", (32, 64), _16BIT, TileConfig(192, 128, 16, stages=2, q_stages=2,
                                                     why="477/344/540/474 (1 Q_i buffer) vs 128x128: "
                                                         "398/314/423/407, 128x176: 420/313/455/424"))
    put("fa3_fwd_sm90", (96, 128), _16BIT, TileConfig(128, 176, 12, stages=2, why="614/449/689/621 vs 128x128: "
                                                                             "599/457/662/608, 128x160: 612/450/674/615"))
    put("fa3_fwd_sm90", (192,), _16BIT, TileConfig(128, 96, 12, stages=2, why="FA3's shape at d = 192; not tuned"))
    put("fa3_fwd_sm90", (256,), _16BIT, TileConfig(128, 80, 12, stages=2, why="622/477/700/624 vs 128x64: "
                                                                          "604/454/671/583; 226 KB"))
    # fa3_fwd_sm90_fp8 (FA3's form on e4m3 inputs): tiles are bytes in 128-column panels, so head_dim runs as 128
    # or 256 (d <= 128 computes 128 columns: d = 64 pays for 128) and the key block is 128 (V^T tiles of whole
    # panels). Two consumer warpgroups at 240 registers: O (d / 2), S (64), P (32 registers of e4m3). 128 x 128 is
    # FA3's FP8 shape at d = 256; three consumer warpgroups (160 registers) spill 288 B at d = 128 (offline).
    # At d <= 128, 192 keys (V^T in 64-byte panels), 3 stages and 2 Q_i buffers; tools/tune.py --which fwd_fp8,
    # session 7 (H200, N = 4096 / 16384, full / causal, TFLOP/s, the lazy rescale on). The final tree measured
    # 760/632/878/850 (rawflash bench, run 5): one edit of OnlineSoftmax::update in between (NOTES, session 7).
    put("fa3_fwd_sm90_fp8", (32, 64, 96, 128), (FP8,), TileConfig(128, 192, 12, stages=3, q_stages=2,
                                                                  why="821/673/931/914 vs 128x128 (2 stages): "
                                                                      "773/658/852/869, 128x192 (3 stages, 1 Q_i "
                                                                      "buffer): 804/663/932/908; 177 KB"))
    put("fa3_fwd_sm90_fp8", (192, 256), (FP8,), TileConfig(128, 128, 12, stages=2,
                                                           why="untuned guess (not measured): 161 KB"))
    # fa3_bwd_sm90 (TMA + warp specialisation, sm_90a): 2 consumer warpgroups x 64 keys and a producer warpgroup;
    # 64 query rows per step, `stages` stages of Q_i, dO_i, L_i, D_i. The shape of fa2_bwd_sm90's d <= 128 row.
    put("fa3_bwd_sm90", (96, 128), _16BIT, TileConfig(64, 128, 12, stages=2, why="fa2_bwd_sm90's shape; untuned"))
    # d <= 64: 128 query rows a step (FlashAttention-3's hdim-64 tile): the consumers split dQ_i's rows instead of
    # its columns, with one dS^T buffer (two do not fit in 227 KB beside the rest). H200, bf16, kernels alone,
    # session 14 (bench/results/ab-s14-bwd*.json), N = 4096 / 16384 full / causal: 461 / 380 / 477 / 462 TFLOP/s
    # against the 64-row tile's 357 / 317 / 379 / 358 (session 13's code), cuDNN 457 / 386 / 483 / 453.
    put("fa3_bwd_sm90", (32, 64), _16BIT, TileConfig(128, 128, 12, stages=2,
                                                     why="461/380/477/462 vs 64x128: 357/317/379/358; 195 KB"))
    # d = 192, 256: the column split (launch.fa3_bwd_split_d, mainloop_bwd_sm90_ws_split_d.cuh): both consumer
    # warpgroups share 64 keys (dK, dV of 64 x d do not fit one warpgroup), each holding dK, dV for half of the
    # columns; 2 stages of Q_i, dO_i fit beside K_j, V_j at d = 256 (231464 B) only with dQ by atomics.
    put("fa3_bwd_sm90", (192, 256), _16BIT, TileConfig(64, 64, 12, stages=2,
                                                       why="dK, dV of 64 x d/2 per consumer warpgroup; 231 KB at "
                                                           "d = 256; not measured"))
    # fa2_bwd_sm90 (wgmma, sm_90a): a warpgroup per 64 keys, 64 query rows per step (one wgmma of dQ_i).
    put("fa2_bwd_sm90", (64, 128), _16BIT, TileConfig(64, 128, 8, why="FA3's d<=128 shape: 2 warpgroups x 64 keys"))
    # d 256: 8 warps on 64 keys = SPLIT_D, each warpgroup holds dK, dV for half of the columns (2 x 64 registers).
    # H200 N=1024/4096/16384: 217/255/266 TF (0.95-1.04x torch-flash); fa2_bwd (mma.sync) ran 89/95/96. No d=192
    # row: its halves of 96 columns would straddle 64-column panels (the kernel's static_assert).
    put("fa2_bwd_sm90", (256,), _16BIT, TileConfig(64, 64, 8, why="dK, dV of 64 x 128 per warpgroup"))
    put("fa2_bwd", (64,), ("float32",), TileConfig(32, 64, 4, why="fp32 FMA path"))
    # d = 32: 3 CTAs per SM, as the pre-skeleton deterministic backward had at 168 registers (the skeleton's takes
    # 178 - 230 when allowed 255, 2 CTAs; all 8 sm_90 instantiations fit 168 without a spill, offline, session 6;
    # on sm_80 the atomic ones spill 24 - 68 B under it, so ARCH_ROWS keeps 1 there). Session 7, H200: 9/9/9/9
    # TFLOP/s against 9/8/9/8 at 2 CTAs (N = 1024 / 4096, full / causal; tools/tune.py rounds to integers).
    put("fa2_bwd", (32,), ("float32",), TileConfig(32, 64, 4, min_blocks=3,
                                                  why="fp32 FMA path; 3 CTAs per SM at 168 registers: 9/9/9/9 vs "
                                                      "9/8/9/8 TFLOP/s"))
    put("fa2_bwd", (96, 128), ("float32",), TileConfig(32, 64, 8, wc=2, why="fp32 FMA path; warps split d"))
    put("fa2_bwd", (192, 256), ("float32",), TileConfig(32, 32, 8, wc=4, why="fp32 FMA path; 16 x d/4 dK, dV per warp"))
    put("fa2_bwd_dq", (32, 64, 96, 128), _16BIT, TileConfig(64, 64, 4, why="split-Q, 16 rows per warp"))
    put("fa2_bwd_dq", (192, 256), _16BIT, TileConfig(64, 16, 4, why="dQ of 16 x d per warp leaves room for 16 x 16 S"))
    put("fa2_bwd_dq", (32, 64, 96, 128, 192), ("float32",), TileConfig(64, 32, 4, why="fp32 FMA path"))
    put("fa2_bwd_dq", (256,), ("float32",), TileConfig(64, 16, 4, why="fp32 FMA path: dQ of 16 x 256 per warp"))
    # decode_split: a warp streams its split of the cache through a ring of `stages` tiles of bc keys; br packed
    # query rows (GQA group x query rows) per CTA. H200 run 3 (bench --decode, 4 warps x 3 stages x 32 keys at
    # d = 128: 196 KB, one CTA of 4 warps per SM) reached 18 % of the copy bandwidth: too few warps to hide the
    # latency of the per-tile work. These rows keep a CTA under 99 KB (2-3 CTAs per SM, 8-12 warps): 2 stages,
    # 16 or 32 keys. 32 rows at d = 128 make ptxas spill (255 registers, offline), so 16 rows there.
    put("decode_split", (32,), _16BIT, TileConfig(32, 32, 4, stages=3, why="2 m-tiles: 126 registers, 51 KB"))
    put("decode_split", (64, 96), _16BIT, TileConfig(16, 32, 4, stages=2, why="1 m-tile, 32 keys, 2 deep: 67 / 99 KB"))
    put("decode_split", (128,), _16BIT, TileConfig(16, 16, 4, stages=2, why="1 m-tile, 16 keys, 2 deep: 68 KB"))
    put("decode_split", (192, 256), _16BIT, TileConfig(16, 16, 4, stages=2, why="16-key tiles, 2 deep: 102 / 136 KB"))
    put("decode_split", (32, 64, 96, 128), ("float32",), TileConfig(16, 16, 4, stages=2, why="fp32: half the keys"))
    put("decode_split", (192, 256), ("float32",), TileConfig(16, 16, 2, stages=2, why="fp32: 2 warps fit 163 KB"))
    return rows


TABLE: dict[tuple[str, int, str], TileConfig] = _rows()

# Rows that differ on other architectures (ptxas allocates differently for sm_80: these tiles spill there).
ARCH_ROWS: dict[str, dict[tuple[str, int, str], TileConfig]] = {
    "sm_80": {
        **{("fa2_fwd", d, dt): TileConfig(128, 32, 4, why="sm_80: 128 x 64 spills 16 B") for d in (96, 128) for dt in _16BIT},
        # early_dv / opaque_tile (register switches, TileConfig): offline, NVRTC 13.0, session 8, registers before
        # -> after, pre-skeleton in brackets. fa2_bwd causal atomic: 16-bit d = 96 220 -> 214 [208], d = 192 213 ->
        # 207 [201], float32 d = 192 202 -> 197 [192]; no spill; the plain instantiations of these rows move -8 ..
        # +5 (the float32 d = 192 deterministic ones 163 / 165 -> 168 [179 / 168]). Untimed: none of these runs on
        # the H200 (the sm_90 rows keep the switches off, and all 657 sm_90 instantiations their SASS).
        **{("fa2_bwd", 96, dt): TileConfig(32, 128, 8, early_dv=True,
                                           why="sm_80: Br = 64 spills; 106 KB of shared memory; early dV: 1-6 fewer "
                                               "registers") for dt in _16BIT},
        **{("fa2_bwd", 128, dt): TileConfig(32, 128, 8, why="sm_80: Br = 64 spills; 106 KB of shared memory")
           for dt in _16BIT},
        **{("fa2_bwd", 192, dt): TileConfig(32, 64, 8, wc=2, early_dv=True,
                                            why="warps also split d: 16 x d/2 per warp; early dV: 4-8 fewer "
                                                "registers")
           for dt in _16BIT},
        ("fa2_bwd", 192, "float32"): TileConfig(16, 32, 8, wc=4, early_dv=True,
                                                why="sm_80: 163 KB per block; Br = 32 spills; early dV: 5-6 fewer "
                                                    "registers (atomic dQ), 3-5 more (deterministic: 168)"),
        ("fa2_bwd", 256, "float32"): TileConfig(16, 32, 8, wc=4, why="sm_80: 163 KB per block; Br = 32 spills"),
        # The serial walk (the ablation's no-seq-parallel) of the float32 forwards (offline, as above): d = 64 190 ->
        # 182 [177] causal, 185 -> 180 [182]; d = 128 230 -> 226 [220], causal 230 -> 233 [238]. The other
        # instantiations of these rows do not walk tiles: the switch leaves their code as it was.
        ("fa2_fwd", 64, "float32"): TileConfig(64, 32, 4, opaque_tile=True,
                                               why="fp32 FMA path: keep registers low (sm_80: 168 registers without "
                                                   "min_blocks); opaque serial tiles: 5-8 fewer registers"),
        ("fa2_fwd", 128, "float32"): TileConfig(64, 32, 4, opaque_tile=True,
                                                why="fp32 FMA path: keep registers low; opaque serial tiles: 4 fewer "
                                                    "registers (3 more causal, within the pre-skeleton 238)"),
        ("fa2_bwd", 32, "float32"): TileConfig(32, 64, 4, why="fp32 FMA path (sm_80: min_blocks=3 spills 24-68 B)"),
        **{("fa1_fwd", 128, dt): TileConfig(16, 64, 4, min_blocks=2, why="73 KB: fits sm_86 / sm_89's 99 KB")
           for dt in _16BIT},
        **{("fa1_fwd", 192, dt): TileConfig(16, 64, 2, why="2 warps: 85 KB fits sm_86 / sm_89's 99 KB") for dt in _16BIT},
    },
}

# Causal forwards of short sequences (plain policy, seqlen_k <= SHORT_CAUSAL_SEQLEN): every query tile meets the
# diagonal within a few key blocks, where 128-row tiles mask less than d = 64's 192-row ones and d = 128's 176-key
# blocks. tools/tune.py --which fwd_fa3, session 7 (H200, bf16, causal, N = 1024 / 4096, TFLOP/s): at N = 4096 the
# table's rows win again (d = 64: 434 vs 397; d = 128: 579 vs 581, even).
SHORT_CAUSAL_SEQLEN = 1024
SHORT_CAUSAL_ROWS: dict[tuple[str, int, str], TileConfig] = {
    **{("fa3_fwd_sm90", d, dt): TileConfig(128, 128, 12, stages=3, why="294 vs 192x128 (2 Q_i buffers): 273")
       for d in (32, 64) for dt in _16BIT},
    **{("fa3_fwd_sm90", d, dt): TileConfig(128, 128, 12, stages=2, q_stages=2, why="393 vs 128x176: 368")
       for d in (96, 128) for dt in _16BIT},
}

# Non-causal forwards of short sequences (plain policy, seqlen_k <= SHORT_FULL_SEQLEN): a query tile meets few key
# blocks, so the tile's epilogue weighs more; 128 x 128 with two Q_i buffers stores O through shared memory and a
# TMA store (launch.fa3_fwd_stage_o), the table's 128 x 176 (one buffer) from registers. Session 13 (H200, bf16,
# d = 128, kernels alone, bench/results/ab-s13-epilogue-first.json): N = 512 488 vs 425 TFLOP/s,
# N = 1024 566 vs 542, N = 2048 616 vs 619 (even), N = 4096 643 vs 660. d = 96 shares the rows (unmeasured).
SHORT_FULL_SEQLEN = 1024
SHORT_FULL_ROWS: dict[tuple[str, int, str], TileConfig] = {
    ("fa3_fwd_sm90", d, dt): TileConfig(128, 128, 12, stages=2, q_stages=2, why="488 / 566 vs 128x176: 425 / 542")
    for d in (96, 128) for dt in _16BIT
}

# Sliding windows of at most SHORT_WINDOW_SPAN keys (left + right, the diagonal's key aside; the general policy):
# a query tile sees a band of keys whose two ends are partly masked, and 128-key blocks waste less of it than the
# table's 176. tools/tune.py --which fwd_fa3 --features window,dense, session 10 (H200, bf16, d = 128, N = 16384,
# window (1024, 0) causal, TFLOP/s over the visible pairs): 463 vs the table's 128 x 176: 420, 128 x 128 with one
# Q_i buffer 456, 128 x 160: 421 (2 Q_i buffers: 429), 128 x 112: 416. Measured at d = 128 only; d = 96 shares its
# rows. Wider windows keep the table's rows (unmeasured: they approach dense attention). The FP8 forward, the same
# way (tools/tune.py --which fwd_fp8 --head-dims 128 --features window,dense, session 23, H200, per-tensor scales):
# 128 x 128 with 2 Q_i buffers 495 vs its table's 128 x 192 x 3 stages: 463 (0.93x bf16's window, now 1.0x), one
# Q_i buffer 494, 3 stages 485, 128 x 192 x 2 stages 462. Measured at d = 128 only.
SHORT_WINDOW_SPAN = 1024
WINDOW_ROWS: dict[tuple[str, int, str], TileConfig] = {
    **{("fa3_fwd_sm90", d, dt): TileConfig(128, 128, 12, stages=2, q_stages=2,
                                           why="463 vs 128x176: 420 (window (1024, 0), N = 16384)")
       for d in (96, 128) for dt in _16BIT},
    ("fa3_fwd_sm90_fp8", 128, FP8): TileConfig(128, 128, 12, stages=2, q_stages=2,
                                               why="495 vs 128x192x3: 463 (FP8, window (1024, 0), N = 16384)"),
}

# Decode calls that pack more than 16 query rows per kv head (the GQA group x seqlen_q: MQA 32 / 1, speculative
# chunks): with the table's 16-row row every 16 rows are a row group of their own, and each row group's CTAs read
# the whole cache again; 32 rows read it once per 32. At d = 128 the 32-row tile took 255 registers and spilled
# 24 B after its key loop until session 23's merge of the CTA's splits (220 registers, no spill, offline).
# tools/tune_decode.py, session 10 (H200, bf16, b 8, N = 32768, MQA 32 / 1,
# d = 128, the model's split counts): 32 x 16, 4 warps, 2 stages 0.0629 ms vs the table's 16 x 16: 0.0727;
# 32 x 16 x 4 with 3 stages 0.0683 - 0.0703, with 2 warps 0.0691; torch-cudnn 0.0557 - 0.0568. Measured at d = 128.
MANY_DECODE_ROWS = 16
MANY_ROWS_DECODE: dict[tuple[str, int, str], TileConfig] = {
    ("decode_split", 128, dt): TileConfig(32, 16, 4, stages=2, why="0.0629 vs 16x16: 0.0727 ms (MQA b 8 N 32768)")
    for dt in _16BIT
}

# Backwards of plain attention over at least LONG_BWD_SEQLEN query rows without a mask, LONG_CAUSAL_BWD_SEQLEN
# causal (FlashAttention-3's non-causal tile at head_dim 128): 80 query rows a step instead of 64, each consumer
# warpgroup computing dQ_i^T for 64 head columns (mainloop_bwd_sm90_ws.cuh's SWAP_DQ), so a step's fixed costs (the
# barriers, L_i / D_i, the dQ_i reduce-add) are spread over 25 % more rows. 231720 B of shared memory. The
# deterministic backward keeps the table's 64 rows (forms.ordered_dq_config: one dQ_i buffer cannot serve its two
# writer warps). Session 15, H200, bf16, d = 128, kernels alone (bench/results/ab-s15-bwd128.json), TFLOP/s of 80
# rows against 64 (both with the uniform warpgroup index), N = 1024 / 2048 / 4096 / 16384: without a mask 379 / 461
# / 520 / 561 against 366 / 441 / 493 / 525; causal 245 / 336 / 416 / 549 against 251 / 339 / 413 / 517 (80 rows
# waste more of the diagonal's blocks on short causal walks). N < 1024 is not measured.
LONG_BWD_SEQLEN = 1024
LONG_CAUSAL_BWD_SEQLEN = 8192
LONG_BWD_ROWS: dict[tuple[str, int, str], TileConfig] = {
    ("fa3_bwd_sm90", d, dt): TileConfig(80, 128, 12, stages=2, why="561/549 vs 64x128: 525/517 (N = 16384)")
    for d in (96, 128) for dt in _16BIT
}

# The rows of a situation (forms.situations names the ones that hold for a call), before the table's.
SITUATION_ROWS: dict[str, dict[tuple[str, int, str], TileConfig]] = {
    "short_causal": SHORT_CAUSAL_ROWS, "short_full": SHORT_FULL_ROWS, "short_window": WINDOW_ROWS,
    "many_decode_rows": MANY_ROWS_DECODE, "long_bwd": LONG_BWD_ROWS,
}

# Instantiations allowed to spill (name expression, arch) -> bytes of spill stores + loads, each with its reason.
# tests/test_compile.py fails if anything else spills, or if one of these stops spilling.
KNOWN_SPILLS: dict[tuple[str, str], int] = {
    # (name expression, arch) -> the bytes of local memory ptxas reports; any other spill fails tests/test_compile.py.
    # float32 (the accuracy path, scalar FMA products): session 18's k loop without unrolling (sm80.cuh's fma_gemm;
    # CI's compile time) ended eight of the nine float32 spills listed here before (the general policy's d = 256
    # forwards, backwards and dQ kernels on sm_80, 16 - 184 B; decode at d = 192 / 256, 48 - 56 B); the ninth, the
    # d = 256 general forward with a window on sm_80, went from 244 to 12 B. (decode at d = 128 on sm_80 spilled
    # 68 B until session 23's merge of the CTA's splits.)
    ("fa2_fwd<float, 256, 64, 16, 4, 1, 1, 2, true, true, true, true, false, 98304>", "sm_80"): 12,
    # FA3's deterministic backward at d = 64 (128 query rows a step, 24 / 240 registers: 40 / 232 spills 148 B in
    # the consumers' general policy): the plain causal one spills the walk's bounds in the producer warpgroup's 24
    # (its dQ writer warps), outside the consumers' products (session 14's SASS). Session 15: the others stopped
    # spilling (the general one with the uniform warpgroup index, the plain one without a mask with the rotated
    # order's 32-bit rank).
    **{(f"fa3_bwd_sm90<{t}, 64, 128, 128, 2, 1, false, true, 199720>", "sm_90"): 40 for t in ("__half", "__nv_bfloat16")},
    # The FP8 forward under a window (the general policy, dynamic schedule): 4 B in the producer warpgroup's 24
    # registers (the walk's bounds), after its setmaxnreg, outside the consumers' key loop (session 22's SASS; the
    # same for WINDOW_ROWS' 128 x 128 row at d = 128, session 23's SASS); with a float16 output at d = 256, 176 B in
    # the consumers (about 11 words of the tile's state, spilled once a tile and a few reloaded a step: session
    # 22's SASS; its speed not measured).
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
                situations: tuple[str, ...] = ()) -> TileConfig:
    """The row for ``kernel`` at the specialised head_dim covering ``head_dim``, for ``dtype`` (a name) on ``arch``;
    ``general``: for the general policy's instantiations (a row's ``general_min_blocks`` then applies);
    ``situations``: names of SITUATION_ROWS that hold for the call (rawflash.kernels.forms.situations decides); the
    first with a row for the key gives it, on the sm_90 family (the rows were measured on the H200; other
    architectures keep their table rows).

    ``override`` (tools/tune.py's candidates) takes precedence over the table, keyed like it.
    """
    key = (kernel, padded_head_dim(head_dim), dtype)
    if override and key in override:
        return override[key]
    if key not in TABLE:
        raise KeyError(f"no tile configuration for kernel={kernel!r}, head_dim={head_dim}, dtype={dtype!r}")
    for name in situations if arch_family(arch) == "sm_90" else ():  # measured on the H200 only
        if key in SITUATION_ROWS[name]:
            return SITUATION_ROWS[name][key]
    row = ARCH_ROWS.get(arch_family(arch), {}).get(key, TABLE[key])
    if general and row.general_min_blocks:
        row = dataclasses.replace(row, min_blocks=row.general_min_blocks)
    return row


def has_row(kernel: str, head_dim: int, dtype: str) -> bool:
    """Whether the table has a row for ``kernel`` at the specialised head_dim covering ``head_dim``."""
    return head_dim <= MAX_HEAD_DIM and (kernel, padded_head_dim(head_dim), dtype) in TABLE
