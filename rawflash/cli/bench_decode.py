"""The decode benchmark: a KV-cache step (one new token per sequence, appended) timed beside the peers.

Decoding reads the whole cache once per step and does little arithmetic on it, so its figure of merit is bandwidth:
bytes of K and V read (plus q and out) over the time, next to what a device-to-device copy reaches on the same GPU
in the same run. Every implementation is validated first (flash-attn's rule against the float64 reference, on a
reduced case of the same kind: dtype, head_dim, group, page size, query rows); an implementation that fails is
reported, not timed. Times are medians of CUDA-event timings with L2 flushed before every timed call (a model's
layers each read their own cache, so a step never finds it in L2). Peers: PyTorch's SDPA flash, cuDNN and
memory-efficient backends on the same contiguous cache (they do not append and cannot read pages; their time is the
attention alone; a paged case is compared with the peers' time on its contiguous twin).

The sweep (``sweep_cases``): batch 1, 8, 64 x context 1k, 8k, 32k, 128k x GQA 32/8, 64/8 and MQA 32/1 x contiguous and
paged (page 16, 64, 256), d = 128, bf16, plus speculative decoding (4 query rows) at every contiguous GQA 32/8
shape. Its largest cache, b64 x 128k x 8 kv heads, is 34 GB (K and V), which fits an H200 (141 GB) with its
float32 fill buffer; a case whose cache does not fit the free memory is reported as skipped. ``quick_cases`` is a
subset of 12 cases (about 2 minutes of an H200 with 10 repeats). ``fp8_cases`` times float8_e4m3fn caches (per
(sequence, kv head) descales, ``fp8.quantize_cache``) each beside the same step on its bf16 cache; the peers read
no FP8 cache and are timed on the bf16 twin, and an FP8 row's bandwidth counts its e4m3 bytes. ``latent_cases``
times the latent cache (MLA's absorbed decode, DeepSeek-V3: one cache of 576 columns whose first 512 are the
values, ``head_dim_v``) at batch 32 - 128 with 4k - 32k keys, 16 - 128 heads on one kv head, contiguous and in
pages of 64, 1 and 4 query rows; a row's bandwidth counts each key's 1152 bytes once. It has no peer: SDPA's flash
and cuDNN backends take head dims up to 256, and reading the same bytes would need v as a strided view of k's first
512 columns, which the memory-efficient backend copies (more bytes than the step reads), so the copy is its roof.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .. import reference
from .bench import _torch, time_ms

IMPLS = ("rawflash", "torch-flash", "torch-cudnn", "torch-efficient")
FILL_CHUNK = 1 << 28  # random fill in chunks of 256 MB of float32 (a 34 GB cache needs no 68 GB float32 copy)


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    batch: int
    cache: int            # keys already in every sequence's cache
    heads: int = 32
    kv_heads: int = 8     # Llama-3-8B's GQA
    head_dim: int = 128
    dtype: str = "bfloat16"
    page: int = 0         # 0: contiguous cache
    sq: int = 1           # query rows per sequence (more: speculative decoding, causal)
    new: int = 1          # keys appended per step (rawflash only)
    kv_dtype: str = ""    # "float8_e4m3fn": an FP8 cache (rawflash only); "": dtype
    head_dim_v: int = 0   # the latent cache (rawflash only): values are k_cache's first head_dim_v columns

    @property
    def name(self) -> str:
        layout = f"paged {self.page}" if self.page else "contiguous"
        return (f"b{self.batch} N{self.cache} h{self.heads}/{self.kv_heads} d{self.head_dim}"
                f"{f'/{self.head_dim_v} latent' if self.head_dim_v else ''} sq{self.sq} "
                f"{layout}" + (" fp8 cache" if self.kv_dtype else ""))

    @property
    def caches(self) -> int:
        """Caches read: K and V, or the latent cache alone."""
        return 1 if self.head_dim_v else 2

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def kv_itemsize(self) -> int:
        return 1 if self.kv_dtype else self.itemsize

    def bytes_moved(self) -> int:
        """K and V of every used key read once (in the cache's dtype; the latent cache's once: its K holds V), q read
        and out written once."""
        keys = self.cache + self.new
        return (self.kv_itemsize * self.caches * self.batch * keys * self.kv_heads * self.head_dim
                + self.itemsize * self.batch * self.sq * self.heads
                * (self.head_dim + (self.head_dim_v or self.head_dim)))

    def cache_bytes(self) -> int:
        """Device memory of the two caches (whole pages when paged)."""
        cap = self.cache + self.new
        rows = -(-cap // self.page) * self.page if self.page else cap
        return self.caches * self.batch * rows * self.kv_heads * self.head_dim * self.kv_itemsize

    @property
    def contiguous(self) -> "DecodeCase":
        """The twin the peers are timed on: contiguous, in the queries' dtype."""
        return dataclasses.replace(self, page=0, kv_dtype="")


