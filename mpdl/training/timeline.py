"""A Chrome-trace timeline of training steps: one track per rank (pid = rank), with threads for
the main thread (forward, backward, waits, optimizer) and the communication thread (each bucket's
all-reduce). Opens in Perfetto (ui.perfetto.dev) or chrome://tracing."""

from __future__ import annotations

import json
from typing import Any

from mpdl.fileio import write_atomic

THREADS = {"main": 0, "comm": 1}


class Timeline:
    """Complete events ("ph": "X") of one rank, times relative to a common origin.

    Every rank takes `origin` (time.perf_counter) right after a barrier, so tracks line up to
    within the barrier's skew.
    """

    def __init__(self, rank: int, origin: float) -> None:
        self.rank, self.origin = rank, origin
        self.events: list[dict[str, Any]] = []

    def add(self, name: str, start: float, end: float, thread: str = "main",
            cat: str = "compute", **args: Any) -> None:
        event = {"name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": THREADS[thread],
                 "ts": round((start - self.origin) * 1e6, 3),
                 "dur": round(max(end - start, 0.0) * 1e6, 3)}
        if args:
            event["args"] = args
        self.events.append(event)

    def counters(self, name: str, keys: tuple[str, ...],
                 samples: list[tuple[float, tuple[int, ...]]]) -> None:
        """A counter track ("ph": "C"): at each (time.perf_counter, values) sample, the value of
        each of `keys`."""
        for t, values in samples:
            self.events.append({"name": name, "ph": "C", "pid": self.rank,
                                "ts": round((t - self.origin) * 1e6, 3),
                                "args": dict(zip(keys, values, strict=True))})

    def metadata(self) -> list[dict[str, Any]]:
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank,
                 "args": {"name": f"rank {self.rank}"}},
                {"name": "process_sort_index", "ph": "M", "pid": self.rank,
                 "args": {"sort_index": self.rank}}]
        for name, tid in THREADS.items():
            meta.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                         "args": {"name": "communication" if name == "comm" else "compute"}})
        return meta


def write_trace(path: str, timelines: list[Timeline] | list[list[dict[str, Any]]]) -> None:
    """Write every rank's events as one Chrome-trace JSON file (atomically)."""
    events: list[dict[str, Any]] = []
    for t in timelines:
        events.extend(t if isinstance(t, list) else t.metadata() + t.events)
    write_atomic(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
