// mainloop_fwd_sm90_ws: FlashAttention-3's forward mainloop (Shah et al. 2024, Alg.1 with warp specialisation)
// on sm_90a: the pipeline every FA3 forward shares (Fa3FwdPipeline) and its 16-bit form for float16 / bfloat16
// (MainloopFwdSm90Ws); mainloop_fwd_sm90_fp8.cuh is its FP8 form. No Numba twin: TMA, mbarriers and warp
// specialisation have no counterpart there; the twin of mainloop_fwd_sm80 computes the same results.
//
// A CTA has NC = WC * BR / 64 consumer warpgroups and one producer warpgroup (the last one):
//   - the producer's first warp issues TMA copies (tma.cuh): Q_i once per tile (into a ring of QSTAGES buffers:
//     with 2, a persistent CTA's next Q_i is copied while this tile runs), then K_j and V_j of every
//     visible key block, into a ring of STAGES stages, each stage guarded by a "full" mbarrier (the copies'
//     bytes complete it) and an "empty" one (every consumer thread arrives when it is done reading the stage);
//     it gives its registers back (setmaxnreg) so the consumers can hold S, P and O of 64 rows each;
//   - consumer warpgroup w owns query rows 64v..64v+63 of the tile (v = w / WC) and runs FA2's loop on wgmma as
//     mainloop_fwd_sm90 does (S = Q K^T from shared memory, P from registers into O += P V, the online softmax,
//     FA3's intra-warpgroup OVERLAP of the softmax of block j with P_{j-1} V_{j-1});
//   - with the column split (WC = 2, head_dim 512, where O of 64 x 512 would be 256 registers a thread) two
//     consumer warpgroups share the tile's 64 rows: each forms all of S = Q K^T and the rows' softmax itself (the
//     same values; P stays in registers, nothing is exchanged) and holds DV / 2 of O's columns (from DV / 2 * w),
//     so the tensor cores do 1.5x the algorithm's work (bench/NOTES.md A10's design (a));
//   - the 16-bit form's epilogue (O_VIA_Q) stages each warpgroup's O in its own 64 rows of the tile's Q_i buffer
//     (stmatrix; no other warpgroup reads those rows, so no barrier between warpgroups), and one thread per
//     warpgroup stores them with TMA; the buffer goes back to the producer once the store has read it. With two
//     Q_i buffers the next tile's Q_i is already in the other one; with one, its copy waits for that read (which
//     rows stage O is the launch's choice: STAGE_O);
//   - PINGPONG (FA3 section 3.1): named barriers hand the tensor cores from one consumer warpgroup to the next,
//     so warpgroup w issues its products while the others run their softmax; each warpgroup waits for its
//     turn before it issues and passes the turn on after.
// The key blocks are visited in the policy's BlockRange order (interior first, edges after), the same for the
// producer and the consumers: both sides walk the same tiles and blocks and keep their ring counters in step.
#pragma once
#include "epilogue.cuh"
#include "hopper.cuh"
#include "policy.cuh"
#include "softmax.cuh"
#include "tma.cuh"

