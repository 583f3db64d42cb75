"""Python functions as XLA FFI custom-call targets, through a ctypes handler: no C or C++ build.

XLA calls an FFI target as ``XLA_FFI_Error* handler(XLA_FFI_CallFrame* frame)``. The call frame (mirrored here
from ``xla/ffi/api/c_api.h``, FFI API 0.3, the header jaxlib 0.10.2 ships under ``jax.ffi.include_dir()``) holds
the ``XLA_FFI_Api*`` function table, an opaque execution context, the stage, and three lists: the arguments and
the results (each an ``XLA_FFI_Buffer``: dtype code, data pointer, rank, dims) and the attributes sorted by name
(each a type tag, a name byte span and a pointer to a scalar, a dense array, a byte span or a nested attribute
list). The handler returns NULL for success or an error made by the table's ``XLA_FFI_Error_Create``, which XLA
owns from then on; ``XLA_FFI_Stream_Get`` gives the platform stream (a ``CUstream`` on CUDA) and
``XLA_FFI_DeviceOrdinal_Get`` the device. When XLA registers a handler it first calls it with a frame whose
extension chain starts with the metadata extension (and whose API pointer is NULL): the handler then writes its
FFI API version and traits (bit 0: command-buffer compatible, i.e. safe to capture into a CUDA graph) into the
``XLA_FFI_Metadata`` and returns without running. XLA rejects a version outside the range it supports (0.1 to
0.3 for jaxlib 0.10.2). FFI API 0.4 (jaxlib 0.11.2) keeps every layout used here, renames the error-message call
``XLA_FFI_Error_GetDetails`` and gives its arguments one more out field, for which the call here leaves room; a
0.3 handler registers and runs there (on CUDA too, inside CUDA graphs).

rawflash is pure Python, pip-installable, whose CUDA kernels NVRTC compiles at first use; a C++ handler would
need a compiler and XLA headers at install time. A ``ctypes.CFUNCTYPE`` pointer is a real C function pointer,
and ctypes takes the GIL on entry, so XLA calls Python directly, on whatever thread runs the custom call.

:func:`register` makes a Python ``fn(frame: Frame) -> None`` an FFI target; the handler decodes the call frame
into a :class:`Frame` of plain Python values (:func:`decode_frame`), calls ``fn`` at the execute stage only, and
turns an exception into an XLA error whose message names the target and carries the exception's type and text.
The per-call work is one pass over the frame with ctypes types built at import; the API table's functions are
wrapped once per table address (XLA's table is a static singleton).
"""
from __future__ import annotations

import ctypes
from ctypes import POINTER, Structure, c_bool, c_char_p, c_double, c_float, c_int, c_int8, c_int16, c_int32
from ctypes import c_int64, c_size_t, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p

import numpy as np

__all__ = ["Buffer", "Frame", "FFIError", "register", "decode_frame", "decode_attrs", "handler_pointer",
           "API_VERSION", "TRAIT_COMMAND_BUFFER_COMPATIBLE"]

API_VERSION = (0, 3)  # XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR of the mirrored header
TRAIT_COMMAND_BUFFER_COMPATIBLE = 1 << 0  # XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE

EXTENSION_METADATA = 1  # XLA_FFI_Extension_Type
STAGE_INSTANTIATE, STAGE_PREPARE, STAGE_INITIALIZE, STAGE_EXECUTE = 0, 1, 2, 3  # XLA_FFI_ExecutionStage
ARG_BUFFER = 1  # XLA_FFI_ArgType
RET_BUFFER = 1  # XLA_FFI_RetType
ATTR_ARRAY, ATTR_DICTIONARY, ATTR_SCALAR, ATTR_STRING = 1, 2, 3, 4  # XLA_FFI_AttrType
ERROR_UNKNOWN, ERROR_INVALID_ARGUMENT = 2, 3  # XLA_FFI_Error_Code (the ones used here)

