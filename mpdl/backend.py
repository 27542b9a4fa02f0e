"""Array backends: NumPy on the host, CuPy on a GPU, and a stand-in device type for CPU-only tests.

One code path serves every backend: ``xp = get_array_module(x)`` and then ``xp.add(...)``.
"""

from __future__ import annotations

import functools
import types
import warnings
from typing import Any

import numpy as np

from mpdl import settings

#: NumPy's own dtypes among those the collectives support (SUPPORTED_DTYPES adds ml_dtypes' floats)
_NUMPY_SUPPORTED = tuple(np.dtype(t) for t in (
    "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
    "uint32", "uint64", "bool"))

#: the ml_dtypes floats the collectives support: MPI moves them as raw words of their size
ML_FLOATS = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


@functools.cache
def ml_dtype(name: str) -> np.dtype:
    """One of ml_dtypes' floats (`ML_FLOATS`) by name. ml_dtypes is imported at the first use:
    its import takes longer than NumPy's, and a process that never meets such an array (most
    ranks of most jobs) need not pay it."""
    import ml_dtypes  # noqa: PLC0415

    return np.dtype(getattr(ml_dtypes, name))


def bfloat16_dtype() -> np.dtype:
    """bfloat16 on the host (NumPy has no 16-bit brain float of its own: ml_dtypes provides it)."""
    return ml_dtype("bfloat16")


def __getattr__(name: str) -> Any:
    """The module's constants that hold ml_dtypes' types: `bfloat16`, `LOW_PRECISION` (the 16-bit
    floating-point types of mixed precision) and `SUPPORTED_DTYPES` (those of the collectives)."""
    if name == "bfloat16":
        return bfloat16_dtype()
    if name == "LOW_PRECISION":
        return (np.dtype("float16"), bfloat16_dtype())
    if name == "SUPPORTED_DTYPES":
        return (*_NUMPY_SUPPORTED, *(ml_dtype(n) for n in ML_FLOATS))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _dtype(dtype: Any) -> np.dtype:
    """np.dtype(dtype), the names of ml_dtypes' floats included before ml_dtypes is imported."""
    return ml_dtype(dtype) if isinstance(dtype, str) and dtype in ML_FLOATS else np.dtype(dtype)


#: is_ml_float's answers by dtype: NumPy computes a dtype's name in Python on every read, and
#: every message asks
_ML_FLOAT: dict[np.dtype, bool] = {}


def is_ml_float(dt: np.dtype) -> bool:
    """Whether dt is one of ml_dtypes' floats (`ML_FLOATS`); told by name without importing
    ml_dtypes for NumPy's own types."""
    known = _ML_FLOAT.get(dt)
    if known is None:
        known = _ML_FLOAT[dt] = dt.name in ML_FLOATS and dt == ml_dtype(dt.name)
    return known


def is_bfloat16(dt: np.dtype) -> bool:
    """Whether dt is bfloat16 (told without importing ml_dtypes for NumPy's own types)."""
    return is_ml_float(dt) and dt.name == "bfloat16"


@functools.lru_cache(maxsize=1)
def cupy_module() -> types.ModuleType | None:
    """CuPy if it imports and sees a GPU, else None. Imported lazily: it is slow to load."""
    if settings.current().no_cupy:
        return None
    try:
        import cupy  # noqa: PLC0415
    except Exception:
        return None
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
    except Exception:
        return None
    return cupy


def get_array_module(x: Any) -> types.ModuleType:
    """The array module (numpy, cupy or the stand-in) that owns ``x``; numpy for anything else."""
    if isinstance(x, np.ndarray) or np.isscalar(x):
        return np
    if isinstance(x, standin.ndarray):
        return standin
    mod = type(x).__module__
    if mod.startswith("cupy"):
        import cupy  # noqa: PLC0415

        return cupy
    return np


def to_host(x: Any) -> np.ndarray:
    """A NumPy array with x's values (a copy for device arrays, x itself for NumPy arrays)."""
    xp = get_array_module(x)
    if xp is np:
        return np.asarray(x)
    return xp.asnumpy(x)


