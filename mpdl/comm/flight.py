"""The flight recorder: the last N collective and point-to-point operations of this process.

Every collective of `mpdl.collectives` (and every send or receive a program makes outside one)
takes one slot of a ring buffer of `settings.flight_records` entries (MPDL_FLIGHT_RECORDS, default
1000; 0 switches the recorder off): its sequence number (counted per group of ranks, so that the
same number means the same call on every rank of the group), the collective and algorithm, bytes,
dtype, op, the group's ranks or the peer, start and end time (seconds since the epoch), its state
(started, done, failed) and, once a wait has taken long, the peers it still waits for.

The records are written to FLIGHT/rank-R.json (`directory()`: MPDL_FLIGHT_DIR, else what the
program set with `set_default_directory` — `mpdl train --checkpoint DIR` sets DIR/flight —, else
./mpdl-flight) when a `CollectiveTimeout` is raised, when an uncaught exception ends the process,
on SIGUSR1, when a peer that fails says so (`MPIComm` passes the word), and when `dump()` is
called. `mpdl doctor FLIGHT` reads them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from time import time
from typing import Any

from mpdl import mpi_runtime, settings
from mpdl.fileio import write_atomic

#: the fields of an entry, in the order they are kept
FIELDS = ("seq", "collective", "algorithm", "bytes", "dtype", "op", "peers", "start", "end",
          "state", "waiting_for")
DEFAULT_DIRECTORY = "mpdl-flight"


@dataclass(slots=True)
class FlightEntry:
    """One operation: its sequence number, the fields fixed for its call site (collective,
    algorithm, bytes, dtype, op, peers: one tuple the call site keeps), when it started and
    ended, its state (started, done, failed) and the peers a long wait still waits for."""

    seq: int
    info: tuple
    start: float
    end: float | None = None
    state: str = "started"
    waiting_for: list[int] | None = None


class FlightRecorder:
    """A ring buffer of the last `capacity` operations of one process (rank `rank` of `size`).

    Each entry is a `FlightEntry`."""

    def __init__(self, capacity: int, rank: int = 0, size: int = 1) -> None:
        self.capacity, self.rank, self.size = capacity, rank, size
        self.slots: deque[FlightEntry] = deque(maxlen=capacity)
        #: the next sequence number of each group, in a one-element list (`counter`)
        self._seqs: dict[tuple[int, ...], list[int]] = {}

    @property
    def count(self) -> int:
        """Operations recorded so far (each took one sequence number of one group)."""
        return sum(cell[0] for cell in list(self._seqs.values()))

    @property
    def last(self) -> FlightEntry | None:
        """The operation started last (a wait that stalls notes whom it waits for in it)."""
        try:
            return self.slots[-1]
        except IndexError:
            return None

    def next_seq(self, group: tuple[int, ...]) -> int:
        """The sequence number the next operation over `group` will get."""
        cell = self._seqs.get(group)
        return 0 if cell is None else cell[0]

    def counter(self, group: tuple[int, ...]) -> list[int]:
        """The group's sequence counter: a one-element list a prepared caller keeps and passes to
        `begin_counted` (saving a lookup per operation)."""
        cell = self._seqs.get(group)
        if cell is None:
            cell = self._seqs[group] = [0]
        return cell

    def begin(self, group: tuple[int, ...], collective: str, algorithm: str, nbytes: int,
              dtype: Any, op: str | None, peers: tuple[int, ...]) -> FlightEntry:
        """Record the start of an operation; returns its entry for `end`."""
        return self.begin_counted(self.counter(group),
                                  (collective, algorithm, nbytes, dtype, op, peers))

    def begin_counted(self, cell: list[int], info: tuple) -> FlightEntry:
        """`begin` with the group's counter (`counter(group)`) and the tuple (collective,
        algorithm, bytes, dtype, op, peers) already at hand."""
        seq = cell[0]
        cell[0] = seq + 1
        entry = FlightEntry(seq, info, time())
        self.slots.append(entry)
        return entry

    @staticmethod
    def end(entry: FlightEntry, state: str = "done") -> None:
        entry.end, entry.state = time(), state

    def waiting(self, peers: list[int]) -> FlightEntry | None:
        """Note that the operation started last, if it has not ended, still waits for `peers`;
        returns its entry."""
        entry = self.last
        if entry is None or entry.state != "started":
            return None
        entry.waiting_for = sorted(set(peers))
        return entry

    def records(self) -> list[dict[str, Any]]:
        """The entries kept, oldest first."""
        records = []
        for e in list(self.slots):
            r = dict(zip(FIELDS[1:7], e.info, strict=True))
            # kept as given (a NumPy dtype is named only here, off the hot path)
            r["dtype"] = str(r["dtype"]) if r["dtype"] is not None else ""
            r.update(seq=e.seq, start=e.start, end=e.end, state=e.state,
                     waiting_for=e.waiting_for)
            records.append({f: r[f] for f in FIELDS})
        return records

    def snapshot(self, reason: str) -> dict[str, Any]:
        return {"rank": self.rank, "size": self.size, "host": socket.gethostname(),
                "pid": os.getpid(), "reason": reason, "time": time(),
                "capacity": self.capacity, "recorded": self.count, "records": self.records()}


_recorder: list[FlightRecorder | None] = []
_default_directory: list[str] = []
_dumped: set[str] = set()
#: the reason this rank told the others it fails (they are told once)
_notified: list[str] = []
#: called with the reason after a fatal dump to tell the other ranks (MPIComm sets it for its
#: world)
notify_peers: list[Callable[[str], None]] = []


def recorder(rank: int = 0, size: int = 1) -> FlightRecorder | None:
    """This process's recorder (created on first use with rank and size; None when switched off).
    Creating it installs the dumps on SIGUSR1 and on an uncaught exception."""
    if not _recorder:
        capacity = settings.current().flight_records
        _recorder.append(FlightRecorder(capacity, rank, size) if capacity else None)
        if capacity:
            _install_hooks()
    return _recorder[0]


def set_default_directory(path: str | os.PathLike) -> None:
    """Where records go when MPDL_FLIGHT_DIR is not set (mpdl train: CHECKPOINT/flight)."""
    _default_directory[:] = [os.fspath(path)]


def directory() -> Path:
    """FLIGHT: MPDL_FLIGHT_DIR, else the program's default, else ./mpdl-flight."""
    chosen = settings.current().flight_dir or (_default_directory[0] if _default_directory
                                                else DEFAULT_DIRECTORY)
    return Path(chosen).absolute()