GROUPS = ((32, 8), (64, 8), (32, 1))  # GQA 32/8 (Llama 3 8B), 64/8 (Llama 3 70B), MQA


def sweep_cases() -> list[DecodeCase]:
    """The full sweep: batch x context x group x layout at d = 128, bf16; then 4 query rows (GQA 32/8)."""
    out = [DecodeCase(b, n, h, hk, page=page) for b in (1, 8, 64) for n in (1024, 8192, 32768, 131072)
           for h, hk in GROUPS for page in (0, 16, 64, 256)]
    out += [DecodeCase(b, n, sq=4) for b in (1, 8, 64) for n in (1024, 8192, 32768, 131072)]
    return out


def quick_cases() -> list[DecodeCase]:
    """A subset that still shows every regime: small grids (b1, MQA), full waves (b8 / b64 long), each page size,
    the 64/8 group and speculative decoding."""
    return [DecodeCase(1, 32768), DecodeCase(1, 131072), DecodeCase(8, 8192), DecodeCase(8, 32768),
            DecodeCase(8, 32768, page=16), DecodeCase(8, 32768, page=64), DecodeCase(8, 32768, page=256),
            DecodeCase(64, 4096), DecodeCase(64, 8192, page=64), DecodeCase(8, 32768, 32, 1),
            DecodeCase(8, 32768, 64, 8), DecodeCase(8, 32768, sq=4)]


def fp8_cases() -> list[DecodeCase]:
    """FP8 caches, each after its bf16 twin: batch 8 and 64 with 8k - 32k keys (GQA 32/8, MQA 32/1, pages of 64)
    and batch 1 with 128k keys (a small grid)."""
    shapes = [DecodeCase(8, 8192), DecodeCase(8, 32768), DecodeCase(64, 8192), DecodeCase(1, 131072),
              DecodeCase(8, 32768, 32, 1), DecodeCase(8, 32768, page=64)]
    return [c for s in shapes for c in (s, dataclasses.replace(s, kv_dtype="float8_e4m3fn"))]


def latent_cases() -> list[DecodeCase]:
    """The latent cache (MLA's absorbed decode, DeepSeek-V3 / R1 serving): 128 heads at batch 32 / 64 / 128 with 4k -
    32k keys in pages of 64, then contiguous, 4 query rows, 16 and 64 heads, float16, one shape each."""
    mla = dict(heads=128, kv_heads=1, head_dim=576, head_dim_v=512, page=64)
    out = [DecodeCase(b, n, **mla) for b in (32, 64, 128) for n in (4096, 8192, 32768)]
    out += [DecodeCase(64, 8192, **{**mla, "page": 0}), DecodeCase(64, 8192, sq=4, **mla),
            DecodeCase(64, 8192, **{**mla, "heads": 16}), DecodeCase(64, 8192, **{**mla, "heads": 64}),
            DecodeCase(64, 8192, dtype="float16", **mla)]
    return out


def decode_cases() -> list[DecodeCase]:
    """A fixed set of 13 cases: GQA 32/8 at d = 128, bf16, batch 1 / 8 / 64 with 4k - 128k keys, contiguous; then
    pages of 16 and 256, 4 query rows, MHA at d = 64, MQA and float16, one shape each."""
    out = [DecodeCase(b, n) for b, n in ((1, 4096), (1, 32768), (1, 131072), (8, 4096), (8, 32768), (64, 4096),
                                         (64, 8192))]
    out += [DecodeCase(8, 32768, page=16), DecodeCase(8, 32768, page=256), DecodeCase(8, 32768, sq=4),
            DecodeCase(8, 8192, heads=16, kv_heads=16, head_dim=64), DecodeCase(8, 8192, heads=8, kv_heads=1),
            DecodeCase(8, 32768, dtype="float16")]
    return out


