"""rawflash.jax.ffi on the CPU: Python targets called through jax.ffi.ffi_call under jax.jit (buffers, attributes of
every kind, errors), hand-made call frames (metadata query, decoding, the API table's stream and device), the
ctypes mirror against jaxlib's c_api.h, and a CUDA lowering without a GPU."""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
ml_dtypes = pytest.importorskip("ml_dtypes")

from rawflash.jax import ffi  # noqa: E402

HEADER = Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h"
SIZES = ffi.STRUCT_SIZES
KEEP: list = []  # fake API tables and their callbacks live as long as the process, as XLA's table does


def _header_version() -> tuple[int, int]:
    text = HEADER.read_text() if HEADER.exists() else ""
    found = dict(re.findall(r"#define XLA_FFI_API_(MAJOR|MINOR) (\d+)", text))
    return int(found.get("MAJOR", -1)), int(found.get("MINOR", -1))


# the tests that compare the mirror with the header field by field: the header of the mirrored API version only
same_header = pytest.mark.skipif(_header_version() != ffi.API_VERSION,
                                 reason=f"this jaxlib's c_api.h is FFI API {_header_version()}, the mirror is of "
                                        f"{ffi.API_VERSION} (later versions keep the layouts the handler reads)")


@pytest.fixture(autouse=True)
def on_the_cpu():
    """The targets here are registered for the CPU: computations run there, also where JAX has a GPU."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def host_view(buf: ffi.Buffer) -> np.ndarray:
    """A NumPy view of a host buffer (the CPU platform's buffers are host memory)."""
    dtype = np.dtype(ml_dtypes.bfloat16) if buf.dtype == "bfloat16" else np.dtype(buf.dtype)
    nbytes = int(np.prod(buf.shape, dtype=np.int64)) * dtype.itemsize
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(buf.ptr))[:nbytes]
    return raw.view(dtype).reshape(buf.shape)


def jitted(name: str, results, **attrs):
    """jax.jit of the FFI call of target ``name`` with ``attrs``."""
    return jax.jit(lambda *xs: jax.ffi.ffi_call(name, results)(*xs, **attrs))


# ---- through jax.jit on the CPU ----

def scale(frame: ffi.Frame) -> None:
    x, out = frame.args[0], frame.rets[0]
    assert x.shape == out.shape and x.dtype == out.dtype
    host_view(out)[...] = host_view(x) * frame.attrs["factor"]


@pytest.mark.parametrize("dtype, factor", [("float32", np.float32(2.5)), ("int32", np.int32(-3))])
def test_handler_writes_out_as_in_times_attr(dtype, factor):
    ffi.register("rawflash_test_scale", scale, platform="cpu")
    x = jnp.arange(12, dtype=dtype).reshape(3, 4)
    out = jitted("rawflash_test_scale", jax.ShapeDtypeStruct(x.shape, x.dtype), factor=factor)(x)
    np.testing.assert_array_equal(np.asarray(out), np.arange(12, dtype=dtype).reshape(3, 4) * factor)
    assert out.dtype == dtype


def test_attributes_arrive_with_their_values_and_types():
    seen = []
    ffi.register("rawflash_test_attrs", lambda frame: seen.append(frame.attrs), platform="cpu")
    x = jnp.zeros(2, jnp.float32)
    attrs = dict(i32=np.int32(-7), i64=np.int64(1 << 40), f32=np.float32(0.25), f64=np.float64(1 / 3), flag=True,
                 off=False, text="causal", empty="", pyint=5, pyfloat=2.5, ints=np.array([3, -1, 1 << 35], np.int64),
                 floats=np.array([0.5, -1.25, 3.0], np.float32), u8=np.uint8(200), nested={"k": np.int32(4), "s": "x"})
    jitted("rawflash_test_attrs", jax.ShapeDtypeStruct(x.shape, x.dtype), **attrs)(x).block_until_ready()
    got = seen[-1]
    assert list(got) == sorted(attrs)  # XLA sorts attributes by name
    expected = dict(i32=-7, i64=1 << 40, f32=0.25, f64=1 / 3, flag=True, off=False, text="causal", empty="", pyint=5,
                    pyfloat=2.5, ints=(3, -1, 1 << 35), floats=(0.5, -1.25, 3.0), u8=200, nested={"k": 4, "s": "x"})
    assert got == expected
    for key in ("i32", "i64", "pyint", "u8"):
        assert type(got[key]) is int, key
    for key in ("f32", "f64", "pyfloat"):
        assert type(got[key]) is float, key
    assert type(got["flag"]) is bool and type(got["off"]) is bool
    assert type(got["text"]) is str
    assert type(got["ints"]) is tuple and all(type(v) is int for v in got["ints"])
    assert type(got["floats"]) is tuple and all(type(v) is float for v in got["floats"])


