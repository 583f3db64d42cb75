"""Tensor maps for Hopper's TMA copies (cuda/tma.cuh), encoded on the host by the CUDA driver.

A TMA copy is described by a 128-byte ``CUtensorMap`` that ``cuTensorMapEncodeTiled`` fills in from the tensor's
address, sizes and strides, the box one copy moves and the shared-memory swizzle. The kernels take the forward's
four maps as one ``__grid_constant__`` parameter (``TmaFwd``: q, k, v and o, whose box is one consumer
warpgroup's 64 rows: the 16-bit epilogue's TMA store), the backward its five (``TmaBwd``: q, k, v, dO and the
float32 dQ rows).

The driver function is called through ``ctypes`` on ``libcuda``, the driver library CuPy has already loaded:
one C function with plain integer and pointer arguments needs no binding package (``cuda-bindings`` would be a
new dependency for one call), and its enums are written out below from ``cuda.h``.

Every tensor is described as 4-d, (head_dim, rows, heads, batch) innermost first, strides in bytes; packed
variable-length tensors are one "batch" of all their rows. A box is 64 columns (128 bytes: the 128-byte swizzle)
by ``box_rows`` rows of one head of one sequence; columns past head_dim and rows past the tensor's end are filled
with zeros, which is how a head_dim that is not a multiple of 64 runs with no padding copy.
"""
from __future__ import annotations

import ctypes
import functools
import math

import numpy as np

DATA_TYPE = {"float16": 6, "bfloat16": 9}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16
FLOAT32 = 7                                # CU_TENSOR_MAP_DATA_TYPE_FLOAT32
INTERLEAVE_NONE = 0
SWIZZLE_128B = 3
SWIZZLE_64B = 2
L2_PROMOTION_256B = 3
OOB_FILL_ZEROS = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: out-of-bounds elements read as zero
BOX_COLS = 64        # 128 bytes of 16-bit elements: one swizzle row
MAX_BOX_ROWS = 256
DESC_BYTES = 128

FWD_DTYPE = np.dtype([("q", np.uint64, 16), ("k", np.uint64, 16), ("v", np.uint64, 16), ("o", np.uint64, 16)])
O_BOX_ROWS = 64  # the forward's output box: one consumer warpgroup's rows (mainloop_fwd_sm90_ws.cuh's store)
DQ_BOX_ROWS = 64  # the backward's dQ box: one consumer warpgroup's dQ_i slice (mainloop_bwd_sm90_ws.cuh)


def dq_box_rows(br: int) -> int:
    """The rows of the backward's dQ box for query blocks of br rows (mainloop_bwd_sm90_ws.cuh's DQ_ROWS): one
    consumer warpgroup's 64-row slice, or the whole block where br is no multiple of 64 (80 rows: a warpgroup then
    holds a column slice of every row)."""
    return DQ_BOX_ROWS if br % DQ_BOX_ROWS == 0 else br
BWD_DTYPE = np.dtype([("q", np.uint64, 16), ("k", np.uint64, 16), ("v", np.uint64, 16), ("dout", np.uint64, 16),
                      ("dq", np.uint64, 16)])


class TmaUnavailable(ValueError):
    """The tensor cannot be described by a tensor map (alignment, strides) or the driver refused it."""


@functools.lru_cache(maxsize=1)
def _encode_fn():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                   ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32),
                   ctypes.POINTER(ctypes.c_uint32), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


