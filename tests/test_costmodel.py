"""The cost model, auto's choice, the parameter file, link emulation and the bench helpers."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from mpdl import collectives as C
from mpdl import emulation, settings
from mpdl.collectives import registry
from mpdl.perf import bench
from mpdl.perf.bench import bus_factor
from mpdl.perf.units import parse_size
from mpdl.threadworld import run_world
from mpdl.tuning import auto
from mpdl.tuning import costmodel as cm

ZERO = cm.Params(alpha=0.0, beta=0.0, gamma=0.0, copy=0.0, barrier=0.0, call=0.0, alpha_native=0.0)
SIZES = [0, 8, 1000, 1 << 16, 1 << 20, 1 << 26]


@pytest.fixture(autouse=True)
def _isolated_model(tmp_path, monkeypatch):
    monkeypatch.setenv("MPDL_COST_MODEL", str(tmp_path / "model.json"))
    monkeypatch.delenv("MPDL_EMULATE", raising=False)
    settings.use(None)
    auto.forget()
    yield
    auto.forget()


@pytest.mark.parametrize("collective", registry.COLLECTIVES)
def test_every_algorithm_has_a_positive_prediction_that_grows_with_size(collective):
    for name in registry.algorithms(collective):
        for p in (1, 2, 3, 4, 5, 8):
            for nodes in (1, 2):
                times = [cm.predict(collective, name, n, p, nodes) for n in SIZES]
                assert all(t > 0 and math.isfinite(t) for t in times), (name, p, times)
                assert times == sorted(times), (name, p, nodes, times)


def test_ring_matches_the_textbook_formula():
    params = cm.Params(alpha=10e-6, beta=1e-9, gamma=0.5e-9, copy=0.0, call=0.0)
    n, p = 1 << 18, 4  # one segment per block
    expected = 2 * (p - 1) * 10e-6 + 2 * n * (p - 1) / p * 1e-9 + n * (p - 1) / p * 0.5e-9
    assert cm.predict("allreduce", "ring", n, p, 1, params) == pytest.approx(expected)
    rd = math.log2(p) * 10e-6 + n * math.log2(p) * (1e-9 + 0.5e-9)
    assert cm.predict("allreduce", "recursive_doubling", n, p, 1, params) == pytest.approx(rd)
    rab = 2 * math.log2(p) * 10e-6 + 2 * n * (p - 1) / p * 1e-9 + n * (p - 1) / p * 0.5e-9
    assert cm.predict("allreduce", "rabenseifner", n, p, 1, params) == pytest.approx(rab)


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "rabenseifner", "tree"])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_latency_terms_count_the_messages_of_the_message_log(algorithm, p):
    """With α = 1 and nothing else, the prediction is the number of messages on the critical
    path; for these algorithms that is what the busiest rank sends in the message log."""
    x = np.ones(64, np.float32)
    _, log = run_world(p, lambda c: C.allreduce(x, algorithm=algorithm, comm=c),
                       message_log=True)
    sent = Counter(src for _, _, src, _, _ in log)
    alpha_only = cm.predict("allreduce", algorithm, x.nbytes, p, 1, replace(ZERO, alpha=1.0))
    if algorithm == "tree":  # rank 0 receives lg p messages and sends lg p
        assert alpha_only == 2 * math.log2(p)
    else:
        assert alpha_only == max(sent.values())


def test_logged_estimate_is_close_to_the_closed_form_for_ring():
    params = cm.Params()
    for n in (1 << 12, 1 << 20):
        closed = cm.predict("allreduce", "ring", n, 4, 1, params) - params.call - n * params.copy
        recorded = cm.logged_estimate("allreduce", "ring", n, 4, 1, params)
        assert 0.5 < recorded / closed < 2.0


def test_hierarchical_wins_under_a_slow_inter_node_link():
    slow = cm.Params().emulated(emulation.parse("inter=10Gbit/s,20us"))
    for n in (1 << 22, 1 << 26):
        ring = cm.predict("allreduce", "ring", n, 4, 2, slow)
        hier = cm.predict("allreduce", "hierarchical", n, 4, 2, slow)
        assert hier < ring
    assert cm.fastest("allreduce", 1 << 24, 4, 2, False, slow) in ("hierarchical", "torus2d")


def test_choice_is_deterministic_excludes_the_baseline_and_breaks_ties_by_registration_order():
    for collective in registry.COLLECTIVES:
        first = next(iter(cm.candidates(collective, True)))
        assert cm.fastest(collective, 1 << 20, 4, 1, True, ZERO) == first
        for n in SIZES:
            picks = {cm.fastest(collective, n, 4, 1, True) for _ in range(3)}
            assert len(picks) == 1 and picks != {"mpi"}
    assert all(cm.fastest("allreduce", n, 4, 1, False) != "shm" for n in SIZES)


def test_small_messages_go_to_few_steps_and_large_ones_to_bandwidth_optimal_algorithms():
    params = cm.Params()
    assert cm.fastest("allreduce", 8, 8, 1, False, params) == "recursive_doubling"
    assert cm.fastest("allreduce", 64 << 20, 8, 1, False, params) in ("ring", "rabenseifner",
                                                                      "torus2d")


def test_parameter_file_round_trip_nearest_world_size_and_defaults(tmp_path):
    path = str(tmp_path / "model.json")
    assert cm.load_params(4) == cm.Params()  # nothing calibrated yet
    cm.save(path, replace(cm.Params(), alpha=1e-6, ranks=2, gammas=(("float64", 3e-9),)))
    cm.save(path, replace(cm.Params(), alpha=9e-6, ranks=8))
    assert cm.load_params(2).alpha == 1e-6
    assert cm.load_params(4).alpha == 1e-6  # |4-2| < |4-8|
    assert cm.load_params(6).alpha == 9e-6
    assert cm.load_params(2).gamma_for("float64") == 3e-9
    assert sorted(json.load(open(path))["entries"]) == ["2", "8"]


def test_a_broken_file_or_model_off_falls_back_to_the_simple_rule(tmp_path, monkeypatch):
    (tmp_path / "model.json").write_text("{not json")
    with pytest.raises(cm.ModelUnavailable, match="mpdl calibrate"):
        cm.load_params(4)
    for n in SIZES:
        assert auto.choose("allreduce", n, 4, 1, True) == auto.simple_choice(
            "allreduce", n, 4, 1, True)
    monkeypatch.setenv("MPDL_COST_MODEL", "off")
    settings.use(None)
    assert auto.choose("reduce", 1 << 20, 4, 1, True) == "ring"


def test_default_path_honours_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv("MPDL_COST_MODEL")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    settings.use(None)
    assert cm.default_path() == str(tmp_path / "mpdl" / "costmodel.json")


def test_auto_runs_the_chosen_algorithm_on_the_in_process_world():
    x = np.arange(10, dtype=np.float64)
    results = run_world(3, lambda c: C.allreduce(x, algorithm="auto", comm=c))
    for r in results:
        np.testing.assert_array_equal(r, 3 * x)


def test_emulation_spec_parsing():
    e = emulation.parse("inter=10Gbit/s,20us")
    assert e.inter == emulation.Link(1.25e9, pytest.approx(20e-6)) and e.intra is None
    both = emulation.parse("inter=1.25GB/s, 0.5ms; intra=100Gbit/s,1us")
    assert both.inter.latency == pytest.approx(5e-4) and both.intra.bandwidth == 12.5e9
    assert emulation.parse(e.describe()) == e
    for bad in ("", "inter", "outer=1Gbit/s", "inter=fast", "inter=1Gbit/s,2Gbit/s", "10us"):
        with pytest.raises(ValueError, match="MPDL_EMULATE"):
            emulation.parse(bad)


def test_link_delay_applies_to_the_node_boundary_only():
    hook = emulation.LinkDelay(emulation.parse("inter=1Gbit/s,5us"), [0, 0, 1, 1], rank=1)
    assert hook.links[0] is None and hook.links[2] is hook.links[3] is not None
    assert hook.links[2].delay(125) == pytest.approx(5e-6 + 1e-6)


def test_bench_sizes_and_bus_factors():
    assert [parse_size(s) for s in ("8", "1K", "64M", "1G", "2KiB")] == [8, 1024, 64 << 20,
                                                                       1 << 30, 2048]
    with pytest.raises(ValueError):
        parse_size("lots")
    assert bus_factor("allreduce", 4) == 1.5
    assert bus_factor("allgather", 4) == bus_factor("reduce_scatter", 4) == 0.75
    assert bus_factor("broadcast", 4) == bus_factor("reduce", 4) == 1.0


def test_bench_reads_its_names_from_the_registry():
    assert registry.COLLECTIVES == tuple(registry.REGISTRY)
    for collective in registry.REGISTRY:
        assert bench.algorithm_names(collective) == [*registry.algorithms(collective), "auto"]
    assert bench.algorithm_names("allreduce", ["tree", "auto", "tree"]) == ["tree", "auto", "mpi"]
    with pytest.raises(ValueError, match="'shm' for broadcast"):
        bench.algorithm_names("broadcast", ["ring", "shm"])
    assert bench.sizes(8, 128, 4) == [8, 32, 128] and bench.sizes(8, 127, 4) == [8, 32]
    assert bench.sizes(5, 7, 1.01) == [5, 6, 7]


def test_measured_exchange_curve_times_intra_node_messages():
    table = ((8.0, 10e-6), (1024.0, 12e-6), (1 << 20, 300e-6), (1 << 22, 1300e-6))
    params = cm.Params(exchange=table)
    assert params.exchange_time(1) == 10e-6
    assert params.exchange_time(512) == pytest.approx(10e-6 + (512 - 8) / (1024 - 8) * 2e-6)
    # beyond the last size: the last slope
    assert params.exchange_time(1 << 23) == pytest.approx(1300e-6 + (1 << 22) * (1000e-6 / (3 << 20)))
    setting = cm.Setting(p=2, nodes=1, n=1 << 20, params=params, gamma=0.0, seg=1 << 20)
    assert setting.msg(1 << 20) == pytest.approx(300e-6)
    assert setting.msg(1 << 21, segmented=True) == pytest.approx(2 * 300e-6)
    # the table survives the parameter file, and an emulated intra-node link replaces it
    assert cm.Params.from_json(params.to_json()).exchange == table
    from mpdl import emulation

    assert params.emulated(emulation.parse("intra=1Gbit/s,10us")).exchange == ()


def test_ring_steps_use_the_ring_curve_and_pairwise_steps_the_pair_curve():
    """With more ranks than cores a step round a ring of all ranks costs more than an exchange in
    pairs; calibrate measures both, and the formulas take the curve of their pattern."""
    pairs = ((8.0, 10e-6), (1 << 24, 10e-3))
    ring = ((8.0, 100e-6), (1 << 24, 20e-3))
    plain, both = cm.Params(exchange=pairs), cm.Params(exchange=pairs, ring_exchange=ring)
    assert both.exchange_time(8, ring=True) == 100e-6 and both.exchange_time(8) == 10e-6
    assert plain.exchange_time(8, ring=True) == 10e-6  # no ring curve: the pair curve serves
    n = 1 << 20
    # ring: 2(p-1) ring steps of n/p bytes; recursive doubling: log2(p) pairwise steps
    ring_steps = 2 * 3 * (both.exchange_time(n / 4, ring=True) - plain.exchange_time(n / 4))
    assert (cm.predict("allreduce", "ring", n, 4, 1, both)
            - cm.predict("allreduce", "ring", n, 4, 1, plain)) == pytest.approx(ring_steps)
    assert (cm.predict("allreduce", "recursive_doubling", n, 4, 1, both)
            == cm.predict("allreduce", "recursive_doubling", n, 4, 1, plain))
    assert cm.Params.from_json(both.to_json()).ring_exchange == ring
    from mpdl import emulation

    assert both.emulated(emulation.parse("intra=1Gbit/s,10us")).ring_exchange == ()


def test_calibrated_curve_never_decreases():
    from mpdl.tuning.measuring import monotone

    assert monotone((8, 64, 128), [5e-6, 2e-6, 3e-6]) == ((8.0, 2e-6), (64.0, 2e-6), (128.0, 3e-6))


def test_recursive_doubling_pays_the_inter_node_link_only_where_pairs_cross_nodes():
    links = cm.Params(alpha=1.0, beta=0.0, gamma=0.0, alpha_inter=10.0, beta_inter=0.0)
    # p=8 on 2 nodes of 4: distances 1 and 2 stay inside a node, distance 4 crosses
    assert cm.recursive_doubling_time(cm.Setting(8, 2, 8.0, links, 0.0, 8)) == 1 + 1 + 10
    # p=6 on 2 nodes of 3: the fold pairs (0,1), (2,3) cross (2 messages of 10); the group is
    # ranks 1, 3, 4, 5 and both its exchanges, (1,3)/(4,5) and (1,4)/(3,5), cross
    assert cm.recursive_doubling_time(cm.Setting(6, 2, 8.0, links, 0.0, 8)) == 20 + 10 + 10


def test_calibrated_exchange_drops_a_sweep_a_slow_spell_fell_on(monkeypatch):
    """Each size is timed in several sweeps; one sweep ten times slower (the machine paused) must
    not move the figure, as it would with a mean or with a single sweep."""
    from mpdl.tuning import measuring

    effort = measuring.thorough(4)
    sizes = effort.sizes
    calls = iter(range(10_000))

    def fake_bench_time(comm, fn, reps, mpi_barrier=False):
        sweep, size = divmod(next(calls), len(sizes))
        return (10.0 if sweep == 1 and size == 3 else 1.0) * (size + 1)

    monkeypatch.setattr(measuring, "bench_time", fake_bench_time)
    assert effort.sweeps >= 3
    times = measuring.exchange_times(comm=None, peers=None, effort=effort)
    assert times == [float(i + 1) for i in range(len(sizes))]


@pytest.mark.parametrize("nbytes", [8, 1 << 16, 1 << 20])
def test_calibrated_exchange_buffers_share_a_page_offset(nbytes):
    """Not 16 bytes apart modulo 4 KiB, as two heap arrays allocated in a row are (4K aliasing)."""
    from mpdl.tuning.measuring import exchange_buffers

    send, recv = exchange_buffers(nbytes)
    assert send.nbytes == recv.nbytes == nbytes and not np.shares_memory(send, recv)
    assert send.ctypes.data % 4096 == recv.ctypes.data % 4096
    assert (send == 1).all()


def test_calibrated_ring_curve_is_per_step_of_a_chain(monkeypatch):
    """The ring curve times 2(p-1) forwarding steps in one call and reports the time per step;
    each step sends one block to the next rank and receives one from the previous."""
    from mpdl.threadworld import run_world
    from mpdl.tuning import measuring

    monkeypatch.setattr(measuring, "bench_time", lambda comm, fn, reps, mpi_barrier=False: 6.0)
    effort = measuring.thorough(4)
    assert measuring.exchange_times(None, None, effort, steps=6) == [1.0] * len(effort.sizes)

    def chain(c):
        measuring.ring_chain(c, ((c.rank + 1) % c.size, (c.rank - 1) % c.size), 64, 4)()

    _, log = run_world(3, chain, message_log=True)
    for rank in range(3):
        sent = [m for m in log if m[2] == rank]
        assert [(m[3], m[4]) for m in sent] == [((rank + 1) % 3, 64)] * 4

    # large blocks are reused in turn: memory stays within CHAIN_BYTES however long the chain
    monkeypatch.setattr(measuring, "CHAIN_BYTES", 4 * 64)
    allocated = []
    real_buffers = measuring.exchange_buffers
    monkeypatch.setattr(measuring, "exchange_buffers",
                        lambda n: allocated.append(n) or real_buffers(n))
    _, log = run_world(3, lambda c: measuring.ring_chain(
        c, ((c.rank + 1) % 3, (c.rank - 1) % 3), 64, 10)(), message_log=True)
    assert len(log) == 3 * 10 and allocated == [4 * 64] * 3


def test_ring_reduce_scatter_steps_use_the_reducing_ring_curve():
    """Calibrated, a reduce-scatter step is timed with its reduction (of a block just received,
    in cache): no separate γ term; a dtype slower to add than float32 pays the difference."""
    ring = ((8.0, 10e-6), (1 << 20, 100e-6))
    reducing = ((8.0, 20e-6), (1 << 20, 150e-6))
    gammas = (("float16", 5e-9), ("float32", 1e-9))
    plain = cm.Params(exchange=ring, ring_exchange=ring, gamma=1e-9, gammas=gammas)
    both = replace(plain, ring_reduce_exchange=reducing)
    n, p = 3 << 19, 3  # blocks of 512 KiB
    block = n / p
    rs = cm.predict("reduce_scatter", "ring", n, p, 1, both) - cm.predict(
        "reduce_scatter", "ring", 0, p, 1, replace(both, ring_reduce_exchange=()))
    want = (p - 1) * float(np.interp(block, [8, 1 << 20], [20e-6, 150e-6]))
    assert cm.ring_reduce_scatter_time(cm.Setting(p, 1, n, both, 1e-9, 1 << 20)) == pytest.approx(want)
    assert cm.ring_reduce_scatter_time(cm.Setting(p, 1, n, plain, 1e-9, 1 << 20)) == pytest.approx(
        (p - 1) * (float(np.interp(block, [8, 1 << 20], [10e-6, 100e-6])) + block * 1e-9))
    assert cm.ring_reduce_scatter_time(cm.Setting(p, 1, n, both, 5e-9, 1 << 20)) == pytest.approx(
        want + (p - 1) * 4e-9 * block)
    assert rs > 0
    # the all-gather has nothing to reduce: the plain ring curve; the curve survives the file and
    # an emulated intra-node link (an α-β link) replaces it
    assert cm.ring_allgather_time(cm.Setting(p, 1, n, both, 0.0, 1 << 20)) == pytest.approx(
        (p - 1) * float(np.interp(block, [8, 1 << 20], [10e-6, 100e-6])))
    assert cm.Params.from_json(both.to_json()).ring_reduce_exchange == reducing
    assert both.emulated(emulation.parse("intra=1Gbit/s,10us")).ring_reduce_exchange == ()


def test_the_input_copy_follows_the_measured_copy_curve():
    curve = ((8.0, 1e-6), (1 << 20, 21e-6), (1 << 22, 100e-6))
    flat = cm.Params(copy=1e-9)
    measured = replace(flat, copy_curve=curve)
    assert flat.copy_time(1 << 20) == pytest.approx((1 << 20) * 1e-9)
    assert measured.copy_time(1 << 20) == pytest.approx(21e-6)
    assert measured.copy_time(5 << 19) == pytest.approx(60.5e-6)
    assert measured.copy_time(0) == 0.0
    # the API's input copy is the only difference in an all-reduce's prediction
    n = 1 << 20
    assert (cm.predict("allreduce", "ring", n, 4, 1, measured)
            - cm.predict("allreduce", "ring", n, 4, 1, flat)) == pytest.approx(21e-6 - n * 1e-9)
    assert cm.Params.from_json(measured.to_json()).copy_curve == curve
    with pytest.raises(cm.ModelUnavailable, match="copy_curve"):
        cm.Params.from_json({**measured.to_json(), "copy_curve": [[8, 1e-6]]})


@pytest.mark.parametrize("nbytes", [64, 66])
def test_calibrated_reducing_ring_chain_adds_each_block_it_receives(nbytes, monkeypatch):
    """Each step sends its block to the next rank, receives the next block from the previous one
    and adds it in (float32: whole elements, 66 bytes become 64); the block a step sends is the
    one the step before added into, so after 4 steps the last block holds 1 + 4 (all ones)."""
    from mpdl.threadworld import run_world
    from mpdl.tuning import measuring

    buffers = []
    real_buffers = measuring.exchange_buffers
    monkeypatch.setattr(measuring, "exchange_buffers",
                        lambda n: buffers.append(real_buffers(n)) or buffers[-1])

    def chain(c):
        run = measuring.ring_chain(c, ((c.rank + 1) % c.size, (c.rank - 1) % c.size), nbytes, 4,
                                    reduce=True)
        run()

    _, log = run_world(3, chain, message_log=True)
    blocks = [b[0].view(np.float32).reshape(5, 16) for b in buffers if b[0].nbytes == 5 * 64]
    assert len(blocks) == 3 and all((b[4] == 5).all() and (b[0] == 1).all() for b in blocks)
    for rank in range(3):
        sent = [m for m in log if m[2] == rank]
        assert [(m[3], m[4]) for m in sent] == [((rank + 1) % 3, 64)] * 4