def test_args_and_rets_report_their_dtypes_and_shapes():
    seen = []
    ffi.register("rawflash_test_shapes", seen.append, platform="cpu")
    args = [jnp.ones((3, 4), jnp.float32), jnp.asarray(1.5, jnp.bfloat16), jnp.ones((2, 1, 3), jnp.int8),
            jnp.ones((5,), jnp.bool_), jnp.ones((2, 2), ml_dtypes.float8_e4m3fn)]
    rets = [jax.ShapeDtypeStruct((5,), jnp.float16), jax.ShapeDtypeStruct((), jnp.int32),
            jax.ShapeDtypeStruct((2, 2), jnp.uint8), jax.ShapeDtypeStruct((7, 1), jnp.bfloat16)]
    jax.block_until_ready(jitted("rawflash_test_shapes", rets)(*args))
    frame = seen[-1]
    assert [(b.dtype, b.shape) for b in frame.args] == [
        ("float32", (3, 4)), ("bfloat16", ()), ("int8", (2, 1, 3)), ("bool", (5,)), ("float8_e4m3fn", (2, 2))]
    assert [(b.dtype, b.shape) for b in frame.rets] == [
        ("float16", (5,)), ("int32", ()), ("uint8", (2, 2)), ("bfloat16", (7, 1))]
    assert all(isinstance(b.ptr, int) and b.ptr for b in frame.args + frame.rets)
    assert frame.stream == 0 and frame.device == 0  # the CPU gives no stream; its one device is ordinal 0


def test_float64_buffers_and_their_values_under_x64():
    seen = []

    def record(frame):
        seen.append((frame, host_view(frame.args[0]).copy()))
        host_view(frame.rets[0])[...] = 1.0

    ffi.register("rawflash_test_f64", record, platform="cpu")
    with jax.enable_x64(True):
        x = jnp.arange(6, dtype=jnp.float64).reshape(2, 3)
        out = jitted("rawflash_test_f64", jax.ShapeDtypeStruct((4,), jnp.int64))(x)
        np.testing.assert_array_equal(np.asarray(out), np.ones(4, np.int64))
    frame, values = seen[-1]
    assert (frame.args[0].dtype, frame.rets[0].dtype) == ("float64", "int64")
    np.testing.assert_array_equal(values, np.arange(6.0).reshape(2, 3))


def test_an_exception_in_fn_surfaces_from_the_jitted_call():
    calls = []

    def fail(frame):
        calls.append(frame)
        if frame.attrs["fail"]:
            raise ValueError("the kernel rejected head_dim=72")
        host_view(frame.rets[0])[...] = 0

    ffi.register("rawflash_test_fail", fail, platform="cpu")
    x = jnp.ones(3, jnp.float32)
    with pytest.raises(Exception) as info:
        jitted("rawflash_test_fail", jax.ShapeDtypeStruct(x.shape, x.dtype), fail=True)(x).block_until_ready()
    text = str(info.value)
    assert "ValueError" in text and "the kernel rejected head_dim=72" in text and "rawflash_test_fail" in text
    out = jitted("rawflash_test_fail", jax.ShapeDtypeStruct(x.shape, x.dtype), fail=False)(x)
    np.testing.assert_array_equal(np.asarray(out), np.zeros(3, np.float32))  # the target still works
    assert len(calls) == 2


def test_an_error_from_xlas_api_table_becomes_the_calls_error(monkeypatch):
    ffi.register("rawflash_test_api_error", lambda frame: None, platform="cpu")
    decode = ffi._decode
    monkeypatch.setattr(ffi, "_decode", lambda frame, stream: decode(frame, True))  # the CPU has no stream to get
    x = jnp.ones(2, jnp.float32)
    with pytest.raises(Exception, match="FFIError: XLA_FFI_Stream_Get failed: .+") as info:
        jitted("rawflash_test_api_error", jax.ShapeDtypeStruct(x.shape, x.dtype))(x).block_until_ready()
    assert "rawflash_test_api_error" in str(info.value)


