"""The float32 matrix product of the layers on the CPU: MKL's ``cblas_sgemm`` where the optional
``mkl`` package is installed (``pip install "mpdl[mkl]"``), NumPy's own BLAS otherwise.

NumPy's wheels carry OpenBLAS, whose single-precision GEMM on one core is slower than MKL's
(which PyTorch's CPU build uses) at a GPT train step's shapes, and those products are most of the
step (docs/results/gpt.md#gpt-train-step-against-pytorch-cpu). ``matmul(a, b)`` is ``a @ b``
for 2-D float32 NumPy arrays, computed by the chosen library through its 64-bit-integer CBLAS
entry point, called with ctypes on the operands in place (a transposed view is passed as a
transposed operand, as NumPy does); anything else (other dtypes, other array types, more
dimensions, strides BLAS cannot take, empty products) is ``a @ b``.

``MPDL_BLAS`` chooses: ``auto`` (default: MKL where it is installed and NumPy's BLAS runs one
thread, as under ``mpiexec`` where the ranks fill the cores), ``mkl`` (an error where it is not
installed) or ``numpy``. MKL runs sequentially, one thread per process: where NumPy's OpenBLAS
may use several cores (one process, a notebook), ``auto`` leaves the products to it, faster there
(docs/results/collectives.md#waiting-on-crowded-cores). Which
library computes a product changes its last bits, never its shape or dtype; every rank of a job
uses the same one (the ranks of a job run as many threads each).
"""

from __future__ import annotations

import ctypes
import glob
import itertools
import os
import sys
from typing import Any

import numpy as np

from mpdl import settings

#: cblas.h's enums
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
#: MKL's MKL_THREADING_SEQUENTIAL (mkl_service.h)
MKL_THREADING_SEQUENTIAL = 1
#: products of fewer multiply-adds than this stay with NumPy: the call's own cost outweighs a
#: faster kernel
MIN_MULTIPLY_ADDS = 1 << 16

_int64, _float, _pointer = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_ENUM = ctypes.c_int