def dump(reason: str = "requested", once: bool = False) -> Path | None:
    """Write this rank's records to FLIGHT/rank-R.json; returns the path (None when the recorder
    is off, or when `once` and this reason's kind was written already)."""
    rec = recorder()
    if rec is None:
        return None
    kind = reason.split(":", 1)[0]
    if once and (kind in _dumped or "fatal" in _dumped):  # a rank's own failure says most
        return None
    _dumped.add(kind)
    folder = directory()
    path = folder / f"rank-{rec.rank}.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(rec.snapshot(reason), indent=1) + "\n")
    except OSError as exc:
        sys.stderr.write(f"mpdl: rank {rec.rank}: could not write flight records to {path}: "
                         f"{exc}\n")
        return None
    return path


def fatal(reason: str) -> None:
    """Dump once for a failure of this rank and tell the other ranks (once) why it fails."""
    dump(f"fatal: {reason}", once=True)
    if not _notified:
        _notified.append(reason)
        for notify in notify_peers:
            with contextlib.suppress(Exception):
                notify(reason)


def _install_hooks() -> None:
    previous = sys.excepthook

    def hook(kind, value, tb) -> None:
        if not mpi_runtime.aborts_the_job(previous):  # else it does this after its own line
            fatal(f"{kind.__name__}: {value}")
        previous(kind, value, tb)

    hook._mpdl_previous = previous  # type: ignore[attr-defined]
    sys.excepthook = hook
    mpi_runtime.before_abort.append(fatal)
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGUSR1, lambda signum, frame: dump("SIGUSR1"))