def test_registering_twice_is_a_no_op():
    ffi.register("rawflash_test_twice", scale, platform="cpu")
    first = ffi.handler_pointer("rawflash_test_twice", "cpu")
    ffi.register("rawflash_test_twice", lambda frame: None, platform="cpu")
    ffi.register("rawflash_test_twice", scale, platform="CPU", command_buffer=True)
    assert ffi.handler_pointer("rawflash_test_twice", "cpu") == first
    x = jnp.arange(4, dtype=jnp.float32)
    out = jitted("rawflash_test_twice", jax.ShapeDtypeStruct(x.shape, x.dtype), factor=np.float32(3))(x)
    np.testing.assert_array_equal(np.asarray(out), np.arange(4, dtype=np.float32) * 3)  # the first fn runs


def test_cuda_lowering_without_a_gpu_shows_the_custom_call_and_its_attributes():
    ffi.register("rawflash_test_cuda", scale, platform="CUDA")  # no CUDA backend here: jax keeps it pending
    x = jnp.ones((2, 8), jnp.float16)
    f = jitted("rawflash_test_cuda", jax.ShapeDtypeStruct(x.shape, x.dtype), factor=np.float32(0.5), mode="causal",
               window=np.array([4, 0], np.int64))
    text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    call = next(line for line in text.splitlines() if "stablehlo.custom_call" in line)
    assert "@rawflash_test_cuda(" in call
    assert "factor = 5.000000e-01 : f32" in call and 'mode = "causal"' in call
    assert re.search(r"window = (array<i64: 4, 0>|dense<\[4, 0\]> : tensor<2xi64>)", call), call
    assert "mhlo.backend_config = {" in call  # attributes as a dictionary: the typed FFI (custom-call API 4)


# ---- hand-made call frames ----

class FakeApi:
    """An XLA_FFI_Api table whose functions are Python callbacks: Error_Create records the message and returns a
    fake error address; Stream_Get and DeviceOrdinal_Get answer ``stream`` and ``device`` (or fail)."""
    ERROR = 0xE000

    def __init__(self, stream=0x5EA, device=3, stream_fails=False, with_device=True):
        self.messages, self.destroyed = [], []
        call = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
        void = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

        def error_create(address):
            args = ffi.XLA_FFI_Error_Create_Args.from_address(address)
            assert args.struct_size == SIZES["XLA_FFI_Error_Create_Args"]
            self.messages.append((args.errc, args.message.decode()))
            return self.ERROR + len(self.messages)

        def error_get_message(address):
            args = ffi.XLA_FFI_Error_GetMessage_Args.from_address(address)
            args.message = b"no stream for you"

        def error_destroy(address):
            self.destroyed.append(ffi.XLA_FFI_Error_Destroy_Args.from_address(address).error)

        def stream_get(address):
            args = ffi.XLA_FFI_Stream_Get_Args.from_address(address)
            assert args.struct_size == SIZES["XLA_FFI_Stream_Get_Args"] and args.ctx == 0xC7
            if stream_fails:
                return self.ERROR
            args.stream = stream
            return None

        def device_ordinal_get(address):
            args = ffi.XLA_FFI_DeviceOrdinal_Get_Args.from_address(address)
            assert args.struct_size == SIZES["XLA_FFI_DeviceOrdinal_Get_Args"] and args.ctx == 0xC7
            args.device_ordinal = device
            return None

        self.callbacks = [call(error_create), void(error_get_message), void(error_destroy), call(stream_get),
                          call(device_ordinal_get)]
        size = SIZES["XLA_FFI_Api"] if with_device else ffi.XLA_FFI_Api.XLA_FFI_DeviceOrdinal_Get.offset
        self.table = ffi.XLA_FFI_Api(size, None, ffi.XLA_FFI_Api_Version(SIZES["XLA_FFI_Api_Version"], None, 0, 3))
        address = [ctypes.cast(c, ctypes.c_void_p).value for c in self.callbacks]
        (self.table.XLA_FFI_Error_Create, self.table.XLA_FFI_Error_GetMessage, self.table.XLA_FFI_Error_Destroy,
         self.table.XLA_FFI_Stream_Get, self.table.XLA_FFI_DeviceOrdinal_Get) = address
        KEEP.append(self)

    @property
    def address(self) -> int:
        return ctypes.addressof(self.table)


