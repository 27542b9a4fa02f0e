"""Loading the MPI library, and making a failing rank take the whole job down."""

from __future__ import annotations

import os
import sys
import time
import traceback
from types import ModuleType


class MPIUnavailable(RuntimeError):
    """mpi4py could not load an MPI library."""


INSTALL_HINT = ("install an MPI runtime: `pip install \"mpdl[mpich]\"` (the MPICH wheel from PyPI) "
                "or your system's MPI (e.g. `apt install mpich`, `module load mpi`), then reinstall "
                "mpi4py against it")


def load_mpi() -> ModuleType:
    """mpi4py.MPI, or MPIUnavailable with a message that says how to install an MPI runtime."""
    try:
        from mpi4py import MPI  # noqa: PLC0415
    except (ImportError, RuntimeError, OSError) as exc:
        reason = str(exc).strip().splitlines()
        detail = reason[-1] if reason else type(exc).__name__
        raise MPIUnavailable(f"could not load an MPI library ({detail}); {INSTALL_HINT}") from None
    return MPI


def library_version(MPI: ModuleType) -> str:
    """The first line of the MPI library's version string, spaces collapsed (Open MPI ends it
    with a NUL byte, MPICH and Intel MPI with newlines)."""
    text = MPI.Get_library_version().replace("\x00", " ").strip()
    return " ".join(text.splitlines()[0].split()) if text else "unknown"


#: environment variables in which launchers give the number of ranks on this node
LOCAL_SIZE_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


def launcher_local_size() -> int | None:
    """The number of ranks on this node as the launcher says (MPICH's Hydra, Open MPI, Slurm);
    None where it says nothing."""
    for variable in LOCAL_SIZE_VARIABLES:
        value = os.environ.get(variable, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


def oversubscribed() -> bool:
    """Does this node run more ranks than this process may use cores (as far as the launcher
    says)? Then a rank waiting for a message should give its core away at once: the peer it
    waits for may be the one that needs it."""
    local = launcher_local_size()
    return local is not None and local > usable_cores()


def wait_for_peers(limit_s: float = 5.0) -> None:
    """Wait (at most limit_s) until every rank has got here (starting MPI if it has not started).

    For ranks about to exit with an error that only rank 0 prints: Open MPI's launcher ends the
    whole job as soon as one rank exits with a non-zero status, and rank 0's line could be lost.
    Bounded, so a rank that never comes costs limit_s and no hang."""
    try:
        MPI = load_mpi()  # an error found before MPI started (a bad flag) starts it here
    except MPIUnavailable:
        return
    if not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
        return
    request = MPI.COMM_WORLD.Ibarrier()
    deadline = time.monotonic() + limit_s
    while not request.Test() and time.monotonic() < deadline:
        time.sleep(1e-3)


#: whether this process has said its one line on the way out (`say`)
_said: list[str] = []
#: called with the failure's one-line reason before a failing rank aborts the job (the flight
#: recorder dumps its records and tells the other ranks, which say so in a line of their own)
before_abort: list = []


def say(line: str) -> bool:
    """Write line to stderr, unless this process has said its line already; whether it did.
    A rank leaving the job says one line: why it fails, or why the job ends for it."""
    if _said:
        return False
    _said.append(line)
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    return True


def abort_on_uncaught_exception() -> None:
    """Make an uncaught exception on any rank abort the whole MPI job instead of hanging its
    peers: the rank says one line (mpdl's own errors that name what happened, marked
    `one_line`, without a traceback), tells the other ranks (`before_abort`), then aborts.
    Installed once per process (by the `mpdl` command, and by the first MPI communicator)."""
    if aborts_the_job(sys.excepthook):
        return
    previous = sys.excepthook

    def hook(kind, value, tb) -> None:
        from mpi4py import MPI  # noqa: PLC0415

        if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
            rank = MPI.COMM_WORLD.Get_rank()
            reason = f"{kind.__name__}: {value}"
            if getattr(value, "one_line", False):
                say(f"mpdl: rank {rank} failed: {reason}")
            elif say(f"mpdl: rank {rank} failed; aborting the job"):
                traceback.print_exception(kind, value, tb)
                sys.stderr.flush()
            for callback in before_abort:
                try:
                    callback(reason)
                except Exception:  # noqa: BLE001 - the job is ending either way
                    pass
            MPI.COMM_WORLD.Abort(1)
            os._exit(1)  # MPICH's MPI_Abort may return before the launcher ends the process
        previous(kind, value, tb)

    hook._mpdl_abort = True  # type: ignore[attr-defined]
    hook._mpdl_previous = previous  # type: ignore[attr-defined]
    sys.excepthook = hook


def aborts_the_job(hook) -> bool:
    """Whether the excepthook `hook` is, or wraps, the one `abort_on_uncaught_exception`
    installs."""
    return any(getattr(h, "_mpdl_abort", False) for h in _hooks(hook))


def _hooks(hook) -> list:
    """The chain of excepthooks mpdl installed, outermost first (each keeps the one it wraps)."""
    chain = []
    while hook is not None:
        chain.append(hook)
        hook = getattr(hook, "_mpdl_previous", None)
    return chain