class CBLAS:
    """``cblas_sgemm`` with 64-bit integers (ILP64) from one shared library, called with ctypes.

    ``symbol`` is the entry point's name: ``cblas_sgemm_64`` in MKL's ``libmkl_rt``,
    ``scipy_cblas_sgemm64_`` in the OpenBLAS NumPy's wheels carry."""

    def __init__(self, name: str, path: str, symbol: str, batch_symbol: str | None = None) -> None:
        self.name, self.path, self.symbol = name, path, symbol
        self.library = ctypes.CDLL(path)
        self._sgemm = getattr(self.library, symbol)
        self._sgemm.argtypes = [_ENUM, _ENUM, _ENUM, _int64, _int64, _int64, _float, _pointer,
                                _int64, _pointer, _int64, _float, _pointer, _int64]
        self._sgemm.restype = None
        self._batch = getattr(self.library, batch_symbol) if batch_symbol else None
        if self._batch is not None:  # as sgemm, with each operand's stride between matrices
            self._batch.argtypes = [_ENUM, _ENUM, _ENUM, _int64, _int64, _int64, _float, _pointer,
                                    _int64, _int64, _pointer, _int64, _int64, _float, _pointer,
                                    _int64, _int64, _int64]
            self._batch.restype = None

    def matmul(self, a: Any, b: Any) -> np.ndarray | None:
        """a @ b for 2-D float32 arrays whose strides BLAS can take; None for any other pair."""
        if a.dtype != np.float32 or b.dtype != np.float32 or a.ndim != 2 or b.ndim != 2:
            return None
        (m, k), n = a.shape, b.shape[1]
        if m == 0 or n == 0 or k == 0 or b.shape[0] != k:
            return None
        layout_a = operand_layout(a.shape, a.strides, a.itemsize)
        layout_b = operand_layout(b.shape, b.strides, b.itemsize)
        if layout_a is None or layout_b is None:
            return None
        out = np.empty((m, n), np.float32)
        self._sgemm(ROW_MAJOR, layout_a[0], layout_b[0], m, n, k, 1.0, a.ctypes.data, layout_a[1],
                    b.ctypes.data, layout_b[1], 0.0, out.ctypes.data, n)
        return out

    def matmul_into(self, a: Any, b: Any, out: Any) -> bool:
        """out[...] = a @ b for stacks of float32 matrices of one batch shape (no broadcasting),
        each matrix in strides BLAS can take and ``out``'s rows contiguous: batched calls along
        one batch axis where the library has them and the results do not interleave there, else
        one call per matrix.
        False (nothing written) for anything else."""
        if not all(type(x) is np.ndarray and x.dtype == np.float32 for x in (a, b, out)):
            return False
        if not a.ndim == b.ndim == out.ndim >= 3 or not a.shape[:-2] == b.shape[:-2] == out.shape[:-2]:
            return False
        (m, k), n = a.shape[-2:], b.shape[-1]
        if b.shape[-2] != k or out.shape[-2:] != (m, n) or 0 in a.shape or 0 in b.shape:
            return False
        layout_a, layout_b, layout_out = (operand_layout(x.shape[-2:], x.strides[-2:], x.itemsize)
                                          for x in (a, b, out))
        if layout_a is None or layout_b is None or layout_out is None or layout_out[0] != NO_TRANS:
            return False
        item = a.itemsize
        if any(stride % item for x in (a, b, out) for stride in x.strides[:-2]):
            return False
        batch = range(a.ndim - 2)
        axis = self._batch_axis(a, b, out, m * layout_out[1] * item)
        loops = [i for i in batch if i != axis]
        starts = [(x.__array_interface__["data"][0], [x.strides[i] for i in loops]) for x in (a, b, out)]
        for index in itertools.product(*(range(a.shape[i]) for i in loops)):
            at_a, at_b, at_out = (start + sum(j * step for j, step in zip(index, steps, strict=True))
                                  for start, steps in starts)
            if axis is None:
                self._sgemm(ROW_MAJOR, layout_a[0], layout_b[0], m, n, k, 1.0, at_a, layout_a[1],
                            at_b, layout_b[1], 0.0, at_out, layout_out[1])
            else:
                self._batch(ROW_MAJOR, layout_a[0], layout_b[0], m, n, k, 1.0, at_a, layout_a[1],
                            a.strides[axis] // item, at_b, layout_b[1], b.strides[axis] // item,
                            0.0, at_out, layout_out[1], out.strides[axis] // item, a.shape[axis])
        return True

    def _batch_axis(self, a: np.ndarray, b: np.ndarray, out: np.ndarray, out_matrix_bytes: int
                    ) -> int | None:
        """The longest batch axis a batched call can run along: the operands' strides on it not
        negative and the results' at least one matrix apart (MKL rejects overlapping results
        and leaves them unwritten); None without a batched call or such an axis."""
        if self._batch is None:
            return None
        axes = [axis for axis in range(a.ndim - 2) if a.strides[axis] >= 0 and b.strides[axis] >= 0
                and out.strides[axis] >= out_matrix_bytes]
        return max(axes, key=lambda axis: a.shape[axis], default=None)

    def describe(self) -> str:
        return f"{self.name} ({os.path.basename(self.path)}, {self.symbol})"


def operand_layout(shape: tuple[int, ...], strides: tuple[int, ...], item: int
                   ) -> tuple[int, int] | None:
    """(NO_TRANS or TRANS, leading dimension) of a matrix of this shape and strides (bytes) and
    items of `item` bytes as a row-major BLAS operand: rows one leading dimension apart and
    columns adjacent (or the transpose of that); None where neither holds (a copy or NumPy's own
    loop is needed)."""
    (rows, cols), (row_stride, col_stride) = shape, strides
    if (col_stride == item or cols == 1) and row_stride % item == 0:
        ld = row_stride // item if rows > 1 else cols
        if ld >= max(cols, 1):
            return NO_TRANS, ld
    if (row_stride == item or rows == 1) and col_stride % item == 0:
        ld = col_stride // item if cols > 1 else rows
        if ld >= max(rows, 1):
            return TRANS, ld
    return None


def mkl() -> CBLAS | None:
    """MKL's runtime library from the ``mkl`` package (in this Python's prefix, or where the
    loader finds ``libmkl_rt``), set to run sequentially; None where it is not installed."""
    candidates = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))
    candidates += ["libmkl_rt.so.2", "libmkl_rt.so"]
    for path in candidates:
        try:
            library = CBLAS("mkl", path, "cblas_sgemm_64", "cblas_sgemm_batch_strided_64")
        except (OSError, AttributeError):
            continue
        library.library.MKL_Set_Threading_Layer.argtypes = [ctypes.c_int]
        library.library.MKL_Set_Threading_Layer(MKL_THREADING_SEQUENTIAL)
        return library
    return None