class FrameBuilder:
    """An XLA_FFI_CallFrame built in Python, with everything it points to kept alive by the builder."""

    def __init__(self, api: FakeApi | None = None, stage=ffi.STAGE_EXECUTE):
        self.keep = []
        self.frame = ffi.XLA_FFI_CallFrame(SIZES["XLA_FFI_CallFrame"], None, api.address if api else None, 0xC7,
                                           stage)
        self.frame.args.struct_size = SIZES["XLA_FFI_Args"]
        self.frame.rets.struct_size = SIZES["XLA_FFI_Rets"]
        self.frame.attrs.struct_size = SIZES["XLA_FFI_Attrs"]

    def _hold(self, obj):
        self.keep.append(obj)
        return obj

    def _address(self, obj) -> int:
        return ctypes.addressof(self._hold(obj))

    def buffer(self, code: int, shape: tuple[int, ...], data: int = 0x1000) -> int:
        dims = self._hold((ctypes.c_int64 * max(len(shape), 1))(*shape))
        return self._address(ffi.XLA_FFI_Buffer(SIZES["XLA_FFI_Buffer"], None, code, data, len(shape),
                                                ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))))

    def span(self, text: str) -> int:
        raw = self._hold(ctypes.create_string_buffer(text.encode()))
        return self._address(ffi.XLA_FFI_ByteSpan(ctypes.addressof(raw), len(text.encode())))

    def scalar(self, code: int, value) -> int:
        return self._address(ffi.XLA_FFI_Scalar(code, self._address(value)))

    def array(self, code: int, values: np.ndarray) -> int:
        data = self._hold(np.ascontiguousarray(values))
        return self._address(ffi.XLA_FFI_Array(code, data.size, data.ctypes.data if data.size else None))

    def attrs(self, items: list[tuple[str, int, int]], into: ffi.XLA_FFI_Attrs | None = None) -> ffi.XLA_FFI_Attrs:
        """Fills ``into`` (the frame's list, or a new nested one) with (name, XLA_FFI_AttrType, address) items."""
        target = into if into is not None else self._hold(ffi.XLA_FFI_Attrs(SIZES["XLA_FFI_Attrs"]))
        n = len(items)
        target.size = n
        target.types = self._hold((ctypes.c_int * n)(*(kind for _, kind, _ in items)))
        target.names = self._hold((ctypes.c_void_p * n)(*(self.span(name) for name, _, _ in items)))
        target.attrs = self._hold((ctypes.c_void_p * n)(*(address for _, _, address in items)))
        return target

    def set_buffers(self, which: str, buffers: list[int]) -> None:
        part = getattr(self.frame, which)
        part.size = len(buffers)
        part.types = self._hold((ctypes.c_int * len(buffers))(*[1] * len(buffers)))
        setattr(part, which, self._hold((ctypes.c_void_p * len(buffers))(*buffers)))

    @property
    def address(self) -> int:
        return ctypes.addressof(self.frame)


def call_handler(pointer: int, frame_address: int):
    """Calls a registered handler through its C address, as XLA does."""
    return ffi.HANDLER_TYPE(pointer)(frame_address)


