"""Schedules recorded from the algorithms themselves, for persistent plans to replay.

A persistent plan (`mpdl.tuning.plan`) sends the same messages on every run. Rather than
keep a second copy of an algorithm's schedule, the plan runs the algorithm once on stand-ins:
`Span`s in place of its arrays (which buffer, where in it, how long) and a `RecordingComm` in
place of its communicator, which notes every message posted and every reduction instead of moving
data. The algorithm's control flow depends only on the rank, the world size and the count, so this
one run gives its whole schedule.

The record is a list of `Step`s: messages started together, all of them completed, then the
reductions, in the algorithm's order. A step begins at the first message posted after a wait or a
reduction. Completing every message of a step before its reductions gives the same result as
the algorithm's own order: a reduction made while a message is in flight neither writes the
buffer it sends nor touches the buffer it receives into (either would race with the transfer).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpdl.comm import Communicator, Request

#: the buffer an algorithm reduces in place, and the input it may read instead (`reading_input`)
BUF, SRC = "buf", "src"


@dataclass(frozen=True)
class Span:
    """A stand-in for a 1-D array: `size` elements of `dtype` at `offset` in the named buffer.
    Slicing it gives the span of the slice, as slicing an array gives a view."""

    buffer: str
    offset: int
    size: int
    dtype: np.dtype

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def __getitem__(self, key: slice) -> Span:
        start, stop, step = key.indices(self.size)
        if step != 1:
            raise TypeError(f"span: a step of {step} is not a contiguous part")
        return Span(self.buffer, self.offset + start, max(stop - start, 0), self.dtype)

    def view(self, arrays: dict[str, Any]) -> Any:
        """The part of arrays[self.buffer] this span stands for."""
        return arrays[self.buffer][self.offset:self.offset + self.size]


@dataclass(frozen=True)
class Message:
    """A send or receive ("send", "recv") of a span with a peer; `step` is the algorithm's own
    label of it (timeouts name it)."""

    kind: str
    peer: int
    span: Span
    step: Any


@dataclass
class Step:
    """Messages started together and all completed, then reductions f(a, b, out=o) in order."""

    messages: list[Message] = field(default_factory=list)
    reductions: list[tuple[Span, Span, Span]] = field(default_factory=list)


@dataclass
class Recording:
    """An algorithm's schedule on one rank for `count` elements: its steps, and the elements of
    every work buffer it asked its communicator for (`workspace`)."""

    count: int
    steps: list[Step]
    scratch: dict[str, int]


class RecordingComm(Communicator):
    """Rank `rank` of `size` ranks, recording instead of communicating: messages and reductions
    go into `steps`, work buffers are spans of buffers named as the algorithm names them."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__()
        self.rank, self.size = rank, size
        self.steps: list[Step] = []
        self.scratch: dict[str, int] = {}
        self._posting = False  # whether the last step still takes messages

    def _isend(self, buf: Span, dest: int, step: Any) -> Request:
        return self._post(Message("send", dest, buf, step))

    def _irecv(self, buf: Span, source: int, step: Any) -> Request:
        return self._post(Message("recv", source, buf, step))

    def _post(self, message: Message) -> Request:
        if not self._posting:
            self.steps.append(Step())
            self._posting = True
        self.steps[-1].messages.append(message)
        return Request(None, message.peer, message.step, message.kind)

    def _wait_all(self, requests: Any) -> None:
        self._posting = False

    def reduce(self, a: Span, b: Span, out: Span) -> None:
        """The reduction the algorithm asks for, noted as the last step's."""
        if not self.steps:
            self.steps.append(Step())
        self.steps[-1].reductions.append((a, b, out))
        self._posting = False

    def workspace(self, name: str, count: int, dtype: Any, xp: Any) -> Span:
        self.scratch[name] = max(self.scratch.get(name, 0), count)
        return Span(name, 0, count, np.dtype(dtype))


def record(algorithm: Any, rank: int, size: int, count: int, dtype: Any) -> Recording:
    """The schedule of algorithm(comm, buf, reduce) on rank `rank` of `size` reducing `count`
    elements of dtype in place (in the buffer BUF)."""
    comm = RecordingComm(rank, size)
    algorithm(comm, Span(BUF, 0, count, np.dtype(dtype)), comm.reduce)
    return Recording(count, comm.steps, comm.scratch)


def reading_input(recording: Recording) -> Recording | None:
    """The recording with every read of a part of BUF not yet written by then (a send, an operand
    of a reduction) reading that part of the input SRC instead, so that the input need not be
    copied into BUF first. None where that does not give the same result: a read of a part only
    partly written, or a part of BUF never written (it must hold the input at the end)."""
    written = np.zeros(recording.count, dtype=bool)

    def read(span: Span) -> Span | None:
        if span.buffer != BUF:
            return span
        part = written[span.offset:span.offset + span.size]
        if part.all():
            return span
        return None if part.any() else dataclasses.replace(span, buffer=SRC)

    def write(span: Span) -> None:
        if span.buffer == BUF:
            written[span.offset:span.offset + span.size] = True

    steps = []
    for step in recording.steps:
        messages, reductions = [], []
        for m in step.messages:
            span = read(m.span) if m.kind == "send" else m.span
            if span is None:
                return None
            messages.append(dataclasses.replace(m, span=span))
        for m in step.messages:
            if m.kind == "recv":
                write(m.span)
        for a, b, out in step.reductions:
            operands = read(a), read(b)
            if None in operands:
                return None
            reductions.append((*operands, out))
            write(out)
        steps.append(Step(messages, reductions))
    if not written.all():
        return None
    return Recording(recording.count, steps, recording.scratch)
