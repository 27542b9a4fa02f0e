"""What `mpdl launch` starts on every rank: the rank's program as a child, watched.

    python -m mpdl.tools.rankwatch PROGRAM ARGS...

When the program ends with a signal or a non-zero status, this prints one line that the
supervisor reads ("mpdl launch: rank R (pid P on HOST) was killed by signal 9 (SIGKILL)") and
exits the same way. The launcher sees this process; the rank (and MPI's own file descriptors) are
the child's. On Linux the child is killed when this process is (the launcher's cleanup kills the
processes it started), so that no rank outlives its watcher.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys

#: variables in which launchers give a process its rank (MPICH's Hydra, Open MPI, Slurm)
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m mpdl.tools.rankwatch PROGRAM ARGS...", file=sys.stderr)
        return 2
    rank = next((os.environ[v] for v in RANK_VARIABLES if os.environ.get(v, "").isdigit()), "?")
    child = subprocess.Popen(argv, close_fds=False,
                             preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    for forwarded in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(forwarded, lambda signum, frame: child.send_signal(signum))
    status = child.wait()
    where = f"(pid {child.pid} on {socket.gethostname()})"
    if status < 0:
        name = signal.Signals(-status).name if -status in signal.Signals._value2member_map_ \
            else "unknown"
        sys.stderr.write(f"mpdl launch: rank {rank} {where} was killed by signal {-status} "
                         f"({name})\n")
        sys.stderr.flush()
        return 128 - status
    if status:
        sys.stderr.write(f"mpdl launch: rank {rank} {where} exited with status {status}\n")
        sys.stderr.flush()
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