namespace rf {

// The FA3 forward pipeline: rings, roles, ping-pong turns and the walk over key blocks, for any element type.
// The mainloop that derives from it (CRTP: Derived) says what depends on the element type:
//   - TQ, TK, TV: the shared-memory tiles of Q_i, K_j and V_j (TV may hold V_j^T, or V_j of DV < D columns: MLA's
//     narrower v); their BYTES size the rings;
//   - PACKED: whether packed sequences reach it (their copies read "batch" 0 from the sequence's first row);
//   - PAGED: whether paged keys reach it (a paged forward: the general policy with block_table; produce_paged);
//   - load_v(p, tma, tile, bar, bi, k0, row, bk): the copy of V_j, keys k0.. of sequence bi at rows row.. of
//     the tensor, "batch" bk (V is addressed by rows, V^T by keys);
//   - gemm_qk(s, sq, r0, sk): S = Q K^T; gemm_pv(o, pa, sv): O += P V; pack_p(pa, s): S's registers -> P's
//     A fragments of type PA; P_LOG2: the power of two P is scaled by before its cast (0: none); REF: what the
//     softmax subtracts (softmax.cuh's SoftmaxRef: the running max, a fixed bound, the first block's max);
//   - consume (walk plus what surrounds it) and store (the epilogue).
// PRODUCER_REGS / CONSUMER_REGS: registers per thread after the hand-over (launch bounds give every thread
// 65536 / NTHREADS rounded down to 8 before it). QSTAGES: Q_i buffers (1 or 2). DV: O's columns (V's head_dim).
// WC: consumer warpgroups that share 64 rows and split O's columns (1, or 2 with BR = 64); gemm_pv then takes the
// warpgroup's first column of V_j.
template <class Derived, typename T_, class TQ, class TK, class TV, int D, int DV, int BR_, int BC, int STAGES,
          bool OVERLAP, bool PINGPONG, class Pol_, int PRODUCER_REGS, int CONSUMER_REGS, int QSTAGES, int WC = 1>
struct Fa3FwdPipeline {
  using T = T_;  // what the softmax's exp2 and the epilogue's stores are instantiated for
  using Pol = Pol_;
  using Info = typename Pol_::Info;
  // NO: the 8-column tiles of O a consumer warpgroup holds (DV / WC columns)
  static constexpr int BR = BR_, NC = BR_ / 64 * WC, NTHREADS = (NC + 1) * 128, NT = BC / 8, NO = DV / WC / 8;
  static constexpr int ALIGN = 1024, Q_BYTES = TQ::BYTES, K_BYTES = TK::BYTES, V_BYTES = TV::BYTES;
  // Q full / empty per Q_i buffer; K full / empty and V full / empty per stage
  static constexpr int BARRIERS = 2 * QSTAGES + 4 * STAGES;
  // ... and 16 bytes: the index of the tile whose Q_i is (being) copied into each Q_i buffer (the dynamic
  // scheduler's hand-over; 4 bytes each), then V's landed mbarrier (paged keys' last block, PAGED kernels)
  static constexpr int SMEM_BYTES = ALIGN + QSTAGES * Q_BYTES + STAGES * (K_BYTES + V_BYTES) + 8 * BARRIERS + 16;
  static_assert(NC == 2 || NC == 3, "two or three consumer warpgroups");
  static_assert(QSTAGES == 1 || QSTAGES == 2, "one or two Q_i buffers (tile-index slots of 4 bytes before V landed)");
  static_assert(DV <= D && DV % (64 * WC) == 0, "O of whole 64-column panels (each warpgroup's), at most Q's columns");
  static_assert(WC == 1 || (WC == 2 && BR_ == 64), "the column split: two warpgroups on one tile of 64 rows");
  static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * 128 * NC <= launch_regs(NTHREADS) * NTHREADS,
                "setmaxnreg moves registers within the launch's pool");

  struct State {
    Acc<1, NO> o;
    OnlineSoftmax<2> sm;
  };
  // The rings' positions; each side (producer, consumer warpgroups) keeps its own copy.
  struct Pipes {
    PipeState<QSTAGES> q;
    PipeState<STAGES> kv;
    int landed = 0;  // the producer's uses of the V-landed barrier (produce_paged)
    // The Q_i buffer of the tile a consumer has just walked (its epilogue's staging buffer with O_VIA_Q).
    __device__ __forceinline__ int last_q() const { return (q.n + QSTAGES - 1) % QSTAGES; }
  };
  // Shared-memory addresses: the Q_i buffers, then STAGES stages of K_j, then STAGES of V_j, then the mbarriers, then
  // the tile index of each Q_i buffer.
  struct Smem {
    static constexpr int KV0 = QSTAGES * Q_BYTES, QB = 2 * QSTAGES;  // K_j's first stage; K's first barrier
    u32 base;
    __device__ __forceinline__ explicit Smem(char* smem)
        : base(((u32)__cvta_generic_to_shared(smem) + ALIGN - 1) & ~(u32)(ALIGN - 1)) {}
    __device__ __forceinline__ TQ q(int qs) const { return {base + qs * Q_BYTES}; }
    __device__ __forceinline__ TK k(int s) const { return {base + KV0 + s * K_BYTES}; }
    __device__ __forceinline__ TV v(int s) const { return {base + KV0 + STAGES * K_BYTES + s * V_BYTES}; }
    __device__ __forceinline__ u32 bar(int i) const { return base + KV0 + STAGES * (K_BYTES + V_BYTES) + 8 * i; }
    __device__ __forceinline__ u32 q_full(int qs) const { return bar(qs); }
    __device__ __forceinline__ u32 q_empty(int qs) const { return bar(QSTAGES + qs); }
    __device__ __forceinline__ u32 k_full(int s) const { return bar(QB + s); }
    __device__ __forceinline__ u32 k_empty(int s) const { return bar(QB + STAGES + s); }
    __device__ __forceinline__ u32 v_full(int s) const { return bar(QB + 2 * STAGES + s); }
    __device__ __forceinline__ u32 v_empty(int s) const { return bar(QB + 3 * STAGES + s); }
    __device__ __forceinline__ u32 tile(int qs) const { return bar(BARRIERS) + 4 * qs; }
    __device__ __forceinline__ u32 v_landed() const { return bar(BARRIERS) + 8; }
    // One thread: full barriers (V landed too) wait for one arrival (the producer's expect_tx) plus the bytes,
    // empty ones for every consumer thread.
    __device__ __forceinline__ void init() const {
      for (int i = 0; i < BARRIERS; ++i) {
        const bool full = i < QSTAGES || (i >= QB && i < QB + STAGES) || (i >= QB + 2 * STAGES && i < QB + 3 * STAGES);
        mbar_init(bar(i), full ? 1 : NC * 128);
      }
      if constexpr (Derived::PAGED) mbar_init(v_landed(), 1);
      mbar_init_fence();
    }
  };

