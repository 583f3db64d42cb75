// mainloop_bwd_sm90_ws: FA2's backward mainloop (Alg.2 l.6-16, atomic dQ) with FlashAttention-3's warp
// specialisation, for float16 / bfloat16 and head_dim up to 128 (sm_90a; 192 and 256: its column-split sibling
// mainloop_bwd_sm90_ws_split_d.cuh, which runs this file's producer, bwd_ws_produce). No Numba twin:
// mainloop_bwd_sm80's twin computes the same results.
//
// A CTA owns key block K_j, V_j (BC = 64 keys per consumer warpgroup) of one kv head. Its producer warpgroup's
// first warp copies K_j, V_j once with TMA, then streams Q_i, dO_i (TMA) and L_i, D_i (plain loads by its 32
// lanes) of every (query head, query block) the policy says sees K_j into a ring of STAGES stages. The consumer
// warpgroups compute exactly what mainloop_bwd_sm90's warpgroups do (S^T, dP^T, P^T, dS^T; dV, dK in registers;
// dQ_i += dS K_j from dS^T in shared memory); they meet each other at one named barrier per step (every dS^T
// written), double-buffered at 64 query rows a step so the next step's dS^T cannot overwrite one still being
// read; at 128 rows (head_dim <= 64, FlashAttention-3's tile; the warpgroups then split dQ_i's rows instead of its
// columns) one buffer, guarded by a second barrier (DS_FREE). Each step issues dV, meets the neighbour, issues
// dQ_i and dK, and writes dQ_i out while dK runs (FlashAttention-3's order). Each warpgroup's slice
// of dQ_i goes to shared memory (float32, double-buffered) and one thread adds it into the float32 dQ rows with a
// TMA reduce-add, so the consumers issue no atomics of their own.
// DV < D (the DV form, MLA's narrower v: configs.VALUE_ROWS): V_j, dO_i and dV_j have DV columns, so dP^T's and
// dV_j's products and V's and dO's tiles cost DV's FLOPs and bytes; S^T, dK_j and dQ_i keep D.
//
// DET (deterministic=True): the key blocks of one (sequence, query head) add into each query block's dQ rows in a
// fixed order (FlashAttention-3's ordered dQ accumulation), so float32's non-associative sums come out bitwise the
// same every run. The consumers leave the reduce-add to two warps of the producer warpgroup, the dQ writers
// (write_dq), one per dQ buffer (even and odd steps): per step a writer takes both warpgroups' slices (named
// barriers DQ_FULL / DQ_EMPTY per warpgroup and buffer), waits until the query block's int32 semaphore
// (p.dq_semaphore, zeroed before the launch) equals this key block's rank (Policy::dq_rank), adds, waits for the
// additions to be complete in global memory and stores rank + 1. The waiting is the writers' alone: the consumers
// run up to two steps ahead (the double buffer), and with a writer per buffer one step's wait for its additions
// to land overlaps the next step's.
// Each head walks its query blocks in ascending order (QIterAscending) and, under a mask bounded on the right,
// the key tiles are dispatched last-first (KTileScheduler's reverse): the rank order is then the order in which
// the key blocks reach a query block, and a CTA waits only on CTAs dispatched before it. Without a mask bound,
// where a (sequence, kv head) has at most half as many key blocks as the GPU has SMs (p.dq_rotate), each key
// block's walk starts at its own query block instead (Policy::dq_start / dq_rank_rotated): in the ascending order
// key block j waits on key block j - 1's addition of the same step, a chain as long as the key blocks; rotated,
// each waits on additions made steps earlier (+12 - 27 % at N = 2048 / 4096; bench/NOTES.md).
#pragma once
#include "mainloop_bwd_sm90.cuh"
#include "tma.cuh"