def layout_4d(x, packed: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(dims, byte strides of dims 1..3) of a (batch, rows, heads, d) or packed (total, heads, d) array.

    TMA wants every stride a positive multiple of 16 bytes: a dimension of size 1 gets the next dimension's
    extent as its (never used) stride; a zero or negative stride, or one off the 16-byte grid, raises
    TmaUnavailable.
    """
    item = x.dtype.itemsize
    if packed:
        (rows, heads, d), (s_row, s_head, _) = x.shape, x.strides
        batch, s_batch = 1, 0
    else:
        (batch, rows, heads, d), (s_batch, s_row, s_head, _) = x.shape, x.strides
    if x.strides[-1] != item and d > 1:
        raise TmaUnavailable("head_dim is not contiguous")
    dims = (d, rows, heads, batch)
    if min(dims) == 0:
        raise TmaUnavailable(f"an empty tensor (dims {dims})")
    strides = []
    for extent, stride in ((rows, s_row), (heads, s_head), (batch, s_batch)):
        if extent == 1:
            stride = -(-max(abs(stride), x.nbytes, 16) // 16) * 16
        if stride <= 0 or stride % 16:
            raise TmaUnavailable(f"a stride of {stride} bytes (TMA needs positive multiples of 16)")
        strides.append(stride)
    return dims, tuple(strides)


def _encode(ptr: int, data_type: int, dims: tuple, strides: tuple, box: tuple, swizzle: int) -> np.ndarray:
    """cuTensorMapEncodeTiled: the 16 quad-words of the map (zero fill, 256-byte L2 promotion)."""
    rank = len(dims)
    buf = (ctypes.c_uint64 * (2 * DESC_BYTES // 8))()           # room to align the map to 128 bytes
    aligned = -(-ctypes.addressof(buf) // DESC_BYTES) * DESC_BYTES
    rc = _encode_fn()(aligned, data_type, rank, ptr, (ctypes.c_uint64 * rank)(*dims),
                      (ctypes.c_uint64 * (rank - 1))(*strides), (ctypes.c_uint32 * rank)(*box),
                      (ctypes.c_uint32 * rank)(*([1] * rank)), INTERLEAVE_NONE, swizzle, L2_PROMOTION_256B,
                      OOB_FILL_ZEROS)
    if rc != 0:
        raise TmaUnavailable(f"cuTensorMapEncodeTiled returned CUresult {rc} for dims {dims}, strides {strides}, "
                             f"box {box}")
    return np.frombuffer(ctypes.string_at(aligned, DESC_BYTES), dtype=np.uint64).copy()


def encode(x, box_rows: int, packed: bool) -> np.ndarray:
    """A tensor map of ``x`` (float16 / bfloat16, 4-d as ``layout_4d``) whose box is 64 columns by ``box_rows``
    rows of one head, 128-byte swizzle, zero fill."""
    dtype = str(x.dtype)
    if dtype not in DATA_TYPE:
        raise TmaUnavailable(f"TMA forms take float16 or bfloat16, got {dtype}")
    if not 0 < box_rows <= MAX_BOX_ROWS:
        raise TmaUnavailable(f"a box of {box_rows} rows (at most {MAX_BOX_ROWS})")
    if x.data.ptr % 16:
        raise TmaUnavailable("the base address is not 16-byte aligned")
    dims, strides = layout_4d(x, packed)
    return _encode(x.data.ptr, DATA_TYPE[dtype], dims, strides, (BOX_COLS, box_rows, 1, 1), SWIZZLE_128B)


def encode_rows_f32(x, box_rows: int) -> np.ndarray:
    """A tensor map of a contiguous float32 array of rows (..., head_dim) as 2-d (head_dim, rows): boxes of 32
    columns (128 bytes, 128-byte swizzle) by ``box_rows`` rows; the backward's TMA reduce-add of dQ targets it."""
    if x.dtype != np.float32 or not x.flags.c_contiguous or x.shape[-1] % 4:
        raise TmaUnavailable("dQ rows must be contiguous float32 with head_dim a multiple of 4")
    d = x.shape[-1]
    if x.size == 0:
        raise TmaUnavailable("no dQ rows")
    return _encode(x.data.ptr, FLOAT32, (d, x.size // d), (d * 4,), (32, box_rows), SWIZZLE_128B)


def tma_pages(page_size: int) -> bool:
    """Whether FA3's forward reads pages of ``page_size`` rows (a paged forward's keys): powers of two, so its
    producer locates a key by shift and mask and its boxes (:func:`paged_box_rows`, at least 16 rows with the
    pages' own minimum of 16) start on whole 8-row swizzle atoms; other sizes run the cp.async forms."""
    return page_size > 0 and page_size & (page_size - 1) == 0


def paged_box_rows(bc: int, page_size: int) -> int:
    """The rows of a paged forward's k and v boxes for key blocks of bc rows in pages of page_size rows: their
    greatest common divisor, so that every box lies inside one page and a block is whole boxes
    (mainloop_fwd_sm90_ws.cuh's produce_paged computes the same for a power-of-two page size)."""
    return math.gcd(bc, page_size)


def fwd_maps(q, k, v, o, br: int, bc: int, packed: bool, page_size: int = 0) -> np.ndarray:
    """The forward's ``TmaFwd`` parameter: q in boxes of br rows, k and v in boxes of bc rows (paged keys, a
    ``page_size``: the page pool (num_pages, page_size, kv_heads, head_dim) in boxes of ``paged_box_rows``), the
    output o in boxes of ``O_BOX_ROWS`` rows."""
    rec = np.zeros(1, FWD_DTYPE)
    rec["q"] = encode(q, br, packed)
    if page_size:
        rec["k"] = encode(k, paged_box_rows(bc, page_size), False)
        rec["v"] = encode(v, paged_box_rows(bc, page_size), False)
    else:
        rec["k"] = encode(k, bc, packed)
        rec["v"] = encode(v, bc, packed)
    rec["o"] = encode(o, O_BOX_ROWS, packed)
    return rec


UINT8 = 0  # CU_TENSOR_MAP_DATA_TYPE_UINT8: e4m3 bytes
BOX_BYTES = 128


def fwd_maps_fp8(q, k, vt, br: int, bc: int, d: int, packed: bool = False) -> np.ndarray:
    """The FP8 forward's ``TmaFwd`` (its o unused: the FP8 epilogue stores from registers): q and k (uint8 views
    of e4m3, 4-d as ``layout_4d``) in boxes of 128 columns by
    br / bc rows; the V^T workspace (batch, kv_heads, head_dim, keys) as (keys, head_dim, kv_heads, batch) in boxes
    of 128 keys by ``d`` rows (the compiled head_dim: rows past the caller's are zero-filled), or of 64 keys with
    the 64-byte swizzle when bc is not a multiple of 128."""
    rec = np.zeros(1, FWD_DTYPE)
    for name, x, rows in (("q", q, br), ("k", k, bc)):
        if x.data.ptr % 16:
            raise TmaUnavailable(f"{name}'s base address is not 16-byte aligned")
        dims, strides = layout_4d(x, packed)
        rec[name] = _encode(x.data.ptr, UINT8, dims, strides, (BOX_BYTES, rows, 1, 1), SWIZZLE_128B)
    dims, strides = layout_4d(vt.transpose(0, 2, 1, 3), False)
    wide = bc % BOX_BYTES == 0  # else 64-key boxes in the 64-byte swizzle (hopper.cuh's Sw64x8: bc = 192)
    rec["v"] = _encode(vt.data.ptr, UINT8, dims, strides, (BOX_BYTES if wide else BOX_BYTES // 2, d, 1, 1),
                       SWIZZLE_128B if wide else SWIZZLE_64B)
    return rec


def bwd_maps(q, k, v, dout, dq_ws, br: int, bc: int, packed: bool) -> np.ndarray:
    """The backward's ``TmaBwd`` parameter: q and dout in boxes of br rows, k and v in boxes of bc rows, and the
    float32 dQ rows dq_ws for the reduce-add in boxes of ``dq_box_rows(br)`` rows."""
    rec = np.zeros(1, BWD_DTYPE)
    for name, x, rows in (("q", q, br), ("k", k, bc), ("v", v, bc), ("dout", dout, br)):
        rec[name] = encode(x, rows, packed)
    rec["dq"] = encode_rows_f32(dq_ws, dq_box_rows(br))
    return rec
