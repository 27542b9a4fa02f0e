"""Every collective algorithm on the in-process world: p = 1..32, awkward counts, message logs.

The same algorithm code also runs over real MPI in tests/mpi.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from mpdl import backend, settings
from mpdl import collectives as C
from mpdl.backend import bfloat16, standin
from mpdl.comm import CollectiveTimeout
from mpdl.comm.base import background_is_awaited
from mpdl.comm.handles import CommThread
from mpdl.threadworld import ThreadWorld, run_world

OURS = [a for a in C.algorithms("allreduce") if a != "mpi"]
SIZES = list(range(1, 17)) + [24, 31, 32]


def counts(p: int) -> list[int]:
    return sorted({0, 1, max(p - 1, 0), p, p + 1, 13, 97})


def data(p: int, n: int, dtype=np.float64) -> list[np.ndarray]:
    rng = np.random.default_rng(p * 100 + n)
    return [rng.standard_normal(n).astype(dtype) for _ in range(p)]


@pytest.mark.parametrize("algorithm", OURS)
def test_allreduce_every_p_and_count(algorithm):
    for p in SIZES:
        for n in counts(p):
            xs = data(p, n)
            expected = np.sum(xs, axis=0) if n else np.zeros(0)
            results = run_world(p, lambda c: C.allreduce(xs[c.rank], algorithm=algorithm, comm=c),
                                ranks_per_node=4 if p > 4 else None)
            for r in results:
                np.testing.assert_allclose(r, expected, rtol=1e-12, atol=1e-12)
                assert r.tobytes() == results[0].tobytes(), f"p={p} n={n}: ranks differ"


@pytest.mark.parametrize("algorithm", OURS)
def test_allreduce_uneven_emulated_nodes(algorithm):
    for p, per_node in [(5, 2), (7, 3), (6, 4)]:
        xs = data(p, 101)
        results = run_world(p, lambda c: C.allreduce(xs[c.rank], op="max", algorithm=algorithm, comm=c),
                            ranks_per_node=per_node)
        for r in results:
            np.testing.assert_array_equal(r, np.max(xs, axis=0))


@pytest.mark.parametrize("collective", ["reduce_scatter", "allgather", "broadcast", "reduce"])
def test_other_collectives_every_p(collective):
    for algorithm in [a for a in C.algorithms(collective) if a != "mpi"]:
        for p in (1, 2, 3, 5, 8, 13):
            for n in counts(p):
                xs = data(p, n)
                root = p - 1
                if collective == "reduce_scatter":
                    res = run_world(p, lambda c: C.reduce_scatter(xs[c.rank], algorithm=algorithm, comm=c))
                    for r, block in zip(res, np.array_split(np.sum(xs, axis=0), p), strict=True):
                        np.testing.assert_allclose(r, block, rtol=1e-12, atol=1e-12)
                elif collective == "allgather":
                    res = run_world(p, lambda c: C.allgather(xs[c.rank], algorithm=algorithm, comm=c))
                    for r in res:
                        np.testing.assert_array_equal(r, np.concatenate(xs))
                elif collective == "broadcast":
                    res = run_world(p, lambda c: C.broadcast(xs[c.rank], root, algorithm=algorithm, comm=c))
                    for r in res:
                        np.testing.assert_array_equal(r, xs[root])
                else:
                    res = run_world(p, lambda c: C.reduce(xs[c.rank], root, algorithm=algorithm, comm=c))
                    np.testing.assert_allclose(res[root], np.sum(xs, axis=0), rtol=1e-12, atol=1e-12)
                    assert all(r is None for i, r in enumerate(res) if i != root)


def test_ring_schedule_is_the_textbook_one():
    p, n = 4, 4000
    xs = data(p, n, np.float32)
    _, log = run_world(p, lambda c: C.allreduce(xs[c.rank], algorithm="ring", comm=c),
                       message_log=True)
    for rank in range(p):
        sent = [m for m in log if m[2] == rank]
        assert {m[3] for m in sent} == {(rank + 1) % p}, "a ring rank only talks to its right"
        assert sum(m[4] for m in sent) == 2 * (p - 1) * (n // p) * 4


@pytest.mark.parametrize("algorithm", ["ring", "tree", "double_tree", "hierarchical", "torus2d"])
def test_allreduce_in_small_pipeline_segments(monkeypatch, algorithm):
    """Blocks longer than a segment travel in several messages, each reduced as it lands."""
    settings.update(segment_bytes=40)  # 5 float64 per segment
    for p in (2, 3, 4, 5):
        for n in (0, 1, p - 1, 13, 97):
            xs = data(p, n)
            results = run_world(p, lambda c: C.allreduce(xs[c.rank], algorithm=algorithm, comm=c),
                                ranks_per_node=2)
            for r in results:
                np.testing.assert_allclose(r, np.sum(xs, axis=0), rtol=1e-12, atol=1e-12)
    _, log = run_world(3, lambda c: C.allreduce(np.ones(97), algorithm="ring", comm=c),
                       message_log=True)
    # blocks of 33, 32 and 32 elements: 7 segments per reduce-scatter step, whole blocks after
    assert len(log) == 3 * (2 * 7 + 2) and max(m[4] for m in log) == 33 * 8
    assert sum(m[4] == 40 for m in log) == 3 * 2 * 6


def test_segment_size_setting_is_validated(monkeypatch):
    assert settings.current().segment_bytes >= 1
    for bad in ("1M", "0", "-4"):
        monkeypatch.setenv("MPDL_SEGMENT_BYTES", bad)
        with pytest.raises(ValueError, match="MPDL_SEGMENT_BYTES"):
            settings.Settings.from_environment()
    monkeypatch.setenv("MPDL_SEGMENT_BYTES", "4096")
    settings.use(None)
    assert settings.current().segment_bytes == 4096


def test_recursive_doubling_sends_lg_p_whole_buffers():
    p, n = 8, 100
    xs = data(p, n)
    _, log = run_world(p, lambda c: C.allreduce(xs[c.rank], algorithm="recursive_doubling", comm=c),
                       message_log=True)
    assert len(log) == p * 3 and all(m[4] == n * 8 for m in log)


def test_workspace_is_reused_across_calls():
    def twice(c):
        C.allreduce(np.ones(1000), algorithm="ring", comm=c)
        before = {k: id(v) for k, v in c._workspace.items()}
        C.allreduce(np.ones(1000), algorithm="ring", comm=c)
        return before == {k: id(v) for k, v in c._workspace.items()}

    assert all(run_world(3, twice))


def test_stand_in_device_arrays_reduce_on_the_device():
    xs = data(4, 50)

    def f(c):
        result = C.allreduce(standin.asarray(xs[c.rank]), algorithm="ring", comm=c)
        assert isinstance(result, standin.ndarray)
        return standin.asnumpy(result)

    for r in run_world(4, f):
        np.testing.assert_allclose(r, np.sum(xs, axis=0))


def test_a_missing_peer_times_out_naming_the_step(monkeypatch):
    monkeypatch.setenv("MPDL_TIMEOUT", "0.3")
    settings.use(None)

    def f(c):
        if c.rank == 1:
            return None  # never joins
        return C.allreduce(np.ones(8), algorithm="ring", comm=c)

    expected = r"allreduce/ring: rank [02] waited .* from rank [12] at step \d"
    with pytest.raises(CollectiveTimeout, match=expected):
        run_world(3, f)


def test_check_mode_catches_mismatched_dtypes(monkeypatch):
    monkeypatch.setenv("MPDL_CHECK", "1")
    settings.use(None)

    def f(c):
        return C.allreduce(np.ones(4, np.float32 if c.rank else np.float64), comm=c)

    with pytest.raises(ValueError, match="ranks disagree"):
        run_world(2, f)


def test_async_handles_complete_in_order():
    def f(c):
        handles = [C.allreduce_async(np.full(100, float(i)), algorithm="ring", comm=c) for i in range(5)]
        return [h.wait()[0] for h in handles]

    assert run_world(3, f) == [[0.0, 3.0, 6.0, 9.0, 12.0]] * 3


def test_a_thread_blocked_in_wait_is_seen_by_the_communication_thread():
    """While a caller waits on a handle, background waits know it (and so need not pause to leave
    the GIL to it); before and after, they do not."""
    thread = CommThread()
    release = threading.Event()

    def work():
        release.wait(10)
        deadline = time.monotonic() + 10
        while not background_is_awaited() and time.monotonic() < deadline:
            time.sleep(1e-3)
        return background_is_awaited()

    handle = thread.submit(work)
    before = background_is_awaited()
    release.set()
    assert handle.wait() is True
    assert before is False and background_is_awaited() is False
    done = thread.submit(lambda: 7)
    while not done.test():
        time.sleep(1e-3)
    assert done.wait() == 7 and background_is_awaited() is False  # a finished handle: no wait


def test_algorithms_lists_every_collective():
    assert "ring" in C.algorithms("allreduce") and "mpi" in C.algorithms("broadcast")
    with pytest.raises(ValueError, match="collective"):
        C.algorithms("scan")


def test_timeout_setting_is_validated(monkeypatch):
    monkeypatch.setenv("MPDL_TIMEOUT", "soon")
    settings.use(None)
    with pytest.raises(ValueError, match="MPDL_TIMEOUT"):
        run_world(1, lambda c: None)
    del os.environ["MPDL_TIMEOUT"]


def test_public_calls_accept_a_sub_communicator():
    def f(c):
        if c.rank % 2:
            return None
        evens = c.sub([r for r in range(c.size) if r % 2 == 0])
        return C.allreduce(np.full(3, float(c.rank)), algorithm="ring", comm=evens)

    results = run_world(5, f)
    for r in results[::2]:
        np.testing.assert_array_equal(r, np.full(3, 0.0 + 2 + 4))


def test_a_subcommunicator_allgathers_objects_among_its_members_only():
    """Odd and even ranks each gather their own objects (ZeRO's hybrid checkpoints need this)."""
    def body(comm):
        members = [r for r in range(comm.size) if r % 2 == comm.rank % 2]
        return comm.sub(members).allgather_object({"rank": comm.rank, "tail": "x" * comm.rank})

    out = run_world(5, body)
    assert out[0] == out[2] == out[4] == [{"rank": r, "tail": "x" * r} for r in (0, 2, 4)]
    assert out[1] == out[3] == [{"rank": r, "tail": "x" * r} for r in (1, 3)]


NARROW = ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
REDUCING = [(collective, a) for collective in ("allreduce", "reduce_scatter", "reduce")
            for a in C.algorithms(collective) if a != "mpi"]


def exactly_reducible(p: int, n: int, dtype: str, op: str) -> list[np.ndarray]:
    """p arrays of n narrow floats, random signs, whose float32 partial results are exact in any
    order: magnitudes in [2^-6, 8] for sums (at most 20 and 23 significant bits for p <= 8),
    significands of 3 bits for products (at most 24 bits)."""
    rng = np.random.default_rng(p * 100 + n)
    if op == "prod":
        values = rng.choice([0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0], size=(p, n))
    else:
        values = 2.0 ** rng.uniform(-6, 3, size=(p, n))
    values *= rng.choice([-1.0, 1.0], size=(p, n))
    return list(values.astype(backend.check_dtype(dtype)))


def rounded_once(xs: list[np.ndarray], op: str) -> np.ndarray:
    """The oracle: the float32 sum (product) in rank order, for avg divided by p in float32,
    rounded once into the narrow dtype."""
    acc = xs[0].astype(np.float32)
    for x in xs[1:]:
        acc = acc * x.astype(np.float32) if op == "prod" else acc + x.astype(np.float32)
    if op == "avg":
        acc = acc / np.float32(len(xs))
    return acc.astype(xs[0].dtype)


def words(x: np.ndarray) -> np.ndarray:
    return x.view(f"u{x.itemsize}")


@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize("collective,algorithm", REDUCING)
def test_narrow_float_results_are_the_float32_result_rounded_once(collective, algorithm, dtype):
    for p in (1, 2, 3, 4, 5, 8):
        for n in sorted({0, 1, p + 1, 13}):
            for op in ("sum", "avg", "prod"):
                xs = exactly_reducible(p, n, dtype, op)
                expected = rounded_once(xs, op)
                where = f"p={p} n={n} op={op}"
                if collective == "allreduce":
                    res = run_world(p, lambda c: C.allreduce(xs[c.rank], op=op, algorithm=algorithm,
                                                             comm=c),
                                    ranks_per_node=2 if p > 2 else None)
                elif collective == "reduce_scatter":
                    res = run_world(p, lambda c: C.reduce_scatter(xs[c.rank], op=op,
                                                                  algorithm=algorithm, comm=c))
                    res = [np.concatenate(res)]
                else:
                    res = run_world(p, lambda c: C.reduce(xs[c.rank], p - 1, op=op,
                                                          algorithm=algorithm, comm=c))[p - 1:]
                for r in res:
                    assert r.dtype == expected.dtype, where
                    np.testing.assert_array_equal(words(r), words(expected), err_msg=where)


@pytest.mark.parametrize("algorithm", OURS)
@pytest.mark.parametrize("p", [3, 4])
def test_sixteen_bit_sums_keep_what_per_hop_rounding_loses(algorithm, p):
    # 1 + 2^-8 rounds back to 1 in bfloat16 (a tie, to even): summed one by one in bfloat16 the
    # two halves of an ulp vanish, summed in float32 and rounded once they give 1 + 2^-7
    values = [1.0, 2.0**-8, 2.0**-8, 0.0][:p]
    xs = [np.full(5, v, dtype=bfloat16) for v in values]
    res = run_world(p, lambda c: C.allreduce(xs[c.rank], algorithm=algorithm, comm=c),
                    ranks_per_node=p)
    for r in res:
        np.testing.assert_array_equal(r.astype(np.float32), np.full(5, 1 + 2.0**-7, np.float32))


def test_narrow_sums_in_flight_keep_their_own_float32_buffers():
    """Asynchronous 16-bit sums queued on the communication thread, then a blocking one: each
    is its own float32 sum rounded once."""
    p, n = 3, 4099
    batches = [exactly_reducible(p, n + i, "bfloat16", "sum") for i in range(5)]

    def body(c):
        handles = [C.allreduce_async(xs[c.rank], algorithm="ring", comm=c) for xs in batches[:4]]
        blocking = C.allreduce(batches[4][c.rank], algorithm="tree", comm=c)
        return [h.wait() for h in handles] + [blocking]

    for results in run_world(p, body):
        for got, xs in zip(results, batches, strict=True):
            np.testing.assert_array_equal(words(got), words(rounded_once(xs, "sum")))


@pytest.mark.parametrize("round_per_hop", [False, True])
def test_a_sixteen_bit_ring_sends_float32_partials_unless_rounding_per_hop(monkeypatch,
                                                                          round_per_hop):
    """Rounded once, a bfloat16 ring all-reduce of n elements moves a float32 one's bytes,
    2(p-1)·n·4 over p ranks; MPDL_ROUND_PER_HOP=1 moves half of that and loses the half-ulps
    that a hop at a time round away (a binomial tree adds 1 + 2^-8 first: a tie, to 1)."""
    monkeypatch.setenv("MPDL_ROUND_PER_HOP", "1" if round_per_hop else "0")
    settings.use(None)
    try:
        p, n = 4, 100
        _, log = run_world(p, lambda c: C.allreduce(np.ones(n, bfloat16), algorithm="ring",
                                                    comm=c), message_log=True)
        assert sum(m[4] for m in log) == 2 * (p - 1) * n * (2 if round_per_hop else 4)
        xs = [np.full(5, v, dtype=bfloat16) for v in (1.0, 2.0**-8, 2.0**-8, 0.0)]
        res = run_world(p, lambda c: C.allreduce(xs[c.rank], algorithm="tree", comm=c))
        expected = 1.0 if round_per_hop else 1 + 2.0**-7
        for r in res:
            np.testing.assert_array_equal(r.astype(np.float32), np.full(5, expected, np.float32))
    finally:
        monkeypatch.delenv("MPDL_ROUND_PER_HOP")
        settings.use(None)


def test_stand_in_device_arrays_reduce_bfloat16():
    xs = exactly_reducible(3, 40, "bfloat16", "sum")

    def f(c):
        result = C.allreduce(standin.asarray(xs[c.rank]), algorithm="ring", comm=c)
        assert isinstance(result, standin.ndarray) and result.dtype == bfloat16
        return standin.asnumpy(result)

    for r in run_world(3, f):
        np.testing.assert_array_equal(words(r), words(rounded_once(xs, "sum")))



@pytest.mark.parametrize("p", [2, 3, 5])
def test_an_array_in_shared_memory_is_summed_where_it_lies(p, monkeypatch):
    """shm on a `shared_array` (whole, or a slice of one at the same place on every rank) gives
    every rank, in its own array, the bits the copying path gives for the same data, without that
    path; any count (0, 1, < p, prime, several in-place blocks), dtype and op (a 16-bit sum is
    reduced in a float32 copy, so float16 is checked with max only). Across nodes the copying
    path runs, with its bits."""
    from mpdl.collectives import shm

    counts = (0, 1, p - 1, 7919, 3 * shm.SHARED_BLOCK_BYTES // 4 + 5)
    data = [[np.random.default_rng(r + n).standard_normal(n).astype(d) * (1 + r)
             for r in range(p)] for n in counts for d in ("float16", "float32", "float64", "int32")]

    def ops(dtype):
        return ("max",) if dtype == np.float16 else ("sum", "max")

    def copying(comm):
        return [C.allreduce(xs[comm.rank], op=op, algorithm="shm", comm=comm).tobytes()
                for xs in data for op in ops(xs[0].dtype)]

    def in_place(comm, shared: bool):
        out = []
        for xs in data:
            n, dtype = xs[0].size, xs[0].dtype
            whole = shm.shared_array(comm, n + 6, dtype)
            assert not whole.any()
            for op in ops(dtype):
                got = []
                for a in (whole[:n], whole[3:n + 3]):
                    a[...] = xs[comm.rank]
                    assert shm.in_shared_memory(comm, a) == shared
                    assert C.allreduce(a, op=op, algorithm="shm", comm=comm, out=a) is a
                    got.append(a.tobytes())
                assert got[0] == got[1]
                out.append(got[0])
        return out

    across = run_world(p, lambda c: in_place(c, False), ranks_per_node=1)
    assert across == run_world(p, copying, ranks_per_node=1)
    expected = run_world(p, copying, ranks_per_node=p)
    calls = []
    real = shm._allreduce_chunk
    monkeypatch.setattr(shm, "_allreduce_chunk", lambda *a: (calls.append(a), real(*a)))
    assert run_world(p, lambda c: in_place(c, True), ranks_per_node=p) == expected
    assert calls == []


def test_a_failing_rank_is_what_the_world_reports_not_the_ranks_left_waiting():
    world = ThreadWorld(3)

    def body(comm):
        if comm.rank == 1:
            raise ValueError("rank 1 fails")
        comm.recv(np.empty(1), 1, step="never")  # waits for rank 1, which never sends

    with pytest.raises(ValueError, match="rank 1 fails") as caught:
        world.run(body, timeout=1.0)
    assert "ranks [0, 2] were left waiting" in caught.value.__notes__[0]


def test_a_hung_world_says_where_each_rank_waits():
    def body(comm):
        if comm.rank == 0:
            comm.recv(np.empty(1), 1, step="never")

    with pytest.raises(TimeoutError, match=r"ranks \[0\] did not finish within 1.0 s "
                                           r"\(rank 0 in test_collectives_threadworld.py:\d+ body > "
                                           r"base.py:\d+ recv > "):
        ThreadWorld(2).run(body, timeout=1.0)