namespace rf {

// The backward's tensor maps: q, k, v and dO (head_dim, rows, heads, batch; v and dO at v's head_dim), boxes of BR
// (q, dO) or BC rows; dq: the float32 dQ rows (head_dim, rows), boxes of 32 columns by BR rows (128-byte swizzle).
struct TmaBwd {
  TmaDesc q, k, v, dout, dq;
};

// A warpgroup's 64-row dQ_i accumulator (64 x 8 NT floats, times scale) into a float32 tile of shared memory cut
// into panels of 32 columns (128 bytes a row, PANEL bytes apart) with the 128-byte swizzle (16-byte chunk c of row
// r at c ^ r % 8), the layout the dq map's box reads (tma_reduce_add_2d). A 64-bit store is served a half-warp at a
// time (lanes of groups g = 0..3, then 4..7), and groups g and g ^ 1 swizzle one chunk pair onto the same banks,
// so lanes of odd g store the column slot y ^ 2 while the others store y: each half-warp then covers all 32 banks
// and a store takes two wavefronts instead of four (Nsight Compute shows the unswizzled slots at 2.5-way average
// conflicts over the backward's shared stores; bench/NOTES.md).
// (J0, NJ: only the 8-column groups J0.. J0 + NJ - 1 of dq, at the tile's columns 0.., e.g. half a panel)
template <int PANEL, int J0, int NJ, int NT>
__device__ __forceinline__ void stage_dq_rows(u32 tile, const Acc<1, NT>& dq, float scale) {
  static_assert(NJ % 4 == 0 && J0 % 4 == 0 && J0 + NJ <= NT, "column slots y and y ^ 2 lie in one 32-column panel");
  const int g = lane_id() >> 2, t = lane_id() & 3, qr = 16 * warp_in_group();
  const bool odd = g & 1;
#pragma unroll
  for (int y = 0; y < NJ; ++y)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int ys = odd ? y ^ 2 : y;  // this lane's column slot in this store
      const int row = qr + g + 8 * hh, col = 8 * ys + 2 * t;  // col % 32 / 4 is the 16-byte chunk in the panel
      const u32 at = tile + col / 32 * PANEL + row * 128 + ((((col % 32) >> 2) ^ (row & 7)) << 4) + (col & 3) * 4;
      // (picked by a select: dq.v[0][ys], an index that depends on the lane, would put dq in local memory)
      const float x0 = odd ? dq.v[0][J0 + (y ^ 2)][2 * hh] : dq.v[0][J0 + y][2 * hh];
      const float x1 = odd ? dq.v[0][J0 + (y ^ 2)][2 * hh + 1] : dq.v[0][J0 + y][2 * hh + 1];
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(at), "f"(scale * x0), "f"(scale * x1) : "memory");
    }
}

// The producer of both FA3 backward mainloops (this one and mainloop_bwd_sm90_ws_split_d's): its warpgroup gives
// registers back, and its warp WARP (the first one) copies; Sm is the mainloop's shared memory, which has K_j, V_j
// (k(), v()), the ring's Q_i, dO_i, L_i, D_i (q(s), dout(s), lse2(s), delta(s)) and their barriers (kv_full(),
// full(s), empty(s)); with Sm::DO_RING, dO_i in a ring of its own (do_full(s), do_empty(s)); with Sm::KX > 0, the
// columns kx_col0().. of the cluster partner's key block too (kx(), with K_j: the column split's pair).
template <int REGS, int WARP> __device__ __forceinline__ bool bwd_ws_producer_start(const TmaBwd& tma) {
  regs_release<REGS>();
  if (warp_id() != WARP) return false;
  if (lane_id() == 0) {
    tma_prefetch_desc(tma.q);
    tma_prefetch_desc(tma.k);
    tma_prefetch_desc(tma.v);
    tma_prefetch_desc(tma.dout);
    tma_prefetch_desc(tma.dq);
  }
  return true;
}
template <typename T, int D, int BR, int BC, int STAGES, class Pol, class Walk, class Sm>
__device__ __forceinline__ void bwd_ws_produce(const BwdParams& p, const TmaBwd& tma, const typename Pol::Info& bi,
                                               int k0, const Walk& walk, const Sm& sm) {
  // the bytes of K_j, V_j, Q_i and dO_i (BwdWsSmem's); V_j and dO_i have DV columns (MLA's narrower v), the
  // others D; a panel's bytes are its rows times 128 whatever the columns
  constexpr int DV = Sm::DV, QB = Sm::QB, DOB = Sm::DOB, KPANEL = Sw128<T, BC, D>::PANEL_BYTES;
  constexpr int QPANEL = Sw128<T, BR, D>::PANEL_BYTES;
  const int bq = p.cu_seqlens_q ? 0 : bi.b, bk = p.cu_seqlens_k ? 0 : bi.b;
  // ---- [mainloop_bwd_sm90_ws:load_kv] Alg.2 l.6: K_j, V_j, once ----
  if (lane_id() == 0) {
    mbar_expect_tx(sm.kv_full(), Sm::KB + Sm::VB + Sm::KX);
#pragma unroll
    for (int c = 0; c < D; c += 64)
      tma_load_4d(tma.k, sm.k().base + c / 64 * KPANEL, sm.kv_full(), c, bi.k_row0 + k0, bi.hk, bk);
#pragma unroll
    for (int c = 0; c < DV; c += 64)
      tma_load_4d(tma.v, sm.v().base + c / 64 * KPANEL, sm.kv_full(), c, bi.k_row0 + k0, bi.hk, bk);
    if constexpr (Sm::KX > 0) {  // the partner's key block K_j' (k0 ^ BC), the columns this CTA's dQ_i owns
      using Kx = decltype(sm.kx());
#pragma unroll
      for (int c = 0; c < Kx::PANELS * 64; c += 64)
        tma_load_4d(tma.k, sm.kx().base + c / 64 * Kx::PANEL_BYTES, sm.kv_full(), sm.kx_col0() + c,
                    bi.k_row0 + (k0 ^ BC), bi.hk, bk);
    }
  }
  // ---- [mainloop_bwd_sm90_ws:load_q] Alg.2 l.8: Q_i, dO_i, L_i, D_i of every step into the next free stage ----
  typename Pol::Info bh = bi;
  PipeState<STAGES> pipe;
  PipeState<Sm::DO_STAGES> do_pipe;  // (DO_RING: dO_i's own ring)
#pragma unroll 1
  for (int it = 0; it < walk.total; ++it, pipe.advance(), do_pipe.advance()) {
    const int s = pipe.stage(), q0 = walk.block(it) * BR;
    bh.set_head(p, walk.head(it));
    mbar_wait(sm.empty(s), pipe.parity() ^ 1);
    if (lane_id() == 0) {
      mbar_expect_tx(sm.full(s), Sm::DO_RING ? QB : QB + DOB);
#pragma unroll
      for (int c = 0; c < D; c += 64)
        tma_load_4d(tma.q, sm.q(s).base + c / 64 * QPANEL, sm.full(s), c, bh.q_row0 + q0, bh.h, bq);
      if constexpr (!Sm::DO_RING) {
#pragma unroll
        for (int c = 0; c < DV; c += 64)
          tma_load_4d(tma.dout, sm.dout(s).base + c / 64 * QPANEL, sm.full(s), c, bh.q_row0 + q0, bh.h, bq);
      }
    }
    // rows past the sequence get L = D = 0 (their P and dS are zeroed by the consumers)
    const int nq = min(BR, bh.seqlen_q - q0);
#pragma unroll
    for (int r = lane_id(); r < BR; r += 32) {
      sm.lse2(s)[r] = r < nq ? p.lse2[bh.row0 + q0 + r] : 0.f;
      sm.delta(s)[r] = r < nq ? p.delta[bh.row0 + q0 + r] : 0.f;
    }
    mbar_arrive(sm.full(s));
    if constexpr (Sm::DO_RING) {  // dO_i into its own ring (fewer stages: freed as soon as dV_j's product is done)
      const int sd = do_pipe.stage();
      mbar_wait(sm.do_empty(sd), do_pipe.parity() ^ 1);
      if (lane_id() == 0) {
        mbar_expect_tx(sm.do_full(sd), DOB);
#pragma unroll
        for (int c = 0; c < DV; c += 64)
          tma_load_4d(tma.dout, sm.dout(sd).base + c / 64 * QPANEL, sm.do_full(sd), c, bh.q_row0 + q0, bh.h, bq);
      }
    }
  }
}

