"""mpdl: a transparent MPI data-parallel deep-learning runtime over NumPy/CuPy and mpi4py."""

__version__ = "0.1.0"