def test_decode_frame_reads_buffers_and_every_attribute_kind():
    b = FrameBuilder()
    codes = ffi.DTYPE_CODES
    b.set_buffers("args", [b.buffer(codes["float32"], (2, 3), 0xA0), b.buffer(codes["bfloat16"], ()),
                           b.buffer(codes["token"], (), 0)])
    b.set_buffers("rets", [b.buffer(codes["float8_e5m2"], (4, 1, 2), 0xB0)])
    nested = b.attrs([("inner", ffi.ATTR_SCALAR, b.scalar(codes["int16"], ctypes.c_int16(-2)))])
    b.attrs([
        ("a_bf16", ffi.ATTR_SCALAR, b.scalar(codes["bfloat16"], ctypes.c_uint16(0x3FC0))),  # 1.5
        ("b_f16", ffi.ATTR_ARRAY, b.array(codes["float16"], np.array([0.5, -2.0], np.float16))),
        ("c_c64", ffi.ATTR_SCALAR, b.scalar(codes["complex64"], (ctypes.c_float * 2)(1.0, -0.5))),
        ("d_bools", ffi.ATTR_ARRAY, b.array(codes["bool"], np.array([True, False, True]))),
        ("e_empty", ffi.ATTR_ARRAY, b.array(codes["int32"], np.zeros(0, np.int32))),
        ("f_dict", ffi.ATTR_DICTIONARY, ctypes.addressof(nested)),
        ("g_text", ffi.ATTR_STRING, b.span("fa3")),
        ("h_u64", ffi.ATTR_SCALAR, b.scalar(codes["uint64"], ctypes.c_uint64(2**64 - 1))),
        ("i_bf16s", ffi.ATTR_ARRAY, b.array(codes["bfloat16"], np.array([1.0, -3.0], ml_dtypes.bfloat16))),
    ], into=b.frame.attrs)
    frame = ffi.decode_frame(b.address)
    assert [(x.ptr, x.dtype, x.shape) for x in frame.args] == [(0xA0, "float32", (2, 3)), (0x1000, "bfloat16", ()),
                                                               (0, "token", ())]
    assert [(x.ptr, x.dtype, x.shape) for x in frame.rets] == [(0xB0, "float8_e5m2", (4, 1, 2))]
    assert frame.attrs == {"a_bf16": 1.5, "b_f16": (0.5, -2.0), "c_c64": complex(1.0, -0.5),
                           "d_bools": (True, False, True), "e_empty": (), "f_dict": {"inner": -2}, "g_text": "fa3",
                           "h_u64": 2**64 - 1, "i_bf16s": (1.0, -3.0)}
    assert (frame.stream, frame.device) == (0, -1)  # no API table: no stream, no device


def test_decode_frame_asks_the_api_for_stream_and_device():
    api = FakeApi(stream=0x5EA, device=3)
    b = FrameBuilder(api)
    assert (ffi.decode_frame(b.address, stream=True).stream, ffi.decode_frame(b.address).stream) == (0x5EA, 0)
    assert ffi.decode_frame(b.address).device == 3
    older = FakeApi(with_device=False)  # a table that ends before XLA_FFI_DeviceOrdinal_Get
    assert ffi.decode_frame(FrameBuilder(older).address, stream=True).device == -1


def test_a_failing_stream_get_becomes_the_handlers_error():
    api = FakeApi(stream_fails=True)
    calls = []
    ffi.register("rawflash_test_stream_error", calls.append, platform="CUDA")
    error = call_handler(ffi.handler_pointer("rawflash_test_stream_error"), FrameBuilder(api).address)
    assert error == FakeApi.ERROR + 1 and not calls
    assert api.destroyed == [FakeApi.ERROR]  # the API's error is destroyed, its text carried on
    code, message = api.messages[0]
    assert code == ffi.ERROR_UNKNOWN and "FFIError" in message and "no stream for you" in message


def test_handler_runs_fn_at_the_execute_stage_only_and_reports_its_exceptions():
    api = FakeApi(stream=0xAB, device=1)
    frames = []

    def fn(frame):
        frames.append(frame)
        if frame.attrs:
            raise KeyError("missing plan")

    ffi.register("rawflash_test_stages", fn, platform="CUDA")
    pointer = ffi.handler_pointer("rawflash_test_stages", "cuda")
    for stage in (ffi.STAGE_INSTANTIATE, ffi.STAGE_PREPARE, ffi.STAGE_INITIALIZE):
        assert call_handler(pointer, FrameBuilder(api, stage).address) is None
    assert not frames
    assert call_handler(pointer, FrameBuilder(api).address) is None
    assert (frames[-1].stream, frames[-1].device) == (0xAB, 1)  # a CUDA target reads the stream
    b = FrameBuilder(api)
    b.attrs([("x", ffi.ATTR_STRING, b.span("y"))], into=b.frame.attrs)
    assert call_handler(pointer, b.address) == FakeApi.ERROR + 1
    assert api.messages == [(ffi.ERROR_UNKNOWN, "rawflash FFI target 'rawflash_test_stages': KeyError: 'missing plan'")]
    other = ffi.XLA_FFI_Extension_Base(SIZES["XLA_FFI_Extension_Base"], 99, None)
    with_extension = FrameBuilder(api)
    with_extension.frame.extension_start = ctypes.addressof(other)  # not the metadata query: fn runs
    assert call_handler(pointer, with_extension.address) is None and len(frames) == 3
    short = FrameBuilder(api)
    short.frame.struct_size = SIZES["XLA_FFI_CallFrame"] - 8
    assert call_handler(pointer, short.address) == FakeApi.ERROR + 2 and "XLA_FFI_CallFrame" in api.messages[-1][1]