  __device__ __forceinline__ static bool is_producer() { return warpgroup_id() == NC; }
  // consumers: the warp's first row of the tile, 64 (w / WC) + 16 * its warp in the warpgroup
  __device__ __forceinline__ static int warp_row() {
    if constexpr (WC == 1) return 16 * warp_id();
    else return 64 * (warpgroup_id() / WC) + 16 * warp_in_group();
  }
  // consumers: the first of the DV / WC columns of O the warpgroup holds (0 without the column split)
  __device__ __forceinline__ static int warpgroup_col() {
    if constexpr (WC == 1) return 0;
    else return DV / WC * (uniform_warpgroup_id() % WC);
  }

  // ---------------------------------------------------------------- producer
  __device__ __forceinline__ static bool producer_start(const TmaFwd& tma) {
    regs_release<PRODUCER_REGS>();
    if (warp_id() != 4 * NC) return false;                                   // one warp walks the tiles
    if (lane_id() == 0) {
      tma_prefetch_desc(tma.q);
      tma_prefetch_desc(tma.k);
      tma_prefetch_desc(tma.v);
    }
    return true;
  }
  // The copies of one tile (the scheduler's index `tile`, published for the consumers with Q_i). Coordinates are
  // (column, row, head, batch); packed sequences are one "batch" whose rows start at the sequence's first row.
  __device__ __forceinline__ static void produce(const FwdParams& p, const TmaFwd& tma, const Info& bi, const Pol& pol,
                                                 int q0, int tile, const Smem& sm, Pipes& pipes) {
    const int nrows = min(BR, bi.seqlen_q - q0);
    const BlockRange kv = pol.kv_blocks(q0, nrows, BC);
    const int n = kv.n(), bq = Derived::PACKED && p.cu_seqlens_q ? 0 : bi.b,
              bk = Derived::PACKED && p.cu_seqlens_k ? 0 : bi.b;
    if constexpr (Derived::PAGED)
      if (p.block_table) return produce_paged(p, tma, bi, kv, q0, tile, bq, sm, pipes);
    if (lane_id() != 0) return;
    load_q(tma, bi, q0, tile, bq, sm, pipes);
    // ---- [mainloop_fwd_sm90_ws:load_kv] K_j, then V_j, into the next free stage ----
#pragma unroll 1
    for (int step = 0; step < n; ++step) {
      const int s = pipes.kv.stage(), free = pipes.kv.parity() ^ 1, k0 = kv.block(step) * BC, row = bi.k_row0 + k0;
      mbar_wait(sm.k_empty(s), free);
      mbar_expect_tx(sm.k_full(s), K_BYTES);
      tma_load_tile(tma.k, sm.k(s), sm.k_full(s), 0, row, bi.hk, bk);
      mbar_wait(sm.v_empty(s), free);
      mbar_expect_tx(sm.v_full(s), V_BYTES);
      Derived::load_v(p, tma, sm.v(s), sm.v_full(s), bi, k0, row, bk);
      pipes.kv.advance();
    }
  }

