// mainloop_bwd_sm90_ws_split_d: FA2's backward mainloop (Alg.2 l.6-16, atomic dQ) with FlashAttention-3's warp
// specialisation at head_dim 192 and 256 (float16 / bfloat16, sm_90a), the column-split sibling of
// mainloop_bwd_sm90_ws (which keeps dK, dV of 64 keys x D in one warpgroup's registers: at D = 256 that is 128
// floats each, more than a consumer has beside S^T and dP^T). No Numba twin: mainloop_bwd_sm80's twin computes the
// same results.
//
// A CTA owns key block K_j, V_j (BC = 64 keys) of one kv head; mainloop_bwd_sm90_ws's producer (bwd_ws_produce)
// streams Q_i, dO_i, L_i, D_i of every (query head, query block) that sees K_j into a ring of STAGES stages. Its
// two consumer warpgroups share all 64 keys and split the work twice:
// - by queries for the scores: warpgroup w forms S^T = K_j Q_w^T and dP^T = V_j dO_w^T for its 32 queries 32w..
//   (wgmma M = 64 keys, N = 32, K = D), then P^T and dS^T through the policy exactly as mainloop_bwd_sm90_ws, and
//   writes both in 16-bit to shared memory (double-buffered by step parity, so a step's tiles cannot overwrite the
//   ones its neighbour is still reading); one named barrier per step joins the two halves;
// - by columns for the products: warpgroup w accumulates its half of the columns of dV_j += P^T dO_i and
//   dK_j += dS^T Q_i over all 64 queries (M = 64 keys, N = D / 2, K = 64, A = P^T / dS^T from shared memory) and
//   computes part of dQ_i = dS K_j (M = 64 queries, K = 64 keys), added into the float32 dQ rows while dK_j runs
//   (summed with the cluster partner's first: PAIR below).
// Registers of a consumer thread at D = 256: dK, dV halves 64 + 64, S^T and dP^T 16 + 16 or dQ_i's half 64.
// A half is cut at 64-column panels (an operand starting inside a 128-byte-swizzle panel must end there): at
// D = 256 one 128-column slice, at D = 192 a 64-column panel and a 32-column half panel (WIDE, NARROW), warpgroup
// 0 taking columns 0..63 and 64..95, warpgroup 1 128..191 and 96..127.
// deterministic=True runs fa2_bwd + fa2_bwd_dq at these head dims (forms.py): this mainloop has no ordered dQ.
// DV < D (the DV form, MLA's narrower v: configs.VALUE_ROWS, 192 / 128): V_j, dO_i and dV_j have DV columns, so
// dP^T = V_j dO_w^T reduces over DV columns and each warpgroup accumulates half of dV_j's DV columns (cut like D's:
// at DV = 128 one 64-column panel each, WIDE_V, no half panel), while S^T, dK_j and dQ_i keep D; V's tile and
// dO_i's stage hold DV columns.
//
// PAIR (D = 192 and 256, every policy; packed sequences cut into pairs of key tiles by KTileScheduler): at these
// head dims the additions of dQ_i bound the kernel (without them it runs 1.4 - 1.65x faster, bench/NOTES.md;
// `red.global.add.v4.f32` takes 1.8 - 2.4 TB/s on the H200, tools/l2_reduce.py). Two CTAs on neighbouring key
// blocks j, j' = j ^ 1 of one kv head run as a cluster and walk the same steps (the query blocks that see either
// block), so their dQ_i = dS_ij K_j + dS_ij' K_j' can be summed before it is added. At D = 256 CTA rank r owns
// dQ_i's columns 128 r.., warpgroup w the panel 128 r + 64 w..; at D = 192 CTA 0 computes the panels 0, 1 and CTA
// 1 the panels 1, 2 (one panel a warpgroup, so every operand is panel aligned), and each adds half of the shared
// panel 1 (pair_dq_lo / pair_dq_hi: a window of its 8-column groups): 96 columns a CTA. Each CTA keeps 128 of
// the partner's K_j' columns (kx(), 16 KB, copied once with K_j: its half at D = 256, columns 0..127 or 64..191 at
// D = 192) and receives the partner's dS^T every step (dsx(), 8 KB, a bulk copy from the partner's shared memory
// into this one's, completing on this CTA's barrier xfull), so it adds half the floats a step. The room for kx()
// and two dsx() (32 KB at D = 256) is dO_i's: one stage of its own (BwdWsSmem's DO_RING), released right after
// dV_j's product. It also leaves room for a float32 tile per consumer warpgroup: the warpgroup stores its dQ_i
// panel there (stage_dq_rows, the dq map's layout) and one thread adds the panel's 32-column boxes of its window
// by TMA reduce-add instead of vector atomics (cp.reduce.async.bulk). At D = 192 the tile is 64 x 64 (223320 B in
// all; 1.08 - 1.17x over the atomics); at D = 256 (TIGHT) one P^T buffer and one dsx() instead of two each free
// 16 KB for a 64 x 32 tile, and the panel goes out in two halves: the first at once, the second (held in
// registers, dqb) under the next step's S^T and dP^T products, once the first half's add has read the tile
// (add_dq_second_half; 231496 B; over the atomics 1.04 - 1.07x with both halves in one step and a further 1.05 -
// 1.10x with the second half under the next step; figures in bench/NOTES.md).
// Each step then runs dV_j (release dO_i), dQ_i (release the partner's dS^T on its barrier xfree, add dQ_i while
// dK_j runs), dK_j (release Q_i). A CTA writes its dS^T of step it (ds(it), and the copy into the partner's
// dsx(it)) only once the partner has read the one of step it - DSX_BUFS (it - 2 at D = 192, it - 1 at D = 256,
// where P^T's one buffer also waits, on the named barrier PT_FREE, for the other warpgroup's dV_j product of step
// it - 1; xfree: 8 warp arrivals from the partner), which also means that copy has landed. The partner of an odd
// count's last key block walks with it past the keys (all its keys masked). Each CTA copies its own Q_i, dO_i:
// one copy for both CTAs by TMA multicast is 0 - 3.5 % slower (bench/NOTES.md).
#pragma once
#include "mainloop_bwd_sm90_ws.cuh"

