"""What a call does, without running it: validation, launches, registers, occupancy, tiles and HBM bytes.

Every number comes from its one owner: tile sizes from ``configs`` (through ``Launch.config``), grids, blocks and
shared memory from ``launch``, tile counts and bytes from ``iomodel``, blocks per SM from ``occupancy`` (and from
the driver when a GPU is present), registers from the compiler (ptxas offline through NVRTC, or the loaded kernel's
attributes on a GPU). This module only puts them side by side.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from .. import reference, settings, validation
from ..kernels import compile, configs, forms, launch, registry, tma
from ..kernels.cupy_backend import run_head_dim
from ..kernels.launch import Launch
from ..problem import Problem, cdiv
from . import accuracy, iomodel, occupancy, sysinfo

DEFAULT_GPU = "H200"
"""The target where neither a GPU nor ``--gpu`` says otherwise: the H200 test machine (sm_90)."""
DEFAULT_ARCH = "sm_90"
ELEMENTWISE_NOTE = "elementwise: no tiles"
SITUATION_NOTES = {  # forms.situations' names, as explain says them
    "paged_keys": "paged keys' row (128-key blocks: whole pages of 64 a block)",
    "short_causal": f"short causal row (<= {configs.SHORT_CAUSAL_SEQLEN} keys)",
    "short_full": f"short row without a mask (<= {configs.SHORT_FULL_SEQLEN} keys)",
    "short_window": f"short window row (<= {configs.SHORT_WINDOW_SPAN} keys beside the diagonal)",
    "many_decode_rows": f"many packed rows' row (> {configs.MANY_DECODE_ROWS} query rows per kv head)",
    "long_bwd": "long backward row (>= {long} query rows, {causal} causal on the {gpu}: configs.GATES)",
}


def situation_notes(p: Problem, lau: Launch) -> list[str]:
    """Which situation's tile row (configs.SITUATION_ROWS, forms.situations) ``lau`` runs, if any."""
    g = configs.gates(p.gpu)
    return [f"the {SITUATION_NOTES[name].format(long=g.long_bwd_seqlen, causal=g.long_causal_bwd_seqlen, gpu=p.gpu)}: "
            f"configs.SITUATION_ROWS[{name!r}]" for name in forms.situations(p)
            if lau.config is not None and lau.config in configs.SITUATION_ROWS[name].values()]