def metadata_query(pointer: int, *, before=None, api: FakeApi | None = None, metadata_size=None):
    """Calls the handler with XLA's metadata query: a frame whose extension chain (after the extensions in
    ``before``) holds the metadata extension, and no API table unless ``api``. Returns (error, metadata)."""
    metadata = ffi.XLA_FFI_Metadata(metadata_size or SIZES["XLA_FFI_Metadata"],
                                    ffi.XLA_FFI_Api_Version(SIZES["XLA_FFI_Api_Version"]), 0xF0, 77)
    extension = ffi.XLA_FFI_Metadata_Extension(
        ffi.XLA_FFI_Extension_Base(SIZES["XLA_FFI_Metadata_Extension"], ffi.EXTENSION_METADATA, None),
        ctypes.pointer(metadata))
    b = FrameBuilder(api)
    start = ctypes.addressof(extension)
    for other in reversed(before or []):
        other.next = start
        start = ctypes.addressof(other)
    b.frame.extension_start = start
    return call_handler(pointer, b.address), metadata


@pytest.mark.parametrize("platform", ["cpu", "CUDA"])
@pytest.mark.parametrize("command_buffer", [False, True])
def test_metadata_query_fills_version_and_traits_without_calling_fn(platform, command_buffer):
    calls = []
    name = f"rawflash_test_metadata_{platform}_{command_buffer}"
    ffi.register(name, calls.append, platform=platform, command_buffer=command_buffer)
    error, metadata = metadata_query(ffi.handler_pointer(name, platform))
    assert error is None and not calls
    version = metadata.api_version
    assert (version.struct_size, version.major_version, version.minor_version) == (
        SIZES["XLA_FFI_Api_Version"], *ffi.API_VERSION)
    assert metadata.traits == (ffi.TRAIT_COMMAND_BUFFER_COMPATIBLE if command_buffer else 0)
    assert metadata.state_type_id == 0  # XLA_FFI_UNKNOWN_TYPE_ID


def test_metadata_query_finds_the_extension_down_the_chain_and_checks_its_size():
    calls = []
    ffi.register("rawflash_test_metadata_chain", calls.append, platform="cpu", command_buffer=True)
    pointer = ffi.handler_pointer("rawflash_test_metadata_chain", "cpu")
    other = ffi.XLA_FFI_Extension_Base(SIZES["XLA_FFI_Extension_Base"], 99, None)
    error, metadata = metadata_query(pointer, before=[other])
    assert error is None and metadata.api_version.major_version == ffi.API_VERSION[0] and metadata.traits == 1
    api = FakeApi()
    error, metadata = metadata_query(pointer, api=api, metadata_size=8)
    assert error == FakeApi.ERROR + 1 and "XLA_FFI_Metadata of 8 bytes" in api.messages[0][1]
    assert (metadata.api_version.minor_version, metadata.traits) == (0, 0xF0)  # left as it was
    assert not calls


# ---- the mirror against the installed jaxlib's header ----