def _fill(x, rng) -> None:
    """x (any shape, a 16-bit or float32 CuPy array) filled with N(0, 1) draws, FILL_CHUNK float32 at a time."""
    flat = x.reshape(-1)
    for start in range(0, flat.size, FILL_CHUNK):
        stop = min(flat.size, start + FILL_CHUNK)
        flat[start:stop] = rng.standard_normal(stop - start, dtype=np.float32).astype(x.dtype)


def _inputs(case: DecodeCase, seed: int = 0):
    """Device arrays: q, the caches (a shuffled page order when paged), k_new, v_new, cache_seqlens, block_table."""
    import cupy
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16) if case.dtype == "bfloat16" else np.dtype(case.dtype)
    rng = cupy.random.default_rng(seed)
    cap = case.cache + case.new

    def rand(*shape):
        x = cupy.empty(shape, dtype=dt)
        _fill(x, rng)
        return x

    q = rand(case.batch, case.sq, case.heads, case.head_dim)
    table = None
    if case.page:
        per = -(-cap // case.page)
        kc, vc = [rand(case.batch * per, case.page, case.kv_heads, case.head_dim) for _ in range(case.caches)] + \
            [None] * (2 - case.caches)
        order = np.random.default_rng(seed).permutation(case.batch * per).astype(np.int32)
        table = cupy.asarray(order.reshape(case.batch, per))
    else:
        kc, vc = [rand(case.batch, cap, case.kv_heads, case.head_dim) for _ in range(case.caches)] + \
            [None] * (2 - case.caches)
    kn, vn = [rand(case.batch, case.new, case.kv_heads, case.head_dim) for _ in range(case.caches)] + \
        [None] * (2 - case.caches)  # (the latent cache: k_cache and k_new alone)
    lens = cupy.full(case.batch, case.cache, dtype=cupy.int32)
    return q, kc, vc, kn, vn, lens, table


def _quantized(case: DecodeCase, kc, vc) -> tuple:
    """(k_cache, v_cache, descales): an FP8 case's caches quantised per (sequence, kv head) (one descale per kv head
    over all pages when paged), with {k_descale, v_descale}; other cases' as they are, with {}."""
    if not case.kv_dtype:
        return kc, vc, {}
    from .. import fp8

    batch = case.batch if case.page else None
    (k8, kd), (v8, vd) = (fp8.quantize_cache(x, "head", batch=batch) for x in (kc, vc))
    return k8, v8, {"k_descale": kd, "v_descale": vd}


def _rawflash(case: DecodeCase, q, kc, vc, kn, vn, lens, table, override=None, descales=None):
    """(the kernels of one step bound once, the public call); ``override`` replaces tile rows in the bound one;
    ``descales``: an FP8 cache's {k_descale, v_descale}."""
    import rawflash

    from .. import settings, validation
    from ..kernels import cupy_backend

    causal = case.sq > 1
    descales = descales or {}
    latent = {"head_dim_v": case.head_dim_v} if case.head_dim_v else {}
    c = validation.check_decode(q, kc, vc, lens, kn, vn, table, causal, None, "cupy", validation.Features(),
                                **descales, **latent)
    bound = cupy_backend.bind_decode(c.problem, q, kc, vc, kn, vn, c.scale, None, c.extras, settings.load(), override)
    public = lambda: rawflash.decode(q, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn, block_table=table,  # noqa
                                     causal=causal, **descales, **latent)
    return bound, public


def _torch_call(impl: str, case: DecodeCase, q, kc, vc):
    """SDPA on the contiguous cache's first case.cache + case.new keys (the appended token included)."""
    torch = _torch()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"torch-flash": SDPBackend.FLASH_ATTENTION, "torch-cudnn": SDPBackend.CUDNN_ATTENTION,
               "torch-efficient": SDPBackend.EFFICIENT_ATTENTION}[impl]
    n = case.cache + case.new
    tq = torch.from_dlpack(q).transpose(1, 2)
    tk, tv = (torch.from_dlpack(x)[:, :n].transpose(1, 2) for x in (kc, vc))
    gqa = case.heads != case.kv_heads

    mask = None
    if case.sq > 1:  # bottom-right causal, as decode's (SDPA's is_causal is top-left)
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(case.sq, n)

    def call():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, enable_gqa=gqa)

    return call


