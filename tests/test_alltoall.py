"""The all-to-all family on the in-process world: every algorithm, p = 1..9, awkward counts, every
dtype, in place and not, varying counts with zeros, persistent and asynchronous calls, bad input.

The expected results are NumPy transpositions of the inputs (block j of rank i lands as block i
of rank j); tests/mpi/test_alltoall.py compares the same algorithms with MPI_Alltoall(v).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from mpdl import collectives as C
from mpdl import emulation
from mpdl import tuning as T
from mpdl.threadworld import run_world
from mpdl.tuning import auto
from mpdl.tuning import costmodel as cm

OURS = [a for a in C.algorithms("alltoall") if a != "mpi"]
DTYPES = ["float16", "float32", "float64", "int32", "int64"]


def inputs(p: int, block: int, dtype: str = "float64", tail: tuple = ()) -> list[np.ndarray]:
    """Rank r's x: p blocks of `block` rows, random bits (every bit pattern must arrive)."""
    rng = np.random.default_rng(1000 * p + block)
    item = np.dtype(dtype).itemsize
    shape = (p, block, *tail)
    return [rng.integers(0, 256, int(np.prod(shape)) * item, dtype=np.uint8).view(dtype)
            .reshape(shape) for _ in range(p)]


def expected(xs: list[np.ndarray], rank: int) -> np.ndarray:
    return np.stack([x[rank] for x in xs])


def assert_bits(result: np.ndarray, want: np.ndarray) -> None:
    assert result.dtype == want.dtype and result.shape == want.shape
    assert result.tobytes() == want.tobytes()


def ranks_per_node(p: int) -> int | None:
    """Emulated nodes of 2 ranks (uneven at odd p) from p = 3 on: hierarchical's two levels."""
    return 2 if p >= 3 else None


@pytest.mark.parametrize("algorithm", OURS)
def test_alltoall_every_p_and_count(algorithm):
    for p in range(1, 10):
        for block in (0, 1, 7):
            xs = inputs(p, block)
            for in_place in (False, True):
                def call(c, in_place=in_place):
                    x = xs[c.rank].copy()
                    result = C.alltoall(x, comm=c, algorithm=algorithm,
                                        out=x if in_place else None)
                    assert (result is x) == in_place
                    if not in_place:
                        assert_bits(x, xs[c.rank])  # the input is left alone
                    return result

                for r, result in enumerate(run_world(p, call, ranks_per_node=ranks_per_node(p))):
                    assert_bits(result, expected(xs, r))


@pytest.mark.parametrize("algorithm", OURS)
def test_alltoall_every_dtype_and_multidimensional_blocks(algorithm):
    for dtype in DTYPES:
        for p in (3, 4, 5):
            xs = inputs(p, 3, dtype, tail=(2,))
            out = run_world(p, lambda c: C.alltoall(xs[c.rank], comm=c, algorithm=algorithm),
                            ranks_per_node=2)
            for r, result in enumerate(out):
                assert_bits(result, expected(xs, r))


