"""Persistent plans over real mpiexec: bit-identical to the one-shot calls, bound to their arrays."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from rankdata import local_data

from mpdl import collectives as C
from mpdl import tuning as T
from mpdl.comm import CollectiveTimeout, MPIComm, as_communicator
from mpdl.tuning import plan as plans
from mpdl.tuning.flightplan import FlightPlan

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
COUNTS = sorted({0, 1, max(P - 1, 0), P, P + 1, 7, 13, 31})
DTYPES = ["float16", "float32", "float64", "int32", "int64"]
OPS = ["sum", "prod", "max", "min", "avg"]


def same_bytes(a: np.ndarray, b: np.ndarray, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert a.tobytes() == b.tobytes(), f"{what}: plan and one-shot results differ"


def cases():
    for op in OPS:
        for dtype in DTYPES:
            if op == "avg" and not dtype.startswith("float"):
                continue
            yield op, dtype, 13
    for count in COUNTS:
        yield "sum", "float32", count


@pytest.mark.parametrize("algorithm", C.algorithms("allreduce"))
def test_allreduce_plans_match_the_one_shot_call_bit_for_bit(algorithm):
    for seed, (op, dtype, count) in enumerate(cases()):
        x = local_data(count, dtype, op, seed)
        out = np.empty_like(x)
        h = T.allreduce_init(x, op=op, algorithm=algorithm, out=out)
        for run in range(3):  # a plan runs again and again on the array's current values
            x[...] = local_data(count, dtype, op, seed + 100 * run)
            expected = C.allreduce(x, op=op, algorithm=algorithm)  # one-shot (out=None)
            before = x.copy()
            result = h() if run % 2 == 0 else h.start(x).wait()
            assert result is out
            same_bytes(result, expected, f"{algorithm} {op} {dtype} n={count} run {run}")
            np.testing.assert_array_equal(x, before, err_msg="input was modified")
        inplace = local_data(count, dtype, op, seed)
        expected = C.allreduce(inplace, op=op, algorithm=algorithm)
        g = T.allreduce_init(inplace, op=op, algorithm=algorithm, out=inplace)
        assert g() is inplace
        same_bytes(inplace, expected, f"{algorithm} {op} {dtype} n={count} in place")


@pytest.mark.parametrize("algorithm", C.algorithms("reduce_scatter"))
def test_reduce_scatter_plans_match_the_one_shot_call(algorithm):
    for op in ("sum", "max", "avg"):
        for count in COUNTS:
            x = local_data(count, "float64", op, seed=3)
            expected = C.reduce_scatter(x.copy(), op=op, algorithm=algorithm)
            h = T.reduce_scatter_init(x, op=op, algorithm=algorithm)
            same_bytes(h(), expected, f"{algorithm} {op} n={count}")
            same_bytes(h(), expected, f"{algorithm} {op} n={count} again")
            work = x.copy()
            g = T.reduce_scatter_init(work, op=op, algorithm=algorithm, in_place=True)
            same_bytes(g(), expected, f"{algorithm} {op} n={count} in place")


@pytest.mark.parametrize("algorithm", C.algorithms("allgather"))
def test_allgather_plans_match_the_one_shot_call(algorithm):
    for count in COUNTS:
        if algorithm == "mpi" and count % P:
            continue  # MPI_Allgather: equal blocks only
        block = np.array_split(np.arange(count, dtype=np.int64) * 7 + 1, P)[RANK].copy()
        out = np.empty(count, np.int64)
        h = T.allgather_init(block, algorithm=algorithm, count=count, out=out)
        assert h() is out
        np.testing.assert_array_equal(out, np.arange(count) * 7 + 1)
        x = local_data(count, "float32", "sum", seed=4)
        same_bytes(T.allgather_init(x, algorithm=algorithm)(), C.allgather(x, algorithm=algorithm),
                   f"{algorithm} n={count}")


def test_a_plan_refuses_another_array_on_every_rank():
    x = np.ones(5, np.float32)
    h = T.allreduce_init(x, algorithm="recursive_doubling", out=np.empty_like(x))
    with pytest.raises(ValueError, match="x: this allreduce plan was made for another array"):
        h.start(np.ones(5, np.float32))
    with pytest.raises(ValueError, match="another array"):
        h(x.copy())
    x.shape = (5, 1)  # the plan's array, reshaped in place
    with pytest.raises(ValueError, match="x: the plan's array changed"):
        h(x)
    with pytest.raises(RuntimeError, match="before start"):
        h.wait()
    x.shape = (5,)
    np.testing.assert_array_equal(h(x), np.full(5, P, np.float32))  # nothing left in flight


def test_bad_arguments_raise_when_the_plan_is_made():
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="op"):
        T.allreduce_init(np.ones(4, np.int32), op="avg")
    with pytest.raises(ValueError, match="algorithm"):
        T.allreduce_init(x, algorithm="butterfly")
    with pytest.raises(ValueError, match="out"):
        T.allreduce_init(x, out=np.empty(5, np.float32))
    with pytest.raises(ValueError, match="count"):
        T.allgather_init(x, count=-1)
    with pytest.raises(ValueError, match="in_place"):
        T.reduce_scatter_init(np.ones((2, 2)), in_place=True)


@pytest.mark.parametrize("algorithm", ["mpi", "recursive_doubling", "ring", "tree", "auto"])
def test_the_cache_gives_right_results_for_other_arrays_of_the_same_shape(algorithm):
    plans.clear_cache()
    xs = [local_data(11, "float64", "sum", seed=s) for s in range(3)]
    outs = [np.empty(11), np.empty(11)]
    for i in range(6):
        x, out = xs[i % 3], outs[i % 2]
        x += 1.0  # new values every call
        expected = C.allreduce(x, algorithm=algorithm)
        assert C.allreduce(x, algorithm=algorithm, out=out) is out
        same_bytes(out, expected, f"call {i}")
    # an array that replaces a cached one (same id possible once the old one is gone)
    for _ in range(3):
        y = local_data(11, "float64", "sum", seed=9)
        same_bytes(C.allreduce(y, algorithm=algorithm, out=y.copy()),
                   C.allreduce(y, algorithm=algorithm), "fresh array")
    assert len(plans.cache) <= plans.CACHE_PLANS


def test_the_flight_recorder_keeps_planned_calls():
    comm = as_communicator(None)
    if comm.flight is None:
        pytest.skip("the flight recorder is off")
    x = np.ones(6, np.float32)
    h = T.allreduce_init(x, op="max", algorithm="recursive_doubling", out=np.empty_like(x))
    first = comm.flight.next_seq(comm.flight_group())
    h()
    h.start().wait()
    records = comm.flight.records()[-2:]
    assert [r["seq"] for r in records] == [first, first + 1]
    for r in records:
        assert (r["collective"], r["algorithm"], r["bytes"], r["dtype"], r["op"], r["state"]) == \
            ("allreduce", "recursive_doubling", 24, "float32", "max", "done")
        assert r["peers"] == tuple(range(P)) and r["end"] >= r["start"]


def test_one_shot_planned_and_cached_calls_write_the_same_entries():
    """allreduce(out=) and alltoall: the one-shot call, then a plan made, then the cached plan
    (FlightPlans over MPI's fast schedules); plans made while the recorder is off run bare."""
    comm = as_communicator(None)
    recorder = comm.flight
    if recorder is None:
        pytest.skip("the flight recorder is off")
    group = comm.flight_group()
    y, o, a = np.arange(7.0), np.empty(7), np.ones((P, 3), np.float32)
    first = recorder.next_seq(group)
    for _ in range(3):
        C.allreduce(y, algorithm="ring", out=o)
    for _ in range(3):
        C.alltoall(a, algorithm="pairwise")
    records = recorder.records()[-6:]
    assert [r["seq"] for r in records] == list(range(first, first + 6))
    assert [(r["collective"], r["algorithm"], r["bytes"], r["dtype"], r["op"], r["state"])
            for r in records] == [("allreduce", "ring", 56, "float64", "sum", "done")] * 3 + \
        [("alltoall", "pairwise", 12 * P, "float32", None, "done")] * 3
    assert type(plans.cache[plans.allreduce_key(y, "sum", "ring", None, o)]) is FlightPlan
    wrapped = T.allreduce_init(y, algorithm="recursive_doubling", out=np.empty_like(y))
    comm.flight = None
    try:
        bare = T.allreduce_init(y, algorithm="recursive_doubling", out=np.empty_like(y))
    finally:
        comm.flight = recorder
    assert type(wrapped) is FlightPlan and type(bare) is plans.Plan
    assert wrapped().tobytes() == bare().tobytes() == (y * P).tobytes()
    assert recorder.next_seq(group) == first + 7  # the bare plan's run took no number


# -- persistent point-to-point requests --------------------------------------------------------
P2P_SHAPES = [(0,), (1,), (9,), (3, 5), (2, 3, 40)]


def needs_two():
    if P < 2:
        pytest.skip("point to point needs 2 ranks")


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64"])
def test_persistent_sends_and_receives_deliver_each_start(dtype):
    """Every rank sends to the right and receives from the left, 5 starts per shape, new values
    each time; the sends and receives are persistent MPI requests."""
    needs_two()
    comm = as_communicator(COMM)
    right, left = (RANK + 1) % P, (RANK - 1) % P
    for k, shape in enumerate(P2P_SHAPES):
        out, into = np.empty(shape, dtype), np.empty(shape, dtype)
        send, recv = comm.send_init(out, right, step=k), comm.recv_init(into, left, step=k)
        assert send.persistent is not None and recv.persistent is not None
        for n in range(5):
            out[...] = (np.arange(out.size).reshape(shape) + 1000 * RANK + 10 * n).astype(dtype)
            comm.waitall([recv.start(), send.start()])
            expected = (np.arange(out.size).reshape(shape) + 1000 * left + 10 * n).astype(dtype)
            assert into.tobytes() == expected.tobytes(), f"shape {shape} start {n}"
        send.free()
        recv.free()
        assert send.persistent is None and recv.persistent is None


def test_a_persistent_request_started_twice_raises():
    needs_two()
    comm = as_communicator(COMM)
    buf = np.zeros(3)
    if RANK == 0:
        send = comm.send_init(buf, 1, step="twice")
        send.start()
        with pytest.raises(RuntimeError, match=r"persistent send to rank 1 \(step twice\) "
                                               r"started again before a wait"):
            send.start()
        comm.waitall([send])
    elif RANK == 1:
        recv = comm.recv_init(buf, 0, step="twice")
        recv.start()
        with pytest.raises(RuntimeError, match="persistent recv from rank 0"):
            recv.start()
        comm.waitall([recv])
    COMM.Barrier()


def test_persistent_requests_on_a_sub_communicator_and_staged_device_arrays():
    needs_two()
    from mpdl.backend import standin  # noqa: PLC0415

    comm = as_communicator(COMM)
    sub = comm.sub(list(range(P))[::-1])  # sub rank 0 is the last world rank
    host = np.full(6, float(RANK))
    device = standin.asarray(np.full(4, float(RANK)))
    right, left = (sub.rank + 1) % P, (sub.rank - 1) % P
    reqs = [sub.send_init(host.copy(), right, "h"), sub.recv_init(host, left, "h"),
            sub.send_init(standin.asarray(np.full(4, float(RANK))), right, "d"),
            sub.recv_init(device, left, "d")]
    assert reqs[2].persistent is None  # a staged device array posts ordinary staged messages
    for _ in range(3):
        sub.waitall([r.start() for r in reqs])
    sender = sub.ranks[left]
    assert host.tolist() == [float(sender)] * 6
    assert standin.asnumpy(device).tolist() == [float(sender)] * 4


def test_a_persistent_receive_times_out_naming_the_peer_and_completes_later():
    needs_two()
    comm = as_communicator(COMM)
    buf = np.zeros(4)
    if RANK == 0:
        recv = comm.recv_init(buf, 1, step=("act", 2))
        recv.start()
        timeout, comm.timeout = comm.timeout, 0.3
        try:
            with pytest.raises(CollectiveTimeout, match=r"waited more than 0.3 s receiving from "
                                                        r"rank 1 at step \('act', 2\)"):
                comm.waitall([recv])
        finally:
            comm.timeout = timeout
        COMM.Barrier()
        comm.waitall([recv])  # the send comes after the barrier
        assert buf.tolist() == [1.0] * 4
    else:
        COMM.Barrier()
        if RANK == 1:
            comm.send(np.ones(4), 0)


def test_the_compiled_wait_is_bounded_and_completes_later():
    """A persistent receive polled in compiled code: with nothing sent the wait gives up after its
    polls (no hang); after the send it completes and the data has landed."""
    needs_two()
    from mpdl.comm import polling  # noqa: PLC0415

    buf = np.zeros(5)
    if RANK == 0:
        recv = COMM.Recv_init([buf, MPI.BYTE], 1, 91)
        recv.Start()
        wait = polling.compiled_wait([recv])
        assert wait is not None, "no compiled wait over this MPI library"
        assert wait(2000, 1) is False
        COMM.Barrier()
        for _ in range(1000):
            if wait(1 << 16, 64):
                break
        else:
            pytest.fail("the compiled wait never saw the receive complete")
        assert buf.tolist() == [7.0] * 5
        recv.Free()
    else:
        COMM.Barrier()
        if RANK == 1:
            COMM.Send([np.full(5, 7.0), MPI.BYTE], 0, 91)


def test_the_compiled_exchange_starts_copies_and_waits():
    """One compiled call starts persistent requests (a ring: right and left), copies a block
    while they travel and waits: each of several runs delivers new values and the copy."""
    needs_two()
    from mpdl.comm import polling  # noqa: PLC0415

    out, into = np.zeros(7), np.zeros(7)
    src, dst = np.zeros(5), np.zeros(5)
    reqs = [COMM.Recv_init([into, MPI.BYTE], (RANK - 1) % P, 92),
            COMM.Send_init([out, MPI.BYTE], (RANK + 1) % P, 92)]
    run = polling.compiled_exchange(reqs, dst, src)
    wait = polling.compiled_wait(reqs)
    assert run is not None and wait is not None, "no compiled exchange over this MPI library"
    assert polling.compiled_exchange(reqs, np.zeros(4), src) is None  # sizes differ
    for k in range(3):
        out[:] = 100 * RANK + k
        src[:] = np.arange(5) + 10 * k
        done = run(1 << 16, 1)
        for _ in range(1000):
            if done:
                break
            done = wait(1 << 16, 64)
        assert done, f"run {k} never completed"
        assert into.tolist() == [100.0 * ((RANK - 1) % P) + k] * 7
        assert dst.tolist() == (np.arange(5) + 10 * k).tolist()
    for r in reqs:
        r.Free()


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])  # replayed schedules
def test_plans_run_many_times_wait_in_compiled_code_bit_for_bit(algorithm, monkeypatch):
    """From its COMPILED_AFTER-th run a plan's steps wait in compiled code; every run still
    matches the one-shot call bit for bit (new values each run, awkward counts)."""
    needs_two()
    from mpdl.comm import polling  # noqa: PLC0415

    made = []

    def counting(requests):
        wait = real(requests)
        made.append(wait is not None)
        return wait

    real = polling.compiled_wait
    monkeypatch.setattr(polling, "compiled_wait", counting)
    # a communicator of its own: an earlier test's strategy may have left a message log on
    # the world's (ZeRO counts its bytes there), and plans do not run their schedules then
    comm = MPIComm(COMM.Dup())
    for count in (1, P + 1, 31):
        x = local_data(count, "float32", "sum", count)
        h = T.allreduce_init(x, algorithm=algorithm, comm=comm, out=np.empty_like(x))
        for run in range(plans.COMPILED_AFTER + 3):
            x[...] = local_data(count, "float32", "sum", 7 * run + count)
            same_bytes(h(), C.allreduce(x, algorithm=algorithm, comm=comm),
                       f"{algorithm} n={count} run {run}")
        h.free()
    assert made and all(made), "the plans never waited in compiled code"