# XLA_FFI_DataType code -> numpy-style name (ml_dtypes' names for the narrow floats and integers).
DTYPE_NAMES = {
    0: "invalid", 1: "bool", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "uint8", 7: "uint16", 8: "uint32",
    9: "uint64", 10: "float16", 11: "float32", 12: "float64", 15: "complex64", 16: "bfloat16", 17: "token",
    18: "complex128", 19: "float8_e5m2", 20: "float8_e4m3fn", 21: "int4", 22: "uint4", 23: "float8_e4m3b11fnuz",
    24: "float8_e5m2fnuz", 25: "float8_e4m3fnuz", 26: "int2", 27: "uint2", 28: "float8_e4m3", 29: "float8_e3m4",
    30: "int1", 31: "uint1", 32: "float4_e2m1fn", 33: "float8_e8m0fnu",
}
DTYPE_CODES = {name: code for code, name in DTYPE_NAMES.items()}


# ---- ctypes mirrors of c_api.h (field names as in the header) ----

def _struct_size(struct: type, last_field: str) -> int:
    """The header's XLA_FFI_STRUCT_SIZE: the offset of the last field plus its size (no tail padding)."""
    field = getattr(struct, last_field)
    return field.offset + field.size


class XLA_FFI_Extension_Base(Structure):
    _fields_ = [("struct_size", c_size_t), ("type", c_int), ("next", c_void_p)]


class XLA_FFI_Api_Version(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("major_version", c_int),
                ("minor_version", c_int)]


class XLA_FFI_Error_Create_Args(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("message", c_char_p), ("errc", c_int)]


class XLA_FFI_Error_GetMessage_Args(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("error", c_void_p),
                ("message", c_char_p)]


class _GetMessageArgsWithRoom(Structure):
    """XLA_FFI_Error_GetMessage_Args and room behind it for out fields a newer XLA may write there."""
    _fields_ = [("args", XLA_FFI_Error_GetMessage_Args), ("room", c_int64 * 2)]


class XLA_FFI_Error_Destroy_Args(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("error", c_void_p)]


class XLA_FFI_Buffer(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("dtype", c_int), ("data", c_void_p),
                ("rank", c_int64), ("dims", POINTER(c_int64))]


class XLA_FFI_ByteSpan(Structure):
    _fields_ = [("ptr", c_void_p), ("len", c_size_t)]


class XLA_FFI_Scalar(Structure):
    _fields_ = [("dtype", c_int), ("value", c_void_p)]


class XLA_FFI_Array(Structure):
    _fields_ = [("dtype", c_int), ("size", c_size_t), ("data", c_void_p)]


class XLA_FFI_Args(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("size", c_int64),
                ("types", POINTER(c_int)), ("args", POINTER(c_void_p))]


class XLA_FFI_Rets(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("size", c_int64),
                ("types", POINTER(c_int)), ("rets", POINTER(c_void_p))]


class XLA_FFI_Attrs(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("size", c_int64),
                ("types", POINTER(c_int)), ("names", POINTER(c_void_p)), ("attrs", POINTER(c_void_p))]


class XLA_FFI_CallFrame(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("api", c_void_p), ("ctx", c_void_p),
                ("stage", c_int), ("args", XLA_FFI_Args), ("rets", XLA_FFI_Rets), ("attrs", XLA_FFI_Attrs),
                ("future", c_void_p)]


class XLA_FFI_Metadata(Structure):
    _fields_ = [("struct_size", c_size_t), ("api_version", XLA_FFI_Api_Version), ("traits", c_uint32),
                ("state_type_id", c_int64)]  # XLA_FFI_TypeId is a struct of one int64_t


class XLA_FFI_Metadata_Extension(Structure):
    _fields_ = [("extension_base", XLA_FFI_Extension_Base), ("metadata", POINTER(XLA_FFI_Metadata))]


class XLA_FFI_Stream_Get_Args(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("ctx", c_void_p), ("stream", c_void_p)]


