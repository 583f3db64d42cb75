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

from . import _compile, accuracy, forms, iomodel, launch, occupancy, registry, sysinfo, validation
from .cupy_backend import run_head_dim
from .launch import Launch, Problem

DEFAULT_ARCH = "sm_90"
"""The H200's target: what offline compiles are for when neither a GPU nor ``--arch`` says otherwise."""
GPU_PEAKS = {"H200": "H200", "H100": "H100-SXM", "A100": "A100-80GB-SXM"}
"""Device-name fragment -> ``iomodel.GPUS`` key, for the roofline of the current GPU."""


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

    @property
    def q_shape(self) -> tuple:
        return (self.batch, self.seqlen_q, self.heads, self.head_dim)

    @property
    def kv_shape(self) -> tuple:
        nk = self.seqlen_q if self.seqlen_k is None else self.seqlen_k
        hk = self.heads if self.kv_heads is None else self.kv_heads
        return (self.batch, nk, hk, self.head_dim)


def placeholders(spec: ShapeSpec) -> dict:
    """q, k, v, out, dout, lse as zero-stride NumPy arrays of the right shapes and dtypes (no memory behind them)."""
    dt = accuracy.DTYPES[spec.dtype]
    one = np.zeros((), dt)
    q, kv = spec.q_shape, spec.kv_shape
    return {"q": np.broadcast_to(one, q), "k": np.broadcast_to(one, kv), "v": np.broadcast_to(one, kv),
            "out": np.broadcast_to(one, q), "dout": np.broadcast_to(one, q),
            "lse": np.broadcast_to(np.zeros((), np.float32), (q[0], q[2], q[1]))}


def validate(spec: ShapeSpec, *, kernel: str = "fa2", backend: str = "cupy", scale=None, direction: str = "fwd",
             deterministic: bool = False) -> validation.Checked:
    """Run the API's own validation on arrays of this shape; raises its TypeError / ValueError unchanged."""
    x = placeholders(spec)
    checked = validation.check_forward(x["q"], x["k"], x["v"], spec.causal, scale, kernel, backend)
    if direction in ("bwd", "both"):
        checked = validation.check_backward(x["dout"], x["q"], x["k"], x["v"], x["out"], x["lse"], spec.causal,
                                            scale, deterministic, backend)
    return checked


def call_text(spec: ShapeSpec, kernel: str, backend: str, scale, direction: str, deterministic: bool) -> list[str]:
    """The API calls a dry run stands for, as Python."""
    q = f"q{list(spec.q_shape)}"
    kv = f"k{list(spec.kv_shape)}, v{list(spec.kv_shape)}"
    opts = f"causal={spec.causal}, scale={scale!r}"
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
    """The problem as the CUDA backend launches it: head_dim zero-padded to what the kernels read (cupy_backend)."""
    return dataclasses.replace(p, head_dim=run_head_dim(p.head_dim))


def launches(p: Problem, kernel: str, direction: str, deterministic: bool = False) -> list[tuple[str, Launch]]:
    """(direction, launch) for every launch of the call, in order; direction 'both' gives forward then backward."""
    kp = kernel_problem(p)
    out = []
    if direction in ("fwd", "both"):
        out += [("fwd", lau) for lau in forms.forward_plan(kp, kernel)]
    if direction in ("bwd", "both"):
        out += [("bwd", lau) for lau in forms.backward_plan(kp, deterministic)]
    return out


def tiles(p: Problem, lau: Launch) -> tuple[int, int] | None:
    """(computed, skipped) tiles over every (batch, head) with this launch's Br, Bc; None for launches without tiles."""
    if lau.config is None:
        return None
    computed, skipped = iomodel.visible_blocks(p.seqlen_q, p.seqlen_k, lau.config.br, lau.config.bc, p.causal)
    heads = p.batch * p.heads
    return computed * heads, skipped * heads