def validate(impl: str, case: DecodeCase, override=None) -> tuple[bool, str]:
    """flash-attn's rule on a reduced case of the same kind (batch 2, at most 3000 cached keys); with
    ``override`` (tools/tune_decode.py's candidate rows) rawflash's bound kernels are checked instead of the call."""
    import cupy

    small = dataclasses.replace(case, batch=2, cache=min(case.cache, 3000) - 7)
    if impl != "rawflash" and (small.page or small.kv_dtype or small.head_dim_v):
        return False, "no paged cache" if small.page else "no FP8 cache" if small.kv_dtype else "no latent cache"
    q, kc, vc, kn, vn, lens, table = _inputs(small, seed=3)
    kc, vc, descales = _quantized(small, kc, vc)
    host = [None if x is None else _host(x) for x in (q, kc, vc, kn, vn, lens, table)]
    host_descales = {n: cupy.asnumpy(x) for n, x in descales.items()}
    causal = small.sq > 1
    if impl == "rawflash":
        bound, public = _rawflash(small, q, kc, vc, kn, vn, lens, table, override, descales)
        if override is None:
            got = cupy.asnumpy(public())
        else:
            bound.launch()
            got = cupy.asnumpy(bound.result()[0])
    else:  # the peers see the cache with the new token already in place
        kc[:, small.cache:small.cache + small.new], vc[:, small.cache:small.cache + small.new] = kn, vn
        host[1], host[2] = cupy.asnumpy(kc), cupy.asnumpy(vc)
        host[3] = host[4] = None
        host[5] = host[5] + small.new
        got = _torch_call(impl, small, q, kc, vc)().transpose(1, 2).float().cpu().numpy()
    args = dict(k_new=host[3], v_new=host[4], block_table=host[6], causal=causal, **host_descales,
                head_dim_v=small.head_dim_v or None)
    ref, _ = reference.decode(host[0], host[1], host[2], host[5], **args)
    base, _ = reference.decode(host[0], host[1], host[2], host[5], upcast=False, **args)
    ok, err, _, bound = reference.error_ratio_ok(np.asarray(got, np.float64), ref, base, host[0].dtype, 2.0)
    return (True, "ok") if ok else (False, f"out error {err:.3g} > {bound:.3g}")


def _host(x):
    """A device array on the host (an FP8 one through its bytes: CuPy does not copy e4m3 arrays out)."""
    import cupy

    if x.dtype.itemsize == 1 and x.dtype != np.uint8 and x.dtype != np.int8:
        return cupy.asnumpy(x.view(cupy.uint8)).view(x.dtype)
    return cupy.asnumpy(x)


