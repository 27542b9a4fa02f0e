"""Persistent collectives: check, choose and prepare once, then run many times.

As MPI-4's `MPI_Allreduce_init` and FFTW's plans: `h = allreduce_init(x, out=out)` checks the
arguments (every rank, before any message), chooses the algorithm and prepares its schedule for
these very buffers (block bounds, peers, views, the reduction function and, over MPI, persistent
requests); `h.start()` and `h.wait()`, or `h()`, then run it with little Python per call. A plan
is bound to its arrays: starting it with another one raises ValueError. Results are bit-identical
to the one-shot calls'.

`alltoall_init` plans an all-to-all the same way (persistent sends and receives for the pairwise
and scattered algorithms, MPI_Alltoall_init for mpi).

`allreduce`, `reduce_scatter`, `allgather` and `alltoall` keep a bounded cache of plans keyed by their arrays'
identity and the other arguments, so repeated calls on the same arrays (`out=` preallocated) get
the same benefit without asking for a plan: a plan is made at the second call on the same arrays
(until then they are held weakly), for arrays up to CACHE_MAX_BYTES (ALLREDUCE_CACHE_MAX_BYTES for
`allreduce`, whose plans verify auto's choice), the distinct arrays of all cached plans within
CACHE_BYTES.
`alltoall` without `out` keeps plans by shape instead (`shaped_alltoall`), copying each call's x
in and its result out.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable
from time import monotonic
from typing import Any

import numpy as np

from mpdl import backend, memory, settings
from mpdl.collectives import checks, registry, shm
from mpdl.collectives.bruck import moving
from mpdl.collectives.ops import (
    in_float32,
    reduced_bytes,
    reducer,
    reduces_wide,
    segment_elements,
)
from mpdl.collectives.pairwise import partners
from mpdl.collectives.scattered import THROTTLE
from mpdl.comm import Communicator, Request, as_communicator, polling
from mpdl.comm.calls import call_name, call_state
from mpdl.comm.mpi import MPIComm, free_before_finalize
from mpdl.mpi_runtime import library_version
from mpdl.tuning import capture, verify
from mpdl.tuning.flightplan import FlightPlan, watched

#: plans the ordinary calls keep (oldest dropped first), and the largest array they plan for: above
#: it a call's Python overhead is lost in the transfer, and a plan would keep the array alive
CACHE_PLANS = 64
CACHE_MAX_BYTES = 1 << 20
#: the same for `allreduce(x, out=out)`, whose plans verify auto's choice in the caller's rhythm:
#: the rhythm still ranks the algorithms at 16 and 32 MiB, so plans go to 64 MiB, within
#: CACHE_BYTES (docs/results/auto.md#cached-plans-up-to-64-mib)
ALLREDUCE_CACHE_MAX_BYTES = 64 << 20
#: the most bytes of distinct arrays the cached plans may keep alive (their x and out; oldest plan
#: dropped first): a dropped plan's trial starts again with the next plan of its arrays, so the
#: bound holds the plans of a sweep over a dozen algorithms of one x at 64 MiB (`mpdl bench --loop`:
#: x and twelve results, 832 MiB)
CACHE_BYTES = 1 << 30

#: the plans of the ordinary calls, by signature (the allreduce key: `allreduce_key`)
cache: dict[tuple, Plan | FlightPlan] = {}


class Plan:
    """A collective prepared for fixed arrays: its schedule and its buffers. `start()`, then
    `wait()` for the result; `h()` does both. `start(x)` / `h(x)` check that x is the array the
    plan was made for. A plan whose communicator keeps a flight recorder comes wrapped in a
    `FlightPlan` (`watched`), which notes its runs; a bare plan only runs."""

    __slots__ = ("comm", "x", "result", "signature", "trial", "_name", "_call", "_schedule",
                 "_finish", "_precheck",
                 "shape", "dtype", "_started", "_held", "__weakref__")

    #: the flight recorder that notes the runs: none (`FlightPlan.flight` where one does)
    flight = None

    def __init__(self, comm: Communicator, x: Any, result: Any, signature: tuple, go, finish,
                 fast=None, requests: list | None = None) -> None:
        self.comm = comm
        #: the input array the plan was made for, and the array (or view) it returns
        self.x, self.result = x, result
        #: the call it stands for (collective, algorithm, shape, dtype, op, root or count), which
        #: the ranks compare under MPDL_CHECK
        self.signature = signature
        self._name = self._call = call_name(signature)
        #: a run through `go` of an algorithm whose messages carry no tag of ours compares the
        #: signature across the ranks first, as the one-shot call does
        self._precheck = signature[1] in checks.UNTAGGED
        #: (go, fast, requests): what a run does, the fast schedule where there is one, and the
        #: persistent requests they hold
        self._schedule = (go, fast, requests or [])
        self._finish = finish
        #: x's shape and dtype, plain attributes: the API's cache hit compares them in line
        self.shape, self.dtype = x.shape, x.dtype
        self._started = False
        #: the comm and out arguments of the ordinary call a cached plan stands for (kept alive:
        #: the cache's key holds their ids)
        self._held: tuple = (None, None)
        #: the verification of auto's choice on the first runs (mpdl.tuning.verify), if any
        self.trial: Any = None
        if requests:
            free_before_finalize(self)  # its persistent MPI requests

    @property
    def collective(self) -> str:
        return self.signature[0]

    @property
    def algorithm(self) -> str:
        return self.signature[1]

    @property
    def nbytes(self) -> int:
        """The bytes of the buffer the collective works on, as for the one-shot call (all-gather:
        the whole result)."""
        return (self.result if self.collective == "allgather" else self.x).nbytes

    def __repr__(self) -> str:
        return (f"<Plan {self._name} of {self.shape} {self.dtype} over {self.comm.size} "
                f"ranks>")

    def _check_x(self, x: Any) -> None:
        if x is not self.x:
            raise ValueError(f"x: this {self.collective} plan was made for another array (shape "
                             f"{self.shape}, {self.dtype}); make a plan for this one "
                             f"({self.collective}_init)")
        if x.shape != self.shape or x.dtype != self.dtype:
            raise ValueError(f"x: the plan's array changed since the plan was made (shape "
                             f"{self.shape} -> {x.shape}, {self.dtype} -> {x.dtype}); make a "
                             f"new plan")

    def _runs_inline(self, x: Any) -> bool:
        """Check x; whether a call may run at once here rather than through `start` and `wait`
        (the plan not started, no argument checks, the communication thread idle or this one)."""
        if x is not None and (x is not self.x or x.shape != self.shape):
            self._check_x(x)
        comm = self.comm
        thread = comm._comm_thread
        return not (self._started or comm.check or (
            thread is not None and thread._pending
            and threading.current_thread() is not thread.thread))

    def __call__(self, x: Any = None) -> Any:
        """Run the collective once and return its result (`start` and `wait` in one)."""
        if not self._runs_inline(x):
            return self.start().wait()
        self._run()
        return self.result if self._finish is None else self._finish()

    def start(self, x: Any = None) -> Plan:
        """Start the collective (hand-written algorithms run to the end here); returns the plan."""
        return self._start(x, self._begin, self._begin)

    def wait(self) -> Any:
        """Finish the collective started by `start()` and return its result."""
        if not self._started:
            raise RuntimeError(f"plan: {self._name} waited for before start()")
        self._started = False
        return self._result()

    def _start(self, x: Any, now: Callable[[], None], behind: Callable[[], None]) -> Plan:
        """`start`, running `now` (`_begin`, or a wrapper's around it), or `behind` on the
        communication thread after the asynchronous collectives in flight there (issue order)."""
        if x is not None:
            self._check_x(x)
        if self._started:
            raise RuntimeError(f"plan: {self._name} started again before wait()")
        thread = self.comm._comm_thread
        if thread is not None and thread.busy() and threading.current_thread() is not thread.thread:
            thread.submit(behind).wait()
        else:
            now()
        self._started = True
        return self

    def _begin(self) -> None:
        self._agree()
        self._run()

    def _agree(self) -> None:
        """Compare the call across the ranks first (MPDL_CHECK)."""
        comm = self.comm
        if comm.check:
            checks.agree(comm, *self.signature)

    def _run(self) -> None:
        """Run the schedule once (the fast one, unless a message log or link emulation is
        installed), named for timeouts."""
        comm = self.comm
        previous, comm.collective = comm.collective, self._call
        try:
            go, fast, _ = self._schedule
            # (a fast schedule exists only on an MPIComm, which always has link_delay); its
            # persistent requests carry the call's tag already
            if fast is not None and comm.message_log is None and comm.link_delay is None:
                fast()
            else:
                tag, call_state.tag = call_state.tag, self._call.tag
                try:
                    if self._precheck:
                        checks.precheck(comm, self._call)
                    go()
                finally:
                    call_state.tag = tag
        finally:
            comm.collective = previous

    def _result(self) -> Any:
        return self.result if self._finish is None else self._finish()

    def schedule(self) -> tuple[Any, Any, list | None]:
        """(go, fast, requests): what a run does, the fast schedule where there is one, and the
        persistent requests they hold."""
        return self._schedule

    def switch(self, name: str, go: Callable[[], None], fast: Callable[[], None] | None) -> None:
        """Run the registered algorithm `name` from now on (`go`, or `fast` where it can):
        verification's verdict."""
        self._schedule = (go, fast, self._schedule[2])
        self.signature = (self.signature[0], name, *self.signature[2:])
        self._name = self._call = call_name(self.signature)
        self._precheck = name in checks.UNTAGGED

    def run_trial(self, trial: Any, requests: list) -> None:
        """Run `trial` (a `verify.Trial`) on the next runs, holding every contender's persistent
        `requests` until the plan is freed."""
        if requests and not self._schedule[2]:
            free_before_finalize(self)
        self._schedule, self.trial = (trial.run, None, requests), trial

    def free(self) -> None:
        """Release the plan's persistent MPI requests (done at exit for plans still alive)."""
        requests = self._schedule[2]
        self._schedule = (self._schedule[0], None, [])
        MPI = getattr(self.comm, "MPI", None)
        if MPI is not None and not MPI.Is_finalized():
            for r in requests:
                r.Free()

    def __del__(self) -> None:
        if self._schedule[2]:
            try:
                self.free()
            except Exception:  # noqa: BLE001 - nothing to do about it at collection time
                pass


# -- rounds of persistent point-to-point requests (MPIComm, NumPy arrays) ------------------------
class _PersistentRounds:
    """Rounds of persistent sends and receives (a captured schedule's `capture.Round`s, or an
    all-to-all's steps), each followed by an optional reduction `f(a, b, out=o)`; runs them in
    order under the communicator's wait policy."""

    def __init__(self, comm, tag: int) -> None:
        self.comm, self.mpi, self.MPI, self.tag = comm, comm.mpi, comm.MPI, tag
        self.rounds: list[tuple] = []
        self.requests: list[Any] = []
        self._pending: list[tuple] = []

    def send(self, buf: np.ndarray, dest: int, step: Any) -> None:
        r = self.mpi.Send_init([buf, self.MPI.BYTE], dest, self.tag)
        self._pending.append((r, Request(r, dest, step, "send")))

    def recv(self, buf: np.ndarray, source: int, step: Any) -> None:
        r = self.mpi.Recv_init([buf, self.MPI.BYTE], source, self.tag)
        self._pending.append((r, Request(r, source, step, "recv")))

    def then(self, f=None, a=None, b=None, o=None) -> None:
        """Close the round: its messages complete, then f(a, b, out=o) when f is given."""
        if self._pending:
            reqs = [r for r, _ in self._pending]
            self.requests += reqs
            self.rounds.append((reqs, [w for _, w in self._pending], f, a, b, o))
        elif f is not None:
            self.rounds.append(([], [], f, a, b, o))
        self._pending = []

    def runner(self, copy: tuple[np.ndarray, np.ndarray] | None = None,
               compiled_after: int = 0) -> Callable[[], None]:
        """run(): the rounds in order under the communicator's wait policy; with `copy` = (dst,
        src), src is copied into dst between the first messages' start and their wait. From its
        `compiled_after`-th run on (default COMPILED_AFTER), a round waits in compiled code
        (`mpdl.comm.polling`) where that is possible."""
        compiled_after = compiled_after or COMPILED_AFTER
        rounds, comm = self.rounds, self.comm
        python = _finisher(comm, self.MPI.Request.Testall,
                           lambda handles, wrapped: comm._wait_all(wrapped))
        if len(rounds) == 1 and rounds[0][0] and rounds[0][2] is None:
            return self._one_round_runner(python, copy, compiled_after)
        during = None if copy is None else functools.partial(np.copyto, *copy)
        finishes = [python] * len(rounds)
        startall = self.MPI.Prequest.Startall
        runs = 0

        def run() -> None:
            nonlocal runs
            runs += 1
            if runs == compiled_after:
                finishes[:] = [_compiled_finisher(comm, reqs, python) if reqs else python
                               for reqs, *_ in rounds]
            first = during
            for (reqs, wrapped, f, a, b, o), finish in zip(rounds, finishes, strict=True):
                if reqs:
                    startall(reqs)
                    if first is not None:
                        first()
                        first = None
                    finish(reqs, wrapped)
                if f is not None:
                    f(a, b, out=o)
            if first is not None:
                first()

        return run

    def _one_round_runner(self, python: Callable[[Any, list[Request]], None],
                          copy: tuple[np.ndarray, np.ndarray] | None,
                          compiled_after: int) -> Callable[[], None]:
        """`runner()` of one round of messages and nothing after (a scattered
        all-to-all): the same, with less Python a run; from the `compiled_after`-th run on the
        main thread (the second at the earliest), the start, the copy and the wait are one
        compiled call."""
        made_after = max(compiled_after - 1, 1)
        comm, startall = self.comm, self.MPI.Prequest.Startall
        reqs, wrapped = self.rounds[0][0], self.rounds[0][1]
        during = None if copy is None else functools.partial(np.copyto, *copy)
        exchange, runs = None, 0
        polls, yield_every = _compiled_polls(comm)
        main, get_ident = threading.main_thread().ident, threading.get_ident

        def run() -> None:
            nonlocal exchange, runs
            if exchange is not None and get_ident() == main:
                if not exchange(polls, yield_every):
                    python(reqs, wrapped)
                return
            startall(reqs)
            if during is not None:
                during()
            python(reqs, wrapped)
            if runs < made_after:
                runs += 1
                if runs == made_after:
                    exchange = polling.compiled_exchange(reqs, *(copy or ()))

        return run


#: polls of a plan's requests, each after yielding the core, before the communicator's wait
#: policy takes over (its timeout, stall warning and sleeps) where ranks outnumber cores: from
#: Python, and in compiled code (a poll there costs a fifth as much); and the compiled wait's
#: polls where ranks have cores of their own (yielding every 64)
YIELD_POLLS = 256
COMPILED_YIELD_POLLS = 2048
COMPILED_POLLS = 8192
#: runs of a schedule after which it waits in compiled code: the first compiled wait costs a
#: process numba's import and cache, repaid only by schedules run many times
COMPILED_AFTER = 8
#: the same for the runs of a plan that verifies auto's choice (a plan run many times): its trial
#: times each algorithm as it will run from then on, waiting in compiled code from the first run;
#: timed in Python's wait, it compared what the plan never runs again
#: (docs/results/auto.md#trials-wait-in-compiled-code)
TRIAL_COMPILED_AFTER = 1


def _finisher(comm, done: Callable[[Any], bool],
              wait: Callable[[Any, list[Request]], None]) -> Callable[[Any, list[Request]], None]:
    """`finish(handles, wrapped)`: return once `done(handles)` (requests just started). Where ranks
    outnumber cores a waiting rank yields its core before each poll, in a loop with nothing else
    in it: the rank it waits for may need that core, and every step of Python between polls
    delays all ranks' messages. Otherwise it polls a few times (a small message is often done by
    then). Off the main thread, or after YIELD_POLLS, `wait(handles, wrapped)` (the
    communicator's policy: timeout, stall warning, sleeps) finishes the wait."""
    if comm.yield_every != 1:
        def finish(handles: Any, wrapped: list[Request]) -> None:
            for _ in range(64):
                if done(handles):
                    return
            wait(handles, wrapped)

        return finish
    main = threading.main_thread().ident
    get_ident, sched_yield = threading.get_ident, os.sched_yield

    def finish_yielding(handles: Any, wrapped: list[Request]) -> None:
        if done(handles):
            return
        if get_ident() == main:
            for _ in range(YIELD_POLLS):
                sched_yield()
                if done(handles):
                    return
        wait(handles, wrapped)

    return finish_yielding


def _compiled_finisher(comm, requests: list[Any], python: Callable[[Any, list[Request]], None]
                       ) -> Callable[[Any, list[Request]], None]:
    """A step's finish that first waits in compiled code for its persistent requests (on the
    main thread; yielding at every poll where ranks outnumber cores, else every 64), then as
    `python` does; `python` itself where no compiled wait is possible."""
    compiled = polling.compiled_wait(requests)
    if compiled is None:
        return python
    main = threading.main_thread().ident
    get_ident = threading.get_ident
    polls, yield_every = _compiled_polls(comm)

    def finish(handles: Any, wrapped: list[Request]) -> None:
        if get_ident() == main and compiled(polls, yield_every):
            return
        python(handles, wrapped)

    return finish


def _compiled_polls(comm) -> tuple[int, int]:
    """(polls, yield every so many) of a compiled wait on comm."""
    return ((COMPILED_YIELD_POLLS, 1) if comm.yield_every == 1
            else (COMPILED_POLLS, comm.yield_every))


def _start_and_poll(comm, request: Any, collective: str) -> Callable[[], None]:
    """A run of a persistent MPI collective: start it, then wait as `_finisher` does (MPICH's
    Testall misreports an unfinished persistent collective as an error, so this polls Test)."""
    wrapped = [Request(request, -1, collective, "collective")]
    test, start = request.Test, request.Start
    finish = _finisher(comm, lambda _: test(), lambda _, w: _wait_one(comm, test, w))

    def run() -> None:
        start()
        finish(None, wrapped)

    return run


def _wait_one(comm, test, wrapped: list[Request]) -> None:
    """Wait for one persistent collective request under the communicator's wait policy (MPICH's
    Testall misreports an unfinished persistent collective as an error, so this polls Test)."""
    spins, deadline, warn = 0, None, None
    yield_every = comm.yield_every
    while not test():
        spins += 1
        if spins % yield_every == 0:
            os.sched_yield()
        if spins & 1023 == 0:
            now = monotonic()
            if deadline is None:
                deadline, warn = now + comm.timeout, now + comm.settings.stall_warn
            elif now > deadline:
                raise comm._timeout_error(wrapped)
            elif warn is not None and now > warn:
                comm._stall_warning(wrapped, now - deadline + comm.timeout)
                warn = None


def _fast_path_possible(comm, *arrays) -> bool:
    return (isinstance(comm, MPIComm)
            and all(backend.get_array_module(a) is np for a in arrays if a is not None))


def _replay(comm, captured: capture.CapturedSchedule, arrays: dict[str, np.ndarray],
            f: Callable, tag: int) -> _PersistentRounds:
    """A captured schedule (`mpdl.tuning.capture`) as persistent requests under `tag` on the
    arrays its regions name, each reduction f(a, b, out=o)."""
    s = _PersistentRounds(comm, tag)
    for r in captured.rounds:
        for m in r.messages:
            (s.send if m.kind == "send" else s.recv)(m.region.view(arrays), m.peer, m.step)
        if not r.reductions:
            s.then()
        for a, b, o in r.reductions:
            s.then(f, a.view(arrays), b.view(arrays), o.view(arrays))
    return s


#: the all-reduce algorithms a plan replays as persistent requests over MPI, and the largest
#: count (given the segment's elements and p) for which they send one message per step
_REPLAYED = {"recursive_doubling": lambda count, seg, p: count <= seg,
             "ring": lambda count, seg, p: -(-count // p) <= seg}


def _tag(call: checks.Call, algorithm: str) -> int:
    """The message tag of the call run by `algorithm` (its own, or a contender of verify's)."""
    return call_name((call.signature[0], algorithm, *call.signature[2:])).tag


def _replayed_allreduce(call: checks.Call, algorithm: Callable, f: Callable, tag: int,
                        compiled_after: int = 0) -> tuple[Callable, list]:
    """(run, requests): the captured schedule of algorithm(comm, buf, reduce) on the call's
    arrays, reducing with f; it reads x where the schedule reads out before writing it (no copy of
    x into out), or runs after a copy where that cannot be done (`capture.reading_input`);
    waiting in compiled code from its `compiled_after`-th run (`_PersistentRounds.runner`)."""
    c, x, out = call.comm, call.x, call.out
    flat, xflat = out.reshape(-1), x.reshape(-1)
    captured = capture.capture(algorithm, c.rank, c.size, flat.size, flat.dtype)
    reading = capture.reading_input(captured) if out is not x else None
    arrays = {capture.BUF: flat, capture.SRC: xflat}
    for name, count in captured.scratch.items():
        arrays[name] = np.empty(count, flat.dtype)
        memory.hold(arrays[name], "communication")
    schedule = _replay(c, reading or captured, arrays, f, tag)
    run = schedule.runner(compiled_after=compiled_after)
    if out is x or reading is not None:
        return run, schedule.requests

    def copy_then_run() -> None:
        np.copyto(flat, xflat)
        run()

    return copy_then_run, schedule.requests


# -- making plans -------------------------------------------------------------------------------
@functools.cache
def _persistent_matches_blocking(MPI: Any) -> bool:
    """Whether this MPI library's persistent MPI_Allreduce_init is known to give the blocking
    MPI_Allreduce's bits (MPICH; tests/mpi/test_plans.py checks it for every dtype)."""
    return "MPICH" in library_version(MPI)


def allreduce_init(x: Any, op: str = "sum", algorithm: str = "auto", comm: Any = None,
                   out: Any = None) -> Plan | FlightPlan:
    """A plan of `allreduce(x, op, algorithm, comm, out)`: each run reduces x's current values
    into `plan.result` (out, or an array the plan allocates) and returns it. With algorithm
    "mpi" it is a persistent MPI_Allreduce_init, which every rank must plan and start alike, under
    MPICH; other libraries may reduce in another order in their persistent collectives than in
    MPI_Allreduce (Open MPI does, for float16), so there the plan makes the one-shot call."""
    return watched(_allreduce_plan(x, op, algorithm, comm, out, persistent=True))


def _allreduce_plan(x: Any, op: str, algorithm: str, comm: Any, out: Any,
                    persistent: bool) -> Plan:
    """allreduce_init; without `persistent`, "mpi" makes the one-shot call (a cached
    plan on one rank must match a one-shot call on another). With algorithm "auto" and the
    settings' verify_runs, the plan times auto's choice against its contenders on its first runs
    (`mpdl.tuning.verify`)."""
    shared = (persistent and algorithm == "auto" and out is x
              and shm.in_shared_memory(as_communicator(comm), x))
    call = checks.allreduce_call(x, op, algorithm, comm, out, plan=True, shared=shared)
    c, algo, xp, out = call.comm, call.algorithm, call.xp, call.out
    names = (verify.candidates("allreduce", reduced_bytes(x, op), c, shared)
             if algorithm == "auto" else None)
    go, fast, requests = _allreduce_runner(call, algo, persistent,
                                           TRIAL_COMPILED_AFTER if names is not None else 0)
    if op == "avg" and not reduces_wide(x.dtype, op):  # (a widened avg is divided in float32)
        flat, size = out.reshape(-1), c.size

        def finish() -> Any:
            xp.true_divide(flat, size, out=flat)
            return out
    else:
        finish = None
    plan = Plan(c, x, out, call.signature, go, finish, fast, requests)
    if names is not None:
        _verifying(plan, names, lambda other: _allreduce_runner(call, other, persistent,
                                                                 TRIAL_COMPILED_AFTER), shared)
    return plan


def _verifying(plan: Plan, names: tuple[str, ...],
               runner_of: Callable[[registry.Algorithm], tuple], shared: bool = False) -> None:
    """Make plan run a verify.Trial of names (its algorithm and the contenders) on its first runs,
    then the winner's; `runner_of(algorithm)` gives a contender's (go, fast, requests) on the
    plan's arrays."""
    c, collective = plan.comm, plan.collective
    built = {plan.algorithm: plan.schedule()}
    for name in names:  # auto's pick for the bytes that travel may differ from names[0]
        other = registry.resolve(collective, name)
        if other.name not in built:
            built[other.name] = runner_of(other)
    requests = [r for _, _, rs in built.values() for r in rs or []]

    def runner(name: str):
        go, fast, _ = built[name]
        return lambda: (fast if fast is not None and c.message_log is None
                        and c.link_delay is None else go)()

    def settle(name: str) -> None:
        go, fast, _ = built[name]
        plan.switch(name, go, fast)

    # (the size auto chooses by: the whole array, or for all-gather the whole result)
    trial = verify.Trial(c, collective, plan.nbytes, names, {n: runner(n) for n in names},
                         settle, settings.current().verify_runs, shared)
    plan.run_trial(trial, requests)


def _allreduce_runner(call: checks.Call, algo: registry.Algorithm, persistent: bool,
                      compiled_after: int = 0) -> tuple[Any, Any, list | None]:
    """(go, fast, requests) of algo (the call's algorithm, or verify's runner-up) running the
    all-reduce call: `go` runs the registered algorithm (after the input copy it needs), `fast` a
    persistent schedule where there is one (waiting in compiled code from its
    `compiled_after`-th run)."""
    c, x, out, op, xp = call.comm, call.x, call.out, call.op, call.xp
    flat, xflat = out.reshape(-1), x.reshape(-1)
    copy = out is not x and not algo.reads_input
    source = {"src": xflat} if algo.reads_input and out is not x else {}
    inner = getattr(algo.run, "__wrapped__", None)  # with_reducer's algorithm: reducer made once
    run, how = (inner, reducer(op, xp)) if inner is not None else (algo.run, op)

    def go() -> None:
        if copy:
            xp.copyto(flat, xflat)
        run(c, flat, how, **source)

    if reduces_wide(x.dtype, op):  # float32 partials, rounded once: no persistent schedule
        wide = xp.empty(x.size, np.float32)
        memory.hold(wide, "communication")

        def rounded_once() -> None:
            flat[...] = in_float32(c, xflat, xp, op, lambda w: run(c, w, how), wide)

        return rounded_once, None, None
    fast, requests = None, None
    if c.size > 1 and _fast_path_possible(c, x, out):
        MPI = c.MPI
        mpi_op = getattr(MPI, {"avg": "SUM"}.get(op, op.upper()))
        replayed = _REPLAYED.get(algo.name)
        if algo.name == "mpi" and not (persistent and _persistent_matches_blocking(MPI)):
            # the one-shot call's own nonblocking MPI_Iallreduce under the deadline (go): Open
            # MPI reduces in another order in MPI_Iallreduce than in MPI_Allreduce
            fast = None
        elif algo.name == "mpi":
            request = (c.mpi.Allreduce_init(MPI.IN_PLACE, flat, op=mpi_op) if out is x else
                       c.mpi.Allreduce_init(xflat, flat, op=mpi_op))
            requests = [request]
            fast = _start_and_poll(c, request, "allreduce")
        elif replayed is not None and replayed(x.size, segment_elements(x.itemsize), c.size):
            fast, requests = _replayed_allreduce(call, inner, reducer(op, np),
                                                 _tag(call, algo.name), compiled_after)
    return go, fast, requests


def reduce_scatter_init(x: Any, op: str = "sum", algorithm: str = "auto", comm: Any = None,
                        in_place: bool = False) -> Plan | FlightPlan:
    """A plan of `reduce_scatter(x, op, algorithm, comm, in_place)`: each run returns this rank's
    block (a view of x with `in_place`, else a new array). With algorithm "auto" and the settings'
    verify_runs, the plan times auto's choice against every other candidate on its first runs
    (`mpdl.tuning.verify`)."""
    return watched(_reduce_scatter_plan(x, op, algorithm, comm, in_place))


def _reduce_scatter_plan(x: Any, op: str, algorithm: str, comm: Any, in_place: bool) -> Plan:
    call = checks.reduce_scatter_call(x, op, algorithm, comm, in_place, plan=True)
    c, algo, xp, bounds, dtype = call.comm, call.algorithm, call.xp, call.layout, x.dtype
    buf = x if in_place else backend.empty_half_page_in(max(x.size, 1), dtype, xp)[:x.size]
    if not in_place:
        memory.hold(buf, "communication")
    mine, size = buf[bounds[c.rank]:bounds[c.rank + 1]], c.size

    def finish() -> Any:
        result = mine if in_place else mine.copy()
        if op == "avg" and not reduces_wide(dtype, op):  # (a widened avg is divided in float32)
            xp.true_divide(result, size, out=result)
        return result

    go = _reduce_scatter_runner(call, algo, buf, in_place)[0]
    plan = Plan(c, x, mine, call.signature, go, finish)
    names = (verify.candidates("reduce_scatter", reduced_bytes(x, op), c)
             if algorithm == "auto" else None)
    if names is not None:
        _verifying(plan, names, lambda other: _reduce_scatter_runner(call, other, buf, in_place))
    return plan


def _reduce_scatter_runner(call: checks.Call, algo: registry.Algorithm, buf: Any,
                           in_place: bool) -> tuple[Any, None, None]:
    """(go, None, None): algo reducing the call's x into buf and scattering it (this rank's block
    of buf reduced over the ranks)."""
    c, xp, bounds, xflat = call.comm, call.xp, call.layout, call.x.reshape(-1)
    inner = getattr(algo.run, "__wrapped__", None)
    run, how = (inner, reducer(call.op, xp)) if inner is not None else (algo.run, call.op)

    if reduces_wide(xflat.dtype, call.op):  # float32 partials, this rank's block rounded once
        mine, wide = slice(bounds[c.rank], bounds[c.rank + 1]), xp.empty(xflat.size, np.float32)
        memory.hold(wide, "communication")

        def go() -> None:
            buf[mine] = in_float32(c, xflat, xp, call.op, lambda w: run(c, w, how, bounds),
                                   wide)[mine]
    else:
        def go() -> None:
            if not in_place:
                xp.copyto(buf, xflat)
            run(c, buf, how, bounds)

    return go, None, None


def allgather_init(x: Any, algorithm: str = "auto", comm: Any = None, count: int | None = None,
                   out: Any = None) -> Plan | FlightPlan:
    """A plan of `allgather(x, algorithm, comm, count, out)`: each run gathers x's current values
    into `plan.result` (out, or an array the plan allocates) and returns it. With algorithm "auto"
    and the settings' verify_runs, the plan times auto's choice against every other candidate on
    its first runs (`mpdl.tuning.verify`)."""
    return watched(_allgather_plan(x, algorithm, comm, count, out))


def _allgather_plan(x: Any, algorithm: str, comm: Any, count: int | None, out: Any) -> Plan:
    call = checks.allgather_call(x, algorithm, comm, count, out, plan=True)
    c, algo, result = call.comm, call.algorithm, call.out
    plan = Plan(c, x, result, call.signature, _allgather_runner(call, algo)[0], None)
    names = verify.candidates("allgather", result.nbytes, c) if algorithm == "auto" else None
    if names is not None:
        _verifying(plan, names, lambda other: _allgather_runner(call, other))
    return plan


def _allgather_runner(call: checks.Call, algo: registry.Algorithm) -> tuple[Any, None, None]:
    """(go, None, None): algo gathering the call's x into its result."""
    c, bounds, result, xp = call.comm, call.layout, call.out, call.xp
    mine, xflat = result[bounds[c.rank]:bounds[c.rank + 1]], call.x.reshape(-1)
    run = algo.run

    def go() -> None:
        xp.copyto(mine, xflat)
        run(c, result, bounds)

    return go, None, None


def alltoall_init(x: Any, comm: Any = None, algorithm: str = "auto",
                  out: Any = None) -> Plan | FlightPlan:
    """A plan of `alltoall(x, comm, algorithm, out)`: each run exchanges x's current blocks into
    `plan.result` (out, or an array the plan allocates; `out is x` in place) and returns it. With
    algorithm "mpi" it is a persistent MPI_Alltoall_init where the library has one (every rank
    must then plan and start it alike)."""
    return watched(_alltoall_plan(x, comm, algorithm, out, persistent=True))


def _alltoall_plan(x: Any, comm: Any, algorithm: str, out: Any, persistent: bool) -> Plan:
    """alltoall_init; without `persistent`, "mpi" stays the blocking MPI_Alltoall (a cached plan
    on one rank must match a one-shot call on another)."""
    call = checks.alltoall_call(x, algorithm, comm, out)
    c, algo, out, layout = call.comm, call.algorithm, call.out, call.layout
    block = layout.block
    flat = out.reshape(-1)
    send = flat if out is x else x.reshape(-1)
    refresh = None
    if out is not x and not x.flags.c_contiguous:
        # x's flat form is a copy (or a strided view): each run sends a fresh contiguous copy
        staging = call.xp.empty(x.shape, dtype=x.dtype)
        send, refresh = staging.reshape(-1), functools.partial(call.xp.copyto, staging, x)
    run = algo.run

    def go() -> None:
        if refresh is not None:
            refresh()
        run(c, flat, send, layout)

    fast, requests = None, None
    if c.size > 1 and _fast_path_possible(c, x, out):
        if algo.name == "mpi":
            fast, requests = _mpi_alltoall_fast(c, flat, send, persistent)
        elif algo.name in ("pairwise", "scattered"):
            fast, requests = _direct_alltoall_fast(c, flat, send, layout, algo.name,
                                                   _tag(call, algo.name))
        elif algo.name == "bruck" and block:
            fast, requests = _bruck_alltoall_fast(c, flat, send, block, _tag(call, algo.name))
        if fast is not None and refresh is not None:
            fast = _after(refresh, fast)
    return Plan(c, x, out, call.signature, go, None, fast, requests)


def _after(first: Callable[[], Any], then: Callable[[], None]) -> Callable[[], None]:
    """first(), then then()."""
    def run() -> None:
        first()
        then()

    return run


def _mpi_alltoall_fast(c, flat: np.ndarray, send: np.ndarray, persistent: bool):
    """(a persistent MPI_Alltoall_init's start and wait, its requests), or (None, None) where the
    plan runs the one-shot call's own nonblocking MPI_Ialltoall, under the deadline and after its
    signature check (a cached plan, or a library without persistent collectives)."""
    MPI = c.MPI
    source = MPI.IN_PLACE if send is flat else [send, MPI.BYTE]
    init = getattr(c.mpi, "Alltoall_init", None)
    if not persistent or init is None:
        return None, None
    try:
        request = init(source, [flat, MPI.BYTE])
    except NotImplementedError:
        return None, None
    return _start_and_poll(c, request, "alltoall"), [request]


def _direct_alltoall_fast(c, flat: np.ndarray, send: np.ndarray, layout, name: str, tag: int):
    """The pairwise or scattered algorithm's messages as persistent requests (in place: from a
    kept copy of the input, refreshed each run)."""
    p, r = c.size, c.rank
    in_place = send is flat
    source = np.empty_like(flat) if in_place else send
    s = _PersistentRounds(c, tag)
    if name == "pairwise":
        batches = [[partners(r, p, step) + (step,)] for step in range(1, p)]
    else:
        batches = [[((r - i) % p, (r + i) % p, i) for i in range(first, min(p, first + THROTTLE))]
                   for first in range(1, p, THROTTLE)]
    for batch in batches:
        for _, src, step in batch:
            if layout.recv_counts[src]:
                s.recv(layout.recv_block(flat, src), src, step)
        for dst, _, step in batch:
            if layout.send_counts[dst]:
                s.send(layout.send_block(source, dst), dst, step)
        s.then()
    own_in, own_out = layout.send_block(source, r), layout.recv_block(flat, r)
    runner = s.runner(copy=(own_out, own_in))
    if not in_place:
        return runner, s.requests

    def fast() -> None:
        np.copyto(source, flat)
        runner()

    return fast, s.requests


def _bruck_alltoall_fast(c, flat: np.ndarray, send: np.ndarray, b: int, tag: int):
    """Bruck's steps as persistent requests between kept buffers; the rotations, packs and unpacks
    run after each step's messages (`bruck.bruck_alltoall`'s order, bit for bit)."""
    p, r = c.size, c.rank
    work = np.empty((p, b), flat.dtype)
    source, result = send.reshape(p, b), flat.reshape(p, b)
    steps = []
    distance = 1
    while distance < p:
        positions = moving(p, distance)
        steps.append((distance, positions, np.empty((positions.size, b), flat.dtype),
                      np.empty((positions.size, b), flat.dtype)))
        distance *= 2

    def rotate_and_pack(*_: Any, out: Any = None) -> None:
        work[:p - r] = source[r:]
        work[p - r:] = source[:r]
        _, positions, outgoing, _ = steps[0]
        np.take(work, positions, axis=0, out=outgoing)

    def unpack(k: int):
        _, positions, _, incoming = steps[k]
        after = steps[k + 1] if k + 1 < len(steps) else None

        def run(*_: Any, out: Any = None) -> None:
            work[positions] = incoming
            if after is not None:
                np.take(work, after[1], axis=0, out=after[2])
            else:
                result[r::-1] = work[:r + 1]
                result[p - 1:r:-1] = work[r + 1:]

        return run

    s = _PersistentRounds(c, tag)
    s.then(rotate_and_pack)
    for k, (distance, _, outgoing, incoming) in enumerate(steps):
        s.recv(incoming, (r - distance) % p, distance)
        s.send(outgoing, (r + distance) % p, distance)
        s.then(unpack(k))
    return s.runner(), s.requests


# -- the plan cache of the ordinary calls --------------------------------------------------------
#: arrays seen once (weakly held): a plan is made and kept at the second call on the same arrays,
#: so arrays made afresh for every call are never kept alive by the cache
_seen: dict[tuple, tuple] = {}


def _cached(key: tuple, x: Any, out: Any, comm: Any, make: Callable, *arguments: Any,
            max_bytes: int | None = None) -> Any:
    """The cached plan for key (made by make(*arguments) at the second call on these arrays, when
    they are at most max_bytes, CACHE_MAX_BYTES by default), or None: then the caller runs the
    one-shot call."""
    plan = cache.get(key)
    if plan is not None:
        if plan.x is x and plan._held[1] is out and plan._held[0] is comm and \
                x.shape == plan.shape and x.dtype is plan.dtype:
            if plan.flight is not plan.comm.flight:
                plan = cache[key] = watched(plan)
            return plan
        cache.pop(key, None)
    limit = CACHE_MAX_BYTES if max_bytes is None else max_bytes
    if x.nbytes > limit or (out is not None and out.nbytes > limit):
        return None
    refs = _seen.get(key)
    if refs is None or refs[0]() is not x or (out is not None and refs[1]() is not out):
        try:
            refs = (weakref.ref(x), weakref.ref(out) if out is not None else None)
        except TypeError:  # an array kind that cannot be referenced weakly: never cached
            return None
        _evict(_seen)
        _seen[key] = refs
        return None
    _seen.pop(key, None)
    plan = make(*arguments)
    plan._held = (comm, out)
    _evict(cache)
    _evict_bytes(cache, plan)
    plan = cache[key] = watched(plan)
    return plan


def _kept_bytes(plans: list[Any]) -> int:
    """The bytes of the distinct arrays the plans keep alive (each one's x and out; plans of one
    x, as a sweep's over several algorithms, keep it once)."""
    arrays = {id(a): a.nbytes for p in plans for a in (p.x, p._held[1]) if a is not None}
    return sum(arrays.values())


def _evict_bytes(table: dict, adding: Any) -> None:
    """Drop the oldest plans until the arrays of those left and of the plan `adding` fit in
    CACHE_BYTES (or none is left)."""
    while _kept_bytes([*table.values(), adding]) > CACHE_BYTES:
        if _pop_oldest(table) is None:
            return


def _evict(table: dict) -> None:
    """Drop the oldest entries above the bound."""
    while len(table) >= CACHE_PLANS and _pop_oldest(table) is not None:
        pass


def _pop_oldest(table: dict) -> Any:
    """Remove the oldest entry and return its value; None when the table is empty or another
    thread changed it meanwhile (a DDP communication thread and the main thread may both call
    collectives)."""
    try:
        return table.pop(next(iter(table)), None)
    except (StopIteration, RuntimeError):
        return None


def allreduce_key(x: Any, op: Any, algorithm: Any, comm: Any, out: Any) -> tuple:
    """The cache key of `allreduce(x, op, algorithm, comm, out)`. A cached plan holds x, out and
    comm, so while it is cached no other object has their ids: a hit whose x still has the plan's
    dtype and shape is this call's plan (`api.allreduce` looks it up in line)."""
    return (id(x), id(out), id(comm), op, algorithm)


def cached_allreduce(x: Any, op: Any, algorithm: Any, comm: Any, out: Any) -> Plan | FlightPlan | None:
    """The cached plan of `allreduce(x, op, algorithm, comm, out)` (out given), or None."""
    return _cached(allreduce_key(x, op, algorithm, comm, out), x, out, comm, _allreduce_plan, x,
                   op, algorithm, comm, out, False, max_bytes=ALLREDUCE_CACHE_MAX_BYTES)


def cached_reduce_scatter(x: Any, op: Any, algorithm: Any, comm: Any,
                          in_place: bool) -> Plan | FlightPlan | None:
    """The cached plan of `reduce_scatter(x, op, algorithm, comm, in_place)`, or None."""
    return _cached(("reduce_scatter", id(x), id(comm), op, algorithm, bool(in_place)), x, None,
                   comm, _reduce_scatter_plan, x, op, algorithm, comm, in_place)


def cached_allgather(x: Any, algorithm: Any, comm: Any, count: Any, out: Any) -> Plan | FlightPlan | None:
    """The cached plan of `allgather(x, algorithm, comm, count, out)` (out given), or None."""
    return _cached(("allgather", id(x), id(out), id(comm), algorithm, count), x, out, comm,
                   _allgather_plan, x, algorithm, comm, count, out)


def cached_alltoall(x: Any, algorithm: Any, comm: Any, out: Any) -> Plan | FlightPlan | None:
    """The cached plan of `alltoall(x, comm, algorithm, out)` (out given), or None."""
    return _cached(("alltoall", id(x), id(out), id(comm), algorithm), x, out, comm,
                   _alltoall_plan, x, comm, algorithm, out, False)


#: the one-shot all-to-all's plans by communicator, algorithm, shape and dtype (`shaped_alltoall`),
#: each with its input array; shapes met once (a plan is made at the second call of a shape); and
#: the largest input they are kept for: above it the copies in and out cost more than they save
#: (docs/results/auto.md#one-shot-all-to-all-plans)
shaped: dict[tuple, tuple[Plan | FlightPlan, np.ndarray]] = {}
_shapes_seen: dict[tuple, None] = {}
SHAPED_MAX_BYTES = 256 << 10


def shaped_alltoall(x: Any, comm: Any, algorithm: Any) -> Any:
    """`alltoall(x, comm, algorithm)` run by a plan kept for x's shape and dtype on this
    communicator: x is copied into the plan's input and the result out of its output into a new
    array, so the checks, the layout and the messages' requests are made once per shape rather
    than once per call. None where no plan is kept (the caller then makes the one-shot call):
    not a NumPy array up to SHAPED_MAX_BYTES on an MPI communicator of more than one rank, or the
    first call of its shape."""
    if type(x) is not np.ndarray or x.nbytes > SHAPED_MAX_BYTES or type(algorithm) is not str:
        return None
    c = as_communicator(comm)
    key = (id(c), algorithm, x.shape, x.dtype)
    entry = shaped.get(key)
    if entry is None:
        if not isinstance(c, MPIComm) or c.size == 1:
            return None
        if key not in _shapes_seen:
            _evict(_shapes_seen)
            _shapes_seen[key] = None
            return None
        del _shapes_seen[key]
        source = np.empty(x.shape, x.dtype)
        entry = watched(_alltoall_plan(source, c, algorithm, np.empty_like(source), False)), source
        _evict(shaped)
        shaped[key] = entry
    plan, source = entry
    if plan.flight is not c.flight:
        plan = watched(plan)
        shaped[key] = plan, source
    np.copyto(source, x)
    return plan().copy()


def clear_cache() -> None:
    """Drop the ordinary calls' cached plans."""
    cache.clear()
    _seen.clear()
    shaped.clear()
    _shapes_seen.clear()


__all__ = ["Plan", "allreduce_init", "reduce_scatter_init", "allgather_init", "alltoall_init",
           "clear_cache", "shaped_alltoall"]
