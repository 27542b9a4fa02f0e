"""What `mpdl launch` starts on every rank: the rank's program as a child, watched.

    python -m mpdl.tools.rankwatch [--status FOLDER] [--flight FOLDER] PROGRAM ARGS...

When the program ends with a signal or a non-zero status, this prints one line that the
supervisor reads ("mpdl launch: rank R (pid P on HOST) was killed by signal 9 (SIGKILL)") and
exits the same way. With --status, it also writes the program's exit status to FOLDER/rank-R
(the supervisor's way to tell a rank that finished from one whose watcher was killed). With
--flight (or MPDL_FLIGHT_DIR, which wins, as for the program), a rank killed by a signal without
writing its own flight record (a SIGKILL gives it no chance) gets one saying so, for
`mpdl doctor`. The launcher sees this process; the rank (and MPI's own file descriptors) are the
child's. On Linux the child is killed when this process is (the launcher's cleanup kills the
processes it started), so that no rank outlives its watcher.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

#: variables in which launchers give a process its rank (MPICH's Hydra, Open MPI, Slurm)
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
#: and the number of ranks
SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")
PR_SET_PDEATHSIG = 1
USAGE = "usage: python -m mpdl.tools.rankwatch [--status FOLDER] [--flight FOLDER] PROGRAM ARGS..."


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _variable(names: tuple[str, ...]) -> str | None:
    return next((os.environ[v] for v in names if os.environ.get(v, "").isdigit()), None)


def _record_death(folder: Path, rank: str, pid: int, started: float, how: str,
                  forwarded: bool) -> None:
    """Write FOLDER/rank-R.json for a rank that ended badly, unless it wrote one itself."""
    path = folder / f"rank-{rank}.json"
    with contextlib.suppress(OSError):
        if path.stat().st_mtime >= started:
            return
    kind = "stopped" if forwarded else "fatal"
    record = {"rank": int(rank), "size": int(_variable(SIZE_VARIABLES) or int(rank) + 1),
              "pid": pid, "host": socket.gethostname(), "time": time.time(),
              "reason": f"{kind}: {how} (seen by mpdl launch's watcher; the rank wrote no record)",
              "records": []}
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(temporary, path)


def main(argv: list[str]) -> int:
    options: dict[str, str] = {}
    while argv[:1] in (["--status"], ["--flight"]) and len(argv) > 1:
        options[argv[0]], argv = argv[1], argv[2:]
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    rank = _variable(RANK_VARIABLES) or "?"
    started = time.time()
    child = subprocess.Popen(argv, close_fds=False,
                             preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    forwarded: list[int] = []

    def forward(signum: int, frame: object) -> None:
        forwarded.append(signum)
        child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, forward)
    status = child.wait()
    if "--status" in options and rank != "?":
        with contextlib.suppress(OSError):
            Path(options["--status"], f"rank-{rank}").write_text(f"{status}\n")
    if status == 0:
        return 0
    where = f"(pid {child.pid} on {socket.gethostname()})"
    if status < 0:
        name = signal.Signals(-status).name if -status in signal.Signals._value2member_map_ \
            else "unknown"
        how = f"was killed by signal {-status} ({name})"
    else:
        how = f"exited with status {status}"
    sys.stderr.write(f"mpdl launch: rank {rank} {where} {how}\n")
    sys.stderr.flush()
    flight = os.environ.get("MPDL_FLIGHT_DIR") or options.get("--flight")
    if flight and rank != "?" and status < 0:
        _record_death(Path(flight), rank, child.pid, started, f"rank {rank} {how}",
                      -status in forwarded)
    return 128 - status if status < 0 else status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