def v_inputs(p: int, seed: int, dtype: str = "float32", zeros: float = 0.3):
    """(counts[i][j]: rows rank i sends rank j, with zeros: from p = 3 on, rank 1 sends nothing
    and rank 2 receives nothing; each rank's rows of 3 values)."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 6, (p, p)) * (rng.random((p, p)) > zeros)
    if p > 2:
        counts[1, :] = 0
        counts[:, 2] = 0
    rows = [rng.integers(-99, 99, (int(counts[i].sum()), 3)).astype(dtype) for i in range(p)]
    return counts, rows


def v_expected(counts, rows, rank: int) -> np.ndarray:
    parts = [np.split(rows[i], np.cumsum(counts[i])[:-1])[rank] for i in range(len(rows))]
    return np.concatenate(parts)


@pytest.mark.parametrize("algorithm", [*OURS, "auto"])
def test_alltoallv_uneven_counts_with_zeros(algorithm):
    for p in range(1, 10):
        counts, rows = v_inputs(p, p)

        def call(c, counts=counts, rows=rows):
            return C.alltoallv(rows[c.rank], counts[c.rank], comm=c, algorithm=algorithm)

        for r, (result, got) in enumerate(run_world(p, call, ranks_per_node=ranks_per_node(p))):
            assert got == [int(v) for v in counts[:, r]]
            assert_bits(result, v_expected(counts, rows, r))


@pytest.mark.parametrize("algorithm", OURS)
def test_alltoallv_with_known_recv_counts_every_dtype(algorithm):
    for dtype in DTYPES:
        p = 4
        counts, rows = v_inputs(p, 7, dtype)

        def call(c, counts=counts, rows=rows):
            return C.alltoallv(rows[c.rank], list(counts[c.rank]), comm=c, algorithm=algorithm,
                               recv_counts=counts[:, c.rank])

        for r, (result, got) in enumerate(run_world(p, call, ranks_per_node=2)):
            assert got == [int(v) for v in counts[:, r]]
            assert_bits(result, v_expected(counts, rows, r))


def errors_on_every_rank(p: int, call) -> list[str]:
    """Each rank's ValueError message (a rank that raised nothing fails the test)."""
    def body(c):
        try:
            call(c)
        except ValueError as exc:
            return str(exc)
        return None

    messages = run_world(p, body)
    assert all(m is not None for m in messages), messages
    return messages


def test_alltoall_first_axis_must_be_the_world_size():
    for algorithm in [*OURS, "auto"]:
        messages = errors_on_every_rank(
            3, lambda c, a=algorithm: C.alltoall(np.ones((4, 2)), comm=c, algorithm=a))
        assert all("x: expected a first axis of length 3" in m for m in messages)
    messages = errors_on_every_rank(2, lambda c: C.alltoall(np.float64(1.0), comm=c))
    assert all("x: expected a first axis of length 2" in m for m in messages)
    messages = errors_on_every_rank(
        2, lambda c: C.alltoall(np.ones((2, 3)), comm=c, out=np.ones((2, 4))))
    assert all(m.startswith("out:") for m in messages)


@pytest.mark.parametrize("algorithm", [*OURS, "auto"])
def test_alltoallv_bad_counts_on_one_rank_raise_on_every_rank(algorithm):
    p = 3
    good = [1, 2, 0]
    bad = {"sum": ([1, 1, 0], "send_counts: expected counts adding up to x's 3 rows"),
           "negative": ([4, -1, 0], "send_counts: expected row counts >= 0"),
           "length": ([1, 2], "send_counts: expected 3 row counts (one per rank), got 2"),
           "type": ([1.0, 2, 0], "send_counts: expected integer row counts")}
    for counts, own in bad.values():
        def call(c, counts=counts):
            x = np.arange(6.0).reshape(3, 2)
            return C.alltoallv(x, counts if c.rank == 1 else good, comm=c, algorithm=algorithm)

        messages = errors_on_every_rank(p, call)
        assert messages[1].startswith(own), messages[1]
        for r in (0, 2):
            assert messages[r].startswith("send_counts: rank 1 passed counts"), messages[r]
    # the world still works afterwards: nothing was left in flight
    out = run_world(p, lambda c: C.alltoallv(np.arange(6.0).reshape(3, 2), good, comm=c,
                                             algorithm=algorithm))
    assert [got for _, got in out] == [[1, 1, 1], [2, 2, 2], [0, 0, 0]]


def test_alltoallv_recv_counts_that_do_not_match_raise_on_every_rank():
    def call(c):
        theirs = [1, 1, 1] if c.rank != 2 else [1, 1, 2]
        return C.alltoallv(np.arange(3.0), [1, 1, 1], comm=c, recv_counts=theirs)

    messages = errors_on_every_rank(3, call)
    assert messages[2].startswith("recv_counts: the ranks send this one [1, 1, 1] rows")
    assert messages[0].startswith("recv_counts: rank(s) [2] passed counts")
    messages = errors_on_every_rank(
        2, lambda c: C.alltoallv(np.arange(2.0), [1, 1], comm=c, recv_counts=[1, -1]))
    assert all(m.startswith("recv_counts: expected row counts >= 0") for m in messages)