def copy_bandwidth(nbytes: int = 4 << 30, repeats: int = 10) -> float:
    """GB/s of a device-to-device copy (bytes read plus bytes written), the roof a cache read is measured against."""
    import cupy

    src = cupy.ones(nbytes // 2, dtype=cupy.uint8)
    dst = cupy.empty_like(src)
    ms = time_ms(lambda: cupy.copyto(dst, src), repeats=repeats)
    del src, dst
    cupy.get_default_memory_pool().free_all_blocks()
    return nbytes / (ms * 1e-3) / 1e9


def _fits(case: DecodeCase) -> str | None:
    """None when the case's caches (and a float32 fill chunk, the L2 flush, the copies the peers make) fit the
    device's free memory, else why not."""
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    free = cupy.cuda.runtime.memGetInfo()[0]
    need = case.cache_bytes() + 4 * FILL_CHUNK + (1 << 30)
    if need > 0.9 * free:
        return f"skipped: needs about {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
    return None


def run_decode(repeats: int = 20, impls: tuple[str, ...] = IMPLS, cases: list[DecodeCase] | None = None) -> dict:
    """Validate, then time every case (default: ``sweep_cases``); rows of (case, impl, ms, GB/s, share of the copy
    bandwidth), and for rawflash its ratio to every peer and to the fastest one (a paged case: the peers' times
    on its contiguous twin)."""
    import cupy

    have_torch = _torch() is not None
    impls = tuple(i for i in impls if i == "rawflash" or have_torch)
    cases = sweep_cases() if cases is None else cases
    roof = copy_bandwidth()
    rows, checked = [], {}
    for case in cases:
        kind = (case.dtype, case.head_dim, case.heads // case.kv_heads, case.page, case.sq)
        skip = _fits(case)
        for impl in impls:
            row = {"case": case.name, "impl": impl}
            if impl != "rawflash" and case.head_dim_v:
                continue  # no peer reads the latent cache's bytes (the module's docstring)
            if impl != "rawflash" and (case.page or case.kv_dtype):
                continue  # SDPA reads no pages and no FP8 cache: compared on the contiguous bf16 twin below
            if skip:
                rows.append({**row, "status": skip})
                continue
            key = (impl, kind)
            if key not in checked:
                try:
                    checked[key] = validate(impl, case)
                except Exception as err:  # a peer that cannot run this kind of case is reported
                    checked[key] = (False, f"{type(err).__name__}: {str(err).splitlines()[0][:100]}")
            ok, why = checked[key]
            if not ok:
                rows.append({**row, "status": f"invalid: {why}"})
                continue
            q = kc = vc = kn = vn = lens = table = None
            try:
                q, kc, vc, kn, vn, lens, table = _inputs(case)
                if impl == "rawflash":
                    kc, vc, descales = _quantized(case, kc, vc)
                    bound, public = _rawflash(case, q, kc, vc, kn, vn, lens, table, descales=descales)
                    row["kernel_ms"] = time_ms(bound.launch, repeats=repeats)
                    row["ms"] = time_ms(public, repeats=repeats)
                    row["splits"] = bound.plan_info.num_splits
                    ms = row["kernel_ms"]
                else:
                    row["ms"] = ms = time_ms(_torch_call(impl, case, q, kc, vc), repeats=repeats)
                row["GB/s"] = case.bytes_moved() / (ms * 1e-3) / 1e9
                row["of copy"] = row["GB/s"] / roof
                row["status"] = "ok"
            except Exception as err:
                row["status"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:100]}"
            rows.append(row)
            del q, kc, vc, kn, vn, lens, table
            bound = public = descales = None
            cupy.get_default_memory_pool().free_all_blocks()
    _ratios(rows, cases, impls[1:])
    return {"copy_GBps": roof, "rows": rows}


def _ratios(rows: list[dict], cases: list[DecodeCase], peers: tuple[str, ...]) -> None:
    """Each rawflash row gets peer time / its time (> 1: faster than the peer), for the kernels and the public call,
    per peer and for the fastest peer (on the case's contiguous twin for paged cases, when the sweep timed it)."""
    by = {(r["case"], r["impl"]): r for r in rows}
    for case in cases:
        r = by.get((case.name, "rawflash"))
        if not r or r.get("status") != "ok":
            continue
        twin = by.get((dataclasses.replace(case, kv_dtype="").name, "rawflash"))
        if case.kv_dtype and twin and twin.get("status") == "ok":  # the same step on the bf16 cache
            r["vs bf16 cache"] = twin["kernel_ms"] / r["kernel_ms"]
        timed = {}
        for peer in peers:
            other = by.get((case.contiguous.name, peer))
            if other and other.get("status") == "ok":
                timed[peer] = other["ms"]
                r[f"vs {peer}"] = other["ms"] / r["kernel_ms"]
        if timed:
            best = min(timed, key=timed.get)
            r["fastest peer"] = best + (" (contiguous)" if case.page else "")
            r["vs fastest"] = timed[best] / r["kernel_ms"]
            r["vs fastest (public call)"] = timed[best] / r["ms"]
