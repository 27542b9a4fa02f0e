"""What a training run shows: the human table (a header, one line per epoch, a closing line), JSON
lines (one row per epoch, then a summary) and the Chrome-trace timeline. Only rank 0 prints and
writes; the timeline is gathered from every rank."""

from __future__ import annotations

import json
from typing import Any, TextIO

from mpdl.fileio import write_atomic
from mpdl.training.timeline import Timeline, write_trace

COLUMNS = ("epoch", "loss", "train_acc", "test_acc", "samples/s", "step_ms", "compute", "comm",
           "exposed")
#: the columns a sharded (ZeRO) run adds: model state held (max over ranks, peak within a step)
#: and bytes sent per step, in MiB
ZERO_COLUMNS = ("state_MiB", "sent_MiB")
MIB = 1 << 20


def write_json_lines(path: str, rows: list[dict[str, Any]]) -> None:
    """Write rows as JSON lines to path (atomically: a temporary file, then a rename)."""
    write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


def ranks_text(roles: list[tuple[str, int]], global_batch_size: int) -> tuple[str, str]:
    """('3 ranks (2 workers, 1 server)', '32 per worker') for the roles of a strategy, the first
    of which trains on the data."""
    def count(role: str, n: int) -> str:
        return f"{n} {role}{'s' if n > 1 else ''}"

    total = sum(n for _, n in roles)
    role, trainers = roles[0]
    ranks = count("rank", total)
    if len(roles) > 1:
        ranks += f" ({', '.join(count(r, n) for r, n in roles)})"
    return ranks, f"{global_batch_size / trainers:g} per {role}"


class Report:
    """The table on `out` and the JSON lines at `json_path` (None: none), written when `enabled`
    (rank 0)."""

    def __init__(self, out: TextIO, json_path: str | None, enabled: bool) -> None:
        self.out, self.json_path, self.enabled = out, json_path, enabled

    def print(self, line: str) -> None:
        if self.enabled:
            print(line, file=self.out)
            self.out.flush()

    def header(self, what: str, resumed: str | None, zero: bool = False) -> None:
        """The run's description line, the resume note and the column names (with `zero`, the
        model state and bytes sent of a sharded run too)."""
        self.print(f"# mpdl train: {what}")
        if resumed:
            self.print(resumed)
        extra = "".join(f" {c:>9}" for c in ZERO_COLUMNS) if zero else ""
        self.print(f"{COLUMNS[0]:>5} {COLUMNS[1]:>8} {COLUMNS[2]:>9} {COLUMNS[3]:>8} "
                   f"{COLUMNS[4]:>10} {COLUMNS[5]:>8} {COLUMNS[6]:>8} {COLUMNS[7]:>8} "
                   f"{COLUMNS[8]:>8}{extra}")

    def row(self, r: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        """An epoch's line, and the JSON lines so far."""
        step_ms = (r["compute_s"] + r["exposed_comm_s"]) * 1e3
        self.print(f"{r['epoch']:>5} {r['loss']:>8.4f} {r['train_acc']:>9.4f} "
                   f"{r['test_acc']:>8.4f} {r['samples_per_s']:>10.0f} {step_ms:>8.2f} "
                   f"{r['compute_s'] * 1e3:>8.2f} {r['comm_s'] * 1e3:>8.2f} "
                   f"{r['exposed_comm_s'] * 1e3:>8.2f}" + (
                       f" {r['model_state_bytes'] / MIB:>9.3f} "
                       f"{r['sent_bytes_per_step'] / MIB:>9.3f}"
                       if "model_state_bytes" in r else ""))
        self.write(rows)

    def summary(self, s: dict[str, Any], rows: list[dict[str, Any]], note: str) -> None:
        """The strategy's closing note (if any), the closing line, and every JSON line."""
        if note:
            self.print(note)
        acc = s["test_acc"]
        acc_text = f"test accuracy {acc:.4f}, " if acc is not None else ""
        self.print(f"# done: {acc_text}{s['seconds']:.2f} s; times are per step (ms), averaged "
                   f"over ranks; exposed = communication not hidden behind backward")
        self.write([*rows, s])

    def write(self, rows: list[dict[str, Any]]) -> None:
        if self.enabled and self.json_path:
            write_json_lines(self.json_path, rows)


def write_timeline(comm: Any, timeline: Timeline, path: str) -> None:
    """Gather every rank's events and write them on rank 0 (collective over comm)."""
    events = comm.allgather_object(timeline.metadata() + timeline.events)
    if comm.rank == 0:
        write_trace(path, events)