def numpy_openblas() -> CBLAS | None:
    """The OpenBLAS NumPy's wheel carries, through its CBLAS entry point (the library NumPy's
    ``@`` calls itself); None where NumPy was built against another BLAS."""
    libs = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libs, "libscipy_openblas64_*.so*"))):
        try:
            return CBLAS("numpy's openblas", path, "scipy_cblas_sgemm64_")
        except (OSError, AttributeError):
            continue
    return None


def numpy_blas_threads() -> int:
    """The threads NumPy's own BLAS may run a product on now (threadpoolctl's view of the BLAS
    libraries loaded, MKL aside; 1 where it sees none)."""
    from threadpoolctl import threadpool_info  # noqa: PLC0415 (imported on first need: its import is slow)

    return max((int(pool["num_threads"]) for pool in threadpool_info()
                if pool.get("user_api") == "blas" and pool.get("internal_api") != "mkl"),
               default=1)


_UNCHOSEN = object()
_library: Any = _UNCHOSEN


def use(library: CBLAS | None) -> CBLAS | None:
    """Compute the products with ``library`` (None: NumPy's ``@``) from now on; returns the one
    used before."""
    global _library
    before, _library = selected(), library
    return before


def selected() -> CBLAS | None:
    """The library the products go to (None: NumPy's ``@``), chosen by ``MPDL_BLAS`` (and, for
    ``auto``, the threads NumPy's BLAS may use) the first time it is asked."""
    global _library
    if _library is _UNCHOSEN:
        choice = settings.current().blas
        several = choice == "auto" and numpy_blas_threads() > 1
        library = None if choice == "numpy" or several else mkl()
        if library is None and choice == "mkl":
            raise ValueError("MPDL_BLAS=mkl: MKL's runtime library (libmkl_rt) is not installed; "
                             "pip install mkl, or set MPDL_BLAS to auto or numpy")
        _library = library
    return _library


def describe() -> str:
    """Which library computes the layers' float32 products (for ``mpdl info``)."""
    library = selected()
    return library.describe() if library is not None else "numpy"


def matmul_into(a: Any, b: Any, out: Any) -> None:
    """out[...] = a @ b for stacks of matrices (any strides), through the chosen BLAS where all
    three are float32 NumPy arrays it can take (see ``CBLAS.matmul_into``)."""
    library = selected()
    if library is not None and a.shape[-2] * a.shape[-1] * b.shape[-1] >= MIN_MULTIPLY_ADDS \
            and library.matmul_into(a, b, out):
        return
    numpy_matmul_into(a, b, out)


def numpy_matmul_into(a: Any, b: Any, out: Any) -> None:
    """out[...] = a @ b by the array library itself (NumPy in place, any strides)."""
    if type(out) is np.ndarray:
        np.matmul(a, b, out=out)
    else:
        out[...] = a @ b


def matmul(a: Any, b: Any) -> Any:
    """a @ b, through the chosen BLAS where both are 2-D float32 NumPy arrays worth a call."""
    library = selected()
    if library is not None and type(a) is np.ndarray and type(b) is np.ndarray \
            and a.ndim == 2 and b.ndim == 2 and a.shape[0] * a.shape[1] * b.shape[-1] >= MIN_MULTIPLY_ADDS:
        out = library.matmul(a, b)
        if out is not None:
            return out
    return a @ b