// The shared-memory map both FA3 backward mainloops share, from a 1024-byte-aligned base: K_j, V_j; STAGES x Q_i and
// DO_STAGES x dO_i (V_j and dO_i of DV columns: D, or MLA's narrower head_dim_v in FA3's DV form); MID bytes that are
// the mainloop's own (mid(): dS^T and the dQ_i slices here, P^T and dS^T in the column split); STAGES x (L_i, D_i) as
// floats; the rings' mbarriers, then EXTRA more of the mainloop's own (extra(i)). A stage is full when the copies'
// bytes have landed and the producer's 32 lanes have stored L_i, D_i (the first lane's expect_tx counts as one more
// arrival); empty when every consumer thread (NWG warpgroups) is done with it. DO_STAGES = STAGES: dO_i shares Q_i's
// stages and barriers; fewer (DO_RING): dO_i is a ring of its own, full when its bytes have landed, empty when every
// consumer thread is done with it. KX: bytes of the mainloop's copy of another key block's columns, which the producer
// loads with K_j (kx(): a derived map's).
template <typename T, int D, int DV_, int BR, int BC, int STAGES, int NWG, int MID, int DO_STAGES_ = STAGES,
          int EXTRA = 0>
struct BwdWsSmem {
  static constexpr int ALIGN = 1024, DV = DV_, LD = 2 * STAGES * BR * 4, KX = 0;
  static constexpr int KB = BC * D * 2, VB = BC * DV_ * 2, QB = BR * D * 2, DOB = BR * DV_ * 2;  // a tile's bytes
  static constexpr int DO_STAGES = DO_STAGES_;
  static_assert(DV_ <= D && DV_ % 64 == 0, "V_j and dO_i of whole 64-column panels, at most Q's columns");
  static constexpr bool DO_RING = DO_STAGES != STAGES;
  static_assert(DO_STAGES >= 1 && DO_STAGES <= STAGES, "dO_i's stages: Q_i's, or a ring of fewer");
  // K_j, V_j full; per stage full and empty; dO_i's ring's; the mainloop's own
  static constexpr int BARRIERS = 1 + 2 * STAGES + (DO_RING ? 2 * DO_STAGES : 0) + EXTRA;
  static constexpr int MID0 = KB + VB + STAGES * QB + DO_STAGES * DOB;  // the bytes before mid()
  static constexpr int BYTES = ALIGN + MID0 + MID + LD + 8 * BARRIERS;
  u32 base;
  float* lsd;  // STAGES x L_i, then STAGES x D_i
  __device__ __forceinline__ explicit BwdWsSmem(char* smem)
      : base(((u32)__cvta_generic_to_shared(smem) + ALIGN - 1) & ~(u32)(ALIGN - 1)) {
    lsd = (float*)(smem + (base - (u32)__cvta_generic_to_shared(smem)) + MID0 + MID);
  }
  __device__ __forceinline__ Sw128<T, BC, D> k() const { return {base}; }
  __device__ __forceinline__ Sw128<T, BC, DV_> v() const { return {base + KB}; }
  __device__ __forceinline__ Sw128<T, BR, D> q(int s) const { return {base + KB + VB + s * QB}; }
  __device__ __forceinline__ Sw128<T, BR, DV_> dout(int s) const {
    return {base + KB + VB + STAGES * QB + s * DOB};
  }
  __device__ __forceinline__ u32 mid() const { return base + MID0; }
  __device__ __forceinline__ float* lse2(int s) const { return lsd + s * BR; }
  __device__ __forceinline__ float* delta(int s) const { return lsd + (STAGES + s) * BR; }
  __device__ __forceinline__ u32 bar(int i) const { return mid() + MID + LD + 8 * i; }
  __device__ __forceinline__ u32 kv_full() const { return bar(0); }
  __device__ __forceinline__ u32 full(int s) const { return bar(1 + s); }
  __device__ __forceinline__ u32 empty(int s) const { return bar(1 + STAGES + s); }
  __device__ __forceinline__ u32 do_full(int s) const { return bar(1 + 2 * STAGES + s); }
  __device__ __forceinline__ u32 do_empty(int s) const { return bar(1 + 2 * STAGES + DO_STAGES + s); }
  __device__ __forceinline__ u32 extra(int i) const { return bar(BARRIERS - EXTRA + i); }
  // the rings' barriers; the mainloop initialises its extra ones before calling this (it ends with the fence)
  __device__ __forceinline__ void init() const {
    mbar_init(kv_full(), 1);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full(s), 33);
      mbar_init(empty(s), NWG * 128);
    }
    if constexpr (DO_RING) {
      for (int s = 0; s < DO_STAGES; ++s) {
        mbar_init(do_full(s), 1);
        mbar_init(do_empty(s), NWG * 128);
      }
    }
    mbar_init_fence();
  }
};

