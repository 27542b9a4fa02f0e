"""A pipeline stage builds only its own parameters: the same values as the whole model's, and a
setup peak of about its share of the bytes."""

from __future__ import annotations

import threading
import tracemalloc

import numpy as np
import pytest

from mpdl.autograd import nn
from mpdl.models.zoo import build_model
from mpdl.parallel.pipeline import PipelineStrategy, model_pieces, partition_by_weight
from mpdl.parallel.pipeline.stage import _is_placeholder
from mpdl.threadworld import run_world


def gpt():
    return build_model("gpt", (16,), 13, seed=3, n_layer=6, n_head=2, n_embd=64)


def mlp():
    return build_model("mlp", (1, 8, 8), 10, seed=3)


def lenet():
    return build_model("lenet", (1, 8, 8), 10, seed=3)


MODELS = {"gpt": gpt, "mlp": mlp, "lenet": lenet}


def held(model) -> dict[str, np.ndarray]:
    return {n: p.data for n, p in model.named_parameters() if not _is_placeholder(p.data)}


@pytest.mark.parametrize("name,pp", [("gpt", 2), ("gpt", 3), ("gpt", 4), ("mlp", 2), ("lenet", 3)])
def test_a_stage_holds_its_parameters_equal_to_the_whole_models(name, pp):
    whole = MODELS[name]()
    pieces = model_pieces(whole)
    bounds = partition_by_weight([w for _, w in pieces], pp)
    names = {id(p): n for n, p in whole.named_parameters()}
    expected = []
    for s in range(pp):
        mine = set()
        for piece, _ in pieces[bounds[s]:bounds[s + 1]]:
            mine |= {names[id(p)] for p in piece.parameters()}
            if getattr(piece, "tied", None) is not None:
                mine.add(names[id(piece.tied)])
        expected.append(mine)
    reference = dict(whole.named_parameters())

    def stage(comm):
        strategy = PipelineStrategy(comm, dp=1, pp=pp)
        return strategy.stage, held(strategy.build(MODELS[name]))

    for s, params in run_world(pp, stage):
        assert set(params) == expected[s]
        for n, value in params.items():
            assert value.dtype == reference[n].dtype
            np.testing.assert_array_equal(value, reference[n].data)
    assert set().union(*expected) == set(reference)


def test_a_stages_setup_peak_is_its_share():
    pp, lock = 3, threading.Lock()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        whole = gpt()
        whole_peak = tracemalloc.get_traced_memory()[1]
        whole_bytes = sum(p.data.nbytes for p in whole.parameters())
        largest = max(p.data.nbytes for p in whole.parameters())
        del whole

        def stage(comm):
            strategy = PipelineStrategy(comm, dp=1, pp=pp)
            comm.barrier()
            with lock:  # one rank builds at a time: the peak is that rank's
                base = tracemalloc.get_traced_memory()[0]
                tracemalloc.reset_peak()
                model = strategy.build(gpt)
                peak = tracemalloc.get_traced_memory()[1] - base
            return sum(a.nbytes for a in held(model).values()), peak

        out = run_world(pp, stage)
    finally:
        tracemalloc.stop()
    assert whole_peak >= whole_bytes  # the control: the whole model's build holds all of it
    for share, peak in out:
        assert share < 0.5 * whole_bytes
        # its share, one parameter's draw in flight (a float64 draw beside its float32 copy and
        # the value it replaces: 4 x the largest parameter) and the modules' Python objects
        assert peak <= share + 4 * largest + 64 * 1024, (share, peak, whole_bytes)
        assert peak < 0.7 * whole_peak, (peak, whole_peak)


def test_partial_build_refuses_to_nest():
    from mpdl.autograd import partial

    def nested():
        return partial.build(lambda: nn.Linear(2, 2, seed=0), set(), lambda p: p.data)

    with pytest.raises(RuntimeError, match="already building"):
        partial.build(nested, set(), lambda p: p.data)