namespace rf {

template <typename T_, int D, int BR_, int BC_, int STAGES, class Pol_, int DV = D> struct MainloopBwdSm90WsSplitD {
  using T = T_;
  using Pol = Pol_;
  static constexpr bool DET = false;
  // (every head dim of the column split runs in pairs; packed sequences: KTileScheduler keeps a pair in one sequence)
  static constexpr bool PAIR = true;
  static_assert(D == 192 || D == 256, "the column split runs head_dim 192 and 256 (launch.fa3_bwd_sm90 checks it)");
  // PAIR at D = 192: CTA 0 owns dQ_i's columns 0..95 (warpgroup 0 a panel, 1 a half panel), CTA 1 96..191 (a half
  // panel, a panel); its kx() holds the partner's columns 0..127 or 64..191. At D = 256 each quarter is a panel.
  // dO_i in one stage of its own (the head comment); the dQ_i panels by TMA reduce-add from a float32 tile
  // per warpgroup (cp.reduce.async.bulk: 1.45 - 1.6x the atomics' rate into L2, tools/l2_reduce.py). At D = 256
  // (TIGHT) one P^T buffer and one dsx() instead of two each make room for a 64 x 32 float32 tile per warpgroup,
  // through which its panel goes out in two halves.
  static constexpr bool TIGHT = D == 256;
  static constexpr int PT_BUFS = TIGHT ? 1 : 2, DSX_BUFS = TIGHT ? 1 : 2;  // (powers of two: indexed by it & (N - 1))
  static constexpr int DQ_BOXES = TIGHT ? 1 : 2;  // 32-column boxes a warpgroup's tile holds
  static constexpr int DQ_PANEL = 64 * 128, DQ_TILE = DQ_BOXES * DQ_PANEL;  // 64 rows x 32 floats a box
  using Walk = QIter;
  static constexpr int BR = BR_, BC = BC_, NWG = 2, NTHREADS = (NWG + 1) * 128;
  static constexpr int QW = BR_ / NWG, NQ = QW / 8;           // a warpgroup's queries of S^T, dP^T
  static constexpr int DW = D / NWG, WIDE = DW / 64 * 64, NARROW = DW - WIDE;  // a warpgroup's columns of dK_j
  static constexpr int DVW = DV / NWG, WIDE_V = DVW / 64 * 64, NARROW_V = DVW - WIDE_V;  // ... and of dV_j
  static constexpr int PS = BC_ * BR_ * 2;
  static constexpr int KX = BC_ * 128 * 2;  // the partner's K_j' columns around this CTA's dQ_i half
  // BwdWsSmem's map with PT_BUFS x P^T, 2 x dS^T, DSX_BUFS x the partner's dS^T, kx() and the dQ_i tiles as its
  // middle, dO_i in one stage of its own, and the barriers xfull, xfree (DSX_BUFS each)
  static constexpr int TILES = PT_BUFS + 2 + DSX_BUFS;  // P^T, dS^T, the partner's dS^T
  using Map = BwdWsSmem<T_, D, DV, BR_, BC_, STAGES, NWG, TILES * PS + KX + NWG * DQ_TILE, 1, 2 * DSX_BUFS>;
  static constexpr int SMEM_BYTES = Map::BYTES;
  // dK, dV ((D + DV) / 2 floats a thread in all) and dQ_i's half (D / 4) or S^T, dP^T (16 + 16): the consumers take
  // 240, the producer (one warp issuing copies, 32 lanes storing L_i, D_i) keeps 24, FA3's split for two consumer
  // warpgroups.
  static constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;
  static constexpr int PS_BARRIER = 1;  // named barrier of the consumer warpgroups: every P^T, dS^T is in shared memory
  static constexpr int DQ_BARRIER = 2;  // + w, warpgroup w's dQ_i tile is in shared memory
  static constexpr int PT_FREE = 4;     // TIGHT: + w, warpgroup w's dV_j product has read P^T (d = 128's DS_FREE)
  static_assert(BR_ == 64 && BC_ == 64 && D % 64 == 0, "64 keys shared by two warpgroups; dQ_i is one 64-row wgmma");
  static_assert(NARROW == 0 || NARROW == 32, "a warpgroup's columns: whole panels, or whole panels and a half panel");
  static_assert(WIDE_V > 0 && (NARROW_V == 0 || NARROW_V == 32), "dV_j's columns likewise, at least a panel each");
  static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * 128 * NWG <= launch_regs(NTHREADS) * NTHREADS,
                "setmaxnreg moves registers within the launch's pool");