def launch_row(p: Problem, direction: str, lau: Launch) -> dict:
    """What ``launch.py`` says about one launch, plus its tile counts."""
    cfg, counted = lau.config, tiles(p, lau)
    return {"dir": direction, "kernel": lau.kernel, "instantiation": lau.name_expression,
            "Br": cfg.br if cfg else None, "Bc": cfg.bc if cfg else None, "warps": cfg.warps if cfg else None,
            "grid": _dims(lau.grid), "block": _dims(lau.block), "smem": lau.smem, "ctas": lau.ctas,
            "tiles": counted[0] if counted else None, "skipped": counted[1] if counted else None}


def _dims(xyz) -> str:
    return "x".join(str(v) for v in xyz)


# ---------------------------------------------------------------- where register counts come from
@dataclasses.dataclass(frozen=True)
class Target:
    """What the resource numbers are for: an arch, its SM count, and whether the kernels load on a real GPU."""

    arch: str
    sms: int
    on_gpu: bool
    description: str


def target(arch: str | None = None, sms: int | None = None) -> Target:
    """``--arch`` (offline NVRTC) if given; else the current GPU; else sm_90 offline with an H200's 132 SMs."""
    gpu = sysinfo.current_gpu()
    if arch is not None:
        same = gpu is not None and gpu.arch == arch
        count = sms or (gpu.sms if same else sysinfo.H200_SMS)
        return Target(arch, count, False, f"compiled offline by NVRTC for {arch} (ptxas), not run; {count} SMs")
    if gpu is not None:
        return Target(gpu.arch, sms or gpu.sms, True, f"{gpu.name} ({gpu.arch}, {gpu.sms} SMs): kernels compiled "
                                                       "and loaded by CuPy; blocks/SM also asked of the driver")
    count = sms or sysinfo.H200_SMS
    return Target(DEFAULT_ARCH, count, False, f"no GPU: compiled offline by NVRTC for {DEFAULT_ARCH} (ptxas), not "
                                              f"run; {count} SMs (an H200)")


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
def _offline(source: str, name_expression: str, arch: str) -> _compile.CompileReport:
    return _compile.compile_offline(source, name_expression, arch)


def resources(lau: Launch, tgt: Target) -> Resources:
    """Registers, static shared memory and spills of ``lau``'s instantiation for ``tgt``."""
    if not tgt.on_gpu:
        rep = _offline(lau.source, lau.name_expression, lau.compile_arch(tgt.arch))
        return Resources(rep.registers, rep.static_smem, rep.spills)
    from cupy.cuda import driver

    fn = _compile.get_kernel(lau.source, lau.name_expression, lau.target)
    if lau.smem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < lau.smem:  # opt in, as cupy_backend.run does
        fn.max_dynamic_shared_size_bytes = lau.smem
    ptr = getattr(fn, "ptr", None) or fn.kernel.ptr
    blocks = driver.occupancyMaxActiveBlocksPerMultiprocessor(ptr, lau.threads, lau.smem)
    return Resources(fn.num_regs, fn.shared_size_bytes, fn.local_size_bytes, int(blocks))


def occupancy_of(lau: Launch, res: Resources, arch: str) -> occupancy.Occupancy | str:
    """Our calculator's answer, or why it has none (an arch it does not know, shared memory over the limit)."""
    try:
        return occupancy.occupancy(arch, lau.threads, res.registers, res.static_smem + lau.smem)
    except (TypeError, ValueError) as err:
        return str(err)


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
        row.update(ctas_per_sm=None, warps_per_sm=None, occupancy=None, limiter=f"cannot run: {occ}")
    else:
        row.update(ctas_per_sm=occ.blocks_per_sm, warps_per_sm=occ.warps_per_sm, occupancy=round(occ.occupancy, 3),
                   limiter=occ.limiter)
    if tgt.on_gpu:
        ours = row["ctas_per_sm"]
        row.update(driver_ctas_per_sm=res.driver_blocks, match=None if ours is None else res.driver_blocks == ours)
    return row


def occupancy_checks(rows: list[dict], tgt: Target) -> dict:
    """Instantiations above launch.register_cap, that cannot run, and (on a GPU) where the driver disagrees."""
    checks = {
        "above the register cap of launch.register_cap":
            [r["instantiation"] for r in rows if r["reg_cap"] is not None and r["regs"] > r["reg_cap"]] or "none",
        "cannot run (calculator)": [r["instantiation"] for r in rows if r["ctas_per_sm"] is None] or "none"}
    if tgt.on_gpu:
        checks["calculator != driver"] = [r["instantiation"] for r in rows if r.get("match") is False] or "none"
    return checks


