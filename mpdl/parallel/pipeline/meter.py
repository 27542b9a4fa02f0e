"""The meter of one pipeline step on one stage, kept apart from the schedule's executor
(`mpdl.parallel.pipeline`): the timeline's spans, the seconds of compute and of waiting, the
microbatches (and the bytes of their stage outputs) held for backward, the messages sent.

Each op of the schedule marks its phases in order: `op_begins()` (it starts to wait for its input:
a receive, or the first stage's slice of the batch), `compute_begins()` (an op with nothing to wait
for begins here), `compute_ends()`, then `forward_done()` or `backward_done()`. The wait becomes
a "recv" span and idle time, the compute a "forward"/"backward" span and compute time; the op's
thread CPU time runs from the start of its compute to its end (the stage's pieces, the last
stage's loss, the start of its send). The end of the step is marked by `synchronising()`,
`optimizer_step()`, `stepped()` and `close()`.
"""

from __future__ import annotations

import time

from mpdl.parallel.strategy import Span, StepResult


class PipelineMeter:
    """One step's figures on one pipeline stage; `result` is the step's `StepResult` (the loss
    sums are the executor's to fill)."""

    def __init__(self) -> None:
        self.result = StepResult()
        self.start = time.perf_counter()
        #: seconds waiting for the ops' inputs, and the whole step's (set by `close`)
        self.idle_s = self.step_s = 0.0
        #: microbatches forwarded and not yet backwarded, and the bytes of their stage outputs
        #: (the activations a stage holds for backward grow with both): now and at the most
        self.live = self.peak = self.live_bytes = self.peak_bytes = 0
        self.messages = self.bytes_sent = 0
        self._held: dict[tuple[int, int | None], int] = {}
        self._wait: float | None = None  # the phases' clocks (time.perf_counter, thread_time)
        self._compute = self._cpu = self._computed = 0.0
        self._sync = self._update = self._updated = 0.0
        self._busy = 0.0

    # -- the ops -----------------------------------------------------------------------------
    def op_begins(self) -> None:
        """An op starts waiting for its input."""
        self._wait = time.perf_counter()

    def compute_begins(self) -> None:
        """The op's input is there: its compute starts."""
        self._compute, self._cpu = time.perf_counter(), time.thread_time()
        if self._wait is None:
            self._wait = self._compute

    def compute_ends(self) -> None:
        self._computed = time.perf_counter()

    def forward_done(self, j: int, output_bytes: int, received_from: int | None,
                     chunk: int | None = None) -> None:
        """Microbatch j's forward (through stage `chunk` of a rank that holds several) is over;
        its stage output (`output_bytes`) is held until its backward; `received_from`: the stage
        its input came from (None: the batch or this rank's previous chunk)."""
        label = _label(j, chunk)
        self._op_done(f"forward {label}", j, f"recv act {label}", received_from, chunk)
        self.live += 1
        self.peak = max(self.peak, self.live)
        self._held[(j, chunk)] = output_bytes
        self.live_bytes += output_bytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def backward_done(self, j: int, received_from: int | None, chunk: int | None = None,
                      weights_later: bool = False) -> None:
        """Microbatch j's backward is over (with `weights_later` only its input gradient: what
        it holds stays until `weights_done`); `received_from`: the stage its output's gradient
        came from (None: the loss or this rank's next chunk)."""
        label = _label(j, chunk)
        self._op_done(f"{'input grad' if weights_later else 'backward'} {label}", j,
                      f"recv grad {label}", received_from, chunk)
        if not weights_later:
            self._release(j, chunk)

    def weights_done(self, j: int, chunk: int | None = None) -> None:
        """The weight gradients of microbatch j's backward are in: what it held is freed."""
        self._op_done(f"weight grad {_label(j, chunk)}", j, "", None, chunk)
        self._release(j, chunk)

    def _release(self, j: int, chunk: int | None) -> None:
        self.live -= 1
        self.live_bytes -= self._held.pop((j, chunk))

    def _op_done(self, name: str, j: int, recv: str, received_from: int | None,
                 chunk: int | None) -> None:
        cpu = time.thread_time() - self._cpu
        wait, compute, computed = self._wait, self._compute, self._computed
        self._wait = None
        self.idle_s += compute - wait
        if received_from is not None:
            self.result.spans.append(Span(recv, wait, compute, cat="communication",
                                          args={"peer_stage": received_from}))
        args = {"microbatch": j, "cpu_s": cpu, **({} if chunk is None else {"stage": chunk})}
        self.result.spans.append(Span(name, compute, computed, args=args))
        self.result.compute_s += computed - compute
        self._busy += computed - compute

    def send(self, what: str, j: int, stage: int, nbytes: int) -> None:
        """A send of microbatch j's activation or gradient to `stage` starts: a zero-length
        span marks it on the timeline."""
        now = time.perf_counter()
        self.result.spans.append(Span(f"send {what} {j}", now, now, cat="communication",
                                      args={"peer_stage": stage, "bytes": int(nbytes)}))
        self.messages += 1
        self.bytes_sent += nbytes

    # -- the end of the step -----------------------------------------------------------------
    def synchronising(self) -> None:
        """The ops are done: the wait for the sends and the gradients' sums start."""
        self._sync = time.perf_counter()

    def optimizer_step(self) -> None:
        self._update = time.perf_counter()

    def stepped(self, name: str) -> None:
        """The optimizer step (`name` on the timeline) is done."""
        self._updated = time.perf_counter()
        self.result.spans += [Span("gradient all-reduce", self._sync, self._update,
                                   cat="communication"),
                              Span(name, self._update, self._updated)]

    def close(self) -> StepResult:
        """The step is over: the wait for the sends, the gradients' sums and whatever followed
        the optimizer step count as exposed communication, with the ops' waits."""
        end = time.perf_counter()
        result = self.result
        result.comm_s = result.exposed_s = (self.idle_s + (self._update - self._sync)
                                            + (end - self._updated))
        result.compute_s += self._updated - self._update
        self.step_s = end - self.start
        #: from the step's start to its last op's end, and the ops' compute seconds in it
        self.ops_s = self._sync - self.start
        self.busy_s = self._busy
        return result


def _label(j: int, chunk: int | None) -> str:
    """An op's microbatch, with its stage where a rank holds several: "3" or "3.5"."""
    return str(j) if chunk is None else f"{j}.{chunk}"