def test_unknown_algorithm_names_the_choices():
    with pytest.raises(ValueError, match="algorithm: expected 'auto' or one of pairwise"):
        run_world(2, lambda c: C.alltoall(np.ones(2), comm=c, algorithm="ring"))


@pytest.mark.parametrize("algorithm", OURS)
def test_persistent_plan_runs_again_on_new_values_in_place_and_not(algorithm):
    p = 5
    rounds = [inputs(p, 3, "int64"), inputs(p, 4, "int64")[:p]]
    rounds[1] = [x[:, :3].copy() for x in rounds[1]]

    def body(c):
        x = rounds[0][c.rank].copy()
        plan = T.alltoall_init(x, comm=c, algorithm=algorithm)
        held = x.copy()
        in_place = T.alltoall_init(held, comm=c, algorithm=algorithm, out=held)
        results = []
        for values in rounds:
            x[...] = values[c.rank]
            held[...] = values[c.rank]
            results.append((plan().copy(), in_place.start().wait().copy()))
        return results

    out = run_world(p, body, ranks_per_node=2)
    for r in range(p):
        for k, values in enumerate(rounds):
            assert_bits(out[r][k][0], expected(values, r))
            assert_bits(out[r][k][1], expected(values, r))


def test_async_handles_complete_in_issue_order():
    p = 4
    rounds = [inputs(p, k) for k in (1, 2, 3)]

    def body(c):
        handles = [C.alltoall_async(xs[c.rank], comm=c, algorithm=a)
                   for xs, a in zip(rounds, ["pairwise", "bruck", "auto"], strict=True)]
        blocking = C.alltoall(rounds[0][c.rank], comm=c, algorithm="scattered")
        return [h.wait() for h in handles], blocking

    for r, (results, blocking) in enumerate(run_world(p, body)):
        for xs, result in zip(rounds, results, strict=True):
            assert_bits(result, expected(xs, r))
        assert_bits(blocking, expected(rounds[0], r))


def test_repeated_calls_with_out_run_a_cached_plan_with_the_same_bytes():
    p = 3
    xs = inputs(p, 5)

    def body(c):
        x, out = xs[c.rank].copy(), np.empty_like(xs[c.rank])
        return [C.alltoall(x, comm=c, algorithm="pairwise", out=out).copy() for _ in range(3)]

    for r, results in enumerate(run_world(p, body)):
        for result in results:
            assert_bits(result, expected(xs, r))


def test_hierarchical_nodes_need_not_be_consecutive_ranks(monkeypatch):
    """Nodes {0, 2, 4}, {1, 3}: the blocks of a node are not back to back in the buffers."""
    from mpdl.threadworld import ThreadComm

    monkeypatch.setattr(ThreadComm, "node_of_rank", lambda self: [r % 2 for r in range(self.size)])
    for p in (4, 5):
        xs = inputs(p, 3)
        out = run_world(p, lambda c: C.alltoall(xs[c.rank], comm=c, algorithm="hierarchical"))
        for r, result in enumerate(out):
            assert_bits(result, expected(xs, r))
        counts, rows = v_inputs(p, 11)
        out = run_world(p, lambda c: C.alltoallv(rows[c.rank], counts[c.rank], comm=c,
                                                 algorithm="hierarchical"))
        for r, (result, _) in enumerate(out):
            assert_bits(result, v_expected(counts, rows, r))