# ---------------------------------------------------------------- the call, validated as the API validates it
@dataclasses.dataclass(frozen=True)
class ShapeSpec:
    """The shape options of the command line (seqlen_k and kv_heads default to seqlen_q and heads)."""

    batch: int
    seqlen_q: int
    seqlen_k: int | None
    heads: int
    kv_heads: int | None
    head_dim: int
    dtype: str
    causal: bool
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False
    varlen: tuple | None = None  # lengths of packed sequences (q and k alike): batch and seqlen then do not apply
    page_size: int = 0           # with varlen: a paged forward, each sequence's keys in pages of this many rows
    head_dim_v: int | None = None  # v's head_dim (MLA's head_dim_v); None: head_dim

    @property
    def q_shape(self) -> tuple:
        if self.varlen:
            return (sum(self.varlen), self.heads, self.head_dim)
        return (self.batch, self.seqlen_q, self.heads, self.head_dim)

    @property
    def kv_shape(self) -> tuple:
        hk = self.heads if self.kv_heads is None else self.kv_heads
        if self.varlen and self.page_size:
            return (sum(self.pages), self.page_size, hk, self.head_dim)
        if self.varlen:
            return (sum(self.varlen), hk, self.head_dim)
        nk = self.seqlen_q if self.seqlen_k is None else self.seqlen_k
        return (self.batch, nk, hk, self.head_dim)

    @property
    def v_shape(self) -> tuple:
        """v's shape: k's with v's head_dim."""
        return (*self.kv_shape[:-1], self.head_dim if self.head_dim_v is None else self.head_dim_v)

    @property
    def out_shape(self) -> tuple:
        """out's and dout's shape: q's with v's head_dim."""
        return (*self.q_shape[:-1], self.v_shape[-1])

    @property
    def pages(self) -> list[int]:
        """A paged forward's pages per sequence (at least one)."""
        return [max(1, -(-n // self.page_size)) for n in self.varlen]

    def features(self) -> validation.Features:
        """The feature arguments of the call this spec stands for (placeholder arrays of the right shapes; a paged
        forward's block_table gives each sequence its own pages in order)."""
        f32 = np.zeros((), np.float32)
        cu = None if not self.varlen else np.cumsum((0,) + tuple(self.varlen)).astype(np.int32)
        used = table = None
        if self.varlen and self.page_size:
            table = np.zeros((len(self.varlen), max(self.pages)), np.int32)
            first = np.cumsum([0] + self.pages)
            for b, n in enumerate(self.pages):
                table[b, :n] = np.arange(first[b], first[b] + n)
            used = np.asarray(self.varlen, np.int32)
        return validation.Features(window=self.window, softcap=self.softcap,
                                   alibi_slopes=np.broadcast_to(f32, (self.heads,)) if self.alibi else None,
                                   sinks=np.broadcast_to(f32, (self.heads,)) if self.sinks else None,
                                   cu_seqlens_q=cu, cu_seqlens_k=None if table is not None else cu, seqused_k=used,
                                   block_table=table)


def placeholders(spec: ShapeSpec) -> dict:
    """q, k, v, out, dout, lse as zero-stride NumPy arrays of the right shapes and dtypes (no memory behind them)."""
    dt = accuracy.DTYPES[spec.dtype]
    one = np.zeros((), dt)
    q, kv = spec.q_shape, spec.kv_shape
    lse = (q[1], q[0]) if spec.varlen else (q[0], q[2], q[1])
    return {"q": np.broadcast_to(one, q), "k": np.broadcast_to(one, kv), "v": np.broadcast_to(one, spec.v_shape),
            "out": np.broadcast_to(one, spec.out_shape), "dout": np.broadcast_to(one, spec.out_shape),
            "lse": np.broadcast_to(np.zeros((), np.float32), lse)}


def validate(spec: ShapeSpec, *, kernel: str = "fa2", backend: str = "cupy", scale=None, direction: str = "fwd",
             deterministic: bool = False) -> validation.Checked:
    """Run the API's own validation on arrays of this shape; raises its TypeError / ValueError unchanged."""
    x = placeholders(spec)
    feats = spec.features()
    checked = validation.check_forward(x["q"], x["k"], x["v"], spec.causal, scale, kernel, backend, feats)
    if direction in ("bwd", "both"):
        checked = validation.check_backward(x["dout"], x["q"], x["k"], x["v"], x["out"], x["lse"], spec.causal,
                                            scale, deterministic, backend, feats)
    return checked


def call_text(spec: ShapeSpec, kernel: str, backend: str, scale, direction: str, deterministic: bool) -> list[str]:
    """The API calls a dry run stands for, as Python."""
    q = f"q{list(spec.q_shape)}"
    kv = f"k{list(spec.kv_shape)}, v{list(spec.v_shape)}"
    opts = f"causal={spec.causal}, scale={scale!r}"
    if spec.varlen and spec.page_size:
        opts = f"cu_seqlens_q=cu, seqused_k=lens, block_table=table, {opts}"
    calls = []
    if direction in ("fwd", "both"):
        calls.append(f"rawflash.forward({q}, {kv}, {opts}, kernel={kernel!r}, backend={backend!r})  # {spec.dtype}")
    if direction in ("bwd", "both"):
        calls.append(f"rawflash.backward(dout, {q}, {kv}, out, lse, {opts}, deterministic={deterministic}, "
                     f"backend={backend!r})  # {spec.dtype}")
    return calls


def is_empty(p: Problem) -> bool:
    return 0 in (p.batch, p.seqlen_q, p.seqlen_k, p.heads)


def kernel_problem(p: Problem) -> Problem:
    """The problem as the CUDA backend plans it: head_dim (and MLA's head_dim_v) rounded up to what the kernels read
    (cupy_backend.run_problem's head dims; the forward's plan then decides whether v is zero-padded to q's)."""
    return dataclasses.replace(p, head_dim=run_head_dim(p.head_dim),
                               head_dim_v=run_head_dim(p.head_dim_v) if p.head_dim_v else 0)


def launches(p: Problem, kernel: str, direction: str, deterministic: bool = False) -> list[tuple[str, Launch]]:
    """(direction, launch) for every launch of the call, in order; direction 'both' gives forward then backward.
    The plans follow the environment's RAWFLASH_* settings, as a call's do."""
    kp, env = kernel_problem(p), settings.load()
    out = []
    if direction in ("fwd", "both"):
        out += [("fwd", lau) for lau in forms.forward_plan(kp, kernel, settings=env)]
    if direction in ("bwd", "both"):
        out += [("bwd", lau) for lau in forms.backward_plan(kp, deterministic, env)]
    return out


def sequences(p: Problem) -> list[tuple[int, int]]:
    """(seqlen_q, seqlen_k) of every sequence of the call: batch copies of one pair, or the packed lengths."""
    return list(p.lengths) if p.lengths else [(p.seqlen_q, p.seqlen_k)] * p.batch


def tiles(p: Problem, lau: Launch) -> tuple[int, int] | None:
    """(computed, skipped) tiles over every (sequence, head) with this launch's Br, Bc (the causal mask and the
    window skip tiles, packed sequences count their own); None for launches without tiles."""
    if lau.config is None:
        return None
    computed = skipped = 0
    for sq, sk in sequences(p):
        if sq == 0 or sk == 0:
            continue
        c, s = iomodel.visible_blocks(sq, sk, lau.config.br, lau.config.bc, p.causal, p.window)
        computed, skipped = computed + c, skipped + s
    return computed * p.heads, skipped * p.heads


def launch_row(p: Problem, direction: str, lau: Launch) -> dict:
    """What ``launch.py`` says about one launch, plus its tile counts."""
    cfg, counted = lau.config, tiles(p, lau)
    row = {"dir": direction, "kernel": lau.kernel, "instantiation": lau.name_expression,
           "Br": cfg.br if cfg else None, "Bc": cfg.bc if cfg else None, "warps": cfg.warps if cfg else None,
           "grid": _dims(lau.grid), "block": _dims(lau.block), "smem": lau.smem, "ctas": lau.ctas,
           "tiles": counted[0] if counted else None, "skipped": counted[1] if counted else None}
    return add_note(row, None if cfg else ELEMENTWISE_NOTE, cluster_note(lau))


def cluster_note(lau: Launch) -> str | None:
    """A launch whose CTAs run in clusters (fa3_bwd_sm90's key-block pairs, launch.fa3_bwd_pair) says so."""
    n = lau.cluster[0] * lau.cluster[1] * lau.cluster[2]
    return None if n == 1 else f"clusters of {n} CTAs ({_dims(lau.cluster)}): neighbouring key blocks sum dQ_i"


def add_note(row: dict, *reasons: str | None) -> dict:
    """Append ``reasons`` to the row's ``note`` column: the why of every '-' (None) in the row."""
    said = [row["note"]] if row.get("note") else []
    said += [r for r in reasons if r and r not in said]
    if said:
        row["note"] = "; ".join(said)
    return row


def _dims(xyz) -> str:
    return "x".join(str(v) for v in xyz)


# ---------------------------------------------------------------- the target GPU: one option, one resolution
@dataclasses.dataclass(frozen=True)
class GpuModel:
    """A GPU that ``--gpu`` can name: its arch, SM count and peak rates, and where the peaks come from."""

    name: str
    arch: str
    sms: int
    peaks: iomodel.GPU
    source: str
    examples: str = ""
    tuning: str = configs.DEFAULT_GPU  # the tuned GPU whose rows and gates its calls take (configs.GPU_ROWS, GATES)


MODELS: dict[str, GpuModel] = {m.name: m for m in (
    GpuModel("H200", "sm_90", 132, iomodel.GPUS["H200"], "measured on the H200 test machine (iomodel.GPUS)"),
    GpuModel("H200-datasheet", "sm_90", 132, iomodel.GPUS["H200-datasheet"], "NVIDIA datasheet (iomodel.GPUS)"),
    GpuModel("H100-SXM", "sm_90", 132, iomodel.GPUS["H100-SXM"], "NVIDIA datasheet (iomodel.GPUS)", tuning="h100"),
    GpuModel("A100-80GB-SXM", "sm_80", 108, iomodel.GPUS["A100-80GB-SXM"], "NVIDIA datasheet (iomodel.GPUS)"),
    GpuModel("A100-40GB-SXM", "sm_80", 108, iomodel.GPU("A100-40GB-SXM", 312.0, 19.5, 1.555),
             "NVIDIA datasheet: 312 dense fp16 tensor, 19.5 fp32, HBM2 1.555 TB/s"),
    GpuModel("A10", "sm_86", 72, iomodel.GPU("A10", 125.0, 31.2, 0.600),
             "NVIDIA datasheet: 250 fp16 tensor with sparsity = 125 dense, 31.2 fp32, GDDR6 600 GB/s"),
    GpuModel("RTX-3090", "sm_86", 82, iomodel.GPU("RTX-3090", 71.0, 35.6, 0.936),
             "GA102 whitepaper: 71 fp16 tensor with fp32 accumulate (dense), 35.6 fp32, 936 GB/s"),
    GpuModel("L4", "sm_89", 58, iomodel.GPU("L4", 121.0, 30.3, 0.300),
             "NVIDIA datasheet: 242 fp16 tensor with sparsity = 121 dense, 30.3 fp32, 300 GB/s"),
    GpuModel("L40S", "sm_89", 142, iomodel.GPU("L40S", 362.0, 91.6, 0.864),
             "NVIDIA datasheet: 733 fp16 tensor with sparsity = 362 dense, 91.6 fp32, 864 GB/s"),
    GpuModel("RTX-4090", "sm_89", 128, iomodel.GPU("RTX-4090", 165.2, 82.6, 1.008),
             "AD102 whitepaper: 165.2 fp16 tensor with fp32 accumulate (dense), 82.6 fp32, 1008 GB/s"),
)}
"""Every GPU ``--gpu`` can name. The SM counts are the products' (an A100 has 108 SMs, an H200 132)."""
ARCH_MODELS = {"sm_80": "A100-80GB-SXM", "sm_86": "A10", "sm_89": "L4", "sm_90": "H200"}
"""The model whose SM count and peaks an arch alone stands for (``--gpu sm_86`` is an A10 unless --sms says)."""
GENERATIONS = {"sm_80": "Ampere (A100, A30)", "sm_86": "Ampere (A10, A40, RTX 30xx)",
               "sm_89": "Ada (L4, L40S, RTX 40xx)", "sm_90": "Hopper (H100, H200)"}
DEVICE_NAMES = (("H200", "H200"), ("H100", "H100-SXM"), ("A100-SXM4-40GB", "A100-40GB-SXM"), ("A100", "A100-80GB-SXM"),
                ("A10", "A10"), ("RTX 3090", "RTX-3090"), ("L40S", "L40S"), ("L4", "L4"), ("RTX 4090", "RTX-4090"))
"""(fragment of a CUDA device name, model): how the GPU at hand finds its peaks; the first match wins."""


ALIASES = {"H100": "H100-SXM"}
"""Other names ``--gpu`` takes for a model (the tuned GPUs' short names: configs.TUNED_GPUS)."""


def target_names() -> list[str]:
    """What ``--gpu`` accepts: every model and alias, then every arch."""
    return list(MODELS) + list(ALIASES) + sorted(occupancy.ARCHS)


@dataclasses.dataclass(frozen=True)
class Target:
    """What the numbers are for: an arch (tile rows, kernels, compile target, occupancy rules), its SM count (waves),
    its peak rates (roofline; None where unknown), and whether the kernels load on a GPU here."""

    arch: str
    sms: int
    on_gpu: bool
    description: str
    name: str = ""
    peaks: iomodel.GPU | None = None
    peaks_from: str = ""
    tuning: str = configs.DEFAULT_GPU  # the tuned GPU whose rows and gates apply (configs.GPU_ROWS, GATES)

    @property
    def limits(self) -> occupancy.ArchLimits | None:
        """Per-SM and per-CTA resources of the arch (None for an arch the occupancy rules do not know)."""
        return occupancy.ARCHS.get(self.arch)


def resolve_gpu(name: str) -> tuple[str, GpuModel, str]:
    """(arch, the model giving SMs and peaks, label) for a ``--gpu`` value: a model or an arch, any case."""
    by_lower = {n.lower(): n for n in target_names()}
    key = by_lower.get(name.strip().lower())
    if key is None:
        raise ValueError(f"gpu must be one of {', '.join(target_names())}, got {name!r}")
    if key in occupancy.ARCHS:
        model = MODELS[ARCH_MODELS[key]]
        return key, model, f"{key} (SMs and peaks of an {model.name}: name a model or pass --sms for another)"
    model = MODELS[ALIASES.get(key, key)]
    return model.arch, model, f"{model.name} ({model.arch})"


def model_of_device(device_name: str) -> GpuModel | None:
    """The model whose peaks the GPU called ``device_name`` uses (matched by name fragment), or None."""
    return next((MODELS[m] for fragment, m in DEVICE_NAMES if fragment in device_name), None)


def target(gpu: str | None = None, sms: int | None = None) -> Target:
    """Resolve ``--gpu`` (and ``--sms``): a named model or arch is compiled for offline (NVRTC, nothing runs); none
    named is the GPU here (kernels loaded by CuPy, the driver asked too), else an H200 offline."""
    current = sysinfo.current_gpu()
    if gpu is None and current is not None:
        model = model_of_device(current.name)
        count = sms or current.sms
        return Target(current.arch, count, True,
                      f"{current.name} ({current.arch}, {count} SMs): kernels compiled and loaded by CuPy; blocks/SM "
                      "also asked of the driver", current.name, model.peaks if model else None,
                      f"peaks of the {model.name} ({model.source})" if model else "", current_tuning())
    arch, model, label = resolve_gpu(DEFAULT_GPU if gpu is None else gpu)
    count = sms or model.sms
    if sms and sms != model.sms:
        label = f"{label}, --sms {sms}"
    why = "no GPU here and no --gpu: " if gpu is None else ""
    return Target(arch, count, False, f"{why}{label}: compiled offline by NVRTC for {arch} (ptxas), not run; "
                                      f"{count} SMs", model.name, model.peaks, f"{model.name}: {model.source}",
                  model.tuning)


def current_tuning() -> str:
    """The tuned GPU whose rows and gates the GPU here takes (cupy_backend.device_gpu: its L2, or RAWFLASH_TILE_GPU)."""
    from ..kernels import cupy_backend  # (CuPy: a GPU is here)

    return cupy_backend.device_gpu(settings.load())


@dataclasses.dataclass(frozen=True)
class Resources:
    """Per-thread and per-block resources of one compiled instantiation.

    spill_bytes is ptxas' spill stores + loads offline, and the kernel's local memory per thread (spills and
    stack) on a GPU. driver_blocks is the driver's blocks per SM (GPU only).
    """

    registers: int
    static_smem: int
    spill_bytes: int
    driver_blocks: int | None = None


@functools.lru_cache(maxsize=None)
def _offline(source: str, name_expression: str, arch: str) -> compile.CompileReport:
    return compile.compile_offline(source, name_expression, arch)


def resources(lau: Launch, tgt: Target) -> Resources:
    """Registers, static shared memory and spills of ``lau``'s instantiation for ``tgt``."""
    if not tgt.on_gpu:
        rep = _offline(lau.source, lau.name_expression, lau.compile_arch(tgt.arch))
        return Resources(rep.registers, rep.static_smem, rep.spills)
    from cupy.cuda import driver

    fn = compile.get_kernel(lau.source, lau.name_expression, lau.target)
    if lau.smem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < lau.smem:  # opt in, as cupy_backend.run does
        fn.max_dynamic_shared_size_bytes = lau.smem
    ptr = getattr(fn, "ptr", None) or fn.kernel.ptr
    blocks = driver.occupancyMaxActiveBlocksPerMultiprocessor(ptr, lau.threads, lau.smem)
    return Resources(fn.num_regs, fn.shared_size_bytes, fn.local_size_bytes, int(blocks))


def fit_problem(smem: int, arch: str) -> str | None:
    """Why a CTA with ``smem`` bytes of shared memory cannot run on ``arch``, or None if it fits."""
    limits = occupancy.ARCHS.get(arch)
    if limits is None:
        return f"no occupancy rules for {arch} (rawflash.cli.occupancy knows {', '.join(sorted(occupancy.ARCHS))})"
    if smem > limits.smem_per_block_optin:
        return (f"does not fit: {smem / 1024:.1f} KB of shared memory per CTA, {arch} allows "
                f"{limits.smem_per_block_optin / 1024:.0f} KB: not launched, the call raises ValueError")
    return None


def occupancy_of(lau: Launch, res: Resources, arch: str) -> occupancy.Occupancy | str:
    """Our calculator's answer, or why it has none (an arch it does not know, shared memory over the limit)."""
    problem = fit_problem(res.static_smem + lau.smem, arch)
    if problem:
        return problem
    try:
        occ = occupancy.occupancy(arch, lau.threads, res.registers, res.static_smem + lau.smem)
    except (TypeError, ValueError) as err:
        return str(err)
    if occ.blocks_per_sm == 0:
        return f"cannot run: no CTA fits an SM ({occ.limiter})"
    return occ


def occupancy_row(lau: Launch, tgt: Target) -> dict:
    """Registers, shared memory, spills and resident blocks of one instantiation on ``tgt``."""
    res = resources(lau, tgt)
    occ = occupancy_of(lau, res, tgt.arch)
    cfg = lau.config
    row = {"kernel": lau.kernel, "instantiation": lau.name_expression, "threads": lau.threads,
           "regs": res.registers, "reg_cap": launch.register_cap(cfg) if cfg else None,
           "smem": res.static_smem + lau.smem, "spills": res.spill_bytes,
           "min_blocks": cfg.min_blocks if cfg else None}
    if isinstance(occ, str):
        row.update(ctas_per_sm=None, warps_per_sm=None, occupancy=None, limiter="cannot run")
    else:
        row.update(ctas_per_sm=occ.blocks_per_sm, warps_per_sm=occ.warps_per_sm, occupancy=round(occ.occupancy, 3),
                   limiter=occ.limiter)
    if tgt.on_gpu:
        ours = row["ctas_per_sm"]
        row.update(driver_ctas_per_sm=res.driver_blocks, match=None if ours is None else res.driver_blocks == ours)
    return add_note(row, None if cfg else "elementwise: no tile row, so no register cap or min_blocks",
                    occ if isinstance(occ, str) else None)


def occupancy_checks(rows: list[dict], tgt: Target) -> dict:
    """Instantiations above launch.register_cap, that cannot run, and (on a GPU) where the driver disagrees."""
    checks = {
        "above the register cap of launch.register_cap":
            [r["instantiation"] for r in rows if r["reg_cap"] is not None and r["regs"] > r["reg_cap"]] or "none",
        "cannot run (calculator)": [r["instantiation"] for r in rows if r["ctas_per_sm"] is None] or "none"}
    if tgt.on_gpu:
        checks["calculator != driver"] = [r["instantiation"] for r in rows if r.get("match") is False] or "none"
    return checks


def launch_config_row(p: Problem, direction: str, lau: Launch, tgt: Target) -> dict:
    """launch_row + blocks per SM from the calculator + waves on ``tgt.sms`` SMs (or why there are none)."""
    row = launch_row(p, direction, lau)
    occ = occupancy_of(lau, resources(lau, tgt), tgt.arch)
    blocks = None if isinstance(occ, str) else occ.blocks_per_sm
    row.update(ctas_per_sm=blocks, waves=round(launch.waves(lau, blocks, tgt.sms), 2) if blocks else None)
    return add_note(row, occ if isinstance(occ, str) else None)


def launch_config_rows(p: Problem, kernel: str, direction: str, deterministic: bool, tgt: Target) -> list[dict]:
    """``launch_config_row`` for every launch of the call."""
    return [launch_config_row(p, d, lau, tgt) for d, lau in launches(p, kernel, direction, deterministic)]


def instantiations(dtype: str, causal: bool, arch: str = "sm_90") -> list[Launch]:
    """The rows of ``forms.all_instantiations(arch)`` for one dtype and causal flag, plain policy (elementwise
    kernels included). The mask mode of a tiled kernel is its first int template argument after the tile sizes
    (pinned by tests/test_cli.py)."""
    ctype = launch.CUDA_TYPES[dtype]
    typed = set(launch.CUDA_TYPES.values())
    return [lau for lau in forms.all_instantiations(arch)
            if (lau.template_args[0] == ctype or lau.template_args[0] not in typed)  # untyped kernels: every slice
            and causal_flag(lau) in (None, causal) and not general_flag(lau)]


def causal_flag(lau: Launch) -> bool | None:
    """Whether a tiled launch masks (causal or a window), None for launches without a mask mode."""
    mode = _mask_arg(lau)
    return None if mode is None else mode != launch.NO_MASK


def general_flag(lau: Launch) -> bool:
    """Whether a tiled launch runs the general policy (the bool after its mask mode)."""
    i = _mask_index(lau)
    return i is not None and i + 1 < len(lau.template_args) and lau.template_args[i + 1] is True and \
        lau.kernel != "fa1_fwd"  # plain policy only: the bool there is another switch


def _mask_index(lau: Launch) -> int | None:
    return launch.MASK_ARG.get(lau.kernel)


def _mask_arg(lau: Launch) -> int | None:
    i = _mask_index(lau)
    return None if i is None else lau.template_args[i]


# ---------------------------------------------------------------- HBM bytes and the roofline
def roofline_note(tgt: Target) -> str:
    """Where the time bound's peaks come from, or why there is none."""
    if tgt.peaks is None:
        return (f"no peak numbers for {tgt.name or tgt.arch}, so no time bound: name a model with --gpu "
                f"({', '.join(MODELS)})")
    return f"time bound: roofline of {tgt.peaks_from}; caches are not modelled, so a kernel may beat it"


def io_tiles(p: Problem, kernel: str, direction: str) -> tuple[int | None, int | None, str, bool]:
    """Br, Bc of the tile config that ``kernel`` runs with in ``direction`` on ``p.arch``, what runs it, and whether
    it reads MLA's v at its own head_dim (FA3's DV form, as the environment's settings plan it)."""
    if kernel == "naive":
        runs = "rawflash (cuBLAS + softmax)" if direction == "fwd" else "model only (FA1 Alg. 0 backward)"
        return None, None, runs, False
    if direction == "fwd" or kernel == "fa2":  # the forward's first launch, the backward's main pass
        lau = launches(p, kernel, direction)[0 if direction == "fwd" else 1][1]
        return lau.config.br, lau.config.bc, f"rawflash {lau.kernel}", forms.reads_value_head_dim(lau)
    cfg = forms.forward_plan(p, "fa1")[0].config
    return cfg.br, cfg.bc, "model only (FA1 Alg. 4), fa1_fwd's tiles", False


def io_shape(p: Problem, value_form: bool = False) -> iomodel.Shape:
    """The I/O model's shape of a call: MLA's v at its own head_dim where the kernels read it so (``value_form``:
    FA3's DV form), else at q's, as the padded path reads it."""
    return iomodel.Shape(p.batch, p.seqlen_q, p.seqlen_k, p.heads, p.kv_heads, p.head_dim, p.itemsize, p.causal,
                         p.window, head_dim_v=p.head_dim_v if value_form and p.head_dim_v else None)


def io_row(p: Problem, kernel: str, direction: str, tgt: Target) -> dict:
    """Bytes, FLOPs and the roofline bound of one (kernel, direction) with the tiles it runs with on ``p.arch``."""
    br, bc, runs, value_form = io_tiles(p, kernel, direction)
    splits = forms.forward_plan(p, "fa1")[0].grid[2] if (kernel, direction) == ("fa1", "fwd") else 1
    if p.lengths:  # packed sequences: each sequence's bytes and FLOPs, summed
        reps = [iomodel.io_bytes(kernel, direction,
                                 io_shape(dataclasses.replace(p, batch=1, seqlen_q=sq, seqlen_k=sk), value_form),
                                 Br=br, Bc=bc, splits=splits) for sq, sk in p.lengths if sq and sk]
        rep = dataclasses.replace(reps[0], read_bytes=sum(r.read_bytes for r in reps),
                                  write_bytes=sum(r.write_bytes for r in reps), flops=sum(r.flops for r in reps),
                                  breakdown={k: sum(r.breakdown.get(k, 0) for r in reps) for k in reps[0].breakdown})
    else:
        rep = iomodel.io_bytes(kernel, direction, io_shape(p, value_form), Br=br, Bc=bc, splits=splits)
    row = {"kernel": kernel, "dir": direction, "runs": runs, "Br": br, "Bc": bc, "read_MB": rep.read_bytes / 1e6,
           "write_MB": rep.write_bytes / 1e6, "GFLOP": rep.flops / 1e9, "flop_per_byte": rep.intensity}
    if tgt.peaks is not None:
        roof = iomodel.roofline(rep, tgt.peaks, p.dtype)
        row.update(bound_ms=roof["bound_ms"], limiter=roof["limiter"], bound_tflops=roof["tflops"])
    else:
        row.update(bound_ms=None, limiter=None, bound_tflops=None)
    row["breakdown_bytes"] = rep.breakdown
    return add_note(row, "naive: S and P go through HBM, no tiles" if kernel == "naive" else None,
                    None if tgt.peaks is not None else f"no peak numbers for {tgt.name or tgt.arch}: no bound")


def io_rows(p: Problem, tgt: Target, kernels=iomodel.KERNELS, directions=iomodel.DIRECTIONS) -> list[dict]:
    """io_row of each kernel and direction; kernels that do not run the call's head_dim (fa1 above
    configs.COMMON_MAX_HEAD_DIM: its tiles model FA1's rows) are left out."""
    return [io_row(p, k, d, tgt) for k in kernels if forms.runs_head_dim(p.head_dim, p.dtype, k) for d in directions]


# ---------------------------------------------------------------- what fits where
FIT_CALLS = (("forward fa2", "fwd", "fa2", False), ("forward fa1", "fwd", "fa1", False),
             ("backward", "bwd", "fa2", False), ("deterministic backward", "bwd", "fa2", True))


def fit_rows(arch: str) -> list[dict]:
    """For every specialised head_dim and dtype, whether each call's launches fit ``arch``'s shared memory."""
    limits = occupancy.ARCHS[arch]
    rows = []
    for d in configs.SPECIALISED_HEAD_DIMS:
        for dtype in configs.DTYPES:
            p = Problem(1, 1, 1, 1, 1, d, dtype, False, arch)
            for call, direction, kernel, det in FIT_CALLS:
                if not forms.runs_head_dim(d, dtype, kernel):
                    continue
                lau_list = [lau for _, lau in launches(p, kernel, direction, det)]
                worst = max(lau_list, key=lambda lau: lau.smem)
                rows.append({"call": call, "head_dim": d, "dtype": dtype, "kernel": worst.kernel, "smem": worst.smem,
                             "limit": limits.smem_per_block_optin,
                             "fits": all(lau.smem <= limits.smem_per_block_optin for lau in lau_list)})
    return rows


def unfit_summary(arch: str) -> str:
    """Which calls have no tile that fits ``arch`` ('nothing' when all fit), by dtype and specialised head_dim."""
    rows = fit_rows(arch)
    parts = []
    for call, *_ in FIT_CALLS:
        bad = {dt: [r["head_dim"] for r in rows if r["call"] == call and r["dtype"] == dt and not r["fits"]]
               for dt in configs.DTYPES}
        groups = ([("every dtype", bad["float32"])] if bad["float16"] == bad["bfloat16"] == bad["float32"] else
                  [("16-bit", bad["float16"]), ("float32", bad["float32"])] if bad["float16"] == bad["bfloat16"] else
                  [(dt, bad[dt]) for dt in configs.DTYPES])
        said = [f"{words} d = {', '.join(map(str, dims))}" for words, dims in groups if dims]
        if said:
            parts.append(f"{call}: {'; '.join(said)}")
    return " / ".join(parts) if parts else "nothing"


# ---------------------------------------------------------------- explain: a dry run of one call
def explain(spec: ShapeSpec, *, kernel: str, backend: str, scale, direction: str, deterministic: bool,
            tgt: Target) -> dict:
    """Everything a call would do on ``tgt``, or the exact error the API would raise; nothing is launched."""
    report = {"call": call_text(spec, kernel, backend, scale, direction, deterministic), "target": tgt.description}
    try:
        checked = validate(spec, kernel=kernel, backend=backend, scale=scale, direction=direction,
                           deterministic=deterministic)
    except (TypeError, ValueError) as err:
        return {**report, "valid": False, "error": f"{type(err).__name__}: {err}",
                "launched": "nothing: the API refuses this call before any launch"}
    p = dataclasses.replace(checked.problem, arch=tgt.arch, gpu=tgt.tuning)
    report.update(valid=True, problem=_problem_summary(p, checked.scale))
    if is_empty(p):
        return {**report, "launched": "nothing: an empty problem returns zeros (and lse = -inf) without a launch"}
    if backend == "reference":
        return {**report, "launched": "nothing: backend 'reference' computes in float64 NumPy on the host (no GPU, "
                                      "no kernel)"}
    dirs = ("fwd", "bwd") if direction == "both" else (direction,)
    report["variants"] = [_variant_summary(registry.for_call(kernel, d)) for d in dirs]
    if backend == "numba":
        report["launches"] = twin_rows(checked.problem, kernel, direction, deterministic, tgt)
    else:
        planned = launches(p, kernel, direction, deterministic)
        report["launches"] = [launch_row(p, d, lau) for d, lau in planned]
        for i, (row, (_, lau)) in enumerate(zip(report["launches"], planned)):
            add_note(row, fit_problem(row["smem"], tgt.arch))
            if lau.config is not None and lau.config.wc > 1 and lau.kernel in ("fa2_fwd", "fa2_bwd_dq"):
                add_note(row, f"{lau.config.wc} warps share each 16 rows and split the head columns, each computing "
                              "the rows' scores itself (the FLOPs count them once)")
            grid = launch.schedule_of(lau)
            if grid is not None:
                add_note(row, f"grid: {grid}" + (" (CTAs take tiles from a counter)" if grid.endswith("dynamic")
                                                  else ""))
                if lau.config.q_stages > 1:
                    add_note(row, f"{lau.config.q_stages} Q_i buffers (the next tile's Q_i copied during this one)")
                if launch.stages_o(lau):
                    add_note(row, "O staged in the Q_i buffer, stored by TMA")
                if forms.reads_value_head_dim(lau):
                    add_note(row, f"DV form: V_j, P V and O of {lau.template_args[launch.DV_ARG[lau.kernel]]} "
                                  "columns (v read at its own head_dim)")
                if lau.kernel == "fa3_fwd_sm90" and p.page_size:
                    rows = tma.paged_box_rows(lau.config.bc, p.page_size)
                    add_note(row, f"paged keys read by TMA in boxes of {rows} rows, one page each")
                ref = lau.template_args[launch.REF_ARG] if lau.kernel == "fa3_fwd_sm90" else None
                if ref == launch.REF_BOUNDED:
                    add_note(row,
                             f"bounded scores (softcap {p.softcap:g} <= {forms.BOUNDED_SOFTCAP_MAX:g}, bfloat16): "
                             "the softmax subtracts the fixed reference softcap log2(e) - 56, no running max and "
                             "no rescale of O")
                elif ref == launch.REF_FIRST:
                    add_note(row, "softmax reference: each row's first block's max" + (
                        " without the ALiBi bias, less the bias of the row's nearest key" if p.alibi else "") +
                        ", kept (no running max, no rescale of O); a row whose sum ends above 2^80 or below 2^-60 "
                        "flags the call")
                elif ref == launch.REF_RUNNING and i > 0 and forms.checks_ref(planned[i - 1][1]):
                    add_note(row, "the way back: runs only where the launch before flagged this call (the running "
                                  "max then recomputes it); otherwise every CTA returns at once")
            add_note(row, *situation_notes(p, lau))
            if row["kernel"] == "fa3_bwd_sm90" and deterministic:
                add_note(row, "deterministic: dQ reduce-adds in a fixed order per query block (int32 semaphores)")
                if launch.fa3_bwd_dq_rotates(p, lau.config, tgt.sms):
                    add_note(row, "rotated order: each key block's walk starts at its own query block")
            if row["kernel"] == "fa3_bwd_sm90" and not deterministic and launch.fa3_bwd_longest_first(
                    p, lau.config, tgt.sms):
                add_note(row, "key tiles longest first: tile 0 of every (batch, kv head), then tile 1, ... (a mask "
                              f"bounded on the right, pairs x {configs.gates(p.gpu).longest_first_ctas} <= SMs on "
                              f"the {p.gpu})")
            if row["kernel"] == "fa3_fwd_sm90" and lau.config.wc > 1:
                add_note(row, f"column split (head_dim {configs.WIDE_HEAD_DIM}): two consumer warpgroups share 64 "
                              "query rows, each forming all of S and the softmax and holding half of O's columns "
                              "(1.5x the tensor work); O stored from registers")
            if row["kernel"] == "fa3_bwd_sm90" and launch.fa3_bwd_split_d(lau.config):
                add_note(row, "column split (head_dim > 128): two consumer warpgroups share 64 keys, each with half "
                              "of dK, dV and dQ's columns; dQ by TMA reduce-add of float32 tiles")
            if row["kernel"] == "fa3_bwd_sm90" and forms.reads_value_head_dim(lau):
                add_note(row, f"DV form: V_j, dO_i, dP^T's and dV's products and dV of "
                              f"{lau.template_args[launch.DV_ARG[lau.kernel]]} columns (v, dout and out read at v's "
                              "own head_dim)")
    report["predicted"] = [_brief_io(io_row(p, kernel if d == "fwd" else "fa2", d, tgt)) for d in dirs]
    report["notes"] = _explain_notes(p, kernel, backend, tgt)
    return report


def twin_rows(p: Problem, kernel: str, direction: str, deterministic: bool, tgt: Target) -> list[dict]:
    """The Numba twins' launches (``numba_backend.twin_launches``) of the validated problem ``p`` as the backend
    receives it, with tile counts and whether their float32 shared memory fits ``tgt``."""
    from ..kernels import numba_backend

    rows = []
    dirs = ("fwd", "bwd") if direction == "both" else (direction,)
    for d in dirs:
        if d == "fwd" and kernel == "naive":
            rows.append(add_note({"dir": d, "kernel": "naive", "grid": None, "block": None, "smem": None,
                                  "ctas": None}, "kernel 'naive' has no Numba twin: the API raises "
                                                 "NotImplementedError with backend='numba'"))
            continue
        for t in numba_backend.twin_launches(p, kernel if d == "fwd" else "fa2", d, deterministic):
            cfg = t.config
            counted = tiles(p, t) if cfg else None
            row = {"dir": d, "kernel": t.kernel, "Br": cfg.br if cfg else None, "Bc": cfg.bc if cfg else None,
                   "grid": _dims(t.grid), "block": str(t.threads), "smem": t.smem, "ctas": t.ctas,
                   "tiles": counted[0] if counted else None, "skipped": counted[1] if counted else None}
            rows.append(add_note(row, None if cfg else ELEMENTWISE_NOTE, fit_problem(t.smem, tgt.arch)))
    return rows


def _problem_summary(p: Problem, scale: float) -> dict:
    out = {"batch": p.batch, "seqlen_q": p.seqlen_q, "seqlen_k": p.seqlen_k, "heads": p.heads,
           "kv_heads": p.kv_heads, "head_dim": p.head_dim, "kernel head_dim": configs.padded_head_dim(p.head_dim),
           **({"head_dim_v": p.head_dim_v} if p.head_dim_v else {}), "dtype": p.dtype, "causal": p.causal,
           "scale": scale}
    if p.window != (-1, -1):
        out["window (left, right)"] = p.window_bounds
    for name, on in (("softcap", p.softcap), ("alibi", p.alibi), ("sinks", p.sinks)):
        if on:
            out[name] = on
    if p.varlen:
        out.update(packed=f"{p.batch} sequences, {p.total_q} query rows (max {p.seqlen_q})")
        if p.page_size:
            out.update(paged=f"keys in pages of {p.page_size} rows (block_table, seqused_k)")
    mask = ("none", "causal", "window")[launch.mask_mode(p)]
    out["policy"] = ("general" if p.general else "plain") + f", mask mode {mask}"
    return out


def _variant_summary(v: registry.Variant) -> dict:
    return {"variant": v.name, "source": f"cuda/{v.source}", "algorithm": v.paper_algorithm,
            "warp partition": v.warp_partition}


def _brief_io(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "breakdown_bytes"}


def _explain_notes(p: Problem, kernel: str, backend: str, tgt: Target) -> list[str]:
    notes = [roofline_note(tgt)]
    if p.causal:
        notes.append("causal: tiles wholly above the diagonal are skipped (never loaded)")
    if p.window_bounds[0] >= 0:
        notes.append(f"window {p.window_bounds}: key blocks wholly outside it are never loaded; the tile counts "
                     "and the FLOPs count visible blocks and pairs only")
    if p.varlen:
        notes.append("packed sequences: the grid covers the tiles of all sequences (an upper bound of "
                     "cdiv(total, Br) + batch CTAs, spare ones exit at once); tile counts are per sequence")
    if p.general:
        notes.append("the general policy's kernels (GENERAL = true): packed lengths, soft-capping and ALiBi at run "
                     "time; plain calls run the plain kernels")
    if configs.padded_head_dim(p.head_dim) != p.head_dim:
        notes.append(f"head_dim {p.head_dim} runs on the {configs.padded_head_dim(p.head_dim)} kernel, zero-padded")
    if p.head_dim > configs.COMMON_MAX_HEAD_DIM:
        notes.append(f"head_dim {p.head_dim} runs on the head_dim {configs.WIDE_HEAD_DIM} forms: on Hopper FA3's "
                     "forward, whose two consumer warpgroups split the head columns; elsewhere, under wgmma=False and "
                     "for every backward, the mma.sync forms, whose warps split them (the backward: one CTA of 4 "
                     "warps per SM)")
    if p.head_dim_v:
        notes.append(f"v's head_dim {p.head_dim_v} (MLA): v (and the backward's dout and out) zero-padded to q's "
                     f"head_dim, out and dv cut back, except in FA3's DV forms (a pair in configs.VALUE_ROWS, forward "
                     f"and backward apart; RAWFLASH_DV_FORM: both by default, =fwd the forward's, =0 neither), which "
                     f"read them at v's own; the predicted bytes and FLOPs count v at the head_dim the kernels read "
                     f"it at")
    if kernel == "naive":
        notes.append("naive: S = QK^T and O = PV are cuBLAS products, not listed among the launches")
    if backend == "numba":
        notes.append("backend 'numba': the Numba twins (one thread per row, float32 tiles in shared memory, no "
                     "wgmma form); grids and tile rows from launch.py for the problem as the backend receives it, "
                     "which keeps the sm_90 tile rows on every GPU; on a machine without a GPU they run on Numba's "
                     "CPU simulator")
        notes.append("predicted bytes and time bound are those of the CUDA C kernels' tiles on the target")
    return notes


# ---------------------------------------------------------------- explain --decode: a dry run of rawflash.decode
def decode_placeholders(spec: ShapeSpec, page_size: int, new_keys: int, fp8_cache: bool = False) -> dict:
    """rawflash.decode's arguments for a spec as zero-stride NumPy arrays: q (batch, seqlen_q, heads, d), caches
    (float8_e4m3fn with ``fp8_cache``) holding seqlen_k (the cache_seqlens, an int) + new_keys keys, contiguous or
    in pages of ``page_size``."""
    dt = accuracy.DTYPES[spec.dtype]
    one = np.zeros((), dt)
    one_kv = np.zeros((), reference.E4M3) if fp8_cache else one
    hk = spec.heads if spec.kv_heads is None else spec.kv_heads
    cache = spec.seqlen_q if spec.seqlen_k is None else spec.seqlen_k
    cap = cache + new_keys
    out = {"q": np.broadcast_to(one, (spec.batch, spec.seqlen_q, spec.heads, spec.head_dim)), "cache_seqlens": cache,
           "block_table": None, "k_new": None, "v_new": None}
    if page_size:
        per = max(1, -(-cap // page_size))
        kv = (spec.batch * per, page_size, hk, spec.head_dim)
        out["block_table"] = np.arange(spec.batch * per, dtype=np.int32).reshape(spec.batch, per)
    else:
        kv = (spec.batch, max(1, cap), hk, spec.head_dim)
    out["k_cache"] = out["v_cache"] = np.broadcast_to(one_kv, kv)
    if new_keys:
        out["k_new"] = out["v_new"] = np.broadcast_to(one, (spec.batch, new_keys, hk, spec.head_dim))
    return out


def explain_decode(spec: ShapeSpec, *, page_size: int, new_keys: int, num_splits: int | None, backend: str, scale,
                   tgt: Target, fp8_cache: bool = False) -> dict:
    """What ``rawflash.decode`` would do on ``tgt`` for the spec (seqlen_q query rows against caches of seqlen_k
    keys each, new_keys appended; an FP8 cache with ``fp8_cache``), or the API's exact error; nothing is
    launched."""
    x = decode_placeholders(spec, page_size, new_keys, fp8_cache)
    layout = (f"pages of {page_size}" if page_size else "contiguous") + (", float8_e4m3fn cache" if fp8_cache else "")
    report = {"call": [f"rawflash.decode(q{list(x['q'].shape)}, k_cache{list(x['k_cache'].shape)}, v_cache, "
                       f"cache_seqlens={x['cache_seqlens']}, k_new={'[...]' if new_keys else None}, "
                       f"block_table={'[...]' if page_size else None}, causal={spec.causal}, num_splits={num_splits}, "
                       f"backend={backend!r})  # {spec.dtype}, {layout}"], "target": tgt.description}
    try:
        if spec.varlen:
            raise ValueError("decode takes no packed sequences (--varlen): its sequences are the batch")
        if num_splits is not None and not 1 <= num_splits <= forms.MAX_SPLITS:
            raise ValueError(f"num_splits must be None or an int between 1 and {forms.MAX_SPLITS}, got {num_splits}")
        checked = validation.check_decode(x["q"], x["k_cache"], x["v_cache"], x["cache_seqlens"], x["k_new"],
                                          x["v_new"], x["block_table"], spec.causal, scale, backend, spec.features())
    except (TypeError, ValueError) as err:
        return {**report, "valid": False, "error": f"{type(err).__name__}: {err}",
                "launched": "nothing: the API refuses this call before any launch"}
    p = dataclasses.replace(checked.problem, arch=tgt.arch, gpu=tgt.tuning)
    summary = _problem_summary(p, checked.scale)
    summary.update({"seqlen_k": f"{x['cache_seqlens']} cached + {new_keys} appended",
                    "cache capacity per sequence": p.seqlen_k, "layout": layout})
    report.update(valid=True, problem=summary, variants=[_variant_summary(registry.get("decode"))])
    if backend == "reference":
        return {**report, "launched": "nothing: backend 'reference' computes in float64 NumPy on the host"}
    kp = kernel_problem(p)
    plan = forms.decode_plan(kp, num_splits, tgt.sms, wgmma=settings.load().wgmma)  # (as a call plans it)
    cfg = plan.split.config
    report["launches"] = []
    roles = {"decode_append": "elementwise: k_new / v_new into the cache, before the split pass (several row "
                               "groups read the same keys)",
             "decode_split": "tiles: one split of whole key tiles per warp (split plan), the CTA's splits merged "
                             "into one partial" +
                             ("; each split first writes the new keys of its range into the cache"
                              if plan.split_appends else "") +
                             ("; the last CTA of each (batch, kv head, row group) merges the partials (the combine)"
                              if plan.fused else ""),
             "decode_combine_warp": "one warp per (batch, query, head) row, 4 rows per CTA: the partials merged by "
                                    "their lse (up to 32 partials)",
             "decode_combine": "one CTA per (batch, query, head) row: the partials merged by their lse (more than 32 "
                               "partials)"}
    for lau in plan.launches:
        row = launch_row(kp, "decode", lau)
        row.pop("note", None)
        row["tiles"] = row["skipped"] = None
        report["launches"].append(add_note(row, roles[lau.kernel], *situation_notes(kp, lau),
                                           fit_problem(row["smem"], tgt.arch)))
    tiles = cdiv(max(1, kp.seqlen_k), cfg.bc)
    cache_bytes = 2 * p.batch * (x["cache_seqlens"] + new_keys) * p.kv_heads * p.head_dim * p.kv_itemsize
    combine = plan.launches[-1].kernel  # forms.decode_combine's choice (decode_split itself when fused)
    report["split plan"] = {
        "num_splits": plan.num_splits,
        "chosen by": "you (num_splits)" if num_splits is not None else
                     f"forms.decode_splits (model of {tgt.sms} SMs, planned from the capacity)",
        "key tiles per split": f"cdiv(cdiv(keys_b, {cfg.bc}), {plan.num_splits}) per sequence; at full capacity "
                               f"{cdiv(tiles, plan.num_splits)}",
        "append": ("none (no k_new)" if not kp.new_keys else
                   "in decode_split: each split writes the new keys inside its range of keys (one row group)"
                   if plan.split_appends else
                   f"decode_append first: {launch.decode_rows(kp, cfg)[1]} row groups of {cfg.br} packed rows read "
                   "the same keys, and one CTA cannot wait for another's stores"),
        "combine": (f"in decode_split: the last CTA of each (batch, kv head, row group) merges its {plan.partials} "
                    "partials (forms.decode_fuses_combine: a few round trips a thread)" if plan.fused else
                    f"{combine} ({'one warp' if combine == 'decode_combine_warp' else 'one CTA'} per row): "
                    f"{plan.partials} partials (forms.decode_fuses_combine: too many rows x partials for one CTA)"),
        "partials per row": f"{plan.partials}: one per CTA of decode_split (its {cfg.warps} warps' splits merged)",
        "waves filled": round(forms.decode_occupancy(kp, cfg, plan.num_splits, tgt.sms), 3),
        "modelled split + combine us": round(forms.decode_split_cost(kp, cfg, plan.num_splits, tgt.sms), 1),
        "cache MB read": round(cache_bytes / 1e6, 3),
        "partials MB (written, read)": round(p.batch * p.seqlen_q * p.heads * (p.head_dim + 1) * 4 *
                                             plan.partials / 1e6, 3),
    }
    if tgt.peaks is not None:
        report["split plan"]["cache read at the HBM peak, us"] = round(cache_bytes / (tgt.peaks.hbm_tbps * 1e6), 1)
    report["notes"] = [
        "cache_seqlens and block_table are never read on the host: the plan comes from the shapes (the capacity), "
        "and each sequence's keys are cut on the device into num_splits runs of whole tiles",
        "the append's rule (forms.decode_split_appends, from the shapes): the splits' key ranges cover every key "
        "whatever the mask (a window narrows the tiles a split loads, not the range it writes), so with one row "
        "group (GQA group x query rows <= the tile's packed rows) each new key is written by the one split whose "
        "range holds it, before that split reads it; with several row groups every row group's CTAs read it, so "
        "decode_append runs first",
        "the split count's model (forms.decode_split_cost) is a heuristic: whole waves of CTAs, enough warps with "
        "tiles in flight, little partial traffic; its microseconds order the choices, they are no measurement",
    ]
    return report


# ---------------------------------------------------------------- how long Numba's CPU simulator takes
SIM_SECONDS_PER_THREAD = 4e-4
"""Simulator cost of one CUDA thread of one CTA: an OS thread started, joined and woken at each barrier."""
SIM_SECONDS_PER_MAC = 3e-7
"""Simulator cost of one multiply-add of a twin's tile products (scalar Python in a simulated thread)."""
SIM_PRODUCTS = {"fa2_fwd": 2, "fa1_fwd": 2, "fa2_bwd": 5, "fa2_bwd_dq": 3}
"""Tile products per (query row, key, column) of each tiled twin: S and O forward; S, dP, dV, dK and dQ backward."""


def simulator_seconds(p: Problem, kernel: str = "fa2", deterministic: bool = False, backward: bool = True) -> float:
    """A rough estimate of the seconds Numba's CPU simulator takes for a forward (and backward) of ``p`` through the
    Numba backend (``numba_backend.twin_launches``; imports numba). Calibrated on a 2-core machine; a busy machine
    is slower."""
    from ..kernels import numba_backend

    total = 0.0
    direction = "both" if backward else "fwd"
    pr = dataclasses.replace(p, head_dim=run_head_dim(p.head_dim))
    for t in numba_backend.twin_launches(p, kernel, direction, deterministic):
        total += t.ctas * t.threads * SIM_SECONDS_PER_THREAD
        if t.config is not None:
            computed, _ = tiles(pr, t)
            products = SIM_PRODUCTS[t.kernel] - (1 if t.kernel == "fa2_bwd" and deterministic else 0)
            d = configs.padded_head_dim(pr.head_dim)
            total += computed * t.config.br * t.config.bc * d * products * SIM_SECONDS_PER_MAC
    return total