def launch_config_rows(p: Problem, kernel: str, direction: str, deterministic: bool, tgt: Target) -> list[dict]:
    """launch_row + blocks per SM from the calculator + waves on ``tgt.sms`` SMs, for every launch of the call."""
    rows = []
    for d, lau in launches(p, kernel, direction, deterministic):
        row = launch_row(p, d, lau)
        occ = occupancy_of(lau, resources(lau, tgt), tgt.arch)
        blocks = None if isinstance(occ, str) else occ.blocks_per_sm
        row.update(ctas_per_sm=blocks, waves=round(launch.waves(lau, blocks, tgt.sms), 2) if blocks else None)
        rows.append(row)
    return rows


def instantiations(dtype: str, causal: bool, arch: str = "sm_90") -> list[Launch]:
    """The rows of ``forms.all_instantiations(arch)`` for one dtype and causal flag, plain policy (elementwise
    kernels included). The mask mode of a tiled kernel is its first int template argument after the tile sizes
    (pinned by tests/test_cli.py)."""
    ctype = launch.CUDA_TYPES[dtype]
    return [lau for lau in forms.all_instantiations(arch)
            if lau.template_args[0] == ctype and causal_flag(lau) in (None, causal) and not general_flag(lau)]


def causal_flag(lau: Launch) -> bool | None:
    """Whether a tiled launch masks (causal or a window), None for launches without a mask mode."""
    mode = _mask_arg(lau)
    return None if mode is None else mode != launch.NO_MASK


def general_flag(lau: Launch) -> bool:
    """Whether a tiled launch runs the general policy (the bool after its mask mode)."""
    i = _mask_index(lau)
    return i is not None and i + 1 < len(lau.template_args) and lau.template_args[i + 1] is True and \
        lau.kernel != "fa1_fwd"


def _mask_index(lau: Launch) -> int | None:
    return launch.MASK_ARG.get(lau.kernel)


def _mask_arg(lau: Launch) -> int | None:
    i = _mask_index(lau)
    return None if i is None else lau.template_args[i]


# ---------------------------------------------------------------- HBM bytes and the roofline
def roofline_gpu(name: str | None) -> tuple[str, str]:
    """(``iomodel.GPUS`` key, why that one): the named GPU, else the current one, else the H200 test machine."""
    if name is not None:
        if name not in iomodel.GPUS:
            raise ValueError(f"gpu must be one of {', '.join(iomodel.GPUS)}, got {name!r}")
        return name, "named"
    gpu = sysinfo.current_gpu()
    if gpu is None:
        return "H200", "no GPU here: the H200 test machine"
    for fragment, key in GPU_PEAKS.items():
        if fragment in gpu.name:
            return key, f"the current GPU ({gpu.name})"
    raise ValueError(f"no peak numbers for the current GPU {gpu.name!r}: name one with --gpu "
                     f"({', '.join(iomodel.GPUS)})")


def io_tiles(p: Problem, kernel: str, direction: str) -> tuple[int | None, int | None, str]:
    """Br, Bc of the tile config that ``kernel`` runs with in ``direction``, and what runs it."""
    if kernel == "naive":
        runs = "rawflash (cuBLAS + softmax)" if direction == "fwd" else "model only (FA1 Alg. 0 backward)"
        return None, None, runs
    if direction == "fwd":
        lau = forms.forward_plan(p, kernel)[0]
        return lau.config.br, lau.config.bc, f"rawflash {lau.kernel}"
    if kernel == "fa2":
        lau = forms.backward_plan(p)[1]
        return lau.config.br, lau.config.bc, f"rawflash {lau.kernel}"
    cfg = forms.forward_plan(p, "fa1")[0].config
    return cfg.br, cfg.bc, "model only (FA1 Alg. 4), fa1_fwd's tiles"


def io_shape(p: Problem) -> iomodel.Shape:
    return iomodel.Shape(p.batch, p.seqlen_q, p.seqlen_k, p.heads, p.kv_heads, p.head_dim, p.itemsize, p.causal)