class XLA_FFI_DeviceOrdinal_Get_Args(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("ctx", c_void_p),
                ("device_ordinal", c_int32)]


# The function table, in the header's order; every entry is a function pointer (c_void_p here, wrapped on use).
API_FUNCTIONS = ("XLA_FFI_Error_Create", "XLA_FFI_Error_GetMessage", "XLA_FFI_Error_Destroy",
                 "XLA_FFI_Handler_Register", "XLA_FFI_Stream_Get", "XLA_FFI_Type_Register",
                 "XLA_FFI_ExecutionContext_Get", "XLA_FFI_State_Set", "XLA_FFI_State_Get",
                 "XLA_FFI_DeviceMemory_Allocate", "XLA_FFI_DeviceMemory_Free", "XLA_FFI_ThreadPool_Schedule",
                 "XLA_FFI_ThreadPool_NumThreads", "XLA_FFI_Future_Create", "XLA_FFI_Future_SetAvailable",
                 "XLA_FFI_Future_SetError", "XLA_FFI_RunId_Get", "XLA_FFI_DeviceOrdinal_Get")


class XLA_FFI_Api(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("api_version", XLA_FFI_Api_Version),
                ("internal_api", c_void_p)] + [(name, c_void_p) for name in API_FUNCTIONS]


STRUCT_SIZES = {
    "XLA_FFI_Extension_Base": _struct_size(XLA_FFI_Extension_Base, "next"),
    "XLA_FFI_Api_Version": _struct_size(XLA_FFI_Api_Version, "minor_version"),
    "XLA_FFI_Error_Create_Args": _struct_size(XLA_FFI_Error_Create_Args, "errc"),
    "XLA_FFI_Error_GetMessage_Args": _struct_size(XLA_FFI_Error_GetMessage_Args, "message"),
    "XLA_FFI_Error_Destroy_Args": _struct_size(XLA_FFI_Error_Destroy_Args, "error"),
    "XLA_FFI_Buffer": _struct_size(XLA_FFI_Buffer, "dims"),
    "XLA_FFI_Args": _struct_size(XLA_FFI_Args, "args"),
    "XLA_FFI_Rets": _struct_size(XLA_FFI_Rets, "rets"),
    "XLA_FFI_Attrs": _struct_size(XLA_FFI_Attrs, "attrs"),
    "XLA_FFI_CallFrame": _struct_size(XLA_FFI_CallFrame, "attrs"),
    "XLA_FFI_Metadata": _struct_size(XLA_FFI_Metadata, "traits"),
    "XLA_FFI_Metadata_Extension": _struct_size(XLA_FFI_Metadata_Extension, "metadata"),
    "XLA_FFI_Stream_Get_Args": _struct_size(XLA_FFI_Stream_Get_Args, "stream"),
    "XLA_FFI_DeviceOrdinal_Get_Args": _struct_size(XLA_FFI_DeviceOrdinal_Get_Args, "device_ordinal"),
    "XLA_FFI_Api": _struct_size(XLA_FFI_Api, "XLA_FFI_DeviceOrdinal_Get"),
}
_FRAME_SIZE = STRUCT_SIZES["XLA_FFI_CallFrame"]
_API_HAS_DEVICE_ORDINAL = STRUCT_SIZES["XLA_FFI_Api"]  # a table at least this long carries DeviceOrdinal_Get

# The handler's C type, and the API functions' (each takes a pointer to its args struct). PYFUNCTYPE keeps the
# GIL across the call: XLA's API functions are short and never call back into Python.
HANDLER_TYPE = ctypes.CFUNCTYPE(c_void_p, c_void_p)
_ApiCall = ctypes.PYFUNCTYPE(c_void_p, c_void_p)
_ApiVoidCall = ctypes.PYFUNCTYPE(None, c_void_p)


# ---- the decoded frame ----