@same_header
def test_versions_and_enums_match_the_header():
    text = HEADER.read_text()
    major = int(re.search(r"#define XLA_FFI_API_MAJOR (\d+)", text).group(1))
    minor = int(re.search(r"#define XLA_FFI_API_MINOR (\d+)", text).group(1))
    assert ffi.API_VERSION == (major, minor)
    enum = {name: int(v) for name, v in re.findall(r"XLA_FFI_DataType_(\w+) = (\d+)", text)}
    names = {"PRED": "bool", "TOKEN": "token", "INVALID": "invalid", "BF16": "bfloat16", "C64": "complex64",
             "C128": "complex128", "F16": "float16", "F32": "float32", "F64": "float64", "F8E5M2": "float8_e5m2",
             "F8E3M4": "float8_e3m4", "F8E4M3": "float8_e4m3", "F8E4M3FN": "float8_e4m3fn",
             "F8E4M3B11FNUZ": "float8_e4m3b11fnuz", "F8E5M2FNUZ": "float8_e5m2fnuz", "F8E4M3FNUZ": "float8_e4m3fnuz",
             "F4E2M1FN": "float4_e2m1fn", "F8E8M0FNU": "float8_e8m0fnu"}
    for bits in (1, 2, 4, 8, 16, 32, 64):
        names[f"S{bits}"], names[f"U{bits}"] = f"int{bits}", f"uint{bits}"
    assert {code: names[name] for name, code in enum.items()} == ffi.DTYPE_NAMES
    for pattern, value in [(r"XLA_FFI_Extension_Metadata = (\d+)", ffi.EXTENSION_METADATA),
                           (r"XLA_FFI_ExecutionStage_EXECUTE = (\d+)", ffi.STAGE_EXECUTE),
                           (r"XLA_FFI_ExecutionStage_PREPARE = (\d+)", ffi.STAGE_PREPARE),
                           (r"XLA_FFI_ArgType_BUFFER = (\d+)", ffi.ARG_BUFFER),
                           (r"XLA_FFI_RetType_BUFFER = (\d+)", ffi.RET_BUFFER),
                           (r"XLA_FFI_AttrType_ARRAY = (\d+)", ffi.ATTR_ARRAY),
                           (r"XLA_FFI_AttrType_DICTIONARY = (\d+)", ffi.ATTR_DICTIONARY),
                           (r"XLA_FFI_AttrType_SCALAR = (\d+)", ffi.ATTR_SCALAR),
                           (r"XLA_FFI_AttrType_STRING = (\d+)", ffi.ATTR_STRING),
                           (r"XLA_FFI_Error_Code_UNKNOWN = (\d+)", ffi.ERROR_UNKNOWN),
                           (r"XLA_FFI_Error_Code_INVALID_ARGUMENT = (\d+)", ffi.ERROR_INVALID_ARGUMENT),
                           (r"XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE = 1u << (\d+)", 0)]:
        assert int(re.search(pattern, text).group(1)) == value, pattern
    table = re.search(r"struct XLA_FFI_Api \{(.*?)\};", text, re.S).group(1)
    assert tuple(re.findall(r"_XLA_FFI_API_STRUCT_FIELD\((\w+)\)", table)) == ffi.API_FUNCTIONS


def _mirrors() -> list[str]:
    return sorted(n for n, v in vars(ffi).items()
                  if n.startswith("XLA_FFI_") and isinstance(v, type) and issubclass(v, ctypes.Structure))


@same_header
def test_struct_field_names_follow_the_header():
    text = HEADER.read_text()
    for name in _mirrors():
        body = re.search(rf"(?:typedef )?struct {name} \{{(.*?)\}}", text, re.S)
        assert body, name
        fields = re.findall(r"(\w+);", re.sub(r"//[^\n]*", "", body.group(1)))
        if name == "XLA_FFI_Api":
            fields = ["struct_size", "extension_start", "api_version", "internal_api", *ffi.API_FUNCTIONS]
        assert [f for f, _ in getattr(ffi, name)._fields_] == fields, name


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to read the header's layout")
@same_header
def test_struct_layouts_match_the_compiled_header(tmp_path):
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "xla/ffi/api/c_api.h"', "int main(void) {"]
    expected = []
    for name in _mirrors():
        cls = getattr(ffi, name)
        lines.append(f'  printf("%zu\\n", sizeof({name}));')
        expected.append((name, "sizeof", ctypes.sizeof(cls)))
        for field, _ in cls._fields_:
            lines.append(f'  printf("%zu %zu\\n", offsetof({name}, {field}), sizeof((({name}*)0)->{field}));')
            expected.append((name, field, f"{getattr(cls, field).offset} {getattr(cls, field).size}"))
    for name, size in SIZES.items():
        lines.append(f'  printf("%d\\n", (int){name}_STRUCT_SIZE);')
        expected.append((name, "STRUCT_SIZE", size))
    lines += ["  return 0;", "}"]
    (tmp_path / "layout.c").write_text("\n".join(lines))
    subprocess.run(["cc", "-I", jax.ffi.include_dir(), "-o", str(tmp_path / "layout"), str(tmp_path / "layout.c")],
                   check=True, capture_output=True)
    got = subprocess.run([str(tmp_path / "layout")], check=True, capture_output=True, text=True).stdout.splitlines()
    assert len(got) == len(expected)
    mismatches = [(name, what, want, have) for (name, what, want), have in zip(expected, got) if str(want) != have]
    assert not mismatches
