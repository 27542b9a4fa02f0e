"""bfloat16 comes from ml_dtypes, imported at its first use: a process that starts mpdl and never
meets a bfloat16 array does not import it, and one that does gets the same answers as before."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import sys
import numpy as np
import mpdl.cli
from mpdl import backend, collectives
assert "ml_dtypes" not in sys.modules, "imported at start-up"
for dtype in ("float16", "float32", "float64", "int32", "int64"):
    backend.check_dtype(np.dtype(dtype))
assert backend.is_floating("float32") and not backend.is_floating("int64")
assert backend.is_low_precision("float16") and not backend.is_low_precision("float32")
assert not backend.is_bfloat16(np.dtype("float16"))
assert "ml_dtypes" not in sys.modules, "imported by a dtype check of a NumPy type"
assert backend.is_floating("bfloat16") and backend.is_low_precision("bfloat16")
import ml_dtypes
assert backend.bfloat16 == np.dtype(ml_dtypes.bfloat16) == backend.check_dtype("bfloat16")
assert backend.LOW_PRECISION == (np.dtype("float16"), backend.bfloat16)
assert [d.name for d in backend.SUPPORTED_DTYPES] == [
    "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
    "uint32", "uint64", "bool", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
x = np.arange(6).astype(backend.bfloat16)
assert backend.as_bytes(x).dtype == np.uint16 and backend.is_bfloat16(x.dtype)
assert backend.as_bytes(x.astype(ml_dtypes.float8_e4m3fn)).dtype == np.uint8
assert backend.is_floating("float8_e5m2") and backend.accumulates_wide("float8_e4m3fn")
assert not backend.accumulates_wide("int8") and not backend.is_floating("bool")
try:
    backend.check_dtype(np.complex64)
except TypeError as e:
    assert "expected one of float16, float32, float64, int8," in str(e), e
else:
    raise AssertionError("complex64 accepted")
print("ok")
"""


def test_ml_dtypes_is_imported_at_the_first_bfloat16_only():
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_ml_float_answers_stay_right_when_asked_again():
    import ml_dtypes
    import numpy as np

    from mpdl import backend

    ml = [np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn),
          np.dtype(ml_dtypes.float8_e5m2)]
    plain = [np.dtype(d) for d in ("float16", "float32", "int8", "uint16", "bool", "V2")]
    plain.append(np.dtype([("bfloat16", "u2")]))  # a structured type: a name is not a type
    for _ in range(2):  # the second round reads the remembered answers
        assert [backend.is_ml_float(d) for d in ml] == [True, True, True]
        assert not any(backend.is_ml_float(d) for d in plain)
        assert [backend.is_bfloat16(d) for d in ml + plain] == [True] + [False] * 9
        assert [backend.as_bytes(np.zeros(2, d)).dtype for d in ml] == [np.uint16, np.uint8,
                                                                        np.uint8]