class Buffer:
    """One argument or result buffer: its address (device memory on CUDA, host memory on CPU), numpy-style
    dtype name ('token' for a token) and shape."""
    __slots__ = ("ptr", "dtype", "shape")

    def __init__(self, ptr: int, dtype: str, shape: tuple[int, ...]):
        self.ptr = ptr
        self.dtype = dtype
        self.shape = shape

    def __repr__(self) -> str:
        return f"Buffer(ptr={self.ptr:#x}, dtype={self.dtype!r}, shape={self.shape})"


class Frame:
    """One call of a target: the platform stream (a CUstream as int on CUDA, 0 where the platform gives none),
    the device ordinal (-1 where XLA gives none), the argument and result buffers, and the attributes by name
    (scalars as int / float / bool / complex, strings as str, dense arrays as tuples, dictionaries as dicts)."""
    __slots__ = ("stream", "device", "args", "rets", "attrs")

    def __init__(self, stream: int, device: int, args: list[Buffer], rets: list[Buffer], attrs: dict[str, object]):
        self.stream = stream
        self.device = device
        self.args = args
        self.rets = rets
        self.attrs = attrs

    def __repr__(self) -> str:
        return (f"Frame(stream={self.stream:#x}, device={self.device}, args={self.args}, rets={self.rets}, "
                f"attrs={self.attrs})")


class FFIError(RuntimeError):
    """An error an XLA API function returned (its message; the XLA error itself is destroyed)."""


# Scalar and array element readers: dtype code -> ctypes type whose .value is the Python value.
_CTYPES = {DTYPE_CODES[name]: ctype for name, ctype in [
    ("bool", c_bool), ("int8", c_int8), ("int16", c_int16), ("int32", c_int32), ("int64", c_int64),
    ("uint8", c_uint8), ("uint16", c_uint16), ("uint32", c_uint32), ("uint64", c_uint64), ("float32", c_float),
    ("float64", c_double)]}
_NUMPY_ONLY = {DTYPE_CODES[np.dtype(t).name]: (t, np.dtype(t).itemsize)  # read through numpy
               for t in (np.float16, np.complex64, np.complex128)}
_BF16 = DTYPE_CODES["bfloat16"]


def _read_numpy(code: int, address: int, count: int) -> list:
    """``count`` elements of dtype ``code`` at ``address`` as Python values, for the dtypes ctypes lacks."""
    if code == _BF16:  # the high half of a float32
        bits = np.frombuffer(ctypes.string_at(address, 2 * count), dtype=np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).tolist()
    if code not in _NUMPY_ONLY:
        raise TypeError(f"attribute of XLA dtype {DTYPE_NAMES.get(code, code)} is not decoded")
    dtype, size = _NUMPY_ONLY[code]
    return np.frombuffer(ctypes.string_at(address, size * count), dtype=dtype).tolist()


_CHARS = [ctypes.c_char * n for n in range(128)]  # the char array types of short texts, built once


def _span_text(address: int, _span=XLA_FFI_ByteSpan.from_address, _chars=_CHARS) -> str:
    """The UTF-8 text of the ``XLA_FFI_ByteSpan`` at ``address``."""
    span = _span(address)
    n = span.len
    if not n:
        return ""
    return (_chars[n] if n < 128 else ctypes.c_char * n).from_address(span.ptr).raw.decode()


