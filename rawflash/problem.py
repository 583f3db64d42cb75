"""What one attention call is: its shapes, dtypes and features, after validation and before any kernel is chosen.

:class:`Problem` describes the call itself; what the kernels make of it lives with them: the specialised head_dim
(``kernels.configs.padded_head_dim``), the compile-time mask mode (``kernels.launch.mask_mode``) and the softmax
reference of the FA3 forward (``kernels.forms.softmax_ref``). This module imports nothing of rawflash, so every
layer above it (the kernels, validation, the API, the command line) can describe a call in the same terms.
"""
from __future__ import annotations

import dataclasses

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}


def cdiv(a: int, b: int) -> int:
    """Ceiling division, the one used everywhere in rawflash."""
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class Problem:
    """The shape and variant of one attention call after validation (head_dim is the caller's, not the padded one).

    Fixed lengths: every sequence has seqlen_q queries and seqlen_k keys. Packed variable lengths (``varlen``):
    batch sequences of at most seqlen_q / seqlen_k rows (the max lengths), total_q / total_k rows in all.
    ``window`` is flash-attn's ``window_size`` as given; :attr:`window_bounds` folds the causal mask into it.
    """

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    causal: bool
    arch: str = "sm_90"
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False
    varlen: bool = False
    total_q: int = 0
    total_k: int = 0
    seqused_k: bool = False
    # (seqlen_q, seqlen_k) of every packed sequence, when known on the host: introspection's; no launch reads it, so
    # a planned call (keyed on the maxima above) runs for other lengths
    lengths: tuple = ()
    new_keys: int = 0    # decode: rows of k_new / v_new appended to the cache (seqlen_k is the cache's capacity)
    page_size: int = 0   # decode and a paged forward: the pages' rows (0: contiguous keys)
    sms: int = 132       # multiprocessors of the GPU (an H200's by default): persistent grids and split counts
    gpu: str = "h200"    # the tuned GPU whose rows and gates apply (kernels.configs.GPU_ROWS, GATES)
    out_dtype: str = ""  # FP8: the output's dtype (bfloat16 or float16); "" for the 16-bit and float32 forms
    kv_dtype: str = ""   # decode: the KV cache's dtype where it is not dtype ("float8_e4m3fn": an FP8 cache)
    head_dim_v: int = 0  # v's head_dim where it is not head_dim (MLA's head_dim_v < head_dim_qk); 0: head_dim

    @property
    def value_head_dim(self) -> int:
        """v's head_dim (and out's, dout's, dv's): head_dim_v, or head_dim where v has q's."""
        return self.head_dim_v or self.head_dim

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def kv_itemsize(self) -> int:
        """Bytes of one element of the keys and values (decode's FP8 cache: 1)."""
        return ITEMSIZE[self.kv_dtype or self.dtype]

    @property
    def window_bounds(self) -> tuple[int, int]:
        """(left, right) keys a query sees around its diagonal, -1 = unbounded; causal makes right 0."""
        left, right = self.window
        return (left, 0) if self.causal else (left, right)

    @property
    def bounded_right(self) -> bool:
        """Whether no query sees keys beyond a fixed offset right of its diagonal (causal, or a window with a right
        bound): policy.cuh's Policy::bounded_right."""
        return self.window_bounds[1] >= 0

    @property
    def general(self) -> bool:
        """Whether the call needs the general variant policy (policy.cuh): packed lengths, seqused_k, soft-capping,
        ALiBi, or a window other than plain causal. Sinks run in both policies."""
        left, right = self.window_bounds
        windowed = left >= 0 or (right >= 0 and not self.causal)
        return self.varlen or self.seqused_k or self.softcap > 0 or self.alibi or windowed

    @property
    def rows(self) -> tuple[int, int]:
        """(batch, seqlen) of the per-row float32 buffers (lse, L, D, dQ rows): (1, total_q) when packed."""
        return (1, self.total_q) if self.varlen else (self.batch, self.seqlen_q)

    def q_tiles(self, br: int) -> int:
        """Query tiles of height br the grid's x covers (packed sequences: an upper bound, spare CTAs exit)."""
        return cdiv(self.total_q, br) + self.batch if self.varlen else cdiv(self.seqlen_q, br)

    def k_tiles(self, bc: int) -> int:
        """Key tiles of width bc the backward grid's x covers (packed sequences: an upper bound)."""
        return cdiv(self.total_k, bc) + self.batch if self.varlen else cdiv(self.seqlen_k, bc)
