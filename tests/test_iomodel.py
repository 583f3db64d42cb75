"""Tests of rawflash.cli.iomodel: hand-computed byte counts, causal tile skipping against brute force, rooflines."""
import numpy as np
import pytest

from rawflash.cli import iomodel
from rawflash.cli.iomodel import Shape, flops, io_bytes, roofline, visible_blocks

LENGTHS = [(1, 1), (3, 3), (17, 17), (64, 128), (113, 203), (127, 129), (203, 113), (256, 128), (300, 64)]
TILES = [(16, 16), (16, 32), (32, 16), (64, 64), (7, 5)]


def small(**kw):
    """B=1, N=128, one head, d=64, 2-byte elements: a Q/K/V/O matrix is 128*64*2 = 16384 B."""
    args = dict(batch=1, seqlen_q=128, seqlen_k=128, heads=1, kv_heads=1, head_dim=64, itemsize=2, causal=False)
    return Shape(**{**args, **kw})


def brute_mask(nq, nk, causal):
    """mask[i, j]: query i sees key j (bottom-right aligned)."""
    rows, cols = np.arange(nq)[:, None], np.arange(nk)[None, :]
    return cols <= rows + nk - nq if causal else np.ones((nq, nk), bool)


def brute_tiles(nq, nk, Br, Bc, causal):
    """Computed tiles (i, j): some in-range (query, key) pair of the tile is visible."""
    mask = brute_mask(nq, nk, causal)
    return {(i, j) for i in range(-(-nq // Br)) for j in range(-(-nk // Bc))
            if mask[i * Br:(i + 1) * Br, j * Bc:(j + 1) * Bc].any()}


# ---- FLOPs ----

def test_flops_hand_counts():
    # 4 * B * H * Nq * Nk * d = 4 * 2 * 3 * 128 * 256 * 64; backward 2.5x
    shape = Shape(2, 128, 256, 3, 3, 64)
    assert flops(shape, "fwd") == 4 * 2 * 3 * 128 * 256 * 64 == 50331648
    assert flops(shape, "bwd") == 125829120


@pytest.mark.parametrize("n", [1, 3, 17, 128, 1023])
def test_causal_flops_are_exactly_half_at_equal_lengths(n):
    full, causal = Shape(2, n, n, 4, 2, 64), Shape(2, n, n, 4, 2, 64, causal=True)
    for direction in ("fwd", "bwd"):
        assert 2 * flops(causal, direction) == flops(full, direction)
    # the convention undercounts the diagonal: N(N+1)/2 pairs are really computed
    assert flops(causal, "fwd") == 4 * 2 * 4 * 64 * (n * n / 2) < 4 * 2 * 4 * 64 * n * (n + 1) // 2


def test_causal_flops_count_visible_pairs_when_lengths_differ():
    # Nq=3, Nk=5 (offset 2): rows see 3, 4, 5 keys = 12 pairs; Nq=5, Nk=3 (offset -2): 0, 0, 1, 2, 3 = 6 pairs
    assert flops(Shape(1, 3, 5, 1, 1, 8, causal=True), "fwd") == 4 * 8 * 12
    assert flops(Shape(1, 5, 3, 1, 1, 8, causal=True), "fwd") == 4 * 8 * 6
    assert flops(Shape(1, 5, 3, 1, 1, 8, causal=True), "bwd") == 10 * 8 * 6


@pytest.mark.parametrize("nq,nk", LENGTHS + [(1, 1000), (1000, 1)])
def test_visible_pairs_match_brute_force(nq, nk):
    for causal in (False, True):
        assert iomodel.visible_pairs(nq, nk, causal) == brute_mask(nq, nk, causal).sum()


# ---- causal tile skipping ----

def test_visible_blocks_hand_counts():
    # square 256, 64x64 tiles: Q block i visits K blocks 0..i -> 1+2+3+4 = 10 of 16
    assert visible_blocks(256, 256, 64, 64, True) == (10, 6)
    # Nq=128 < Nk=256 (offset 128): Q block 0 (rows <= 63) sees keys <= 191 -> K blocks 0,1,2; block 1 all 4
    assert visible_blocks(128, 256, 64, 64, True) == (7, 1)
    # Nq=256 > Nk=128 (offset -128): Q blocks 0,1 see nothing; block 2 sees keys <= 63, block 3 keys <= 127
    assert visible_blocks(256, 128, 64, 64, True) == (3, 5)
    assert visible_blocks(256, 128, 64, 64, False) == (8, 0)


@pytest.mark.parametrize("nq,nk", LENGTHS)
@pytest.mark.parametrize("Br,Bc", TILES)
@pytest.mark.parametrize("causal", [False, True])
def test_tiles_match_brute_force(nq, nk, Br, Bc, causal):
    expected = brute_tiles(nq, nk, Br, Bc, causal)
    n_tiles = -(-nq // Br) * -(-nk // Bc)
    assert visible_blocks(nq, nk, Br, Bc, causal) == (len(expected), n_tiles - len(expected))
    per_q = iomodel.visited_k_blocks(nq, nk, Br, Bc, causal)
    per_k = iomodel.visited_q_blocks(nq, nk, Br, Bc, causal)
    assert {(i, j) for i, ks in enumerate(per_q) for j in ks} == expected
    assert {(i, j) for j, qs in enumerate(per_k) for i in qs} == expected


@pytest.mark.parametrize("nq,nk", LENGTHS)
@pytest.mark.parametrize("Br,Bc", TILES)
def test_rows_moved_by_tiles_match_brute_force(nq, nk, Br, Bc):
    tiles = brute_tiles(nq, nk, Br, Bc, True)
    k_rows = lambda j: min(Bc, nk - j * Bc)  # in-range rows of K block j
    q_rows = lambda i: min(Br, nq - i * Br)
    counts = iomodel.tile_counts(nq, nk, Br, Bc, True)
    assert counts.k_rows_in_tiles == sum(k_rows(j) for _, j in tiles)
    assert counts.q_rows_in_tiles == sum(q_rows(i) for i, _ in tiles)
    assert counts.q_rows_loaded == sum(q_rows(i) for i in {i for i, _ in tiles})
    assert counts.k_rows_loaded == sum(k_rows(j) for j in {j for _, j in tiles})


# ---- hand-computed bytes, B=1 H=1 N=128 d=64 itemsize 2, tiles 64x64 (Tr = Tc = 2, 4 tiles) ----
# Let M = 128*64*2 = 16384 (one Q/K/V/O matrix), F = 128*64*4 = 32768 (one float32 matrix),
# S = 128*128*2 = 32768 (one score matrix), r = 128*4 = 512 (one float32 value per row).

def test_naive_fwd_bytes():
    report = io_bytes("naive", "fwd", small())
    # read: Q, K (2M) + S (S) + P (S) + V (M) = 3*16384 + 2*32768 = 114688
    # write: S + P (2S) + lse (r) + O (M) = 65536 + 512 + 16384 = 82432
    assert (report.read_bytes, report.write_bytes, report.total_bytes) == (114688, 82432, 197120)
    assert io_bytes("naive", "fwd", small(causal=True)).total_bytes == 197120  # masks in the softmax


def test_naive_bwd_bytes():
    report = io_bytes("naive", "bwd", small())
    # read: dV (S + M) + dP (2M) + dS (2S) + dQ (S + M) + dK (S + M) = 5S + 5M = 163840 + 81920 = 245760
    # write: dV (M) + dP (S) + dS (S) + dQ (M) + dK (M) = 3M + 2S = 49152 + 65536 = 114688
    assert (report.read_bytes, report.write_bytes) == (245760, 114688)
    assert report.breakdown["dS = P*(dP - D): P, dP read"] == 65536


def test_fa1_fwd_bytes():
    report = io_bytes("fa1", "fwd", small(), Br=64, Bc=64)
    # 4 tiles of 64 rows: 256 Q rows over tiles. O,l,m state per row: 64*4 + 8 = 264 B.
    # init: F + 2r = 33792 written; K,V once: 2M = 32768 read; Q per tile: 256*128 = 32768 read;
    # O,l,m per tile: 256*264 = 67584 read and 67584 written; O convert: F read, M written; lse: 2r read, r written
    assert report.breakdown["O_i,l_i,m_i read per K block (float32)"] == 67584
    assert report.read_bytes == 32768 + 32768 + 67584 + 32768 + 1024 == 166912
    assert report.write_bytes == 33792 + 67584 + 16384 + 512 == 118272


def test_fa1_bwd_bytes():
    report = io_bytes("fa1", "bwd", small(), Br=64, Bc=64)
    # dQ init F written; K,V 2M read; Q,O,dO per tile 256*128*3 = 98304; l,m per tile 256*8 = 2048;
    # dQ per tile 256*256 = 65536 read and written; dK,dV 2M written; dQ convert F read, M written
    assert report.read_bytes == 32768 + 98304 + 2048 + 65536 + 32768 == 231424
    assert report.write_bytes == 32768 + 65536 + 32768 + 16384 == 147456


def test_fa2_fwd_bytes():
    report = io_bytes("fa2", "fwd", small(), Br=64, Bc=64)
    # Q once (M); K,V per tile: 2 Q blocks * 128 rows * 128 B * 2 = 65536; O once (M); LSE once (r)
    assert report.breakdown == {"Q read once": 16384, "K,V re-read per Q block": 65536,
                                "O written once": 16384, "LSE written once (float32)": 512}
    assert (report.read_bytes, report.write_bytes) == (81920, 16896)
    assert report.flops == 4 * 128 * 128 * 64 and report.intensity == pytest.approx(4194304 / 98816)


def test_fa2_bwd_bytes():
    report = io_bytes("fa2", "bwd", small(), Br=64, Bc=64)
    # D pass: O, dO (2M) read, D (r) written; dQ zero-fill F written; K,V once per CTA 2M read;
    # Q,dO per tile 256*128*2 = 65536; L,D per tile 256*8 = 2048; dQ atomics 256*256 = 65536 read + written;
    # dK,dV 2M written; dQ convert F read, M written
    assert report.read_bytes == 32768 + 32768 + 65536 + 2048 + 65536 + 32768 == 231424
    assert report.write_bytes == 512 + 32768 + 65536 + 32768 + 16384 == 147968


def test_fa2_fwd_causal_bytes():
    # square 256, d=64, 64x64 tiles: Q blocks visit 1,2,3,4 K blocks -> 640 K rows; K,V 640*128*2 = 163840
    report = io_bytes("fa2", "fwd", small(seqlen_q=256, seqlen_k=256, causal=True), Br=64, Bc=64)
    assert report.breakdown["K,V re-read per Q block"] == 163840
    assert report.total_bytes == 32768 + 163840 + 32768 + 1024
    # Nq=256 > Nk=128: Q blocks 0,1 visit nothing and are not read; blocks 2,3 visit 1 and 2 K blocks
    report = io_bytes("fa2", "fwd", small(seqlen_q=256, causal=True), Br=64, Bc=64)
    assert report.breakdown["Q read once"] == 128 * 128
    assert report.breakdown["K,V re-read per Q block"] == (64 + 128) * 128 * 2
    assert report.breakdown["O written once"] == 256 * 128  # rows that see no key still get O = 0


def test_ragged_tiles_move_only_in_range_rows():
    # Nq=Nk=100, tiles 64x64: K blocks have 64 and 36 rows, read by both Q blocks: 2*100 rows of K and of V
    report = io_bytes("fa2", "fwd", small(seqlen_q=100, seqlen_k=100), Br=64, Bc=64)
    assert report.breakdown["K,V re-read per Q block"] == 2 * 2 * 100 * 128


# ---- comparisons ----

def test_fa2_fwd_far_below_naive_at_4096():
    shape = Shape(1, 4096, 4096, 16, 16, 64)
    naive, fa2 = io_bytes("naive", "fwd", shape), io_bytes("fa2", "fwd", shape, Br=128, Bc=64)
    # naive's O(N^2) traffic: S written, S read, P written, P read = 4 * H * N^2 * 2 B
    score_terms = ["S = QK^T: S written", "softmax: S read", "softmax: P written", "O = PV: P read"]
    assert sum(naive.breakdown[k] for k in score_terms) == 4 * 16 * 4096 ** 2 * 2
    # fa2 re-reads K,V once per Q block: 2 * H * (N / Br) * N * d * 2 B, d/Br = 1/2 of an N^2 matrix per K,V
    assert fa2.breakdown["K,V re-read per Q block"] == 2 * 16 * 32 * 4096 * 64 * 2
    assert fa2.total_bytes * 3.5 < naive.total_bytes
    assert fa2.intensity > 3.5 * naive.intensity


SHAPES = [Shape(2, 1024, 1024, 4, 4, 64), Shape(2, 1024, 1024, 4, 4, 128, causal=True),
          Shape(1, 1000, 1500, 4, 4, 64, causal=True), Shape(1, 1500, 1000, 4, 4, 96, itemsize=4, causal=True)]


@pytest.mark.parametrize("shape", SHAPES)
def test_fa1_moves_more_than_fa2_for_the_same_tiles(shape):
    # Per computed tile fa1 fwd moves Q_i, O_i (float32, read + written), l_i, m_i: Br * (d * (itemsize + 8) + 16) B;
    # fa2 fwd moves K_j, V_j: Bc * 2 * d * itemsize B. So fa1 moves more whenever Bc < 1.5 Br (float32), as here.
    # bwd: fa1's extra O_i read per tile outweighs fa2's D pass (O, dO read once) once a Q row visits more
    # than about 2 K blocks on average (here at least 8).
    for Br, Bc in [(64, 64), (128, 64), (128, 128)]:
        for direction in ("fwd", "bwd"):
            fa1, fa2 = (io_bytes(k, direction, shape, Br=Br, Bc=Bc) for k in ("fa1", "fa2"))
            assert fa1.total_bytes > fa2.total_bytes
            assert fa1.flops == fa2.flops


def test_causal_skipping_lowers_fa_bytes_but_not_naive():
    full, causal = Shape(1, 2048, 2048, 2, 2, 64), Shape(1, 2048, 2048, 2, 2, 64, causal=True)
    for kernel in ("fa1", "fa2"):
        for direction in ("fwd", "bwd"):
            assert (io_bytes(kernel, direction, causal, Br=64, Bc=64).total_bytes
                    < io_bytes(kernel, direction, full, Br=64, Bc=64).total_bytes)
    assert io_bytes("naive", "bwd", causal).total_bytes == io_bytes("naive", "bwd", full).total_bytes


# ---- GQA ----

def test_gqa_fa2_fwd_loads_kv_per_query_head():
    mha, gqa = small(heads=8, kv_heads=8), small(heads=8, kv_heads=2)
    assert io_bytes("fa2", "fwd", gqa, Br=64, Bc=64).breakdown == io_bytes("fa2", "fwd", mha, Br=64, Bc=64).breakdown


def test_gqa_fa2_bwd_reads_kv_once_per_kv_head():
    mha = io_bytes("fa2", "bwd", small(heads=8, kv_heads=8), Br=64, Bc=64).breakdown
    gqa = io_bytes("fa2", "bwd", small(heads=8, kv_heads=2), Br=64, Bc=64).breakdown
    # K,V read and dK,dV written once per (kv head, K block): 2 kv heads * 2 * M = 65536 each
    assert gqa["K_j,V_j read once per CTA"] == gqa["dK,dV written once"] == 2 * 2 * 16384
    assert mha["K_j,V_j read once per CTA"] == 4 * gqa["K_j,V_j read once per CTA"]
    per_query_head = [k for k in mha if "K_j" not in k and "dK" not in k]
    assert {k: gqa[k] for k in per_query_head} == {k: mha[k] for k in per_query_head}


def test_gqa_naive_and_fa1_bwd_sum_the_group():
    # MQA, 4 query heads: read 4 heads * (dK + dV) = 4 * 2M = 131072, write 1 head * 2M = 32768
    for kernel in ("naive", "fa1"):
        mqa = io_bytes(kernel, "bwd", small(heads=4, kv_heads=1), Br=64, Bc=64)
        mha = io_bytes(kernel, "bwd", small(heads=4, kv_heads=4), Br=64, Bc=64)
        assert mqa.breakdown["dK,dV summed over query heads (GQA)"] == 131072 + 32768
        assert mqa.total_bytes == mha.total_bytes + 131072 + 32768


# ---- roofline ----

def test_roofline_arithmetic():
    report = io_bytes("fa2", "fwd", Shape(4, 2048, 2048, 16, 16, 128), Br=128, Bc=64)
    result = roofline(report, "H200", "bfloat16")
    assert result["compute_ms"] == pytest.approx(report.flops / 751e12 * 1e3)
    assert result["memory_ms"] == pytest.approx(report.total_bytes / 4.26e12 * 1e3)
    assert result["bound_ms"] == max(result["compute_ms"], result["memory_ms"])
    assert result["limiter"] == ("compute" if result["compute_ms"] >= result["memory_ms"] else "memory")
    assert roofline(report, iomodel.GPUS["H200-datasheet"], np.float16)["compute_ms"] == pytest.approx(
        report.flops / 989e12 * 1e3)


def test_roofline_limiter_switches_as_n_grows():
    # float32 on the FMA peak (A100: 19.5 TFLOP/s / 2.039 TB/s = 9.6 FLOP/B): at N=16 fa2 does 4*16*16*64 FLOPs
    # over 16*256*4 + 64 B (intensity 4.0, memory); at N=4096 intensity is about 31 (compute)
    limiters = [roofline(io_bytes("fa2", "fwd", Shape(1, n, n, 1, 1, 64, itemsize=4), Br=64, Bc=64),
                         "A100-80GB-SXM", "float32")["limiter"] for n in [16, 32, 64, 128, 1024, 4096]]
    assert limiters[0] == "memory" and limiters[-1] == "compute"
    switch = limiters.index("compute")
    assert limiters[switch:] == ["compute"] * (len(limiters) - switch)


def test_bf16_fa2_intensity_approaches_2_br_over_itemsize():
    # K,V re-read per Q block dominates: intensity -> 4 N^2 d / (2 (N / Br) N d * 2) = Br = 128 FLOP/B,
    # below the H200 ridge (751 / 4.26 = 176): without L2 reuse the paper's model calls FA2 memory-bound
    reports = [io_bytes("fa2", "fwd", Shape(16384 // n, n, n, 16, 16, 128), Br=128, Bc=64)
               for n in [512, 1024, 2048, 4096, 8192, 16384]]
    intensities = [r.intensity for r in reports]
    assert intensities == sorted(intensities) and 0.99 * 128 < intensities[-1] < 128
    assert {roofline(r, "H200", "bfloat16")["limiter"] for r in reports} == {"memory"}
    assert roofline(reports[-1], "H200", "bfloat16")["tflops"] == pytest.approx(4.26 * intensities[-1])


# ---- validation ----

def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="kv_heads"):
        Shape(1, 8, 8, 6, 4, 64)
    with pytest.raises(ValueError, match="itemsize"):
        Shape(1, 8, 8, 4, 4, 64, itemsize=8)
    with pytest.raises(ValueError, match="Br and Bc"):
        io_bytes("fa2", "fwd", small())
    with pytest.raises(ValueError, match="kernel"):
        io_bytes("fa3", "fwd", small(), Br=64, Bc=64)
    with pytest.raises(ValueError, match="direction"):
        flops(small(), "both")
    with pytest.raises(ValueError, match="head_dim_v"):
        Shape(1, 8, 8, 4, 4, 64, head_dim_v=0)
    with pytest.raises(ValueError, match="one head_dim for kernel 'fa1'"):  # (fa2's model counts v's own)
        io_bytes("fa1", "fwd", small(head_dim_v=32), Br=64, Bc=64)
    assert io_bytes("naive", "fwd", small(head_dim_v=small().head_dim)).flops == flops(small(), "fwd")
    with pytest.raises(ValueError, match="itemsize 2"):
        roofline(io_bytes("naive", "fwd", small()), "H200", "float32")


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_fa2_counts_v_out_dout_and_dv_at_v_s_head_dim(direction):
    """MLA (v narrower than q): fa2's terms that move V, O, dO or dV shrink by dv / d, the others stay; with
    dv == d the model is the one-head_dim model."""
    d, dv = 192, 128
    full = io_bytes("fa2", direction, Shape(2, 512, 512, 8, 8, d, causal=True), Br=128, Bc=128)
    mla = io_bytes("fa2", direction, Shape(2, 512, 512, 8, 8, d, causal=True, head_dim_v=dv), Br=128, Bc=128)
    same = io_bytes("fa2", direction, Shape(2, 512, 512, 8, 8, d, causal=True, head_dim_v=d), Br=128, Bc=128)
    assert same.breakdown == full.breakdown
    for name, nbytes in full.breakdown.items():
        moves_v = any(x in name for x in ("V", "O written", "dO", "dV"))
        if name.startswith("K,V") or name.startswith("K_j,V_j") or name.startswith("Q_i,dO_i") \
                or name.startswith("dK,dV"):  # one of two equal halves takes v's width
            assert mla.breakdown[name] == nbytes * (d + dv) // (2 * d), name
        elif moves_v and "rowsum" not in name:
            assert mla.breakdown[name] == nbytes * dv // d, name
        elif "rowsum" in name:  # O and dO read at dv, D written in float32
            assert mla.breakdown[name] < nbytes, name
        else:
            assert mla.breakdown[name] == nbytes, name
    assert mla.flops == flops(Shape(2, 512, 512, 8, 8, d, causal=True, head_dim_v=dv), direction) < full.flops