def decode_attrs(attrs: XLA_FFI_Attrs, _text=_span_text, _scalar=XLA_FFI_Scalar.from_address,
                 _array=XLA_FFI_Array.from_address, _ctypes=_CTYPES.get) -> dict[str, object]:
    """The attributes of one ``XLA_FFI_Attrs`` list (a frame's, or a nested dictionary's) by name."""
    n = attrs.size
    if n == 0:
        return {}
    out = {}
    for kind, name, value in zip(attrs.types[:n], attrs.names[:n], attrs.attrs[:n]):
        if kind == ATTR_SCALAR:
            scalar = _scalar(value)
            ctype = _ctypes(scalar.dtype)
            out[_text(name)] = (ctype.from_address(scalar.value).value if ctype is not None
                                else _read_numpy(scalar.dtype, scalar.value, 1)[0])
        elif kind == ATTR_STRING:
            out[_text(name)] = _text(value)
        elif kind == ATTR_ARRAY:
            array = _array(value)
            size = array.size
            ctype = _ctypes(array.dtype)
            if size == 0:
                out[_text(name)] = ()
            elif ctype is not None:
                out[_text(name)] = tuple((ctype * size).from_address(array.data))
            else:
                out[_text(name)] = tuple(_read_numpy(array.dtype, array.data, size))
        elif kind == ATTR_DICTIONARY:
            out[_text(name)] = decode_attrs(XLA_FFI_Attrs.from_address(value))
        else:
            raise TypeError(f"attribute {_text(name)!r} has unknown XLA_FFI_AttrType {kind}")
    return out


def _buffers(pointers: list) -> list[Buffer]:
    out = []
    for address in pointers:
        b = XLA_FFI_Buffer.from_address(address)
        rank = b.rank
        out.append(Buffer(b.data or 0, DTYPE_NAMES.get(b.dtype) or f"xla_dtype_{b.dtype}",
                          tuple(b.dims[:rank]) if rank else ()))
    return out


class _ApiFunctions:
    """The API table's functions this module calls, wrapped once per table address."""
    __slots__ = ("error_create", "error_get_message", "error_destroy", "stream_get", "device_ordinal_get")

    def __init__(self, address: int):
        api = XLA_FFI_Api.from_address(address)
        self.error_create = _ApiCall(api.XLA_FFI_Error_Create) if api.XLA_FFI_Error_Create else None
        self.error_get_message = (_ApiVoidCall(api.XLA_FFI_Error_GetMessage) if api.XLA_FFI_Error_GetMessage
                                  else None)
        self.error_destroy = _ApiVoidCall(api.XLA_FFI_Error_Destroy) if api.XLA_FFI_Error_Destroy else None
        self.stream_get = _ApiCall(api.XLA_FFI_Stream_Get) if api.XLA_FFI_Stream_Get else None
        has_ordinal = api.struct_size >= _API_HAS_DEVICE_ORDINAL and api.XLA_FFI_DeviceOrdinal_Get
        self.device_ordinal_get = _ApiCall(api.XLA_FFI_DeviceOrdinal_Get) if has_ordinal else None


_API_CACHE: dict[int, _ApiFunctions] = {}


def _api(address: int) -> _ApiFunctions:
    functions = _API_CACHE.get(address)
    if functions is None:
        functions = _API_CACHE[address] = _ApiFunctions(address)
    return functions


def _raise_error(functions: _ApiFunctions, error: int, what: str) -> None:
    """Turns an XLA_FFI_Error* an API function returned into FFIError, destroying the XLA error."""
    message = "(no message)"
    if functions.error_get_message is not None:
        padded = _GetMessageArgsWithRoom()  # FFI API 0.4 names this GetDetails and adds an errc out field
        args = padded.args
        args.struct_size, args.error = STRUCT_SIZES["XLA_FFI_Error_GetMessage_Args"], error
        functions.error_get_message(ctypes.addressof(padded))
        message = (args.message or b"").decode(errors="replace")
    if functions.error_destroy is not None:
        args = XLA_FFI_Error_Destroy_Args(STRUCT_SIZES["XLA_FFI_Error_Destroy_Args"], None, error)
        functions.error_destroy(ctypes.addressof(args))
    raise FFIError(f"{what} failed: {message}")


_STREAM_ARGS_SIZE = STRUCT_SIZES["XLA_FFI_Stream_Get_Args"]
_ORDINAL_ARGS_SIZE = STRUCT_SIZES["XLA_FFI_DeviceOrdinal_Get_Args"]