  // ---- [mainloop_fwd_sm90_ws:load_q] Q_i, once the consumers are done with the buffer's previous tile (one lane) ----
  __device__ __forceinline__ static void load_q(const TmaFwd& tma, const Info& bi, int q0, int tile, int bq,
                                                const Smem& sm, Pipes& pipes) {
    const int qs = pipes.q.stage();
    mbar_wait(sm.q_empty(qs), pipes.q.parity() ^ 1);
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sm.tile(qs)), "r"(tile) : "memory");  // released by the arrive
    mbar_expect_tx(sm.q_full(qs), Q_BYTES);
    tma_load_tile(tma.q, sm.q(qs), sm.q_full(qs), 0, bi.q_row0 + q0, bi.h, bq);
    pipes.q.advance();
  }

  // Paged keys (a paged forward): key j of sequence b is row j % page_size of page block_table[b][j / page_size].
  // The k and v maps describe the page pool as (head_dim, page rows, kv heads, pages) in boxes of
  // SEG = gcd(BC, page_size) rows (rawflash/kernels/tma.py's paged_box_rows; page sizes that are not powers of two
  // run the cp.async forms), so a key block is BC / SEG boxes a panel, each inside one page and starting on a
  // whole swizzle atom: lane i of the warp locates box i (one table read, all lanes' reads in flight together) and
  // issues its copies, once lane 0 has found the stage free and armed its barrier with the block's bytes. A box past
  // the sequence's keys names page num_pages, outside the pool, and lands as zeros (no table entry past the used
  // ones is read). The box holding the sequence's last key also brings the rows after it in its page, whatever
  // the cache holds there: K's are masked scores; V's the warp overwrites with zeros once the copies have landed
  // (a zero P times a NaN there is NaN), and only then completes V's full barrier.
  __device__ __forceinline__ static void produce_paged(const FwdParams& p, const TmaFwd& tma, const Info& bi,
                                                       const BlockRange& kv, int q0, int tile, int bq,
                                                       const Smem& sm, Pipes& pipes) {
    constexpr int BC_POW2 = BC & -BC;  // the largest power of two that divides BC
    const int lane = lane_id(), seg = min(p.page_size, BC_POW2);  // gcd(BC, page_size): page sizes are powers of 2
    const bool mine = lane * seg < BC;  // lane i's box: rows i * seg.. of the block
    if (lane == 0) load_q(tma, bi, q0, tile, bq, sm, pipes);
#pragma unroll 1
    for (int step = 0; step < kv.n(); ++step) {
      const int s = pipes.kv.stage(), free = pipes.kv.parity() ^ 1, k0 = kv.block(step) * BC;
      // ---- [mainloop_fwd_sm90_ws:locate_pages] lane i: the page and first row of box i of this key block ----
      int page = p.num_pages, row = 0;
      const int j = k0 + lane * seg;
      if (mine && j < bi.seqlen_k) {
        const int pg = j >> (__ffs(p.page_size) - 1);  // a power of two (forms.hopper_form_fits)
        page = (int)bi.page_slot(p, pg);
        row = j & (p.page_size - 1);
      }
      // ---- [mainloop_fwd_sm90_ws:load_kv_paged] K_j, then V_j, box by box into the next free stage ----
      if (lane == 0) {
        mbar_wait(sm.k_empty(s), free);
        mbar_expect_tx(sm.k_full(s), K_BYTES);
      }
      __syncwarp();
      if (mine) tma_load_rows(tma.k, sm.k(s), sm.k_full(s), lane * seg, row, bi.hk, page);
      const int inside = bi.seqlen_k - k0, stale = min(BC, (inside + seg - 1) / seg * seg) - inside;
      const u32 v_bar = stale > 0 ? sm.v_landed() : sm.v_full(s);  // V's rows past the last key: zeroed first
      if (lane == 0) {
        mbar_wait(sm.v_empty(s), free);
        mbar_expect_tx(v_bar, V_BYTES);
      }
      __syncwarp();
      if (mine) tma_load_rows(tma.v, sm.v(s), v_bar, lane * seg, row, bi.hk, page);
      if (stale > 0) {
        // ---- [mainloop_fwd_sm90_ws:zero_stale_v] rows inside..inside+stale of every panel, then V_j is full ----
        mbar_wait(sm.v_landed(), pipes.landed & 1);
        ++pipes.landed;
        const u32 first = sm.v(s).base + inside * TV::ROW_BYTES, end = first + stale * TV::ROW_BYTES;
        for (u32 at = first + 16 * lane; at < end; at += 16 * 32)  // 16 bytes a lane, in every panel
#pragma unroll
          for (int panel = 0; panel < TV::PANELS; ++panel)
            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(at + panel * TV::PANEL_BYTES), "r"(0)
                         : "memory");
        fence_async_smem();  // the zeros, before the consumers' wgmma (the async proxy) reads them
        __syncwarp();
        if (lane == 0) mbar_arrive(sm.v_full(s));
      }
      pipes.kv.advance();
    }
  }

  // The dynamic scheduler's end: no tile is left, which the consumers learn from Q_i's barrier as for a tile.
  __device__ __forceinline__ static void produce_end(const Smem& sm, Pipes& pipes) {
    if (lane_id() != 0) return;
    const int qs = pipes.q.stage();
    mbar_wait(sm.q_empty(qs), pipes.q.parity() ^ 1);
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sm.tile(qs)), "r"(-1) : "memory");
    mbar_arrive(sm.q_full(qs));
  }

  // ---------------------------------------------------------------- consumers
  // The index the producer published with the next Q_i (-1: none is left), once its barrier has completed; the
  // walk's own wait on that barrier then returns at once.
  __device__ __forceinline__ static int published_tile(const Smem& sm, const Pipes& pipes) {
    const int qs = pipes.q.stage();
    mbar_wait(sm.q_full(qs), pipes.q.parity());
    int tile;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(tile) : "r"(sm.tile(qs)) : "memory");
    return tile;
  }
  // Ping-pong turns: warpgroup w waits on barrier 1 + w and passes the turn to 1 + (w + 1) % NC; 256 threads
  // meet at each (the waiting warpgroup and the one passing the turn).
  __device__ __forceinline__ static void turn_wait() {
    if (PINGPONG) named_sync(1 + warpgroup_id(), 256);
  }
  __device__ __forceinline__ static void turn_pass() {
    if (PINGPONG) named_arrive(1 + (warpgroup_id() + 1) % NC, 256);
  }
  __device__ __forceinline__ static void consumer_start() {
    regs_claim<CONSUMER_REGS>();
    if (PINGPONG && warpgroup_id() == NC - 1) named_arrive(1, 256);          // warpgroup 0 has the first turn
  }
  __device__ __forceinline__ static void consumer_finish() {
    if (PINGPONG && warpgroup_id() == 0) named_sync(1, 256);                 // the last turn passed to it
  }

  // Alg.1 l.5-11 for one tile: every visible key block through the ring, O and the softmax state left in st.
  __device__ __forceinline__ static void walk(const Info& bi, const Pol& pol, int q0, const Smem& sm, Pipes& pipes,
                                              State& st) {
    const int nrows = min(BR, bi.seqlen_q - q0), wg_row = 64 * (uniform_warpgroup_id() / WC), wq = warp_row();
    const int wg_col = warpgroup_col();  // V_j's first column this warpgroup multiplies P by
    const BlockRange kv = pol.kv_blocks(q0, nrows, BC);
    const int n = kv.n();
    const int qs = pipes.q.stage();
    const auto sQ = sm.q(qs);
    // ---- [mainloop_fwd_sm90_ws:init] Alg.1 l.5: O = 0, l = 0, m = -inf; Q_i has landed ----
    Acc<1, NT> s;
    typename Derived::PA pa;
    float fo[2];
    zero(st.o);
    st.sm.init();
    // Derived::REF (softmax.cuh's SoftmaxRef): the running max; a fixed reference for bounded scores; or the
    // first block's max (that block runs the running max's update, the rest keep its reference). Without the
    // running max there is no rescale of O. (Compiled in, not a run-time choice: both softmaxes in one kernel make
    // ptxas spill 68 - 100 B at d = 128 / 256, offline.)
    constexpr int REF = Derived::REF;
    // ALiBi's first block sets the reference from its scores without their bias (Policy::first_ref) and keeps it.
    auto softmax = [&](int step, auto first) {                               // S of block `step` -> P, fo
      constexpr bool FIRST = decltype(first)::value && REF == REF_FIRST;
      const int k0 = kv.block(step) * BC;
      pol.template scores<T>(s, q0 + wq, k0, kv.is_edge(step));
      const float scale = pol.template softmax_scale<T>();
      if constexpr (FIRST) {
        if (pol.biased()) {
          pol.template first_ref<T>(s, q0 + wq, k0, st.sm.m);
          st.sm.template update<T, false, REF_FIRST>(s, scale, fo, Derived::P_LOG2);
          return;
        }
      }
      st.sm.template update<T, false, FIRST ? REF_RUNNING : REF>(s, scale, fo, Derived::P_LOG2, Derived::STALE_LOG2,
                                                                 pol.fixed_ref());
    };
    mbar_wait(sm.q_full(qs), pipes.q.parity());
    pipes.q.advance();
    if (n > 0) {
      // ---- [mainloop_fwd_sm90_ws:first_scores] S_0 = Q_i K_0^T and its softmax ----
      const int s0 = pipes.kv.stage();
      mbar_wait(sm.k_full(s0), pipes.kv.parity());
      turn_wait();
      wgmma_fence();
      Derived::gemm_qk(s, sQ, wg_row, sm.k(s0));
      wgmma_commit();
      turn_pass();
      wgmma_wait<0>();
      mbar_arrive(sm.k_empty(s0));
      softmax(0, Bool<true>{});
      Derived::pack_p(pa, s);
    }
    int prev = pipes.kv.stage(), prev_parity = pipes.kv.parity();           // the stage of block j - 1
    if (n > 0) pipes.kv.advance();
#pragma unroll 1
    for (int j = 1; j < n; ++j) {
      // ---- [mainloop_fwd_sm90_ws:issue] K_j and V_{j-1} have landed: S_j = Q_i K_j^T and O += P_{j-1} V_{j-1} ----
      const int sj = pipes.kv.stage();
      mbar_wait(sm.k_full(sj), pipes.kv.parity());
      mbar_wait(sm.v_full(prev), prev_parity);
      turn_wait();
      fence_operand(st.o);
      wgmma_fence();
      if (OVERLAP) {
        Derived::gemm_qk(s, sQ, wg_row, sm.k(sj));
        wgmma_commit();
      }
      Derived::gemm_pv(st.o, pa, sm.v(prev), wg_col);
      wgmma_commit();
      if (!OVERLAP) {
        Derived::gemm_qk(s, sQ, wg_row, sm.k(sj));
        wgmma_commit();
      }
      turn_pass();
      // ---- [mainloop_fwd_sm90_ws:softmax] Alg.1 l.9 for block j while P_{j-1} V_{j-1} runs, then the rescale ----
      if (OVERLAP) wgmma_wait<1>();
      else wgmma_wait<0>();
      fence_operand(s);
      mbar_arrive(sm.k_empty(sj));
      softmax(j, Bool<false>{});
      wgmma_wait<0>();
      fence_operand(st.o);
      mbar_arrive(sm.v_empty(prev));
      if constexpr (REF == REF_RUNNING)  // Alg.1 l.10: diag(e^(m_old - m_new)) O
        st.sm.template rescale<(Derived::STALE_LOG2 > 0.f)>(st.o, fo);
      Derived::pack_p(pa, s);
      prev = sj;
      prev_parity = pipes.kv.parity();
      pipes.kv.advance();
    }
    // Every product that reads Q_i has been waited for: the producer may bring the next tile's (unless the
    // epilogue stages O in the buffer: it releases the buffer once its TMA store has read O).
    if constexpr (!Derived::O_VIA_Q) mbar_arrive(sm.q_empty(qs));
    if (n > 0) {
      // ---- [mainloop_fwd_sm90_ws:last_pv] the last key block: O += P V alone ----
      mbar_wait(sm.v_full(prev), prev_parity);
      turn_wait();
      fence_operand(st.o);
      wgmma_fence();
      Derived::gemm_pv(st.o, pa, sm.v(prev), wg_col);
      wgmma_commit();
      turn_pass();
      wgmma_wait<0>();
      fence_operand(st.o);
      mbar_arrive(sm.v_empty(prev));
    }
  }
};