def io_row(p: Problem, kernel: str, direction: str, gpu: str) -> dict:
    br, bc, runs = io_tiles(p, kernel, direction)
    rep = iomodel.io_bytes(kernel, direction, io_shape(p), Br=br, Bc=bc)
    roof = iomodel.roofline(rep, gpu, p.dtype)
    return {"kernel": kernel, "dir": direction, "runs": runs, "Br": br, "Bc": bc, "read_MB": rep.read_bytes / 1e6,
            "write_MB": rep.write_bytes / 1e6, "GFLOP": rep.flops / 1e9, "flop_per_byte": rep.intensity,
            "bound_ms": roof["bound_ms"], "limiter": roof["limiter"], "bound_tflops": roof["tflops"],
            "breakdown_bytes": rep.breakdown}


def io_rows(p: Problem, gpu: str, kernels=iomodel.KERNELS, directions=iomodel.DIRECTIONS) -> list[dict]:
    return [io_row(p, k, d, gpu) for k in kernels for d in directions]


# ---------------------------------------------------------------- explain: a dry run of one call
def explain(spec: ShapeSpec, *, kernel: str, backend: str, scale, direction: str, deterministic: bool,
            gpu: str | None) -> dict:
    """Everything a call would do, or the exact error the API would raise; nothing is launched."""
    report = {"call": call_text(spec, kernel, backend, scale, direction, deterministic)}
    try:
        checked = validate(spec, kernel=kernel, backend=backend, scale=scale, direction=direction,
                           deterministic=deterministic)
    except (TypeError, ValueError) as err:
        return {**report, "valid": False, "error": f"{type(err).__name__}: {err}",
                "launched": "nothing: the API refuses this call before any launch"}
    p = checked.problem
    report.update(valid=True, problem=_problem_summary(p, checked.scale))
    if is_empty(p):
        return {**report, "launched": "nothing: an empty problem returns zeros (and lse = -inf) without a launch"}
    dirs = ("fwd", "bwd") if direction == "both" else (direction,)
    report["variants"] = [_variant_summary(registry.for_call(kernel, d)) for d in dirs]
    report["launches"] = [launch_row(p, d, lau) for d, lau in launches(p, kernel, direction, deterministic)]
    key, why = roofline_gpu(gpu)
    report["predicted"] = [_brief_io(io_row(p, kernel if d == "fwd" else "fa2", d, key)) for d in dirs]
    report["notes"] = _explain_notes(p, kernel, backend, key, why)
    return report


def _problem_summary(p: Problem, scale: float) -> dict:
    return {"batch": p.batch, "seqlen_q": p.seqlen_q, "seqlen_k": p.seqlen_k, "heads": p.heads,
            "kv_heads": p.kv_heads, "head_dim": p.head_dim, "kernel head_dim": p.padded_head_dim,
            "dtype": p.dtype, "causal": p.causal, "scale": scale}


def _variant_summary(v: registry.Variant) -> dict:
    return {"variant": v.name, "source": f"cuda/{v.source}", "algorithm": v.paper_algorithm,
            "warp partition": v.warp_partition}


def _brief_io(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "breakdown_bytes"}


def _explain_notes(p: Problem, kernel: str, backend: str, gpu: str, why: str) -> list[str]:
    notes = [f"time bound: roofline of {gpu} ({why}); caches are not modelled, so a kernel may beat it"]
    if p.causal:
        notes.append("causal: tiles wholly above the diagonal are skipped (never loaded)")
    if p.padded_head_dim != p.head_dim:
        notes.append(f"head_dim {p.head_dim} runs on the {p.padded_head_dim} kernel, zero-padded")
    if kernel == "naive":
        notes.append("naive: S = QK^T and O = PV are cuBLAS products, not listed among the launches")
    if backend == "reference":
        notes.append("backend 'reference': float64 NumPy on the host; no kernel is launched (the launches are "
                     "what backend='cupy' would make)")
    elif backend == "numba":
        notes.append("backend 'numba': the Numba twins take the same tiles, grids and shared memory")
    return notes