def decode_frame(ptr: int, stream: bool = False) -> Frame:
    """The :class:`Frame` of the ``XLA_FFI_CallFrame`` at address ``ptr``. With ``stream``, the stream comes from
    ``XLA_FFI_Stream_Get`` (an error it returns raises :class:`FFIError`), else it is 0. The device ordinal comes
    from ``XLA_FFI_DeviceOrdinal_Get`` where the API table has it; a frame with a NULL API gives stream 0 and
    device -1. The frame need be valid only during this call: the result holds plain Python values."""
    return _decode(XLA_FFI_CallFrame.from_address(ptr), stream)


def _decode(frame: XLA_FFI_CallFrame, stream: bool) -> Frame:
    if frame.struct_size < _FRAME_SIZE:
        raise ValueError(f"XLA_FFI_CallFrame of {frame.struct_size} bytes, expected at least {_FRAME_SIZE}")
    args, rets = frame.args, frame.rets
    n_args, n_rets = args.size, rets.size
    stream_handle, device = 0, -1
    api = frame.api
    if api:
        functions = _api(api)
        if stream and functions.stream_get is not None:
            out = XLA_FFI_Stream_Get_Args(_STREAM_ARGS_SIZE, None, frame.ctx, None)
            error = functions.stream_get(ctypes.addressof(out))
            if error:
                _raise_error(functions, error, "XLA_FFI_Stream_Get")
            stream_handle = out.stream or 0
        if functions.device_ordinal_get is not None:
            out = XLA_FFI_DeviceOrdinal_Get_Args(_ORDINAL_ARGS_SIZE, None, frame.ctx, -1)
            error = functions.device_ordinal_get(ctypes.addressof(out))
            if error:
                _raise_error(functions, error, "XLA_FFI_DeviceOrdinal_Get")
            device = out.device_ordinal
    return Frame(stream_handle, device,
                 _buffers(args.args[:n_args]) if n_args else [],
                 _buffers(rets.rets[:n_rets]) if n_rets else [],
                 decode_attrs(frame.attrs))


# ---- the handler ----

_METADATA_EXTENSION_SIZE = STRUCT_SIZES["XLA_FFI_Metadata_Extension"]
_METADATA_SIZE = STRUCT_SIZES["XLA_FFI_Metadata"]
_VERSION_SIZE = STRUCT_SIZES["XLA_FFI_Api_Version"]


def _find_metadata(extension_address: int) -> int:
    """The address of the metadata extension in the extension chain that starts at ``extension_address``, or 0."""
    while extension_address:
        base = XLA_FFI_Extension_Base.from_address(extension_address)
        if base.type == EXTENSION_METADATA:
            return extension_address
        extension_address = base.next or 0
    return 0


def _fill_metadata(extension_address: int, traits: int) -> str | None:
    """Answers XLA's metadata query: writes the API version and ``traits`` into the metadata of the metadata
    extension at ``extension_address``. Returns None, or the text of what is wrong with the extension."""
    base = XLA_FFI_Extension_Base.from_address(extension_address)
    if base.struct_size < _METADATA_EXTENSION_SIZE:
        return f"XLA_FFI_Metadata_Extension of {base.struct_size} bytes, expected at least {_METADATA_EXTENSION_SIZE}"
    metadata = XLA_FFI_Metadata_Extension.from_address(extension_address).metadata
    if not metadata:
        return "XLA_FFI_Metadata_Extension without metadata"
    m = metadata.contents
    if m.struct_size < _METADATA_SIZE:
        return f"XLA_FFI_Metadata of {m.struct_size} bytes, expected at least {_METADATA_SIZE}"
    m.api_version = XLA_FFI_Api_Version(_VERSION_SIZE, None, *API_VERSION)
    m.traits = traits
    m.state_type_id = 0  # XLA_FFI_UNKNOWN_TYPE_ID: the handler keeps no state
    return None


