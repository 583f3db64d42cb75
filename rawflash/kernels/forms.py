"""Which form of a variant runs a call: the one place the choice (arch, dtype, head_dim, switches) is made.

A call's plan is the list of launches it makes, in order, each from ``launch.py``'s formulas with the tile row
``configs.py`` gives for the chosen form. The backends run plans; ``rawflash explain``, the IO model, the
occupancy report and the compile tests read the same plans, so what they show is what runs.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

from ..problem import Problem, cdiv
from ..settings import DV_BOTH, Settings
from . import configs, launch, registry, tma
from .configs import TileConfig
from .launch import Launch

# Tile rows that replace configs' (tools/tune.py's candidates): keyed like configs.TABLE, (kernel, head_dim, dtype), or
# like configs.VALUE_ROWS, (kernel, head_dim, head_dim_v, dtype), for a DV form's row.
Override = dict[tuple, TileConfig]


@dataclasses.dataclass(frozen=True)
class Switches:
    """The forward's ablation switches: FA2's three ideas, and on Hopper the wgmma forms and FA3's ideas.

    ``wgmma``: None (default) runs a wgmma form wherever it can (unless the settings say ``RAWFLASH_WGMMA=0``),
    True demands it (ValueError where it cannot run), False forces the mma.sync form.
    ``warp_specialize``: the same choice between FA3's form (a TMA producer warpgroup and consumer warpgroups,
    fa3_fwd_sm90) and the wgmma form without it (every thread copies with cp.async, fa2_fwd_sm90).
    ``overlap``: FA3's softmax / P V overlap inside a warpgroup (both wgmma forms); ``pingpong``: its schedule
    between consumer warpgroups and ``persistent``: one CTA per SM walking the tiles (fa3_fwd_sm90 only; None:
    see ``persistent_default``); ``dynamic``: a persistent grid's CTAs take the next tile from a counter when they
    are ready for it (False: the static schedule, tile t on CTA t % grid; None: see ``fa3_dynamic``).
    """

    defer_norm: bool = True
    seq_parallel: bool = True
    split_q: bool = True
    wgmma: bool | None = None
    overlap: bool = True
    warp_specialize: bool | None = None
    pingpong: bool = True
    persistent: bool | None = None
    dynamic: bool | None = None

    @property
    def ideas_on(self) -> bool:
        return self.defer_norm and self.seq_parallel and self.split_q

    @property
    def given(self) -> dict:
        """The switches that differ from the defaults."""
        default = Switches()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


ABLATIONS: dict[str, Switches] = {  # FA2's ideas, measured on the mma.sync form that has switches for them
    "fa2": Switches(wgmma=False),
    "no-deferred-norm": Switches(defer_norm=False),
    "no-seq-parallel": Switches(seq_parallel=False),
    "no-split-q": Switches(split_q=False),
    "none (all three off)": Switches(defer_norm=False, seq_parallel=False, split_q=False),
    # and what Hopper's warpgroup products add on top of full FA2 (sm_90 only), with and without FA3's overlap
    "wgmma": Switches(wgmma=True, warp_specialize=False),
    "wgmma, no overlap": Switches(wgmma=True, warp_specialize=False, overlap=False),
    # FA3's form (TMA producer, consumer warpgroups) with each of its ideas taken away in turn
    "fa3": Switches(wgmma=True, warp_specialize=True),
    "fa3, no ping-pong": Switches(wgmma=True, warp_specialize=True, pingpong=False),
    "fa3, no overlap": Switches(wgmma=True, warp_specialize=True, overlap=False),
    "fa3, persistent": Switches(wgmma=True, warp_specialize=True, persistent=True, dynamic=True),
    "fa3, persistent, static": Switches(wgmma=True, warp_specialize=True, persistent=True, dynamic=False),
    "fa3, not persistent": Switches(wgmma=True, warp_specialize=True, persistent=False),
}


def persistent_default(p: Problem) -> bool:
    """FA3's persistent grid by default wherever the sequences have fixed lengths, every mask included: its
    dynamic schedule (CTAs take the next tile from a counter, ``DynamicTileScheduler``) balances unequal causal
    tiles as the hardware's dispatch of one CTA per tile does, and overlaps each tile's end with the next one's
    copies (H200, bf16, d = 128, causal: N = 1024 366 against 323 TFLOP/s one tile per CTA, N = 16384 703 against
    692, where the static schedule gives 442; bench/NOTES.md). Packed sequences and ``seqused_k`` run one CTA per tile:
    their tiles are unequal without a mask,
    and the dynamic scheduler does not walk packed tiles."""
    return not p.varlen and not p.seqused_k


def fa3_dynamic(p: Problem, sw: Switches) -> bool:
    """Whether a persistent FA3 grid takes its tiles from the counter: the switch when given; by default under a
    mask (unequal tiles), while without one the static schedule balances the equal tiles already at d = 64 / 128
    (H200, bf16: static 1 - 4 % faster for N <= 1024 and 2 % at N = 16384); the 16-bit d = 256 forward takes the
    counter without a mask too (1 - 5 % faster: its long tiles end unevenly; bench/NOTES.md). Never for packed
    sequences, which only the static schedule walks (its holes between sequences)."""
    if p.varlen:
        return False
    if sw.dynamic is not None:
        return sw.dynamic
    return (launch.mask_mode(p) != launch.NO_MASK
            or (configs.padded_head_dim(p.head_dim) >= 256 and p.dtype != configs.FP8))


def short_causal(p: Problem) -> bool:
    """Whether ``p`` takes configs.SHORT_CAUSAL_ROWS: plain causal attention over at most SHORT_CAUSAL_SEQLEN keys."""
    return launch.mask_mode(p) == launch.CAUSAL and not p.general and p.seqlen_k <= configs.SHORT_CAUSAL_SEQLEN


def short_full(p: Problem) -> bool:
    """Whether ``p`` takes configs.SHORT_FULL_ROWS: plain attention without a mask over at most SHORT_FULL_SEQLEN
    keys."""
    return launch.mask_mode(p) == launch.NO_MASK and not p.general and p.seqlen_k <= configs.SHORT_FULL_SEQLEN


def short_window(p: Problem) -> bool:
    """Whether ``p`` takes configs.WINDOW_ROWS: a window bounded on both sides (causal bounds the right at 0) whose
    keys beside the diagonal number at most SHORT_WINDOW_SPAN."""
    left, right = p.window_bounds
    return (launch.mask_mode(p) == launch.WINDOW and left >= 0 and right >= 0
            and left + right <= configs.SHORT_WINDOW_SPAN)


def many_decode_rows(p: Problem) -> bool:
    """Whether ``p`` takes configs.MANY_ROWS_DECODE: more than MANY_DECODE_ROWS packed query rows per kv head."""
    return (p.heads // p.kv_heads) * p.seqlen_q > configs.MANY_DECODE_ROWS


def long_bwd(p: Problem) -> bool:
    """Whether ``p`` takes configs.LONG_BWD_ROWS (the backward's 80-row tile): plain attention over at least the
    GPU's ``long_bwd_seqlen`` query rows without a mask, ``long_causal_bwd_seqlen`` causal (configs.GATES)."""
    mask = launch.mask_mode(p)
    if p.general or mask not in (launch.NO_MASK, launch.CAUSAL):
        return False
    g = configs.gates(p.gpu)
    return p.seqlen_q >= (g.long_bwd_seqlen if mask == launch.NO_MASK else g.long_causal_bwd_seqlen)


def paged_keys(p: Problem) -> bool:
    """A paged forward whose pages FA3's form reads (configs.PAGED_ROWS; tma.tma_pages is False for 0)."""
    return tma.tma_pages(p.page_size)


SITUATIONS = {"paged_keys": paged_keys, "short_causal": short_causal, "short_full": short_full,
              "short_window": short_window, "many_decode_rows": many_decode_rows, "long_bwd": long_bwd}


def situations(p: Problem) -> tuple[str, ...]:
    """The names of configs.SITUATION_ROWS whose predicate holds for ``p`` (each row is keyed by its kernel, so a
    decode situation never changes a forward's row)."""
    return tuple(name for name, holds in SITUATIONS.items() if holds(p))


# The largest softcap whose scores take the FA3 forward's fixed softmax reference (bounded_scores): with the
# reference softcap log2(e) - 56 (policy.cuh's FIXED_TOP_LOG2) P stays in [2^-88.3, 2^56] up to softcap 50.
BOUNDED_SOFTCAP_MAX = 50.0
# ... and the head dims that take it (and softmax_ref's REF_FIRST): d <= 128. At d = 256 one GPU test's dQ comes out
# 1.5x past its bound with it (softcap 30, causal, 203 x 113, MQA; not understood: an open problem in
# bench/NOTES.md), and soft-capping costs d = 256 9 % without it.
BOUNDED_MAX_HEAD_DIM = 128


def p_above_one(p: Problem) -> bool:
    """Whether the FA3 forward's P may exceed 1 (a softmax reference other than the running max): bfloat16 (P has
    float32's exponent range) at head_dim <= BOUNDED_MAX_HEAD_DIM."""
    return p.dtype == "bfloat16" and configs.padded_head_dim(p.head_dim) <= BOUNDED_MAX_HEAD_DIM


def bounded_scores(p: Problem) -> bool:
    """Whether every score is bounded in a range the softmax can take a fixed reference for (policy.cuh's
    Policy::fixed_ref: no running max, no rescale of O): soft-capped (softcap <= BOUNDED_SOFTCAP_MAX) scores without
    ALiBi where :func:`p_above_one`. The FA3 forward compiles it in (its REF_BOUNDED instantiations); the other forms
    ignore it."""
    return p_above_one(p) and 0 < p.softcap <= BOUNDED_SOFTCAP_MAX and not p.alibi


def softmax_ref(p: Problem) -> int:
    """What the FA3 16-bit forward's softmax subtracts (softmax.cuh's SoftmaxRef, ``launch.REF_*``): a fixed
    reference for bounded scores; for bfloat16 attention without a window's left bound its rows' first block's max
    (under ALiBi, of the scores without their bias, less the bias of the row's nearest key: policy.cuh's
    Policy::first_ref), kept for the rest of the row (no max, no rescale of O: the running max costs 9 - 16 % of the
    forward at d <= 128, bench/NOTES.md), checked at the end of every row, with a REF_RUNNING launch after it that
    recomputes the call where the check failed (:func:`forward_plan`); else the running max. The first block
    visited holds key 0 of each row's range: a left-bounded window may hide it from a row that sees keys later.
    float16's P (<= 2^16) has too little range for either; head dims above BOUNDED_MAX_HEAD_DIM keep it too (d = 256
    gains 3 - 4 % without it, and its REF_BOUNDED kernel failed a dQ test that is not understood)."""
    if bounded_scores(p):
        return launch.REF_BOUNDED
    return launch.REF_FIRST if p_above_one(p) and p.window_bounds[0] < 0 else launch.REF_RUNNING


def runs_head_dim(head_dim: int, dtype: str, kernel: str = "fa2") -> bool:
    """Whether the forms run ``head_dim`` in ``dtype`` for the API's ``kernel``: every one up to
    configs.COMMON_MAX_HEAD_DIM; above it (the rows at configs.WIDE_HEAD_DIM) float16 / bfloat16 with kernel='fa2' or
    'naive'."""
    return head_dim <= configs.COMMON_MAX_HEAD_DIM or (dtype in registry.HALF_DTYPES and kernel in ("fa2", "naive"))


def _config(kernel: str, p: Problem, override: Override | None) -> TileConfig:
    """The row of ``kernel`` for ``p`` on its GPU (decode with an FP8 cache: the cache's dtype keys it); ValueError
    naming the kernel where it has none (validation refuses such calls first: this is the last word)."""
    dtype = p.kv_dtype or p.dtype
    if not configs.has_row(kernel, p.head_dim, dtype) and not (override and (
            kernel, configs.padded_head_dim(p.head_dim), dtype) in override):
        raise ValueError(f"{kernel} has no tile row for head_dim {p.head_dim} in {dtype} (head dims above "
                         f"{configs.COMMON_MAX_HEAD_DIM} run the fa2 forward and backward in float16 / bfloat16 only)")
    return configs.tile_config(kernel, configs.padded_head_dim(p.head_dim), dtype, p.arch, override, p.general,
                               situations(p), p.gpu)


def hopper_form_fits(kernel: str, p: Problem) -> bool:
    """Whether the sm_90 form ``kernel`` can run ``p``: an sm_90 GPU (wgmma is sm_90a code), one of the form's
    dtypes, and a tile row at the specialised head_dim. FA3's forward reads a paged forward's keys in pages of a
    power of two rows (tma.tma_pages)."""
    form = registry.form(kernel)
    if kernel == "fa3_fwd_sm90" and p.page_size and not paged_keys(p):
        return False
    return p.arch == "sm_90" and p.dtype in form.dtypes and configs.has_row(kernel, p.head_dim, p.dtype)


def value_form(p: Problem, settings: Settings = Settings(), kernel: str = "fa3_fwd_sm90") -> bool:
    """Whether FA3's forward (``kernel`` fa3_fwd_sm90) or backward (fa3_bwd_sm90) reads MLA's narrower v at its own
    head_dim (the DV form: V_j and O, in the backward V_j, dO_i and dV_j, of head_dim_v columns) for ``p``: the
    settings take ``kernel``'s DV form (RAWFLASH_DV_FORM: both by default), a ``head_dim_v`` whose pair
    of compiled head dims has a row of ``kernel`` in configs.VALUE_ROWS, sm_90, 16-bit, keys not paged. Elsewhere
    v runs zero-padded to q's head_dim."""
    return kernel in settings.dv_form and bool(p.head_dim_v) and p.arch == "sm_90" and not p.page_size and \
        _value_row(p, kernel) is not None


def _value_row(p: Problem, kernel: str, override: Override | None = None) -> TileConfig | None:
    """configs.VALUE_ROWS' row of ``kernel`` for ``p``'s head dims as the FA3 forms compile them (None: no DV
    form), or ``override``'s row under the same key where it has one and configs.VALUE_ROWS has the pair."""
    key = (kernel, launch.tma_head_dim(p), launch.tma_value_head_dim(p), p.dtype)
    row = configs.value_row(*key)
    return override[key] if row is not None and override and key in override else row


def _value_problem(p: Problem, settings: Settings, kernel: str) -> Problem:
    """``p`` as ``kernel``'s plan sees it: with its head_dim_v where that kernel's DV form runs it, else without (v
    zero-padded to q's head_dim: the kernels see one head_dim)."""
    return dataclasses.replace(p, head_dim_v=0) if p.head_dim_v and not value_form(p, settings, kernel) else p


def reads_value_head_dim(lau: Launch) -> bool:
    """Whether a launch reads v (and O, dO; writes O, dV) at v's own head_dim: the DV form of FA3's forward or
    backward. Every other launch of a call with a narrower v reads it zero-padded to q's head_dim
    (cupy_backend.bind_forward, bind_backward)."""
    pos = launch.DV_ARG.get(lau.kernel)
    return pos is not None and lau.template_args[pos] != lau.template_args[launch.D_ARG]


def _use_wgmma(wgmma: bool | None, eligible: bool, kernel: str, also: str, got: str, settings: Settings) -> bool:
    """The choice of a ``wgmma`` switch: None picks the wgmma form wherever it is ``eligible`` unless the settings
    turn it off; True demands it (ValueError where it cannot run); False refuses it."""
    if wgmma is None:
        return eligible and settings.wgmma
    if wgmma and not eligible:
        dims = sorted(d for (k, d, dt) in configs.TABLE if k == kernel and dt == "bfloat16")
        what = " (backward)" if kernel.startswith("fa2_bwd") else ""
        raise ValueError(f"wgmma=True{what} needs an sm_90 GPU, float16 or bfloat16, a head_dim that pads to one of "
                         f"{dims}{also}; got {got}")
    return wgmma


def fp8_forward(p: Problem, sw: Switches = Switches(), override: Override | None = None) -> list[Launch]:
    """The FP8 forward's launches: the V^T pre-pass, then FA3's form on e4m3 (sm_90 only, every FA3 switch but
    warp_specialize=False and wgmma=False, which have no FP8 form)."""
    if p.arch != "sm_90" or not configs.has_row("fa3_fwd_sm90_fp8", p.head_dim, p.dtype):
        raise ValueError(f"float8_e4m3fn inputs need an sm_90 GPU (Hopper) and head_dim <= "
                         f"{configs.COMMON_MAX_HEAD_DIM}; "
                         f"got arch {p.arch}, head_dim {p.head_dim}")
    off = [name for name in ("wgmma", "warp_specialize", "defer_norm", "seq_parallel", "split_q")
           if getattr(sw, name) is False]
    if off:
        raise ValueError(f"{off[0]}=False has no FP8 form (float8_e4m3fn runs FA3's form only); got {off[0]}=False "
                         "with float8_e4m3fn inputs")
    cfg = _config("fa3_fwd_sm90_fp8", p, override)
    main = launch.fa3_fwd_sm90_fp8(p, cfg, p.out_dtype or "bfloat16", overlap=sw.overlap, pingpong=sw.pingpong,
                                   persistent=persistent_default(p) if sw.persistent is None else sw.persistent,
                                   dynamic=fa3_dynamic(p, sw))
    return [launch.fp8_vt_permute(p, cfg.bc), main]


def fa2_forward(p: Problem, sw: Switches = Switches(), settings: Settings = Settings(),
                override: Override | None = None) -> Launch:
    """The fa2 forward launch: its wgmma form where the switches and the GPU allow it, else the mma.sync form."""
    p = _value_problem(p, settings, "fa3_fwd_sm90")
    if p.head_dim > configs.COMMON_MAX_HEAD_DIM and not sw.ideas_on:
        off = next(n for n in ("defer_norm", "seq_parallel", "split_q") if not getattr(sw, n))
        raise ValueError(f"{off}=False (the ablation) runs head_dim up to {configs.COMMON_MAX_HEAD_DIM}: the head_dim "
                         f"{configs.WIDE_HEAD_DIM} forward has the split-Q form with every FA2 idea on only; got "
                         f"head_dim {p.head_dim}")
    got = (f"arch {p.arch}, {p.dtype}, head_dim {p.head_dim}, defer_norm={sw.defer_norm}, "
           f"seq_parallel={sw.seq_parallel}, split_q={sw.split_q}")
    fa3 = sw.ideas_on and hopper_form_fits("fa3_fwd_sm90", p)
    if sw.warp_specialize and p.page_size and not paged_keys(p):
        raise ValueError(f"warp_specialize=True (FA3's TMA form) reads paged keys in pages of a power of two rows; "
                         f"got page_size {p.page_size}")
    if sw.warp_specialize and not (fa3 and sw.wgmma is not False):
        raise ValueError(f"warp_specialize=True needs an sm_90 GPU, float16 or bfloat16, wgmma not False and every "
                         f"FA2 switch on; got {got}, wgmma={sw.wgmma}")
    if _use_wgmma(sw.wgmma, fa3 or (sw.ideas_on and hopper_form_fits("fa2_fwd_sm90", p)), "fa2_fwd_sm90",
                  " and every FA2 switch on", got, settings):
        use_fa3 = (fa3 and settings.warp_specialize) if sw.warp_specialize is None else sw.warp_specialize
        if use_fa3:
            cfg = _value_row(p, "fa3_fwd_sm90", override) if p.head_dim_v else _config("fa3_fwd_sm90", p, override)
            return launch.fa3_fwd_sm90(p, cfg, ref=softmax_ref(p),
                                       overlap=sw.overlap, pingpong=sw.pingpong,
                                       persistent=persistent_default(p) if sw.persistent is None else sw.persistent,
                                       dynamic=fa3_dynamic(p, sw))
        if hopper_form_fits("fa2_fwd_sm90", p):
            return launch.fa2_fwd_sm90(p, _config("fa2_fwd_sm90", p, override), overlap=sw.overlap)
        if sw.warp_specialize is False or sw.wgmma:  # asked for by the call: refused, not replaced
            dims = sorted(d for (k, d, dt) in configs.TABLE if k == "fa2_fwd_sm90" and dt == p.dtype)
            raise ValueError(f"warp_specialize=False on Hopper runs the cp.async wgmma form, which needs a head_dim "
                             f"that pads to one of {dims}; got {got}, wgmma={sw.wgmma}")
        # the settings' RAWFLASH_FA3=0 at a head_dim the cp.async form has no row for: the mma.sync form
    row = "fa2_fwd" if sw.split_q else "fa2_fwd_splitk"
    return launch.fa2_fwd(p, _config(row, p, override), defer_norm=sw.defer_norm, seq_parallel=sw.seq_parallel,
                          split_q=sw.split_q)


def forward_plan_without_tma(p: Problem, kernel: str = "fa2", switches: Switches = Switches(),
                             settings: Settings = Settings(), override: Override | None = None) -> list[Launch]:
    """The plan of the same forward call without FA3's form, for inputs TMA cannot describe (an empty tensor, a
    stride off the 16-byte grid): the cp.async wgmma form where it runs, else the mma.sync form."""
    try:
        return forward_plan(p, kernel, dataclasses.replace(switches, warp_specialize=False), settings, override)
    except ValueError:
        return forward_plan(p, kernel, dataclasses.replace(switches, warp_specialize=None, wgmma=False), settings,
                            override)


def ordered_dq_config(p: Problem, cfg: TileConfig) -> TileConfig:
    """The tile row of FA3's deterministic backward for a call whose default backward runs ``cfg``: the same, but
    the GPU's row without a situation where ``cfg`` is the 80-row tile (launch.FA3_BWD_SWAP_ROWS), whose single
    dQ_i buffer the ordered dQ's two writer warps cannot share."""
    if cfg.br != launch.FA3_BWD_SWAP_ROWS:
        return cfg
    return configs.tile_config("fa3_bwd_sm90", configs.padded_head_dim(p.head_dim), p.dtype, p.arch, None, p.general,
                               gpu=p.gpu)


def fa2_backward_main(p: Problem, atomic_dq: bool, wgmma: bool | None = None, settings: Settings = Settings(),
                      override: Override | None = None, warp_specialize: bool | None = None) -> Launch:
    """The backward's main pass: for the atomic-dQ pass on Hopper FA3's warp-specialised form where it fits (every
    head_dim; 192 and 256 by its column split; MLA's narrower v in its DV form where ``value_form`` says so), else
    the cp.async wgmma form, else mma.sync."""
    p = _value_problem(p, settings, "fa3_bwd_sm90")
    fa3 = atomic_dq and hopper_form_fits("fa3_bwd_sm90", p)
    if _use_wgmma(wgmma, fa3 or (atomic_dq and hopper_form_fits("fa2_bwd_sm90", p)), "fa2_bwd_sm90",
                  " and the atomic dQ pass", f"arch {p.arch}, {p.dtype}, head_dim {p.head_dim}, atomic_dq={atomic_dq}",
                  settings):
        use_fa3 = (fa3 and settings.warp_specialize) if warp_specialize is None else warp_specialize
        if use_fa3 and fa3:
            cfg = _value_row(p, "fa3_bwd_sm90", override) if p.head_dim_v else _config("fa3_bwd_sm90", p, override)
            return launch.fa3_bwd_sm90(p, cfg)
        if use_fa3:
            raise ValueError(f"warp_specialize=True (backward) needs an sm_90 GPU, float16 or bfloat16 and the atomic "
                             f"dQ pass; got arch {p.arch}, {p.dtype}, head_dim {p.head_dim}, atomic_dq={atomic_dq}")
        if atomic_dq and hopper_form_fits("fa2_bwd_sm90", p):
            return launch.fa2_bwd_sm90(p, _config("fa2_bwd_sm90", p, override))
    return launch.fa2_bwd(p, _config("fa2_bwd", p, override), atomic_dq=atomic_dq)


def checks_ref(lau: Launch) -> bool:
    """Whether a launch is an FA3 16-bit forward with the first block's reference (REF_FIRST), which a REF_RUNNING
    launch must follow."""
    return lau.kernel == "fa3_fwd_sm90" and lau.template_args[launch.REF_ARG] == launch.REF_FIRST


def way_back(lau: Launch) -> Launch:
    """The REF_RUNNING twin of a REF_FIRST launch (same tiles, grid and switches): launched after it with the
    same parameters, it recomputes the call only where the first one's check failed (fa3_fwd_sm90.cu's guard)."""
    args = list(lau.template_args)
    args[launch.REF_ARG] = launch.REF_RUNNING
    return dataclasses.replace(lau, template_args=tuple(args))


def with_way_back(lau: Launch) -> list[Launch]:
    return [lau, way_back(lau)] if checks_ref(lau) else [lau]


def forward_plan(p: Problem, kernel: str = "fa2", switches: Switches = Switches(), settings: Settings = Settings(),
                 override: Override | None = None) -> list[Launch]:
    """Every launch a forward call makes, in order (the naive kernel's matrix products are cuBLAS calls, not listed)."""
    if p.page_size and p.arch != "sm_90":  # (a paged forward's load path is Hopper's)
        raise ValueError(f"a paged forward (block_table) needs an sm_90 GPU (Hopper), got {p.arch}")
    if kernel == "fa2" and p.dtype == configs.FP8:
        return fp8_forward(p, switches, override)
    if kernel == "fa2":
        return with_way_back(fa2_forward(p, switches, settings, override))
    if kernel == "fa1":
        return [launch.fa1_fwd(p, _config("fa1_fwd", p, override)), launch.fa1_finalize(p)]
    if kernel == "naive":
        return [launch.naive_softmax(p)]
    raise ValueError(f"kernel must be one of {', '.join(map(repr, registry.api_kernels()))}, got {kernel!r}")


def backward_plan(p: Problem, deterministic: bool = False, settings: Settings = Settings(),
                  override: Override | None = None, wgmma: bool | None = None) -> list[Launch]:
    """Every launch a backward call makes, in order. ``deterministic``: where the default main pass is FA3's form
    with 64 keys per consumer (Hopper, 16-bit, head_dim <= 128), that form with its dQ reduce-adds in a fixed order
    and the same convert pass; elsewhere (its column split at head_dim 192 / 256 included) the main pass without
    atomic dQ and a separate dQ pass (fa2_bwd_dq). Head dims above COMMON_MAX_HEAD_DIM (the 512 forms) take that
    two-pass plan whether asked or not: its dQ pass, with no atomics, beats the main pass's atomic dQ there (1.26 -
    1.30x at 512 on an H100, bench/NOTES.md A10). MLA's narrower v: the FA3 form's DV form where ``value_form``
    says so (its launches then read v, dout and out at v's head_dim: ``reads_value_head_dim``)."""
    p = _value_problem(p, settings, "fa3_bwd_sm90")
    pre = launch.fa2_bwd_preprocess(p)
    if deterministic or p.head_dim > configs.COMMON_MAX_HEAD_DIM:
        main = fa2_backward_main(p, True, wgmma, settings, override) if hopper_form_fits("fa3_bwd_sm90", p) else None
        if main is not None and main.kernel == "fa3_bwd_sm90" and not launch.fa3_bwd_split_d(main.config):
            return [pre, launch.fa3_bwd_sm90(p, ordered_dq_config(p, main.config), deterministic=True),
                    launch.fa2_bwd_convert_dq(p)]
        return deterministic_without_fa3(p, wgmma, settings, override)
    return [pre, fa2_backward_main(p, True, wgmma, settings, override), launch.fa2_bwd_convert_dq(p)]


def backward_plan_without_tma(p: Problem, deterministic: bool = False, settings: Settings = Settings(),
                              override: Override | None = None) -> list[Launch]:
    """The plan of the same backward call without FA3's form, for inputs TMA cannot describe (a stride off the
    16-byte grid): deterministic, the main pass without atomic dQ and fa2_bwd_dq; else the cp.async wgmma form
    whose threads all copy, or mma.sync."""
    if deterministic:
        return deterministic_without_fa3(p, settings=settings, override=override)
    return [launch.fa2_bwd_preprocess(p), fa2_backward_main(p, True, None, settings, override, warp_specialize=False),
            launch.fa2_bwd_convert_dq(p)]


def deterministic_without_fa3(p: Problem, wgmma: bool | None = None, settings: Settings = Settings(),
                              override: Override | None = None) -> list[Launch]:
    """The deterministic backward without FA3's form (other GPUs and dtypes, ``warp_specialize`` off, or inputs
    TMA cannot describe): the main pass without atomic dQ, then fa2_bwd_dq."""
    return [launch.fa2_bwd_preprocess(p), fa2_backward_main(p, False, wgmma, settings, override),
            launch.fa2_bwd_dq(p, _config("fa2_bwd_dq", p, override))]


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """A decode call's launches and its split count; sequence b's keys are cut on the device into num_splits
    runs of cdiv(cdiv(keys_b, bc), num_splits) tiles (the host never reads cache_seqlens). ``split_appends``:
    decode_split writes k_new / v_new itself (``decode_split_appends``), so no decode_append is launched."""

    launches: tuple
    num_splits: int
    split_appends: bool = False
    partials: int = 1    # partial results per output row: one per CTA of decode_split (its warps' splits merged)
    fused: bool = False  # decode_split's last CTAs merge the partials (no combine launch): decode_fuses_combine

    @property
    def split(self) -> Launch:
        """The split-KV pass's launch (decode_split)."""
        return next(lau for lau in self.launches if lau.kernel == "decode_split")

    @property
    def row_groups(self) -> int:
        """(batch, kv head, row group) triples, the fused combine's counters: decode_split's grid y x z."""
        return self.split.grid[1] * self.split.grid[2]


MAX_SPLITS = launch.DECODE_MAX_SPLITS
# The split model's two constants (H200, bf16; bench/NOTES.md, decode): the HBM read rate a
# full grid reaches, and the time one warp waits for each tile it has in flight when the grid is too small to
# be bandwidth-bound (a loaded round trip plus the tile's own work).
DECODE_BYTES_PER_US = 4.0e6
DECODE_TILE_WAIT_US = 2.0


def decode_ctas_per_sm(p: Problem, cfg: TileConfig) -> int:
    """CTAs of decode_split one SM holds: by shared memory (227 KB per SM, 1 KB reserved per CTA), threads (2048)
    and registers (assumed <= 128 per thread, which ptxas reports for the 16-bit rows), at most 32."""
    d, dv = launch.decode_head_dims(p)
    smem = launch.smem_decode_split(cfg, d, p.itemsize, p.kv_itemsize, dv)
    return max(1, min(32, 233472 // (smem + 1024), 2048 // cfg.threads, 65536 // (cfg.threads * 128)))


def decode_split_cost(p: Problem, cfg: TileConfig, splits: int, sms: int = 132) -> float:
    """Modelled microseconds of a decode call's split pass and combine with ``splits`` splits (the heuristic's
    objective; only its ordering matters).

    The (batch, kv head, row group) pairs each run cdiv(splits, warps) CTAs of up to ``warps`` splits, every split
    cdiv(tiles, splits) key tiles of the cache's capacity. CTAs run in waves of ``sms x ctas per SM``; a wave takes
    the longer of its bytes over the HBM rate and its splits' latency chain (each warp keeps stages - 1 tiles in
    flight and waits DECODE_TILE_WAIT_US for them). The partial results add their bytes (written and read back,
    float32), and the combine a latency chain of one wait per 4 splits each of its threads sums.
    """
    rows, groups = launch.decode_rows(p, cfg)
    pairs = p.batch * p.kv_heads * groups
    tiles = cdiv(max(1, p.seqlen_k), cfg.bc)
    per_split = cdiv(tiles, splits)
    per_pair = launch.decode_partials(cfg, splits)
    ctas, slots = pairs * per_pair, sms * decode_ctas_per_sm(p, cfg)
    d, dv = launch.decode_head_dims(p)
    tile_bytes = (1 if dv != d else 2) * cfg.bc * d * p.kv_itemsize  # (the latent cache: one tile holds K and V)
    cta_bytes = splits / per_pair * per_split * tile_bytes
    chain = per_split * DECODE_TILE_WAIT_US / max(1, cfg.stages - 1)
    full, rest = divmod(ctas, slots)
    t = full * max(chain, slots * cta_bytes / DECODE_BYTES_PER_US)
    if rest:
        t += max(chain, rest * cta_bytes / DECODE_BYTES_PER_US)
    if splits > 1:
        out_rows = p.batch * p.seqlen_q * p.heads
        t += 2 * out_rows * splits * (p.value_head_dim + 1) * 4 / DECODE_BYTES_PER_US
        split_groups = max(1, launch.DECODE_COMBINE_THREADS // max(1, p.value_head_dim // 4))
        t += DECODE_TILE_WAIT_US * cdiv(cdiv(splits, split_groups), 4)
    return t


def decode_occupancy(p: Problem, cfg: TileConfig, splits: int, sms: int = 132) -> float:
    """The share of the warp slots of decode_split's waves (whole waves of ``sms`` x CTAs per SM) that hold a split:
    1 for full waves of full CTAs (the heuristic's tie-break)."""
    pairs = p.batch * p.kv_heads * launch.decode_rows(p, cfg)[1]
    per_pair = launch.decode_partials(cfg, splits)
    ctas, slots = pairs * per_pair, sms * decode_ctas_per_sm(p, cfg)
    return ctas / (cdiv(ctas, slots) * slots) * splits / (per_pair * launch.decode_splits_per_cta(cfg))


@functools.lru_cache(maxsize=4096)
def _best_splits(p: Problem, cfg: TileConfig, sms: int) -> int:
    tiles = cdiv(max(1, p.seqlen_k), cfg.bc)
    costs = [(decode_split_cost(p, cfg, s, sms), s) for s in range(1, min(MAX_SPLITS, tiles) + 1)]
    best = min(c for c, _ in costs)
    near = [s for c, s in costs if c <= 1.02 * best]
    # within 2 % of the best: the fullest waves (the model is optimistic where a small grid just reaches the
    # bandwidth), then the fewest splits
    return min(near, key=lambda s: (-round(decode_occupancy(p, cfg, s, sms), 3), s))


def decode_splits(p: Problem, cfg: TileConfig, sms: int = 132) -> int:
    """How many splits decode cuts every sequence's keys into when the caller does not say (``num_splits=None``).

    The split count from 1 to min(256, key tiles of the capacity) that minimises ``decode_split_cost``; among
    those within 2 % of the best, the one whose waves are fullest (``decode_occupancy``), then the fewest. What
    the model trades: more splits give more CTAs (a small batch or
    few kv heads cannot fill ``sms`` multiprocessors otherwise, and one warp alone is latency-bound) and shorter
    latency chains, but waves must come out near whole (a last wave of a few CTAs costs as long as a full one),
    and every split adds its float32 partial O to write and read and a step to the combine. Planned from the
    cache's capacity (``p.seqlen_k``), never from cache_seqlens, so the plan needs no device-to-host copy.
    """
    return _best_splits(dataclasses.replace(p, lengths=()), cfg, sms)


@functools.lru_cache(maxsize=1024)
def _decode_plan(p: Problem, num_splits: int | None, sms: int, wgmma: bool) -> DecodePlan:
    return _make_decode_plan(p, _decode_config(p, None), num_splits, sms, wgmma)


def _decode_config(p: Problem, override: Override | None) -> TileConfig:
    """decode_split's row for ``p``: the latent cache's in configs.VALUE_ROWS (keyed by its head dims as given),
    else the table's (``_config``)."""
    if not launch.latent_decode(p):
        return _config("decode_split", p, override)
    row = configs.value_row("decode_split", p.head_dim, p.head_dim_v, p.dtype)
    if row is None:
        raise ValueError(f"decode_split's latent form has no row for head_dim {p.head_dim} / head_dim_v "
                         f"{p.head_dim_v} in {p.dtype} (it runs {configs.LATENT_HEAD_DIM} / "
                         f"{configs.LATENT_HEAD_DIM_V} in float16 / bfloat16)")
    return row


def decode_split_appends(p: Problem, cfg: TileConfig) -> bool:
    """Whether decode_split appends k_new / v_new itself (no decode_append launch), from the shapes alone.

    Each warp of decode_split writes the new keys that fall in its own range of keys, then reads its tiles: the
    splits' ranges cover all of a sequence's keys whatever the mask (a window or causal mask narrows the tiles a
    warp loads, not the range it writes), so every new key has exactly one writer, even one no query row sees.
    What the fold needs is that no other CTA reads those keys: true with one row group (the GQA group x query rows
    fit one tile of ``cfg.br`` packed rows), where a (sequence, kv head)'s keys are split between its CTAs. With
    several row groups, every row group's CTA reads the same keys, and a CTA cannot wait for another's stores:
    decode_append runs first (MQA 32/1 at d = 128, long speculative chunks)."""
    return p.new_keys > 0 and launch.decode_rows(p, cfg)[1] == 1


def decode_combine(p: Problem, partials: int) -> Launch:
    """The combine's form when decode_split does not fuse it: decode_combine_warp (one warp per output row) up to
    32 partials, else decode_combine (a CTA of 256 threads per row, whose lanes and thread groups share out many
    partials)."""
    if partials <= launch.DECODE_COMBINE_WARP_MAX_SPLITS:
        return launch.decode_combine_warp(p)
    return launch.decode_combine(p)


# The fused combine's budget: the round trips to L2 one thread of the last CTA makes (its share of the rows' 4-column
# chunks, times one per DECODE_COMBINE_BATCH partials); above it a combine launch of its own, whose CTAs share the
# rows out, is the faster (MQA 32/1 at d = 128: 32 packed rows x 31 partials is 32 round trips).
DECODE_FUSE_ROUND_TRIPS = 8
DECODE_COMBINE_BATCH = 8  # the fused combine's loads in flight per thread (cuda/decode.cu, decode_combine_rows)


def decode_fuses_combine(p: Problem, cfg: TileConfig, partials: int) -> bool:
    """Whether the last CTA of each (batch, kv head, row group) of decode_split merges the partials itself (no
    combine launch, and no wait for one): when its threads' share of the rows' chunks and partials is a few round
    trips (``DECODE_FUSE_ROUND_TRIPS``): the GQA groups and speculative rows of one row group at any split count
    the model picks, not MQA's 32 packed rows over many partials."""
    rows = min(cfg.br, launch.decode_rows(p, cfg)[0])
    chunks = cdiv(rows * cdiv(p.value_head_dim, 4), cfg.threads)
    return chunks * cdiv(partials, DECODE_COMBINE_BATCH) <= DECODE_FUSE_ROUND_TRIPS


def _make_decode_plan(p: Problem, cfg: TileConfig, num_splits: int | None, sms: int, wgmma: bool) -> DecodePlan:
    splits = decode_splits(p, cfg, sms) if num_splits is None else num_splits
    folded = decode_split_appends(p, cfg)
    partials = launch.decode_partials(cfg, splits)
    fused = decode_fuses_combine(p, cfg, partials)
    split = launch.decode_split(p, cfg, splits, wgmma and launch.latent_decode(p))
    launches = ([launch.decode_append(p)] if p.new_keys and not folded else []) + [split]
    if not fused:
        launches.append(decode_combine(p, partials))
    return DecodePlan(tuple(launches), splits, folded, partials, fused)


def decode_plan(p: Problem, num_splits: int | None = None, sms: int = 132,
                override: Override | None = None, wgmma: bool = True) -> DecodePlan:
    """The append (when new keys come and decode_split cannot write them itself: ``decode_split_appends``), the
    split-KV pass and the combine (in decode_split's last CTAs, ``decode_fuses_combine``, or ``decode_combine``) of
    one decode call; ``num_splits`` as asked (splits past a
    sequence's keys are empty), or ``decode_splits``'s choice. Cached per problem. An FP8 cache (``p.kv_dtype``)
    needs sm_90: its rows are Hopper's (e4m3 conversions exist from sm_89; no smaller GPU's rows are measured).
    The latent cache runs decode_split's warpgroup form unless ``wgmma`` is False (the settings'
    ``RAWFLASH_WGMMA=0``; the Numba twins run the mma.sync form)."""
    if p.kv_dtype == configs.FP8 and p.arch != "sm_90":
        raise ValueError(f"float8_e4m3fn caches (k_cache, v_cache) need an sm_90 GPU (Hopper), got {p.arch}")
    if launch.latent_decode(p) and p.arch != "sm_90":
        raise ValueError(f"the latent cache (head_dim_v) needs an sm_90 GPU (Hopper): its CTA takes 231,424 B of "
                         f"shared memory, got {p.arch}")
    if override:
        return _make_decode_plan(p, _decode_config(p, override), num_splits, sms, wgmma)
    return _decode_plan(dataclasses.replace(p, lengths=()), num_splits, sms, wgmma)


DV_FORM = Settings(dv_form=DV_BOTH)  # all_instantiations compiles the DV form whatever the environment asks


def _variants_of(p: Problem) -> list[Problem]:
    """The compile-time variants a (dtype, head_dim) instantiates: plain without and with the causal mask, and the
    general policy without a mask and with a window (which is how every feature reaches the kernels), the window
    unbounded and bounded on the left; for bfloat16 the general ones also with bounded scores (soft-capping without
    ALiBi: the FA3 forward's REF_BOUNDED instantiations) and without a left bound (the general policy's REF_FIRST
    instantiations). Each general one also with seqused_k: FA3's forward runs fixed lengths on its persistent grid
    and packed sequences or seqused_k one tile per CTA (persistent_default), another instantiation."""
    general = [dataclasses.replace(p, alibi=True), dataclasses.replace(p, alibi=True, causal=True),
               dataclasses.replace(p, window=(8, 0))]
    bounded = [dataclasses.replace(x, alibi=False, softcap=1.0) for x in general] if p.dtype == "bfloat16" else []
    one_tile = [dataclasses.replace(x, seqused_k=True) for x in general + bounded]
    return [dataclasses.replace(p, causal=False), dataclasses.replace(p, causal=True), *general, *bounded, *one_tile]


def all_instantiations(arch: str = "sm_90") -> list[Launch]:
    """Every template instantiation the library can launch on ``arch`` (for the compile tests and pre-compiling):
    on the sm_90 family, each tuned GPU's (configs.GPU_ROWS)."""
    out: dict[str, Launch] = {}
    gpus = (configs.DEFAULT_GPU,)  # other GPUs' instantiations differ only where they have rows of their own
    if configs.arch_family(arch) == "sm_90":
        gpus += tuple(g for g in configs.TUNED_GPUS if g != configs.DEFAULT_GPU
                      and (configs.GPU_ROWS[g] or configs.GPU_SITUATION_ROWS[g]))
    for dtype, d, gpu in itertools.product(configs.DTYPES, configs.SPECIALISED_HEAD_DIMS, gpus):
        wide = d > configs.COMMON_MAX_HEAD_DIM  # (16-bit fa2 forwards and backwards only: configs.WIDE_HEAD_DIM)
        if not runs_head_dim(d, dtype):
            continue
        base = Problem(1, 1, 1, 1, 1, d, dtype, False, arch, gpu=gpu)
        for p in _variants_of(base):
            launches = [fa2_forward(p, Switches(wgmma=False)), fa2_backward_main(p, True, wgmma=False),
                        fa2_backward_main(p, False), launch.fa2_bwd_dq(p, _config("fa2_bwd_dq", p, None))]
            if hopper_form_fits("fa2_fwd_sm90", p):
                launches += [fa2_forward(p, Switches(wgmma=True, warp_specialize=False)),
                             fa2_forward(p, Switches(wgmma=True, warp_specialize=False, overlap=False))]
            if hopper_form_fits("fa3_fwd_sm90", p):
                # a plain p of one key takes configs.SHORT_CAUSAL_ROWS or SHORT_FULL_ROWS, a short window
                # WINDOW_ROWS; a longer twin, or a wider window, the table's rows
                n = max(configs.SHORT_CAUSAL_SEQLEN, configs.SHORT_FULL_SEQLEN) + 1
                short = short_causal(p) or short_full(p)
                sizes = (p, dataclasses.replace(p, seqlen_q=n, seqlen_k=n)) if short else (p,)
                if short_window(p):
                    sizes += (dataclasses.replace(p, window=(configs.SHORT_WINDOW_SPAN + 1, 0)),)
                launches += [fa2_forward(x, Switches(wgmma=True, warp_specialize=True)) for x in sizes]
                if not p.general and d in (64, 128):  # FA3's ablation, at the FA2 paper's head dims
                    launches += [fa2_forward(x, sw) for sw in ABLATIONS.values() if sw.warp_specialize
                                 for x in sizes]
                if not p.general and dtype == "bfloat16":  # tools/tune.py's candidates
                    launches += [fa2_forward(p, Switches(wgmma=True, warp_specialize=True),
                                             override={("fa3_fwd_sm90", d, dtype): cfg})
                                 for cfg in FA3_TILE_CANDIDATES.get(d, ())]
            for k, dv in ((k, dv) for (k, dq, dv, dt) in configs.VALUE_ROWS if (dq, dt) == (d, dtype)):
                pv = dataclasses.replace(p, head_dim_v=dv)  # the DV form (MLA's narrower v)
                if k == "fa3_fwd_sm90" and hopper_form_fits(k, p):
                    launches.append(fa2_forward(pv, Switches(wgmma=True, warp_specialize=True), DV_FORM))
                if k == "fa3_bwd_sm90" and hopper_form_fits(k, p):
                    main = fa2_backward_main(pv, True, True, DV_FORM, warp_specialize=True)
                    launches.append(main)
                    if not launch.fa3_bwd_split_d(main.config):  # (the column split has no ordered dQ)
                        launches.append(launch.fa3_bwd_sm90(pv, main.config, deterministic=True))
            if hopper_form_fits("fa2_bwd_sm90", p):
                launches.append(fa2_backward_main(p, True, wgmma=True, warp_specialize=False))
            if hopper_form_fits("fa3_bwd_sm90", p):
                fa3 = fa2_backward_main(p, True, wgmma=True, warp_specialize=True)
                launches.append(fa3)
                if not launch.fa3_bwd_split_d(fa3.config):  # (the column split has no ordered dQ)
                    launches.append(launch.fa3_bwd_sm90(p, fa3.config, deterministic=True))
                n = max(max(g.long_bwd_seqlen, g.long_causal_bwd_seqlen) for g in configs.GATES.values())
                long_p = dataclasses.replace(p, seqlen_q=n, seqlen_k=n)
                if long_bwd(long_p):  # a long twin takes configs.LONG_BWD_ROWS where it has a row
                    launches.append(fa2_backward_main(long_p, True, wgmma=True, warp_specialize=True))
            if not p.general and not wide:  # the teaching kernels and the ablation run the plain policy only
                launches += [*forward_plan(p, "fa1"), *forward_plan(p, "naive")]
                if d in (64, 128):  # the ablation runs at the head dims of the FA2 paper's figures
                    launches += [fa2_forward(p, sw) for sw in ABLATIONS.values() if not sw.wgmma]
            launches += [launch.fa2_bwd_preprocess(p), launch.fa2_bwd_convert_dq(p)]
            if not p.general and not p.causal and not wide:  # decode has one instantiation per (dtype, head_dim)
                dp = dataclasses.replace(p, seqlen_k=4096, new_keys=1)
                launches += decode_plan(dp, 8).launches  # the fold and the warp combine
                # MQA with twice MANY_DECODE_ROWS query heads: configs.MANY_ROWS_DECODE's rows
                launches += decode_plan(dataclasses.replace(dp, heads=2 * configs.MANY_DECODE_ROWS), 8).launches
                launches += [launch.decode_append(dp), launch.decode_combine(dp)]  # and the other forms
                if configs.has_row("decode_split", d, configs.FP8) and dtype != "float32" and arch == "sm_90":
                    fp = dataclasses.replace(dp, kv_dtype=configs.FP8)
                    launches += [*decode_plan(fp, 8).launches, launch.decode_append(fp)]
                    launches += decode_plan(dataclasses.replace(fp, heads=2 * configs.MANY_DECODE_ROWS), 8).launches
            for lau in launches:
                for x in with_way_back(lau):  # (a REF_FIRST forward's REF_RUNNING twin)
                    out.setdefault(x.name_expression, x)
    if arch == "sm_90":
        for lau in (lau for gpu in gpus for lau in fp8_instantiations(gpu) + latent_decode_instantiations(gpu)):
            out.setdefault(lau.name_expression, lau)
    return list(out.values())


def latent_decode_instantiations(gpu: str = configs.DEFAULT_GPU) -> list[Launch]:
    """The latent cache's decode launches (sm_90, float16 / bfloat16), in both forms of the split pass (warpgroup
    and mma.sync): 16 heads (one row group: the split pass appends and merges the partials itself) and 128 (two
    row groups: decode_append first, the warp combine), and the CTA combine."""
    out = []
    for dtype in registry.HALF_DTYPES:
        p = Problem(1, 1, 4096, 16, 1, configs.LATENT_HEAD_DIM, dtype, False, "sm_90", seqused_k=True, new_keys=1,
                    head_dim_v=configs.LATENT_HEAD_DIM_V, gpu=gpu)
        for wg in (True, False):
            out += [*decode_plan(p, 8, wgmma=wg).launches,
                    *decode_plan(dataclasses.replace(p, heads=128), 8, wgmma=wg).launches]
        out += [launch.decode_append(p), launch.decode_combine(p)]
    return out


# FP8 tile rows not in configs.TABLE that tools/tune.py times at d = 128 (compiled by fp8_instantiations, so CI
# keeps them compiling): the rows the table's 128 x 192 (3 stages, 2 Q_i buffers) was measured against.
FP8_TILE_CANDIDATES = (configs.TileConfig(128, 128, 12, stages=2), configs.TileConfig(128, 192, 12, stages=2),
                       configs.TileConfig(128, 192, 12, stages=3),
                       configs.TileConfig(128, 128, 12, stages=2, q_stages=2))
# 16-bit FA3 forward rows not in configs.TABLE that tools/tune.py times (compiled by all_instantiations for
# bfloat16's plain policy, so CI keeps them compiling): one Q_i buffer where the table has two and two where it
# has one (they fit in shared memory at d = 128 with 160 or 128 keys, not with the table's 176); at d = 512 the
# column split's other shape within 227 KB, one stage of 64 keys against the table's two of 32.
FA3_TILE_CANDIDATES = {64: (configs.TileConfig(192, 128, 16, stages=2),),
                       128: (configs.TileConfig(128, 160, 12, stages=2, q_stages=2),
                             configs.TileConfig(128, 128, 12, stages=2, q_stages=2)),
                       512: (configs.TileConfig(64, 64, 12, wc=2, stages=1),)}


def fp8_instantiations(gpu: str = configs.DEFAULT_GPU) -> list[Launch]:
    """The FP8 forward's instantiations on the tuned GPU ``gpu``: both output dtypes, without and with the causal
    mask, and the general policy's (packed sequences; a window), at head_dim 128 and 256, with FA3's ablation
    switches at 128; the pre-passes for every input dtype, with and without rotation."""
    out = []
    for d in (128, 256):
        for out_dtype in ("bfloat16", "float16"):
            general = [Problem(2, 64, 64, 1, 1, d, configs.FP8, False, "sm_90", varlen=True, total_q=100,
                               total_k=100, out_dtype=out_dtype, gpu=gpu)]
            general += [Problem(1, 1, 1, 1, 1, d, configs.FP8, True, "sm_90", window=w, out_dtype=out_dtype, gpu=gpu)
                        for w in ((8, 0), (configs.SHORT_WINDOW_SPAN + 1, 0))]  # configs.WINDOW_ROWS and beyond
            for p in general:
                out += fp8_forward(p)
            for causal in (False, True):
                p = Problem(1, 1, 1, 1, 1, d, configs.FP8, causal, "sm_90", out_dtype=out_dtype, gpu=gpu)
                out += fp8_forward(p)
                if d == 128 and out_dtype == "bfloat16":
                    out += [fp8_forward(p, sw)[1] for sw in ABLATIONS.values() if sw.warp_specialize]
                    # tools/tune.py's 128 x 192 candidates (64-byte-swizzled V^T), so that they keep compiling
                    out += [fp8_forward(p, override={("fa3_fwd_sm90_fp8", d, configs.FP8): cfg})[1]
                            for cfg in FP8_TILE_CANDIDATES]
    p = Problem(1, 1, 1, 1, 1, 128, "bfloat16", False, "sm_90")
    out += [launch.fp8_quantize(p, 1, dt, rotate, pass_) for dt in configs.DTYPES for rotate in (False, True)
            for pass_ in (0, 1)]
    return out
