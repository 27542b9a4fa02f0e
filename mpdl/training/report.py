"""What a training run shows: the human table (a header, one line per epoch, a closing line), JSON
lines (one row per epoch, then a summary) and the Chrome-trace timeline. Only rank 0 prints and
writes; the timeline is gathered from every rank."""

from __future__ import annotations

import json
from typing import Any, TextIO

import numpy as np

from mpdl.collectives import allreduce
from mpdl.fileio import write_atomic
from mpdl.memory import CATEGORIES
from mpdl.training.tasks import SUMMARY_FIELDS
from mpdl.training.timeline import Timeline, write_trace

COLUMNS = ("epoch", "loss", "train_acc", "test_acc", "samples/s", "step_ms", "compute", "comm",
           "exposed")
MIB = 1 << 20
#: the columns a sharded (ZeRO) run adds: model state held (max over ranks, peak within a step)
#: and bytes sent per step, in MiB: (title, row field, width, format, divisor)
ZERO_COLUMNS = (("state_MiB", "model_state_bytes", 9, ".3f", MIB),
                ("sent_MiB", "sent_bytes_per_step", 9, ".3f", MIB))
#: the column an fp16 run adds: the optimizer steps the loss scaler skipped so far
FP16_COLUMNS = (("skipped", "skipped_steps", 7, ".0f"),)


def memory_fields(peaks: dict[str, int], comm: Any) -> dict[str, Any]:
    """The JSON fields of a rank's memory peaks (mpdl.memory), max over the ranks of `comm`
    (collective): `memory_peak_bytes` per category, and the most held at one time of all of them
    (`memory_peak_total_bytes`) and of the model state (`memory_peak_state_bytes`: parameters,
    master weights, gradients, optimizer state)."""
    keys = (*CATEGORIES, "total", "model_state")
    most = allreduce(np.array([peaks.get(k, 0) for k in keys], dtype=np.float64), op="max",
                     comm=comm)
    values = dict(zip(keys, (int(v) for v in most), strict=True))
    return {"memory_peak_bytes": {k: values[k] for k in CATEGORIES},
            "memory_peak_total_bytes": values["total"],
            "memory_peak_state_bytes": values["model_state"]}


def write_json_lines(path: str, rows: list[dict[str, Any]]) -> None:
    """Write rows as JSON lines to path (atomically: a temporary file, then a rename)."""
    write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


def ranks_text(roles: list[tuple[str, int]], ranks: int, global_batch_size: int
               ) -> tuple[str, str]:
    """('3 ranks (2 workers, 1 server)', '32 per worker') for the roles of a strategy over
    `ranks` ranks, the first of which trains on the data; a single role of fewer members than
    ranks spans several ranks each ('4 ranks (2 replicas of 2 ranks)', '64 per replica')."""
    def count(role: str, n: int) -> str:
        return f"{n} {role}{'s' if n > 1 else ''}"

    role, trainers = roles[0]
    text = count("rank", ranks)
    if len(roles) > 1:
        text += f" ({', '.join(count(r, n) for r, n in roles)})"
    elif trainers != ranks:
        text += f" ({count(role, trainers)} of {count('rank', ranks // trainers)})"
    return text, f"{global_batch_size / trainers:g} per {role}"


def describe_run(config: Any, model: str, task: Any, roles: list[tuple[str, int]], ranks: int,
                 strategy: str, emulated: str) -> str:
    """The header's description of a run: model, data, ranks, batch, optimizer, strategy."""
    o = config.optim
    ranks_part, per_rank = ranks_text(roles, ranks, o.global_batch_size)
    return (f"{model} on {config.data.dataset} ({len(task.xtr)} train / {len(task.xte)} test), "
            f"{ranks_part}, global batch {o.global_batch_size} ({per_rank}), {o.optimizer} "
            f"lr {config.base_lr():g}, {strategy}"
            + (f", EMULATED links {emulated}" if emulated else ""))


def summary_row(config: Any, rows: list[dict[str, Any]], ranks: int, strategy: dict[str, Any],
                emulated: str, seconds: float) -> dict[str, Any]:
    """The run's summary line: its configuration, the last epoch's metrics and the mean rate."""
    last = rows[-1] if rows else {}
    o = config.optim
    return {"summary": True, "epochs": o.epochs, "ranks": ranks, **strategy,
            "emulated": emulated, "model": config.model.name, "dataset": config.data.dataset,
            "global_batch_size": o.global_batch_size, "optimizer": o.optimizer,
            "overlap": config.communication.overlap, "loss": last.get("loss"),
            "train_acc": last.get("train_acc"),
            "test_acc": last.get("test_acc"), **{k: last[k] for k in SUMMARY_FIELDS if k in last},
            "samples_per_s": (float(np.mean([r["samples_per_s"] for r in rows])) if rows else None),
            "seconds": seconds}


