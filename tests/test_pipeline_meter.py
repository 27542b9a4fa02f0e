"""The pipeline step's meter (`PipelineMeter`) on a scripted clock: which seconds count as
idle, compute and exposed communication, the timeline's spans, and the activations held."""

from __future__ import annotations

import pytest

from mpdl.parallel.pipeline import meter as pipeline_meter
from mpdl.parallel.pipeline.meter import PipelineMeter


class Clock:
    """Wall and thread CPU time that move only when the test says so."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def perf_counter(self) -> float:
        return self.wall

    def thread_time(self) -> float:
        return self.cpu

    def run(self, wall: float, cpu: float = 0.0) -> None:
        self.wall += wall
        self.cpu += cpu


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(pipeline_meter, "time", c)
    return c


def run_op(r: PipelineMeter, clock: Clock, wait: float | None, compute: float,
           cpu: float) -> None:
    """An op's phases: `wait` seconds for its input (None: it has none to wait for), then
    `compute` seconds, `cpu` of them on the thread."""
    if wait is not None:
        r.op_begins()
        clock.run(wait)
    r.compute_begins()
    clock.run(compute, cpu)
    r.compute_ends()


def test_a_middle_stage_step_splits_into_idle_compute_and_exposed_seconds(clock):
    r = PipelineMeter()
    # F 0: waits 1 s for stage 0's activation, computes 2 s, sends 64 bytes to stage 2
    run_op(r, clock, wait=1.0, compute=2.0, cpu=1.5)
    clock.run(0.5, cpu=0.25)
    r.send("act", 0, 2, 64)
    r.forward_done(0, 100, received_from=0)
    # F 1: waits 0.5 s, computes 2 s, holds 50 bytes more
    run_op(r, clock, wait=0.5, compute=2.0, cpu=2.0)
    r.forward_done(1, 50, received_from=0)
    assert (r.live, r.peak, r.live_bytes, r.peak_bytes) == (2, 2, 150, 150)
    # B 0: waits 2 s for stage 2's gradient, computes 3 s
    run_op(r, clock, wait=2.0, compute=3.0, cpu=3.0)
    r.backward_done(0, received_from=2)
    # B 1: nothing to wait for (as the last stage's loss): its compute starts the op
    run_op(r, clock, wait=None, compute=1.0, cpu=1.0)
    r.backward_done(1, received_from=None)
    assert (r.live, r.peak, r.live_bytes, r.peak_bytes) == (0, 2, 0, 150)
    # the end: 1 s for the sends and the gradients' sums, 2 s optimizer, 1 s after it
    r.synchronising()
    clock.run(1.0)
    r.optimizer_step()
    clock.run(2.0)
    r.stepped("optimizer step")
    clock.run(1.0)
    result = r.close()

    assert r.idle_s == 1.0 + 0.5 + 2.0 + 0.0
    assert result.compute_s == 2.0 + 2.0 + 3.0 + 1.0 + 2.0
    assert result.comm_s == result.exposed_s == 3.5 + 1.0 + 1.0
    assert r.step_s == 16.0
    assert (r.messages, r.bytes_sent) == (1, 64)
    spans = [(s.name, s.start, s.end, s.cat, s.args) for s in result.spans]
    assert spans == [
        ("send act 0", 3.5, 3.5, "communication", {"peer_stage": 2, "bytes": 64}),
        ("recv act 0", 0.0, 1.0, "communication", {"peer_stage": 0}),
        ("forward 0", 1.0, 3.0, "compute", {"microbatch": 0, "cpu_s": 1.75}),
        ("recv act 1", 3.5, 4.0, "communication", {"peer_stage": 0}),
        ("forward 1", 4.0, 6.0, "compute", {"microbatch": 1, "cpu_s": 2.0}),
        ("recv grad 0", 6.0, 8.0, "communication", {"peer_stage": 2}),
        ("backward 0", 8.0, 11.0, "compute", {"microbatch": 0, "cpu_s": 3.0}),
        ("backward 1", 11.0, 12.0, "compute", {"microbatch": 1, "cpu_s": 1.0}),
        ("gradient all-reduce", 12.0, 13.0, "communication", {}),
        ("optimizer step", 13.0, 15.0, "compute", {}),
    ]


def test_the_first_stage_waits_for_its_batch_slice_without_a_receive_span(clock):
    r = PipelineMeter()
    run_op(r, clock, wait=0.25, compute=1.0, cpu=1.0)
    r.forward_done(0, 8, received_from=None)
    assert r.idle_s == 0.25
    assert [s.name for s in r.result.spans] == ["forward 0"]
