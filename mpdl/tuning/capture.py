"""Schedules captured from the algorithms themselves, for persistent plans to replay.

A persistent plan (`mpdl.tuning.plan`) sends the same messages on every run. Rather than
keep a second copy of an algorithm's schedule, the plan runs the algorithm once on stand-ins:
`Region`s in place of its arrays (which buffer, where in it, how long) and a `CapturingComm` in
place of its communicator, which notes every message posted and every reduction instead of moving
data. The algorithm's control flow depends only on the rank, the world size and the count, so this
one run gives its whole schedule.

The capture is a list of `Round`s: messages started together, all of them completed, then the
reductions, in the algorithm's order. A round begins at the first message posted after a wait or
a reduction. Completing every message of a round before its reductions gives the same result as
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
class Region:
    """A stand-in for a 1-D array: `size` elements of `dtype` at `offset` in the named buffer.
    Slicing it gives the region of the slice, as slicing an array gives a view."""

    buffer: str
    offset: int
    size: int
    dtype: np.dtype

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def __getitem__(self, key: slice) -> Region:
        start, stop, stride = key.indices(self.size)
        if stride != 1:
            raise TypeError(f"region: a stride of {stride} is not a contiguous part")
        return Region(self.buffer, self.offset + start, max(stop - start, 0), self.dtype)

    def view(self, arrays: dict[str, Any]) -> Any:
        """The part of arrays[self.buffer] this region stands for."""
        return arrays[self.buffer][self.offset:self.offset + self.size]


@dataclass(frozen=True)
class Message:
    """A send or receive ("send", "recv") of a region with a peer; `step` is the algorithm's own
    label of it (timeouts name it)."""

    kind: str
    peer: int
    region: Region
    step: Any


@dataclass
class Round:
    """Messages started together and all completed, then reductions f(a, b, out=o) in order."""

    messages: list[Message] = field(default_factory=list)
    reductions: list[tuple[Region, Region, Region]] = field(default_factory=list)


@dataclass
class CapturedSchedule:
    """An algorithm's schedule on one rank for `count` elements: its rounds, and the elements of
    every work buffer it asked its communicator for (`workspace`)."""

    count: int
    rounds: list[Round]
    scratch: dict[str, int]


class CapturingComm(Communicator):
    """Rank `rank` of `size` ranks, capturing instead of communicating: messages and reductions
    go into `rounds`, work buffers are regions of buffers named as the algorithm names them."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__()
        self.rank, self.size = rank, size
        self.rounds: list[Round] = []
        self.scratch: dict[str, int] = {}
        self._posting = False  # whether the last round still takes messages

    def _isend(self, buf: Region, dest: int, step: Any) -> Request:
        return self._post(Message("send", dest, buf, step))

    def _irecv(self, buf: Region, source: int, step: Any) -> Request:
        return self._post(Message("recv", source, buf, step))

    def _post(self, message: Message) -> Request:
        if not self._posting:
            self.rounds.append(Round())
            self._posting = True
        self.rounds[-1].messages.append(message)
        return Request(None, message.peer, message.step, message.kind)

    def _wait_all(self, requests: Any) -> None:
        self._posting = False

    def reduce(self, a: Region, b: Region, out: Region) -> None:
        """The reduction the algorithm asks for, noted as the last round's."""
        if not self.rounds:
            self.rounds.append(Round())
        self.rounds[-1].reductions.append((a, b, out))
        self._posting = False

    def workspace(self, name: str, count: int, dtype: Any, xp: Any) -> Region:
        self.scratch[name] = max(self.scratch.get(name, 0), count)
        return Region(name, 0, count, np.dtype(dtype))


def capture(algorithm: Any, rank: int, size: int, count: int, dtype: Any) -> CapturedSchedule:
    """The schedule of algorithm(comm, buf, reduce) on rank `rank` of `size` reducing `count`
    elements of dtype in place (in the buffer BUF)."""
    comm = CapturingComm(rank, size)
    algorithm(comm, Region(BUF, 0, count, np.dtype(dtype)), comm.reduce)
    return CapturedSchedule(count, comm.rounds, comm.scratch)


def reading_input(captured: CapturedSchedule) -> CapturedSchedule | None:
    """The schedule with every read of a part of BUF not yet written by then (a send, an operand
    of a reduction) reading that part of the input SRC instead, so that the input need not be
    copied into BUF first. None where that does not give the same result: a read of a part only
    partly written, or a part of BUF never written (it must hold the input at the end)."""
    written = np.zeros(captured.count, dtype=bool)

    def read(region: Region) -> Region | None:
        if region.buffer != BUF:
            return region
        part = written[region.offset:region.offset + region.size]
        if part.all():
            return region
        return None if part.any() else dataclasses.replace(region, buffer=SRC)

    def write(region: Region) -> None:
        if region.buffer == BUF:
            written[region.offset:region.offset + region.size] = True

    rounds = []
    for r in captured.rounds:
        messages, reductions = [], []
        for m in r.messages:
            region = read(m.region) if m.kind == "send" else m.region
            if region is None:
                return None
            messages.append(dataclasses.replace(m, region=region))
        for m in r.messages:
            if m.kind == "recv":
                write(m.region)
        for a, b, out in r.reductions:
            operands = read(a), read(b)
            if None in operands:
                return None
            reductions.append((*operands, out))
            write(out)
        rounds.append(Round(messages, reductions))
    if not written.all():
        return None
    return CapturedSchedule(captured.count, rounds, captured.scratch)