// DV: the columns of V_j, dO_i and dV_j (D, or MLA's narrower head_dim_v: the DV form, whose dP^T = V_j dO_i^T and
// dV_j += P^T dO_i run over DV columns while S^T, dK_j and dQ_i keep D).
template <typename T_, int D, int BR_, int BC_, int STAGES, class Pol_, bool DET_ = false, int DV = D>
struct MainloopBwdSm90Ws {
  using T = T_;
  using Pol = Pol_;
  static constexpr bool DET = DET_, PAIR = false;  // (PAIR: the column split's clusters, fa3_bwd_sm90.cu)
  using Walk = typename QWalk<DET_>::type;
  static constexpr int BR = BR_, BC = BC_, NWG = BC_ / 64, NTHREADS = (NWG + 1) * 128, NQ = BR_ / 8;
  // dQ_i's slice of a consumer warpgroup: 64 rows (a warpgroup product's M) by DQN columns. 64 query rows a step
  // split dQ_i's columns between the warpgroups; 128 rows (ROW_SPLIT, FlashAttention-3's tile at head_dim 64)
  // split its rows, warpgroup w taking rows 64w.. of every column. Two buffers of each slice (a step's slice is
  // written while the reduce-add of the step before may still read its own; DET: one per writer warp).
  // DS_BUFS buffers of dS^T: two at 64 rows, so a warpgroup may write the next step's while its neighbour's dQ_i
  // product still reads this one; at 128 rows two do not fit beside the rest (227 KB), so one, and a warpgroup
  // waits at DS_FREE for its neighbour's dQ_i of the step before (done long before, in practice) first.
  // 80 rows (SWAP_DQ, FlashAttention-3's non-causal tile at head_dim 128): a warpgroup product's M is 64, so dQ_i
  // (80 x D) is computed transposed, dQ_i^T = K_j^T dS_i^T (M = D, warpgroup w taking head columns 64w..), from
  // dS_i stored untransposed (its B operand, K-major); the slice (80 rows by 64 columns) then goes to shared
  // memory row by row for the reduce-add, one buffer of it (two do not fit beside 2 x dS).
  static constexpr bool ROW_SPLIT = BR_ == 128, SWAP_DQ = BR_ == 80;
  static constexpr int DQN = ROW_SPLIT ? D : D / NWG, DS_BUFS = ROW_SPLIT ? 1 : 2, DQ_BUFS = SWAP_DQ ? 1 : 2;
  static constexpr int DQ_ROWS = SWAP_DQ ? BR_ : 64;  // the rows of a dQ_i slice (tma.dq_box_rows)
  static constexpr int NO = D / 8, NOV = DV / 8;  // a warp's 8-column fragments of dK_j, of dV_j
  static constexpr int DS = BC_ * BR_ * 2, DQB = DQ_ROWS * DQN * 4, DQ_PANEL = DQ_ROWS * 128;
  // BwdWsSmem's map with DS_BUFS x dS^T (dS) and DQ_BUFS x NWG dQ_i slices as its middle
  using Map = BwdWsSmem<T_, D, DV, BR_, BC_, STAGES, NWG, DS_BUFS * DS + DQ_BUFS * NWG * DQB>;
  static constexpr int SMEM_BYTES = Map::BYTES;
  // EARLY_DV: the plain policy at head_dim 128 issues dV_w += P^T dO_i as soon as P^T is formed, so it runs while
  // dS^T is formed (+3 % on H200, bf16, N = 4096; at head_dim 64 the same order costs 4 %; bench/NOTES.md), and
  // the general policy needs dP^T for P^T's transform first. P^T (float and A fragments), dP^T, dK and dV are
  // then live at once: at 232 registers that spills 32 B, and the spill code touching registers of products in
  // flight makes ptxas serialise every product, so those instantiations take 24 / 240 (FA3's split for two consumer
  // warpgroups), the others keep 40 / 232. ROW_SPLIT's 128-row scores take 240 too (the general policy spills
  // 148 B at 232); the producer warpgroup keeps 24 there (32 / 240 is more than the launch's pool, launch_regs),
  // where DET's dQ writer warps spill a few bytes (configs.KNOWN_SPILLS).
  // SWAP_DQ's 80-row tile takes 24 / 240 without EARLY_DV (dQ_i^T's 40 accumulators beside dK, dV and dS).
  static constexpr bool EARLY_DV = !Pol_::GENERAL && D >= 128 && !SWAP_DQ;
  static constexpr bool REGS_240 = EARLY_DV || ROW_SPLIT || SWAP_DQ;
  static constexpr int PRODUCER_REGS = REGS_240 ? 24 : 40, CONSUMER_REGS = REGS_240 ? 240 : 232;
  static constexpr int DS_BARRIER = 1;  // named barrier of the consumer warpgroups: every dS^T is in shared memory
  static constexpr int DQ_BARRIER = 2;  // + w: warpgroup w's dQ_i slice is in shared memory
  // DET: + 2 w + buffer, over warpgroup w and the dQ writer warp: the slice is in shared memory (full) / the
  // writer's reduce-add has read it (empty).
  static constexpr int DQ_FULL = 4, DQ_EMPTY = 4 + 2 * NWG, DQ_PAIR = 128 + 32;
  // DS_BUFS == 1: + w, over both consumer warpgroups: warpgroup w's dQ_i product has read dS^T (w arrives, its
  // neighbour waits before writing the next step's dS^T)
  static constexpr int DS_FREE = DQ_EMPTY + 2 * NWG;
  static_assert(DS_FREE + NWG <= 16, "16 named barriers");
  // DET: a writer that spins this often has waited on a rank nobody will store (a broken invariant, not a slow
  // neighbour: a read takes about 0.5 us, so 2^26 of them take half a minute, while a CTA waits at most for its
  // predecessors' walks of the same query block, milliseconds); it traps, so the launch fails with an error (an
  // illegal instruction) instead of hanging the GPU.
  static constexpr long long SPIN_LIMIT = 1ll << 26;
  static_assert(NWG == 2 && (BR_ == 64 || BR_ == 128 || (BR_ == 80 && D == 128)) && D % 64 == 0 && DQN % 32 == 0,
                "2 x 64 keys; a warpgroup's dQ_i slice is one 64-row wgmma (80 rows: of dQ_i^T at head_dim 128)");
  static_assert(!(SWAP_DQ && DET_), "80 rows have one dQ_i buffer; the ordered dQ's writers need two");
  static_assert(DQN % 64 == 0 || 64 % DQN == 0, "column slices within panels");
  static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * 128 * NWG <= launch_regs(NTHREADS) * NTHREADS,
                "setmaxnreg moves registers within the launch's pool");

  struct State {
    Acc<1, NO> dk;
    Acc<1, NOV> dv;
  };
  struct Smem : Map {
    __device__ __forceinline__ explicit Smem(char* smem) : Map(smem) {}
    // dS^T of step it (rows keys); SWAP_DQ: dS_i untransposed (rows queries, columns keys)
    using DsTile = typename Select<SWAP_DQ, Sw128<T_, BR_, BC_>, Sw128<T_, BC_, BR_>>::type;
    __device__ __forceinline__ DsTile ds(int it) const { return {this->mid() + it % DS_BUFS * DS}; }
    // Warpgroup w's float32 dQ_i slice of step it: DQ_ROWS rows of DQN columns in panels of 32 (the dq map's box).
    __device__ __forceinline__ u32 dq(int w, int it) const {
      return this->mid() + DS_BUFS * DS + (DQ_BUFS * w + it % DQ_BUFS) * DQB;
    }
  };

  __device__ __forceinline__ static bool is_producer() { return warpgroup_id() == NWG; }
  // Warpgroup w's dQ_i slice: its first query row within the block and its first column.
  __device__ __forceinline__ static int dq_row(int w) { return ROW_SPLIT ? 64 * w : 0; }
  __device__ __forceinline__ static int dq_col(int w) { return ROW_SPLIT ? 0 : w * DQN; }
  __device__ __forceinline__ static int key_row() { return 64 * warpgroup_id() + 16 * warp_in_group(); }

  // ---------------------------------------------------------------- producer
  // DET: warps 1 and 2 of the producer warpgroup write dQ, of the even and the odd steps (dQ buffer 0 and 1)
  __device__ __forceinline__ static bool is_dq_writer() {
    return DET && (warp_id() == 4 * NWG + 1 || warp_id() == 4 * NWG + 2);
  }
  __device__ __forceinline__ static bool producer_start(const TmaBwd& tma) {
    return bwd_ws_producer_start<PRODUCER_REGS, 4 * NWG>(tma);
  }
  __device__ __forceinline__ static void produce(const BwdParams& p, const TmaBwd& tma, const typename Pol::Info& bi,
                                                 int k0, const Walk& walk, const Smem& sm) {
    bwd_ws_produce<T, D, BR, BC, STAGES, Pol>(p, tma, bi, k0, walk, sm);
  }

  // ---------------------------------------------------------------- the dQ writer (DET)
  // dQ's semaphore of the query block at q0 of bh: (row0 + q0) / BR + (the (sequence, head)'s index in row order).
  // Query blocks are numbered in the order of their first rows, which grow by BR within a (sequence, head) and by
  // more from one to the next, so these are distinct and below cdiv(all rows, BR) + sequences x heads
  // (launch.dq_semaphores).
  __device__ __forceinline__ static int* semaphore(const BwdParams& p, const typename Pol::Info& bh, int q0) {
    const bool packed = Pol::GENERAL && p.cu_seqlens_q;
    const long long seq = packed ? (long long)bh.h * p.batch + bh.b : (long long)bh.b * p.heads + bh.h;
    return p.dq_semaphore + (bh.row0 + q0) / BR_ + seq;
  }
  // Why this cannot deadlock: a CTA waits only on the CTAs of the same (sequence, kv head) with a lower rank for
  // that query block, which (ranks follow key blocks, and the grid's x, key tiles fastest, is mapped to key blocks
  // in rank order: KTileScheduler) have a lower block index. CTAs are dispatched in block-index order, so the
  // unfinished CTA of lowest index is resident and everything it waits on has finished; it finishes; by induction
  // all do. Every lower rank is stored: the key blocks that see a query block are exactly those ranked 0, 1, ...
  // (Policy::dq_rank), each visits it once per query head and stores its rank + 1 after its own addition. GQA: the
  // CTA walks every query head of its kv head's group in the same order as its neighbours, and each query head has
  // its own semaphores, so the groups never wait on one another.
  __device__ __forceinline__ static void write_dq(const BwdParams& p, const TmaBwd& tma, const typename Pol::Info& bi,
                                                  const Pol& pol, int k0, const Walk& walk, const Smem& sm) {
    const int j = k0 / BC_, buf = warp_id() - (4 * NWG + 1);  // this writer's dQ buffer: steps buf, buf + 2, ...
    typename Pol::Info bh = bi;
    if (buf < walk.total)  // the buffer starts empty
#pragma unroll
      for (int w = 0; w < NWG; ++w) named_arrive(DQ_EMPTY + 2 * w + buf, DQ_PAIR);
#pragma unroll 1
    for (int it = buf; it < walk.total; it += 2) {
      const int q0 = walk.block(it) * BR_;
      bh.set_head(p, walk.head(it));
      int* sem = semaphore(p, bh, q0);
      const int rank = pol.dq_rotates(p) ? pol.dq_rank_rotated(q0, BR_, BC_, j) : pol.dq_rank(q0, BR_, BC_, j);
#pragma unroll
      for (int w = 0; w < NWG; ++w) named_sync(DQ_FULL + 2 * w + buf, DQ_PAIR);
      if (lane_id() == 0) {
        // ---- [mainloop_bwd_sm90_ws:dq_order] wait for rank; add; wait until the additions are done; rank + 1 ----
        long long spins = 0;
        while (ld_acquire(sem) != rank)
          if (++spins == SPIN_LIMIT) __trap();
        fence_async_global();  // the acquire, carried over to the TMA unit's accesses
#pragma unroll
        for (int w = 0; w < NWG; ++w)
#pragma unroll
          for (int c = 0; c < DQN; c += 32)
            tma_reduce_add_2d(tma.dq, sm.dq(w, it) + c / 32 * DQ_PANEL, dq_col(w) + c, (int)(bh.row0 + q0) + dq_row(w));
        bulk_commit();
        bulk_wait_read<0>();
      }
      __syncwarp();
      if (it + 2 < walk.total)
#pragma unroll
        for (int w = 0; w < NWG; ++w) named_arrive(DQ_EMPTY + 2 * w + buf, DQ_PAIR);
      if (lane_id() == 0) {
        bulk_wait<0>();        // complete: every addition has landed in global memory (not only read: #2244)
        fence_async_global();  // ... and is ordered before the release below
        st_release(sem, rank + 1);
      }
      __syncwarp();
    }
  }

  // ---------------------------------------------------------------- consumers
  __device__ __forceinline__ static void consumer_start() { regs_claim<CONSUMER_REGS>(); }

  // dQ_i's slice (rows dq_row(w).., columns dq_col(w).., times the scale) from registers to this warpgroup's shared
  // tile (stage_dq_rows' layout; SWAP_DQ: the transposed accumulator, stored below), then one thread adds the tile
  // into the float32 dQ rows (rows past the sequence carry zeros: their dS is 0).
  template <int NT>
  __device__ __forceinline__ static void reduce_dq_tma(const BwdParams& p, const TmaBwd& tma, const Smem& sm,
                                                       const typename Pol::Info& bh, const Acc<1, NT>& dq, int q0,
                                                       int it) {
    const int w = uniform_warpgroup_id();
    const u32 tile = sm.dq(w, it);
    if constexpr (DET) named_sync(DQ_EMPTY + 2 * w + (it & 1), DQ_PAIR);  // the writer has read this buffer
    if constexpr (SWAP_DQ) {
      const int g = lane_id() >> 2, t = lane_id() & 3, qr = 16 * warp_in_group();
      // dq holds dQ_i^T: row 16 (warp) + g + 8 hh is head column dq_col(w) + that, column 8y + 2t + e query row
      // 8y + 2t + e. One float a store: a warp's 32 lanes cover 4 query rows (2t + e: row % 8 takes 4 values
      // of one parity) by 8 columns (two 16-byte chunks), whose swizzled chunks are 8 distinct ones: no conflict.
#pragma unroll
      for (int y = 0; y < NT; ++y)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int row = 8 * y + 2 * t + e, col = qr + g + 8 * hh;
            const u32 at =
                tile + col / 32 * DQ_PANEL + row * 128 + ((((col % 32) >> 2) ^ (row & 7)) << 4) + (col & 3) * 4;
            asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(at), "f"(p.scale * dq.v[0][y][2 * hh + e]) : "memory");
          }
    } else {
      stage_dq_rows<DQ_PANEL, 0, NT>(tile, dq, p.scale);
    }
    fence_async_smem();
    if constexpr (DET) {  // the dQ writer adds it, in its turn (write_dq)
      named_arrive(DQ_FULL + 2 * w + (it & 1), DQ_PAIR);
      return;
    }
    named_sync(DQ_BARRIER + w, 128);
    if ((threadIdx.x & 127) == 0) {
#pragma unroll
      for (int c = 0; c < DQN; c += 32)
        tma_reduce_add_2d(tma.dq, tile + c / 32 * DQ_PANEL, dq_col(w) + c, (int)(bh.row0 + q0) + dq_row(w));
      bulk_commit();
    }
  }

  __device__ __forceinline__ static void consume(const BwdParams& p, const TmaBwd& tma, const typename Pol::Info& bi,
                                                 Pol& pol, int k0, const Walk& walk, const Smem& sm, State& st) {
    const int w = uniform_warpgroup_id(), kw = 64 * w, wk = key_row();
    const auto sK = sm.k();
    const auto sV = sm.v();
    typename Pol::Info bh = bi;
    // ---- [mainloop_bwd_sm90_ws:init] Alg.2 l.7: dK_j = dV_j = 0; K_j, V_j have landed ----
    zero(st.dk);
    zero(st.dv);
    if (walk.total > 0) mbar_wait(sm.kv_full(), 0);
    PipeState<STAGES> pipe;
#pragma unroll 1
    for (int it = 0; it < walk.total; ++it, pipe.advance()) {
      const int q0 = walk.block(it) * BR, s = pipe.stage();
      const bool edge = walk.edge(it);
      bh.set_head(p, walk.head(it));
      if constexpr (Pol::GENERAL) pol.set_head(p, bh);
      const auto sQ = sm.q(s);
      const auto sdO = sm.dout(s);
      const float *sL = sm.lse2(s), *sDelta = sm.delta(s);
      mbar_wait(sm.full(s), pipe.parity());
      // ---- [mainloop_bwd_sm90_ws:scores] Alg.2 l.9-10 and l.12: S^T = K_w Q_i^T and dP^T = V_w dO_i^T ----
      Acc<1, NQ> sc, dp;
      wgmma_fence();
      wg_gemm_abt(sc, sK, kw, sQ, 0, false);
      wgmma_commit();
      wg_gemm_abt(dp, sV, kw, sdO, 0, false);
      wgmma_commit();
      // ---- [mainloop_bwd_sm90_ws:probs] Alg.2 l.10-11, l.13 and l.15: P^T; dV_w += P^T dO_i; dS^T = P^T * (dP^T -
      // D_i); dK_w += dS^T Q_i. EARLY_DV issues dV once P^T is formed, so it runs while dS^T is formed; the
      // others form both first (the general policy's transform needs both). ----
      // Rows past the sequence: the copies may have read a packed neighbour's rows (not zeros), so P = dS = 0.
      u32 p_a[NQ / 2][4], ds_a[NQ / 2][4];
      if constexpr (!EARLY_DV) {
        // SPARE_REGS but on 128-row tiles (which spill 128 B at d = 64 bf16 without a mask; 24 - 140 B with the
        // window's one-compare hide too), which take windows' hidden scores to -inf before the exponential instead
        // (PREMASK)
        probs_sm90<T, !ROW_SPLIT, ROW_SPLIT>(pol, sc, dp, q0, k0 + wk, sL, sDelta, edge);
        if (q0 + BR > bh.seqlen_q) {
          const int nq = bh.seqlen_q - q0;
          for_each2(sc, dp, [&](float& x, float& y, int, int col) {
            if (col >= nq) x = y = 0.f;
          });
        }
        to_a_operand<T>(p_a, sc);
      } else {
        const int nq = bh.seqlen_q - q0;
        probs_p_sm90<T>(pol, sc, q0, k0 + wk, sL, edge);
        if (nq < BR) for_each_col(sc, [&](float& x, int col) { if (col >= nq) x = 0.f; });
        to_a_operand<T>(p_a, sc);
        wgmma_fence();
        wg_gemm_rb(st.dv, p_a, sdO, 0, 0);
        wgmma_commit();
        probs_ds_sm90<1>(sc, dp, sDelta);  // dV may still run
        if (nq < BR) for_each_col(dp, [&](float& y, int col) { if (col >= nq) y = 0.f; });
      }
      to_a_operand<T>(ds_a, dp);
      const auto sdS = sm.ds(it);
      if constexpr (DS_BUFS == 1)
        if (it > 0) named_sync(DS_FREE + 1 - w, NWG * 128);  // the neighbour's dQ_i of step it - 1 has read dS^T
      if constexpr (SWAP_DQ) store_acc_transposed(sdS, dp, wk);  // dS_i: rows queries, columns keys
      else store_acc(sdS, dp, wk, 0);
      fence_async_smem();
      if constexpr (!EARLY_DV) {
        fence_operand(st.dv);  // (not while dV runs: ptxas would serialise the products)
        wgmma_fence();
        wg_gemm_rb(st.dv, p_a, sdO, 0, 0);
        wgmma_commit();
      }
      // ---- [mainloop_bwd_sm90_ws:dq] Alg.2 l.14-15: dQ_i += scale * dS K_j (warpgroup w's slice, from every
      // dS^T), then dK_w += dS^T Q_i; dQ_i's slice goes out while dK runs (FlashAttention-3's order) ----
      // (the reduce-add of DQ_BUFS steps ago has read its dQ tile before anyone passes the barrier and rewrites it)
      if (!DET && (threadIdx.x & 127) == 0) bulk_wait_read<DQ_BUFS - 1>();
      named_sync(DS_BARRIER, NWG * 128);
      Acc<1, (SWAP_DQ ? BR : DQN) / 8> dq;  // SWAP_DQ: dQ_i^T, head columns dq_col(w).. by all BR query rows
      fence_operand(st.dk);
      wgmma_fence();
      if constexpr (SWAP_DQ) wg_gemm_atbt<BC>(dq, sK, dq_col(w), sdS, 0, false);
      else wg_gemm_atb<BC>(dq, sdS, dq_row(w), sK, dq_col(w), false);
      wgmma_commit();
      wg_gemm_rb(st.dk, ds_a, sQ, 0, 0);
      wgmma_commit();
      wgmma_wait<1>();  // dV and dQ_i are done; dK may run
      fence_operand(dq);
      if constexpr (DS_BUFS == 1)
        if (it + 1 < walk.total) named_arrive(DS_FREE + w, NWG * 128);
      reduce_dq_tma(p, tma, sm, bh, dq, q0, it);
      wgmma_wait<0>();
      fence_operand(st.dk);
      fence_operand(st.dv);
      mbar_arrive(sm.empty(s));  // Q_i, dO_i, L_i, D_i of this stage are no longer read
    }
    if (!DET && (threadIdx.x & 127) == 0) bulk_wait_read<0>();  // shared memory outlives the last reduce-add's reads
  }

  __device__ __forceinline__ static void store(const BwdParams& p, const typename Pol::Info& bi, int k0,
                                               const State& st) {
    store_dk<T>(p, bi, st.dk, k0 + key_row(), 0);
    store_dv<T>(p, bi, st.dv, k0 + key_row(), 0);
  }
};

}  // namespace rf