def to_module(x: np.ndarray, xp: types.ModuleType) -> Any:
    """x moved to the array module ``xp`` (no copy when xp is numpy)."""
    if xp is np:
        return x
    return xp.asarray(x)


#: the distance at which a store can be mistaken for a recent load's address (4K aliasing)
PAGE = 4096


def empty_like_page_offset(x: Any) -> Any:
    """An empty C-contiguous array of x's shape and dtype. For NumPy arrays of a page or more it
    starts at the same offset within a 4 KiB page as x: copying x into it then never writes a few
    bytes behind the loads, which on some CPUs (4K aliasing) makes a copy several times slower. Heap
    arrays allocated one after another are 16 bytes apart modulo 4 KiB, which is that case.
    Below a page the slowdown is at most a microsecond or two, less than placing the array costs."""
    xp = get_array_module(x)
    if xp is not np or x.nbytes < PAGE:
        return xp.empty(x.shape, dtype=x.dtype)
    raw = np.empty(x.nbytes + PAGE, dtype=np.uint8)
    start = (x.ctypes.data - raw.ctypes.data) % PAGE
    return np.ndarray(x.shape, x.dtype, raw, start)


def empty_half_page_in(count: int, dtype: Any, xp: Any) -> Any:
    """An empty 1-D array that starts half a page into a 4 KiB page (NumPy): a scratch buffer that
    a page-aligned array and it are never within a few bytes of each other modulo 4 KiB (see
    empty_like_page_offset)."""
    if xp is not np:
        return xp.empty(count, dtype=dtype)
    nbytes = count * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + 2 * PAGE, dtype=np.uint8)
    start = (PAGE // 2 - raw.ctypes.data) % PAGE
    return raw[start:start + nbytes].view(dtype)


def is_floating(dtype: Any) -> bool:
    """Whether dtype is a floating-point type (NumPy's own or one of ml_dtypes')."""
    dt = _dtype(dtype)
    return dt.kind == "f" or is_ml_float(dt)


def is_low_precision(dtype: Any) -> bool:
    """Whether dtype is float16 or bfloat16."""
    dt = _dtype(dtype)
    return dt == np.float16 or is_bfloat16(dt)


def accumulates_wide(dtype: Any) -> bool:
    """Whether a sum of several operands of dtype is accumulated in float32 and rounded once:
    float16, bfloat16 and the 8-bit floats."""
    dt = _dtype(dtype)
    return dt == np.float16 or is_ml_float(dt)


def precision_dtype(name: str, xp: types.ModuleType = np) -> np.dtype:
    """The dtype of a precision name ("fp32", "bf16", "fp16") on the array module xp: bfloat16 is
    ml_dtypes' on the host and the stand-in device, CuPy's own where CuPy has one."""
    if name == "fp32":
        return np.dtype("float32")
    if name == "fp16":
        return np.dtype("float16")
    if name != "bf16":
        raise ValueError(f"precision: expected one of fp32, bf16, fp16, got {name!r}")
    if xp is np or xp is standin:
        return bfloat16_dtype()
    own = getattr(xp, "bfloat16", None)
    if own is None:
        raise TypeError(f"precision: bf16 needs an array module with a bfloat16 type; "
                        f"{xp.__name__} {getattr(xp, '__version__', '')} has none")
    return np.dtype(own)


def as_bytes(host: np.ndarray) -> np.ndarray:
    """A host array's memory as a NumPy buffer MPI can read (ml_dtypes' floats expose no buffer
    format: they are viewed as unsigned words of their size; bool as bytes; other dtypes are
    returned as they are)."""
    dt = host.dtype
    if dt.kind == "b" or is_ml_float(dt):
        return host.view(f"u{dt.itemsize}")
    return host


def check_dtype(dtype: Any, argument: str = "x") -> np.dtype:
    """The dtype if mpdl's collectives support it; TypeError naming it otherwise."""
    dt = _dtype(dtype)
    if dt not in _NUMPY_SUPPORTED and not is_ml_float(dt):
        allowed = ", ".join(d.name for d in __getattr__("SUPPORTED_DTYPES"))
        raise TypeError(f"{argument}: unsupported dtype {dt.name!r}; expected one of {allowed}")
    return dt


class _StandInArray:
    """A CPU array that pretends to live on a device.

    MPI cannot read it (it exposes no buffer and refuses implicit conversion to NumPy), so every
    transfer must go through ``standin.asnumpy`` / ``standin.asarray`` explicitly, as with CuPy.
    It exists so that CI, which has no GPU, exercises the host-staging code path.
    """

    __slots__ = ("_a",)
    __array_priority__ = 100

    def __init__(self, a: np.ndarray):
        self._a = a

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    flags = property(lambda self: self._a.flags)

    def __array__(self, dtype=None, copy=None):
        raise TypeError("stand-in device array: implicit conversion to NumPy is not allowed; "
                        "use standin.asnumpy()")

    def __len__(self) -> int:
        return len(self._a)

    def __getitem__(self, key) -> _StandInArray:
        return _StandInArray(self._a[key])

    def __setitem__(self, key, value) -> None:
        if isinstance(value, np.ndarray):
            raise TypeError("stand-in device array: assigning a host array needs standin.asarray()")
        self._a[key] = value._a if isinstance(value, _StandInArray) else value

    def reshape(self, *shape) -> _StandInArray:
        return _StandInArray(self._a.reshape(*shape))

    def ravel(self) -> _StandInArray:
        return _StandInArray(self._a.ravel())

    def view(self, dtype) -> _StandInArray:
        return _StandInArray(self._a.view(dtype))

    def astype(self, dtype, copy: bool = True) -> _StandInArray:
        return _StandInArray(self._a.astype(dtype, copy=copy))

    def copy(self) -> _StandInArray:
        return _StandInArray(self._a.copy())

    def get(self) -> np.ndarray:
        return standin.asnumpy(self)

    def __repr__(self) -> str:
        return f"standin.ndarray({self._a!r})"


def _unwrap(v: Any) -> Any:
    return v._a if isinstance(v, _StandInArray) else v


def _standin_ufunc(name: str):
    f = getattr(np, name)

    def call(*args, out=None, **kwargs):
        if any(isinstance(a, np.ndarray) for a in args) or isinstance(out, np.ndarray):
            raise TypeError(f"standin.{name}: host and device arrays cannot be mixed")
        result = f(*(_unwrap(a) for a in args), out=_unwrap(out), **kwargs)
        return out if out is not None else _StandInArray(np.asarray(result))

    call.__name__ = name
    return call


class _StandInModule(types.SimpleNamespace):
    """The array module of the stand-in device: a tiny CuPy-like namespace."""

    def asnumpy(self, x: _StandInArray, out: np.ndarray | None = None) -> np.ndarray:
        self.transfers["d2h"] += 1
        if out is None:
            return x._a.copy()
        np.copyto(out, x._a)
        return out

    def asarray(self, x: Any, dtype=None) -> _StandInArray:
        if isinstance(x, _StandInArray):
            return x if dtype is None else x.astype(dtype)
        self.transfers["h2d"] += 1
        return _StandInArray(np.array(x, dtype=dtype, copy=True))

    def empty(self, shape, dtype=np.float64) -> _StandInArray:
        return _StandInArray(np.empty(shape, dtype))

    def zeros(self, shape, dtype=np.float64) -> _StandInArray:
        return _StandInArray(np.zeros(shape, dtype))

    def empty_like(self, x: _StandInArray) -> _StandInArray:
        return _StandInArray(np.empty_like(x._a))

    def copyto(self, dst: _StandInArray, src: _StandInArray) -> None:
        if not isinstance(dst, _StandInArray) or not isinstance(src, _StandInArray):
            raise TypeError("standin.copyto: both arrays must be stand-in device arrays")
        np.copyto(dst._a, src._a)

    def concatenate(self, arrays) -> _StandInArray:
        return _StandInArray(np.concatenate([_unwrap(a) for a in arrays]))

    def synchronize(self) -> None:
        """Stands for ``cupy.cuda.get_current_stream().synchronize()``."""
        self.transfers["sync"] += 1


standin = _StandInModule(
    __name__="mpdl.backend.standin",
    ndarray=_StandInArray,
    transfers={"h2d": 0, "d2h": 0, "sync": 0},
    **{n: _standin_ufunc(n) for n in ("add", "multiply", "maximum", "minimum", "true_divide",
                                       "floor_divide", "divide")},
)


def synchronize(xp: types.ModuleType) -> None:
    """Wait for queued device work of module xp (a no-op on the host)."""
    if xp is np:
        return
    if xp is standin:
        standin.synchronize()
        return
    xp.cuda.get_current_stream().synchronize()


def upload(dst: Any, host: np.ndarray) -> None:
    """Copy the host array into the device array dst (same shape and dtype)."""
    xp = get_array_module(dst)
    if xp is np:
        np.copyto(dst, host)
    elif xp is standin:
        standin.transfers["h2d"] += 1
        np.copyto(dst._a, host)
    else:
        dst.set(host)


# -- asynchronous copies between device and pinned host memory ------------------------------------
class _StandInCopy:
    """The stand-in's copy event: the data moves at once, but the event reports done only on the
    second query, so callers exercise their waiting path as with a real device."""

    __slots__ = ("queries",)

    def __init__(self) -> None:
        self.queries = 0

    @property
    def done(self) -> bool:
        self.queries += 1
        return self.queries > 1

    def synchronize(self) -> None:
        self.queries = 2


@functools.cache
def _copy_stream(device: int) -> Any:
    """A non-blocking CUDA stream per device for staging copies, apart from the compute stream."""
    import cupy  # noqa: PLC0415

    with cupy.cuda.Device(device):
        return cupy.cuda.Stream(non_blocking=True)


def _stream_for(xp: types.ModuleType) -> Any:
    return _copy_stream(xp.cuda.Device().id)


def download_async(src: Any, host: np.ndarray) -> Any:
    """Start copying the contiguous device array src into the pinned host array host; return an
    event (see copy_done). The device data must be ready (see synchronize)."""
    xp = get_array_module(src)
    if xp is standin:
        standin.transfers["d2h"] += 1
        np.copyto(host, src._a)
        return _StandInCopy()
    stream = _stream_for(xp)
    src.get(stream=stream, out=host, blocking=False)
    return stream.record()


def upload_async(dst: Any, host: np.ndarray) -> Any:
    """Start copying the pinned host array host into the contiguous device array dst; return an
    event. host must stay untouched until the event is done."""
    xp = get_array_module(dst)
    if xp is standin:
        standin.transfers["h2d"] += 1
        np.copyto(dst._a, host)
        return _StandInCopy()
    stream = _stream_for(xp)
    dst.set(host, stream=stream)
    return stream.record()


def copy_done(event: Any) -> bool:
    """Whether an asynchronous copy has finished (without waiting)."""
    return event.done


def wait_copy(event: Any) -> None:
    """Block until an asynchronous copy has finished."""
    event.synchronize()


def use_local_gpu(local_rank: int, local_size: int) -> int:
    """Make GPU (local_rank mod number of GPUs) current for this process; return its index.

    Several ranks of a node may share one GPU (it works, slower); a warning says so.
    """
    cupy = cupy_module()
    if cupy is None:
        raise RuntimeError("no GPU: CuPy is not installed or sees no device (pip install \"mpdl[gpu]\")")
    count = cupy.cuda.runtime.getDeviceCount()
    device = local_rank % count
    cupy.cuda.Device(device).use()
    if local_size > count and local_rank == 0:
        warnings.warn(f"{local_size} ranks share {count} GPU(s) on this node; each GPU is "
                      f"time-shared by several ranks", RuntimeWarning, stacklevel=2)
    return device