// ---------------------------------------------------------------- the 16-bit form
// Tiles of 64-column panels (Sw128); V_j is read MN-major as it lies, so O += P V needs no transpose; P goes
// into the A operand as pairs of 16-bit values (to_a_operand). Registers after the hand-over: the producer keeps
// what its loop needs, the consumers the rest of the 64K. DV < D is the DV form (MLA's narrower v): V_j tiles and
// O of DV columns, so P V costs DV's FLOPs and V's ring DV's bytes; O leaves with v's head_dim (NARROW_V). WC = 2
// is the column split (Base's note): each of the two consumer warpgroups multiplies P by its DV / 2 columns of V_j.
template <typename T_, int D, int BR_, int BC, int STAGES, bool OVERLAP, bool PINGPONG, class Pol_, int QSTAGES = 1,
          bool STAGE_O = false, int REF_ = REF_RUNNING, int DV = D, int WC = 1>
struct MainloopFwdSm90Ws
    : Fa3FwdPipeline<MainloopFwdSm90Ws<T_, D, BR_, BC, STAGES, OVERLAP, PINGPONG, Pol_, QSTAGES, STAGE_O, REF_, DV, WC>,
                     T_, Sw128<T_, BR_, D>, Sw128<T_, BC, D>, Sw128<T_, BC, DV>, D, DV, BR_, BC, STAGES, OVERLAP,
                     PINGPONG, Pol_, BR_ / 64 * WC == 2 ? 40 : 32, BR_ / 64 * WC == 2 ? 232 : 160, QSTAGES, WC> {
  using Base = typename MainloopFwdSm90Ws::Fa3FwdPipeline;
  using typename Base::Info, typename Base::Smem, typename Base::Pipes, typename Base::State;
  static_assert(BC % 16 == 0 && BC <= 256 && D % 64 == 0, "a wgmma N of at most 256; panels of 64 columns");
  static constexpr bool PACKED = true;   // the general policy brings packed sequences
  static constexpr bool PAGED = Pol_::GENERAL;  // ... and paged keys (produce_paged)
  static constexpr bool NARROW_V = DV != D;     // O has v's head_dim (FwdParams::head_dim_v), not q's
  static constexpr float P_LOG2 = 0.f;   // P is cast to 16 bits as it is
  // The softmax's reference (SoftmaxRef; the host's Problem.softmax_ref): without the running max P may exceed 1,
  // which needs P's type to have float32's exponent range (bfloat16). REF_BOUNDED: soft-capped scores without ALiBi
  // (the general policy); REF_FIRST: rows that see their first block's keys if they see any (no left bound;
  // ALiBi's reference from the first block's scores without their bias, Policy::first_ref). (The host keeps both
  // to head_dim <= 128: launch.BOUNDED_MAX_HEAD_DIM.)
  static constexpr int REF = REF_;
  static_assert(REF == REF_RUNNING || Same<T_, __nv_bfloat16>::value, "P above 1: bfloat16 only");
  static_assert(REF != REF_BOUNDED || Pol_::GENERAL, "bounded scores: soft-capping, the general policy");
  // (REF_FIRST under the general policy: the host allows it only without a window's left bound, where a row that
  // sees nothing in its first block sees nothing at all, as in plain attention)
  // REF_FIRST's check, at the end of a tile's walk: a row whose l ends above 2^80 (or not finite) had a P above
  // 2^80 (or an inf), and a row with a reference whose l ends below 2^-60 (ALiBi's reference, Policy::first_ref,
  // can lie far above the row's biased scores; elsewhere the reference's own score gives l >= 1) may have lost
  // its P below float32's range: the warp writes this call's number to the flag, and the REF_RUNNING launch after
  // this one recomputes the call (fa3_fwd_sm90's guard). Rows that see nothing have m = -inf and l = 0.
  __device__ __forceinline__ static void check_ref(const FwdParams& p, const typename Base::State& st) {
    const float top = __int_as_float(0x67800000), bottom = __int_as_float(0x21800000);  // 2^80, 2^-60
    bool bad = false;
#pragma unroll
    for (int r = 0; r < 2; ++r) bad |= !(st.sm.l[r] <= top) || (st.sm.m[r] != -INFINITY && !(st.sm.l[r] >= bottom));
    if (__any_sync(0xffffffffu, bad) && lane_id() == 0 && p.ref_flag)
      *reinterpret_cast<volatile int*>(p.ref_flag) = p.ref_gen;
  }
  // The epilogue through shared memory and a TMA store (Base's note) or from registers: the launch decides
  // (rawflash/kernels/launch.py's fa3_fwd_stage_o, with its measurements). With one Q_i buffer the next tile's Q_i
  // waits for the store to have read the buffer.
  static constexpr bool O_VIA_Q = STAGE_O;
  // (With the column split the other warpgroup may still read Q_i's columns while one stages its O there.)
  static_assert(!STAGE_O || WC == 1, "the column split's epilogue stores from registers");
  static constexpr int EPILOGUE_BARRIER = 1 + Base::NC;  // named barriers 1 + NC + w (ping-pong has 1..NC)
  // FA4's lazy rescale (OnlineSoftmax::update's stale_log2) at head_dim 256, where O's rescale is 2 - 4
  // multiplies per score: +3 - 6 % (H200, bf16, N = 16384; bench/NOTES.md); at 64 and 128 the warp's vote
  // and branch cost more than the multiplies they skip (-2 - 5 %), so those keep the exact max. P <= 2^8 before
  // its 16-bit cast: no range is lost.
  static constexpr float STALE_LOG2 = D >= 256 ? 8.f : 0.f;
  using PA = u32[BC / 16][4];  // P's A fragments, one per 16 keys

  __device__ __forceinline__ static void load_v(const FwdParams&, const TmaFwd& tma, const Sw128<T_, BC, DV>& v,
                                                u32 bar, const Info& bi, int, int row, int bk) {
    tma_load_tile(tma.v, v, bar, 0, row, bi.hk, bk);
  }
  template <class SQ, class SK>
  __device__ __forceinline__ static void gemm_qk(Acc<1, BC / 8>& s, const SQ& sq, int r0, const SK& sk) {
    wg_gemm_abt(s, sq, r0, sk, 0, false);
  }
  // O += P V_j's columns n0.. (the warpgroup's: Base::warpgroup_col)
  template <class SV>
  __device__ __forceinline__ static void gemm_pv(Acc<1, DV / WC / 8>& o, const PA& pa, const SV& sv, int n0) {
    wg_gemm_rb(o, pa, sv, 0, n0);
  }
  __device__ __forceinline__ static void pack_p(PA& pa, const Acc<1, BC / 8>& s) { to_a_operand<T_>(pa, s); }

  __device__ __forceinline__ static void consume(const FwdParams& p, const Info& bi, const Pol_& pol, int q0,
                                                 const Smem& sm, Pipes& pipes, State& st) {
    Base::walk(bi, pol, q0, sm, pipes, st);
    if constexpr (REF == REF_FIRST) check_ref(p, st);
  }
  // FA2 Alg.1 l.12-13. With O_VIA_Q: O_i's rows of this warpgroup, normalised and cast, staged in its rows of the
  // Q_i buffer and stored by one TMA copy per 64-column panel (rows past seqlen_q and columns past head_dim are
  // clipped by the tensor map); lse as in epilogue_fwd. A packed sequence's last tile, where this warpgroup's 64
  // rows run past the sequence (the box would write into the next one), is copied out of the buffer by the
  // warpgroup's threads instead. (A second, register path for that tile makes ptxas rebuild the key
  // loop's wgmma descriptors every step: 610 instructions a step against 584 at d = 64, offline; tools/sass_loops.py
  // shows the counts.)
  __device__ __forceinline__ static void store(const FwdParams& p, const TmaFwd& tma, const Info& bi, const Pol_& pol,
                                               int q0, const Smem& sm, const Pipes& pipes, const State& st) {
    if constexpr (!O_VIA_Q) {
      epilogue_fwd<T_, false, NARROW_V>(p, bi, pol, st.o, st.sm, q0 + Base::warp_row(), 1.f, Base::warpgroup_col());
    } else {
      using TO = Sw128<T_, BR_, DV>;  // O's DV columns in the first panels of the Q_i buffer (same panel stride)
      const int wg = warpgroup_id(), r_wg = 64 * wg, rows = bi.seqlen_q - q0 - r_wg;
      const int qs = pipes.last_q();
      const TO sQ{sm.q(qs).base};
      float f[2], lse[2];
      st.sm.template finalize<T_, false>(pol.sink_log2(p, bi), f, lse);
      // ---- [mainloop_fwd_sm90_ws:stage_o] O_i rows of this warp -> its rows of the Q_i buffer ----
      stage_rows<T_>(sQ, st.o, f, Base::warp_row());
      fence_async_smem();                                // the writes, before the TMA unit reads them
      named_sync(EPILOGUE_BARRIER + wg, 128);
      const bool packed_tail = Pol_::GENERAL && p.cu_seqlens_q && rows < 64;
      if (packed_tail) {
        // ---- [mainloop_fwd_sm90_ws:packed_tail] the rows inside the sequence, 16 bytes a thread at a time ----
        T_* g = bi.template q_like<T_>(p.o, p.o_sb, p.o_ss, p.o_sh) + (long long)(q0 + r_wg) * p.o_ss;
        for (int idx = threadIdx.x & 127; idx < rows * (DV / 8); idx += 128) {
          const int r = idx / (DV / 8), c = (idx % (DV / 8)) * 8;
          uint4 x;
          asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w) : "r"(sQ.addr(r_wg + r, c)));
          if (c < o_head_dim<NARROW_V>(p)) *reinterpret_cast<uint4*>(g + r * p.o_ss + c) = x;  // (multiples of 8)
        }
      } else if ((threadIdx.x & 127) == 0) {
        // ---- [mainloop_fwd_sm90_ws:store_o] one thread: the TMA store, waited for until it has read the buffer ----
        const int bq = p.cu_seqlens_q ? 0 : bi.b;
#pragma unroll
        for (int i = 0; i < TO::PANELS; ++i)
          tma_store_4d(tma.o, sQ.base + i * TO::PANEL_BYTES + r_wg * 128, 64 * i, bi.q_row0 + q0 + r_wg, bi.h, bq);
        bulk_commit();
        bulk_wait_read<0>();
      }
      // The buffer back to the producer: each thread once its own reads are done (the tile index, its copies of a
      // packed tail); the phase completes with the TMA store's thread, after the store has read the buffer.
      mbar_arrive(sm.q_empty(qs));
      store_row_values<1>(p.lse + bi.row0, lse, q0 + Base::warp_row(), bi.seqlen_q);
    }
  }
};

}  // namespace rf