class Report:
    """The table on `out` and the JSON lines at `json_path` (None: none), written when `enabled`
    (rank 0), after a `first` line when one is given (the run's configuration). `columns` are
    extra table columns after COLUMNS: (title, row field, width, format) and optionally a divisor
    of the field's value."""

    def __init__(self, out: TextIO, json_path: str | None, enabled: bool,
                 first: dict[str, Any] | None = None) -> None:
        self.out, self.json_path, self.enabled, self.first = out, json_path, enabled, first
        self.columns: tuple[tuple, ...] = ()
        #: the lines within epochs (steps' logs, evaluations): (epoch rows before it, JSON line)
        self.events: list[tuple[int, dict[str, Any]]] = []

    def print(self, line: str) -> None:
        if self.enabled:
            print(line, file=self.out)
            self.out.flush()

    def header(self, what: str, notes: list[str]) -> None:
        """The run's description line, the notes (e.g. that it resumed) and the column names."""
        self.print(f"# mpdl train: {what}")
        for note in notes:
            self.print(note)
        self.print(f"{COLUMNS[0]:>5} {COLUMNS[1]:>8} {COLUMNS[2]:>9} {COLUMNS[3]:>8} "
                   f"{COLUMNS[4]:>10} {COLUMNS[5]:>8} {COLUMNS[6]:>8} {COLUMNS[7]:>8} "
                   f"{COLUMNS[8]:>8}" + "".join(f" {t:>{w}}" for t, _, w, *_ in self.columns))

    def row(self, r: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        """An epoch's line, and the JSON lines so far."""
        step_ms = (r["compute_s"] + r["exposed_comm_s"]) * 1e3
        self.print(f"{r['epoch']:>5} {r['loss']:>8.4f} {r['train_acc']:>9.4f} "
                   f"{r['test_acc']:>8.4f} {r['samples_per_s']:>10.0f} {step_ms:>8.2f} "
                   f"{r['compute_s'] * 1e3:>8.2f} {r['comm_s'] * 1e3:>8.2f} "
                   f"{r['exposed_comm_s'] * 1e3:>8.2f}"
                   + "".join(f" {r[key] / (scale[0] if scale else 1):>{w}{fmt}}"
                             for _, key, w, fmt, *scale in self.columns))
        self.write(rows)

    def summary(self, s: dict[str, Any], rows: list[dict[str, Any]], note: str) -> None:
        """The strategy's closing note (if any), the closing line, and every JSON line."""
        if note:
            self.print(note)
        acc = s["test_acc"]
        acc_text = f"test accuracy {acc:.4f}, " if acc is not None else ""
        if s.get("exact_match") is not None:
            acc_text += f"exact match {s['exact_match']:.4f}, "
        if s.get("bits_per_char") is not None:
            acc_text += (f"validation {s['bits_per_char']:.3f} bits per character (unigram "
                         f"entropy {s['unigram_bits_per_char']:.3f}), ")
        if s.get("mfu") is not None:
            acc_text += f"{s['tokens_per_s']:.0f} tokens/s, MFU {s['mfu']:.2%}, "
        self.print(f"# done: {acc_text}{s['seconds']:.2f} s; times are per step (ms), averaged "
                   f"over ranks; exposed = communication not hidden behind backward")
        self.write([*rows, s])

    def event(self, line: str, fields: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        """A line within an epoch (a step's log, an evaluation) after the epoch rows so far, and
        its JSON line."""
        self.print(line)
        if self.enabled:
            self.events.append((len(rows), fields))
            self.write(rows)

    def write(self, rows: list[dict[str, Any]]) -> None:
        """The JSON lines: the first line, then the rows with the events between them."""
        if not (self.enabled and self.json_path):
            return
        lines, k = [self.first] if self.first else [], 0
        for index, row in enumerate(rows):
            while k < len(self.events) and self.events[k][0] <= index:
                lines.append(self.events[k][1])
                k += 1
            lines.append(row)
        write_json_lines(self.json_path, lines + [fields for _, fields in self.events[k:]])


def write_timeline(comm: Any, timeline: Timeline, path: str) -> None:
    """Gather every rank's events and write them on rank 0 (collective over comm)."""
    events = comm.allgather_object(timeline.metadata() + timeline.events)
    if comm.rank == 0:
        write_trace(path, events)


def resumed_text(directory: str | None, epoch: int, step: int, position: int,
                 steps_per_epoch: int) -> str | None:
    """The header's line about a resumed run (None for a fresh one): after `epoch` whole epochs,
    or at global `step`, `position` steps into the next epoch."""
    if 0 < position < steps_per_epoch:
        return (f"# resumed from {directory} at step {step} (epoch {epoch + 1}, {position} of "
                f"{steps_per_epoch} steps done)")
    return f"# resumed from {directory} after epoch {epoch}" if epoch else None