def _create_error(frame_address: int, code: int, message: str) -> int | None:
    """An XLA_FFI_Error* carrying ``message``, made by the frame's API; None (success) when the frame has no API
    to make one with, as in XLA's metadata query, where XLA then rejects the unfilled version 0.0 itself."""
    api = XLA_FFI_CallFrame.from_address(frame_address).api if frame_address else None
    if not api:
        return None
    functions = _api(api)
    if functions.error_create is None:
        return None
    args = XLA_FFI_Error_Create_Args(STRUCT_SIZES["XLA_FFI_Error_Create_Args"], None,
                                     message.encode(errors="replace"), code)
    return functions.error_create(ctypes.addressof(args))


def _make_handler(name: str, fn, platform_stream: bool, traits: int):
    """The Python body of one target's handler (wrapped by HANDLER_TYPE in :func:`register`)."""
    frame_from = XLA_FFI_CallFrame.from_address

    def handler(ptr):
        try:
            frame = frame_from(ptr)
            if frame.extension_start:
                metadata = _find_metadata(frame.extension_start)
                if metadata:
                    problem = _fill_metadata(metadata, traits)
                    return None if problem is None else _create_error(ptr, ERROR_INVALID_ARGUMENT, problem)
            if frame.stage != STAGE_EXECUTE:
                return None
            fn(_decode(frame, platform_stream))
            return None
        except BaseException as exc:  # nothing may unwind through XLA's C frames
            try:
                return _create_error(ptr, ERROR_UNKNOWN, f"rawflash FFI target {name!r}: {type(exc).__name__}: "
                                                         f"{exc}")
            except BaseException:
                return None  # nothing left to report with (ctypes would print and return NULL anyway)

    return handler


_PLATFORM_KEYS = {"gpu": "cuda", "host": "cpu"}
_REGISTERED: dict[tuple[str, str], object] = {}  # (name, platform key) -> the handler's CFUNCTYPE object
_FAILED: list = []  # the handlers of failed registrations, alive all the same


def _platform_key(platform: str) -> str:
    key = platform.lower()
    return _PLATFORM_KEYS.get(key, key)


def register(name: str, fn, *, platform: str = "CUDA", command_buffer: bool = False) -> None:
    """Registers ``fn(frame: Frame) -> None`` as the XLA FFI target ``name`` for ``platform`` ('CUDA' or 'cpu').

    ``fn`` runs at the execute stage only; an exception it raises becomes an XLA error whose message carries the
    exception's type and text (the caller of the jitted function sees it, e.g. as a ``JaxRuntimeError``). With
    ``command_buffer`` the handler reports the command-buffer-compatible trait when XLA asks for its metadata, so
    XLA:GPU may capture the call into a CUDA graph: ``fn`` then runs when XLA captures the graph, not at its
    replays, so it must only enqueue work on ``frame.stream``. Registering a name twice for one platform is a
    no-op: the first registration stays. The handler lives as long as the process. On a jaxlib without the
    platform (a CPU-only jaxlib and 'CUDA'), jax keeps the registration pending until a plugin for it loads, so
    registering never fails for that reason.
    """
    key = (name, _platform_key(platform))
    if key in _REGISTERED:
        return
    import jax

    traits = TRAIT_COMMAND_BUFFER_COMPATIBLE if command_buffer else 0
    c_handler = HANDLER_TYPE(_make_handler(name, fn, key[1] != "cpu", traits))
    _REGISTERED[key] = c_handler  # kept before registering: XLA may hold the pointer even if a later step fails
    try:
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(ctypes.cast(c_handler, c_void_p).value),
                                    platform=platform, api_version=1)
    except BaseException:
        _FAILED.append(_REGISTERED.pop(key))
        raise


def handler_pointer(name: str, platform: str = "CUDA") -> int:
    """The C address of the handler :func:`register` made for ``name`` on ``platform`` (KeyError if none)."""
    return ctypes.cast(_REGISTERED[(name, _platform_key(platform))], c_void_p).value