  // The column slices of warpgroup w: WIDE columns from wide0 (whole panels), NARROW from narrow0 (a half panel);
  // dV_j's of DV columns: WIDE_V from wide0v, NARROW_V from narrow0v.
  __device__ __forceinline__ static int wide0(int w) { return w ? D - WIDE : 0; }
  __device__ __forceinline__ static int narrow0(int w) { return w ? DW : WIDE; }
  __device__ __forceinline__ static int wide0v(int w) { return w ? DV - WIDE_V : 0; }
  __device__ __forceinline__ static int narrow0v(int w) { return w ? DVW : WIDE_V; }

  struct State {
    Acc<1, WIDE / 8> dk;
    Acc<1, WIDE_V / 8> dv;
    Acc<1, NARROW ? NARROW / 8 : 1> dk2;  // (NARROW = 0: never touched, so never allocated)
    Acc<1, NARROW_V ? NARROW_V / 8 : 1> dv2;
  };
  struct Smem : Map {
    static constexpr int KX = MainloopBwdSm90WsSplitD::KX;  // (bwd_ws_produce copies kx() with K_j)
    __device__ __forceinline__ explicit Smem(char* smem) : Map(smem) {}
    // P^T and dS^T of step it: keys x queries, K-major for dK, dV (A operand) and MN-major for dQ_i
    __device__ __forceinline__ Sw128<T, BC_, BR_> pt(int it) const { return {this->mid() + (it & (PT_BUFS - 1)) * PS}; }
    __device__ __forceinline__ Sw128<T, BC_, BR_> ds(int it) const {
      return {this->mid() + (PT_BUFS + (it & 1)) * PS};
    }
    // the partner's dS^T of step it; its K_j' columns kx_col0().. (keys x 128)
    __device__ __forceinline__ Sw128<T, BC_, BR_> dsx(int it) const {
      return {this->mid() + (PT_BUFS + 2 + (it & (DSX_BUFS - 1))) * PS};
    }
    __device__ __forceinline__ Sw128<T, BC_, 128> kx() const { return {this->mid() + TILES * PS}; }
    // warpgroup w's float32 dQ_i tile (stage_dq_rows' layout)
    __device__ __forceinline__ u32 dq_tile(int w) const { return this->mid() + TILES * PS + KX + w * DQ_TILE; }
    __device__ __forceinline__ static int kx_col0() { return (int)cluster_rank() * (D == 256 ? 128 : 64); }
    // (DSX_BUFS of each: phase it / DSX_BUFS of xfull(it) is the partner's copy of step it, of xfree(it) its read)
    __device__ __forceinline__ u32 xfull(int it) const { return this->extra(it & (DSX_BUFS - 1)); }
    __device__ __forceinline__ u32 xfree(int it) const { return this->extra(DSX_BUFS + (it & (DSX_BUFS - 1))); }
    __device__ __forceinline__ void init() const {
      for (int b = 0; b < DSX_BUFS; ++b) {
        mbar_init(xfull(b), 1);        // the partner's expect_tx, then its copy's bytes
        mbar_init(xfree(b), NWG * 4);  // one arrival per consumer warp of the partner
      }
      Map::init();
    }
  };