def test_hierarchical_sends_one_message_per_node_pair_across_nodes():
    p, per_node = 8, 2
    x = np.ones((p, 16), np.float32)
    _, log = run_world(p, lambda c: C.alltoall(x, comm=c, algorithm="hierarchical"),
                       ranks_per_node=per_node, message_log=True)
    across = [(src, dst, n) for _, _, src, dst, n in log
              if src // per_node != dst // per_node]
    nodes = p // per_node
    assert len(across) == nodes * (nodes - 1)
    assert {n for _, _, n in across} == {per_node * per_node * 16 * 4}
    _, direct = run_world(p, lambda c: C.alltoall(x, comm=c, algorithm="pairwise"),
                          ranks_per_node=per_node, message_log=True)
    assert sum(src // 2 != dst // 2 for _, _, src, dst, _ in direct) == p * (p - per_node)


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_bruck_takes_ceil_lg_p_steps_of_about_half_the_blocks(p):
    block = 4
    x = np.ones((p, block), np.float64)
    _, log = run_world(p, lambda c: C.alltoall(x, comm=c, algorithm="bruck"), message_log=True)
    steps = (p - 1).bit_length()
    for rank in range(p):
        sent = [m for m in log if m[2] == rank]
        assert len(sent) == steps
        distances = sorted((dst - rank) % p for _, _, _, dst, _ in sent)
        assert distances == [1 << k for k in range(steps)]
        moved = sum(sum(1 for i in range(p) if i & (1 << k)) for k in range(steps))
        assert sum(m[4] for m in sent) == moved * block * 8


def test_pairwise_partners_are_xor_for_powers_of_two_else_shifts():
    from mpdl.collectives.pairwise import partners

    assert [partners(5, 8, i) for i in (1, 2, 3)] == [(4, 4), (7, 7), (6, 6)]
    assert [partners(1, 5, i) for i in (1, 2, 4)] == [(2, 0), (3, 4), (0, 2)]


@pytest.mark.parametrize("algorithm", OURS)
def test_device_arrays_stay_on_the_device(algorithm):
    from mpdl.backend import standin

    p = 5
    xs = inputs(p, 3)
    counts, rows = v_inputs(p, 5)

    def body(c):
        result = C.alltoall(standin.asarray(xs[c.rank]), comm=c, algorithm=algorithm)
        received, _ = C.alltoallv(standin.asarray(rows[c.rank]), counts[c.rank], comm=c,
                                  algorithm=algorithm)
        assert isinstance(result, standin.ndarray) and isinstance(received, standin.ndarray)
        return standin.asnumpy(result), standin.asnumpy(received)

    for r, (result, received) in enumerate(run_world(p, body, ranks_per_node=2)):
        assert_bits(result, expected(xs, r))
        assert_bits(received, v_expected(counts, rows, r))


# -- the cost model and auto ---------------------------------------------------------------------
TEXTBOOK = cm.Params(alpha=10e-6, beta=1e-9, copy=0.0, copy_cached=0.0, call=0.0)


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_pairwise_and_bruck_predictions_are_the_textbook_formulas(p):
    n = 4096 * p  # bytes each rank sends in all
    pairwise = (p - 1) * 10e-6 + n * (p - 1) / p * 1e-9
    assert cm.predict("alltoall", "pairwise", n, p, 1, TEXTBOOK) == pytest.approx(pairwise)
    steps = math.ceil(math.log2(p))
    moved = sum(sum(1 for i in range(p) if i & (1 << k)) for k in range(steps)) * n / p
    bruck = steps * 10e-6 + moved * 1e-9
    assert cm.predict("alltoall", "bruck", n, p, 1, TEXTBOOK) == pytest.approx(bruck)
    if p & (p - 1) == 0:  # every step moves half the blocks: (n/2)·lg p·β
        assert moved == pytest.approx(n / 2 * steps)


def test_hierarchical_prediction_is_its_derived_formula():
    slow = replace(TEXTBOOK, alpha_inter=50e-6, beta_inter=1e-8)
    p, g, n = 8, 2, 1 << 16
    m, b = p // g, n / p
    k = math.ceil((m - 1) / g)
    derived = ((g - 1) * (10e-6 + b * 1e-9) + 2 * (m - 1) * (10e-6 + (g - 1) * b * 1e-9)
               + k * (50e-6 + g * g * b * 1e-8))
    assert cm.predict("alltoall", "hierarchical", n, p, m, slow) == pytest.approx(derived)
    # across nodes it sends k messages per rank where pairwise sends p - g: it wins when they
    # are expensive, and stays out of the way on one node
    assert cm.predict("alltoall", "hierarchical", 64 * p, p, m, slow) < cm.predict(
        "alltoall", "pairwise", 64 * p, p, m, slow)


@pytest.mark.parametrize("algorithm", ["pairwise", "bruck", "scattered"])
@pytest.mark.parametrize("p", [2, 4, 5, 8])
def test_latency_terms_count_the_messages_of_the_message_log(algorithm, p):
    """With α = 1 and nothing else the prediction counts messages: the busiest rank's in the
    message log for the algorithms that wait for each one (pairwise, Bruck); one per batch
    plus POST_SHARE for each other message for scattered."""
    x = np.ones((p, 8), np.float32)
    _, log = run_world(p, lambda c: C.alltoall(x, comm=c, algorithm=algorithm),
                       message_log=True)
    sent = max(Counter(src for _, _, src, _, _ in log).values())
    alpha_only = cm.predict("alltoall", algorithm, x.nbytes, p, 1,
                            cm.Params(alpha=1.0, beta=0.0, copy=0.0, copy_cached=0.0, call=0.0))
    if algorithm == "scattered":
        assert alpha_only == pytest.approx(1 + cm.POST_SHARE * (sent - 1))
    else:
        assert alpha_only == sent


def test_scattered_posting_share_is_of_the_calibrated_message_latency():
    """With a measured exchange curve (latency 100 us) and a larger scalar α (a calibration on a
    busy machine: 250 us), a posting costs POST_SHARE of the curve's latency, as the messages of
    Bruck and pairwise are timed by the curve: at 4 ranks scattered's one latency and two postings
    are then 2 latencies, as Bruck's two steps, not 1 + 2.5 (which made Bruck look faster)."""
    latency = 100e-6
    params = cm.Params(alpha=250e-6, beta=0.0, copy=0.0, copy_cached=0.0, call=0.0,
                       exchange=((8.0, latency), (1 << 20, latency)))
    scattered = cm.predict("alltoall", "scattered", 4 * 8, 4, 1, params)
    assert scattered == pytest.approx(latency * (1 + 2 * cm.POST_SHARE))
    assert scattered == pytest.approx(cm.predict("alltoall", "bruck", 4 * 8, 4, 1, params))


def test_mpi_prediction_follows_mpichs_switch_points():
    native = cm.Params(alpha=10e-6, beta=1e-9, copy=0.0, copy_cached=0.0, call=0.0,
                       alpha_native=10e-6)
    for p in (4, 8):
        for per_destination in (64, 256, 257, 32768, 32769):
            n = per_destination * p
            if per_destination <= 256 and p >= 8:
                twin = "bruck"
            elif per_destination <= 32768:
                twin = "scattered"
            else:
                twin = "pairwise"
            assert cm.predict("alltoall", "mpi", n, p, 1, native) == pytest.approx(
                cm.predict("alltoall", twin, n, p, 1, native)), (p, per_destination)
            assert auto.simple_choice("alltoall", n, p, 1, False) == twin


def test_auto_chooses_few_steps_for_small_blocks_at_many_ranks_and_never_the_baseline():
    params = cm.Params()
    assert cm.fastest("alltoall", 8 * 16, 16, 1, False, params) == "bruck"
    for p in (2, 4, 5, 8):
        for per_destination in (8, 256, 4096, 1 << 20):
            assert cm.fastest("alltoall", per_destination * p, p, 1, False, params) != "mpi"
    # a large block is never forwarded: Bruck's (n/2)·lg p bytes lose to p-1 direct messages
    assert cm.fastest("alltoall", (16 << 20) * 16, 16, 1, False, params) != "bruck"
    slow = params.emulated(emulation.parse("inter=10Gbit/s,20us"))
    assert cm.fastest("alltoall", 64 * 16, 16, 4, False, slow) == "hierarchical"
