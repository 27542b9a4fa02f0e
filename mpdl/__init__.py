"""mpdl: a from-scratch distributed deep-learning runtime over NumPy/CuPy and mpi4py."""

__version__ = "0.1.0"

# the collectives' tuning layer (mpdl.tuning) sits above them and joins them through their hook
import mpdl.tuning  # noqa: E402,F401