  __device__ __forceinline__ static bool is_producer() { return warpgroup_id() == NWG; }
  __device__ __forceinline__ static int key_row() { return 16 * warp_in_group(); }

  // ---------------------------------------------------------------- producer (mainloop_bwd_sm90_ws's)
  __device__ __forceinline__ static bool producer_start(const TmaBwd& tma) {
    return bwd_ws_producer_start<PRODUCER_REGS, 4 * NWG>(tma);
  }
  __device__ __forceinline__ static void produce(const BwdParams& p, const TmaBwd& tma, const typename Pol::Info& bi,
                                                 int k0, const Walk& walk, const Smem& sm) {
    bwd_ws_produce<T, D, BR, BC, STAGES, Pol>(p, tma, bi, k0, walk, sm);
  }
  // no ordered dQ (DET is false): the skeleton never calls these
  __device__ __forceinline__ static bool is_dq_writer() { return false; }
  __device__ __forceinline__ static void write_dq(const BwdParams&, const TmaBwd&, const typename Pol::Info&,
                                                  const Pol&, int, const Walk&, const Smem&) {}

  // ---------------------------------------------------------------- consumers
  __device__ __forceinline__ static void consumer_start() { regs_claim<CONSUMER_REGS>(); }

  // P = dS = 0 on rows past the sequence: the copies may have read a packed neighbour's rows (not zeros)
  __device__ __forceinline__ static void zero_rows_past(const typename Pol::Info& bh, Acc<1, NQ>& sc, Acc<1, NQ>& dp,
                                                        int q0, int wq) {
    if (q0 + BR > bh.seqlen_q) {
      const int nq = bh.seqlen_q - q0 - wq;
      for_each2(sc, dp, [&](float& x, float& y, int, int col) {
        if (col >= nq) x = y = 0.f;
      });
    }
  }

  // The panel of dQ_i's columns warpgroup w of the pair's CTA `rank` computes, and which of its 8-column groups
  // [lo, hi) it adds: D = 256 a whole panel each; D = 192 panels 0, 1 (CTA 0) and 1, 2 (CTA 1), the shared panel 1
  // added half by each (its other half computed for nothing: the price of panel-aligned operands).
  __device__ __forceinline__ static int pair_dq_panel(int rank, int w) {
    return D == 256 ? 128 * rank + 64 * w : 64 * (rank + w);
  }
  __device__ __forceinline__ static int pair_dq_lo(int rank, int w) { return D == 192 && rank == 1 && w == 0 ? 4 : 0; }
  __device__ __forceinline__ static int pair_dq_hi(int rank, int w) { return D == 192 && rank == 0 && w == 1 ? 4 : 8; }

  // TIGHT: the second half (columns 32..63) of a step's dQ_i panel, held in registers (dqb) since its first half
  // went out, into the one-box tile and added at the rows `row`: once the first half's add has read the tile.
  __device__ __forceinline__ static void add_dq_second_half(const BwdParams& p, const TmaBwd& tma, const Smem& sm,
                                                            int w, const Acc<1, 4>& dqb, int cq, int row) {
    if ((threadIdx.x & 127) == 0) bulk_wait_read<0>();
    named_sync(DQ_BARRIER + w, 128);
    stage_dq_rows<DQ_PANEL, 0, 4>(sm.dq_tile(w), dqb, p.scale);
    fence_async_smem();
    named_sync(DQ_BARRIER + w, 128);
    if ((threadIdx.x & 127) == 0) {
      tma_reduce_add_2d(tma.dq, sm.dq_tile(w), cq + 32, row);
      bulk_commit();
    }
  }

  // PAIR (the head comment): the walk of the pair. Each step's scores and probabilities split by queries; then
  // this CTA's dS^T goes to the partner, and warpgroup w's columns cq.. of dQ_i are dS_ij K_j + dS_ij' K_j'.
  __device__ __forceinline__ static void consume(const BwdParams& p, const TmaBwd& tma, const typename Pol::Info& bi,
                                                 Pol& pol, int k0, const Walk& walk, const Smem& sm, State& st) {
    const int w = uniform_warpgroup_id(), wq = QW * w, wk = key_row(), cw = wide0(w), cn = narrow0(w);
    // dV_j's columns (DV = D: cw, cn themselves; computing the same columns again changes ptxas's key loop, as
    // tools/sass_loops.py shows)
    const int cwv = DV == D ? cw : wide0v(w), cnv = DV == D ? cn : narrow0v(w);
    const int rank = (int)cluster_rank();
    const u32 other = rank ^ 1;
    const int cq = pair_dq_panel(rank, w), cx = cq - Smem::kx_col0();  // in dQ_i / K_j, and in kx()
    const int jlo = pair_dq_lo(rank, w), jhi = pair_dq_hi(rank, w);
    const auto sK = sm.k();
    const auto sV = sm.v();
    const auto sKx = sm.kx();
    typename Pol::Info bh = bi;
    // ---- [mainloop_bwd_sm90_ws_split_d:pair_init] dK_j = dV_j = 0; K_j, V_j and kx() have landed ----
    zero(st.dk);
    zero(st.dv);
    if constexpr (NARROW > 0) zero(st.dk2);
    if constexpr (NARROW_V > 0) zero(st.dv2);
    if (walk.total > 0) mbar_wait(sm.kv_full(), 0);
    Acc<1, 4> dqb;      // TIGHT: the second half of the last step's dQ_i panel, added under the next step's scores
    int dqb_row = 0;    // its first row in the float32 dQ rows
    PipeState<STAGES> pipe;
#pragma unroll 1
    for (int it = 0; it < walk.total; ++it, pipe.advance()) {
      // use: the buffer of dsx(it), xfull, xfree
      const int q0 = walk.block(it) * BR, s = pipe.stage(), use = (it >> (DSX_BUFS - 1)) & 1;
      const auto sdO = sm.dout(0);
      const bool edge = walk.edge(it);
      bh.set_head(p, walk.head(it));
      if constexpr (Pol::GENERAL) pol.set_head(p, bh);
      const auto sQ = sm.q(s);
      const auto sP = sm.pt(it), sdS = sm.ds(it), sdSx = sm.dsx(it);
      // ---- [mainloop_bwd_sm90_ws_split_d:pair_scores] S^T = K_j Q_w^T, dP^T = V_j dO_w^T; P^T, dS^T ----
      mbar_wait(sm.full(s), pipe.parity());
      Acc<1, NQ> sc, dp;
      wgmma_fence();
      wg_gemm_abt(sc, sK, 0, sQ, wq, false);
      wgmma_commit();
      mbar_wait(sm.do_full(0), it & 1);  // (dO_i's one stage lands after Q_i's)
      wgmma_fence();
      wg_gemm_abt(dp, sV, 0, sdO, wq, false);
      wgmma_commit();
      if constexpr (TIGHT)  // under S^T's and dP^T's products
        if (it > 0) add_dq_second_half(p, tma, sm, w, dqb, cq, dqb_row);
      probs_sm90<T, true>(pol, sc, dp, q0 + wq, k0 + wk, sm.lse2(s) + wq, sm.delta(s) + wq, edge);
      zero_rows_past(bh, sc, dp, q0, wq);
      // ds(it) and the partner's dsx(it) are free once the partner has read this CTA's dS^T of step it - DSX_BUFS
      // (and so, at DSX_BUFS = 1, of step it - 2 too: the copy out of ds(it) has landed)
      mbar_wait(sm.xfree(it), use ^ 1);
      if constexpr (TIGHT)  // P^T (one buffer): the other warpgroup's dV_j product of step it - 1 has read it
        if (it > 0) named_sync(PT_FREE + 1 - w, NWG * 128);
      // the reduce-add of step it - 1 has read this warpgroup's dQ_i tile before anyone passes the barrier
      if ((threadIdx.x & 127) == 0) bulk_wait_read<0>();
      store_acc(sP, sc, wk, wq);
      store_acc(sdS, dp, wk, wq);
      fence_async_smem();
      named_sync(PS_BARRIER, NWG * 128);  // both halves of P^T and dS^T are in shared memory
      // ---- [mainloop_bwd_sm90_ws_split_d:pair_send] this step's dS^T into the partner's dsx(it) ----
      if (threadIdx.x == 0) {
        const u32 bar = map_shared(sm.xfull(it), other);
        mbar_expect_tx_remote(bar, PS);
        bulk_copy_to_cta(map_shared(sdSx.base, other), sdS.base, PS, bar);
      }
      // ---- [mainloop_bwd_sm90_ws_split_d:pair_products] dV_j += P^T dO_i; dQ_i's columns cq..; dK_j += dS^T Q_i ----
      Acc<1, 8> dq;  // a panel of dQ_i's columns
      fence_operand(st.dk);
      fence_operand(st.dv);
      wgmma_fence();
      wg_gemm_ab<BR>(st.dv, sP, 0, sdO, cwv, true);
      if constexpr (NARROW_V > 0) wg_gemm_ab<BR>(st.dv2, sP, 0, sdO, cnv, true);
      wgmma_commit();
      mbar_wait(sm.xfull(it), use);  // the partner's dS^T of this step has landed
      wgmma_fence();
      wg_gemm_atb<BC>(dq, sdS, 0, sK, cq, false);
      wg_gemm_atb<BC>(dq, sdSx, 0, sKx, cx, true);
      wgmma_commit();
      wg_gemm_ab<BR>(st.dk, sdS, 0, sQ, cw, true);
      if constexpr (NARROW > 0) wg_gemm_ab<BR>(st.dk2, sdS, 0, sQ, cn, true);
      wgmma_commit();
      wgmma_wait<2>();
      fence_operand(st.dv);
      if constexpr (NARROW_V > 0) fence_operand(st.dv2);
      mbar_arrive(sm.do_empty(0));  // dO_i: read by dP^T's and dV_j's products
      if constexpr (TIGHT)
        if (it + 1 < walk.total) named_arrive(PT_FREE + w, NWG * 128);  // this warpgroup is done with P^T
      // ---- [mainloop_bwd_sm90_ws_split_d:pair_dq] dQ_i's columns into the float32 rows, while dK_j runs ----
      wgmma_wait<1>();
      __syncwarp();
      if (lane_id() == 0) mbar_arrive_remote(sm.xfree(it), other);  // the partner's dS^T is read
      fence_operand(dq);
      if constexpr (!TIGHT) {  // the panel's 32-column boxes in [8 jlo, 8 jhi): one thread adds them
        stage_dq_rows<DQ_PANEL, 0, 8>(sm.dq_tile(w), dq, p.scale);
        fence_async_smem();
        named_sync(DQ_BARRIER + w, 128);
        if ((threadIdx.x & 127) == 0) {
#pragma unroll
          for (int c = 0; c < 2; ++c)
            if (4 * c >= jlo && 4 * c < jhi)
              tma_reduce_add_2d(tma.dq, sm.dq_tile(w) + c * DQ_PANEL, cq + 32 * c, (int)(bh.row0 + q0));
          bulk_commit();
        }
      } else {  // the first half now, the second under the next step's scores (add_dq_second_half)
        stage_dq_rows<DQ_PANEL, 0, 4>(sm.dq_tile(w), dq, p.scale);
        fence_async_smem();
        named_sync(DQ_BARRIER + w, 128);
        dqb_row = (int)(bh.row0 + q0);
        if ((threadIdx.x & 127) == 0) {
          tma_reduce_add_2d(tma.dq, sm.dq_tile(w), cq, dqb_row);
          bulk_commit();
        }
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) dqb.v[0][j][e] = dq.v[0][4 + j][e];
      }
      wgmma_wait<0>();
      fence_operand(st.dk);
      if constexpr (NARROW > 0) fence_operand(st.dk2);
      mbar_arrive(sm.empty(s));  // Q_i, L_i, D_i of this stage
    }
    if constexpr (TIGHT)
      if (walk.total > 0) add_dq_second_half(p, tma, sm, w, dqb, cq, dqb_row);
    if ((threadIdx.x & 127) == 0) bulk_wait_read<0>();  // shared memory outlives the last reduce-add's reads
  }

  __device__ __forceinline__ static void store(const BwdParams& p, const typename Pol::Info& bi, int k0,
                                               const State& st) {
    const int w = warpgroup_id();
    store_dk<T>(p, bi, st.dk, k0 + key_row(), wide0(w));
    store_dv<T>(p, bi, st.dv, k0 + key_row(), wide0v(w));
    if constexpr (NARROW > 0) store_dk<T>(p, bi, st.dk2, k0 + key_row(), narrow0(w));
    if constexpr (NARROW_V > 0) store_dv<T>(p, bi, st.dv2, k0 + key_row(), narrow0v(w));
  }
};

}  // namespace rf
