"""Every pipeline schedule run by the executor on the in-process world: the loss of every step
and the parameters after them are a plain one-process loop's (float64 within 1e-10, float32
within 1e-5: see tests/test_pipeline.py), at pp 2 and 4, with dp, tp and ZeRO-1 as 1f1b; the
chunks each rank held at once are the schedule's formula; `mpdl train` under every schedule
(a 4-layer GPT on addition) gives one rank's loss; a checkpoint of one schedule continues on
another layout; bad combinations are one line each."""

from __future__ import annotations

import io

import numpy as np
import pytest
from test_pipeline import TOL, data, grid, make_model, oracle, pipeline_losses

from mpdl.autograd import functional as F
from mpdl.autograd import optim
from mpdl.autograd.tensor import Tensor
from mpdl.parallel.pipeline import PipelineStrategy
from mpdl.parallel.strategy import Batch
from mpdl.threadworld import run_world
from mpdl.training.config import ConfigError, TrainConfig, validate
from mpdl.training.loop import Trainer

#: (schedule, chunks per rank, microbatches) that each schedule allows at pp 2 and 4
RUNS = [("interleaved", 2, 4), ("zb-h1", 1, 3), ("zb-v", 2, 3), ("dualpipev", 2, 8)]


@pytest.mark.parametrize("schedule, v, m", RUNS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_every_schedule_follows_one_process(schedule, v, m, dtype):
    ref = oracle("mlp", dtype)
    for dp, pp in ((1, 2), (1, 4), (2, 2)):
        if dp > 1 and dtype == "float64":
            continue
        out = run_world(dp * pp, lambda c, dp=dp, pp=pp: pipeline_losses(
            c, "mlp", dtype, dp, pp, m, schedule, v=v, zero=int(dp > 1)))
        for losses, params, _ in out:
            np.testing.assert_allclose(losses, ref, rtol=0, atol=TOL[dtype],
                                       err_msg=f"dp {dp} pp {pp}")
            assert np.array_equal(params, out[0][1])
        peaks = [s.last_peak for _, _, s in out[:pp]]
        want = {"interleaved": [min(2 * (pp - r - 1) + pp + 1, m * v) for r in range(pp)],
                "zb-h1": [min(pp, m)] * pp, "zb-v": [min(2 * pp, 2 * m)] * pp,
                "dualpipev": [2 * pp + 1] * pp}[schedule]
        assert peaks == want, (pp, peaks)


def test_the_gpt_with_tensor_parallel_stages_under_zero_bubble():
    ref = oracle("gpt", "float32")
    for schedule, v in (("zb-h1", 1), ("zb-v", 2)):
        for losses, _, _ in run_world(4, lambda c, s=schedule, v=v: pipeline_losses(
                c, "gpt", "float32", 1, 2, 4, s, tp=2, v=v)):
            np.testing.assert_allclose(losses, ref, rtol=0, atol=TOL["float32"])


ADDITION = {"model.name": "gpt", "data.dataset": "addition", "data.digits": 1,
            "model.n_layer": 4, "model.n_head": 2, "model.n_embd": 8,
            "optim.global_batch_size": 32, "optim.optimizer": "sgd", "data.drop_last": True,
            "output.progress": False, "optim.epochs": 1}


def train(config: TrainConfig, comm) -> tuple[np.ndarray, list[dict]]:
    trainer = Trainer(config, comm=comm, out=io.StringIO())
    trainer.setup()
    rows = trainer.run()
    with trainer.strategy.gathered():
        return np.concatenate([p.data.ravel() for p in trainer.model.parameters()]), rows


def test_train_under_every_schedule_follows_one_rank():
    """The 4-layer GPT on addition, SGD, global batch 32 in 8 microbatches, the short batch
    dropped: every schedule on pp 2, and zb-h1 on dp 2 × pp 2, ends with one rank's loss and
    parameters; each row reports a measured bubble per stage beside the formula's."""
    ref, ref_rows = run_world(1, lambda c: train(TrainConfig.from_keys(ADDITION), c))[0]
    runs = [dict(pp=2, schedule=s) for s in ("afab", "1f1b", "zb-h1", "zb-v", "dualpipev")]
    runs += [dict(pp=2, schedule="interleaved", virtual_stages=2),
             dict(pp=2, dp=2, schedule="zb-h1")]
    for kw in runs:
        size = kw.get("dp", 1) * kw["pp"]
        for params, rows in run_world(size, lambda c, kw=kw: train(TrainConfig.from_keys(
                {**ADDITION, **grid({**kw, "microbatches": 8 // kw.get("dp", 1)})}), c)):
            assert rows[0]["loss"] == pytest.approx(ref_rows[0]["loss"], abs=1e-5), kw
            np.testing.assert_allclose(params, ref, rtol=0, atol=1e-5, err_msg=str(kw))
            row = rows[0]
            assert row["schedule"] == kw["schedule"] and len(row["bubble_stages"]) == 2
            assert 0 <= row["bubble"] <= 1 and 0 < row["bubble_formula"] < 1


@pytest.mark.parametrize("first, second", [
    (dict(pp=2, schedule="zb-v", microbatches=2), dict()),
    (dict(pp=2, schedule="interleaved", virtual_stages=2, microbatches=2),
     dict(pp=2, dp=2, schedule="zb-h1", microbatches=2, zero=1))])
def test_a_checkpoint_continues_on_another_schedule(tmp_path, first, second):
    tiny = {**ADDITION, "model.n_layer": 2, "optim.global_batch_size": 12,
            "data.drop_last": False, "optim.lr_schedule": "constant"}
    ref = run_world(1, lambda c: train(TrainConfig.from_keys({**tiny, "optim.epochs": 2}), c))
    ckpt = {"checkpoint.dir": str(tmp_path / "ckpt")}
    run_world(first["pp"], lambda c: train(TrainConfig.from_keys(
        {**tiny, **ckpt, **grid(first)}), c))
    size = second.get("dp", 1) * second.get("pp", 1)
    for params, _ in run_world(size, lambda c: train(TrainConfig.from_keys(
            {**tiny, **ckpt, "optim.epochs": 2, "checkpoint.resume": True, **grid(second)}),
            c)):
        np.testing.assert_allclose(params, ref[0][0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("flags, words", [
    (dict(schedule="interleaved", virtual_stages=2, microbatches=6, pp=4),
     "parallel.microbatches 6 must be a multiple of parallel.pp 4"),
    (dict(schedule="dualpipev", microbatches=3, pp=2),
     "parallel.microbatches 3 must be at least 2 x parallel.pp = 4"),
    (dict(schedule="1f1b", virtual_stages=2, pp=2), "needs parallel.schedule interleaved"),
    (dict(schedule="zb-v", virtual_stages=3, pp=2), "runs 2 chunks per rank (a V)"),
    (dict(schedule="interleaved", virtual_stages=4, microbatches=4, pp=2),
     "8 stages: model.name gpt has 6 pieces"),
])
def test_bad_combinations_are_one_line(flags, words):
    with pytest.raises(ConfigError) as error:
        validate(TrainConfig.from_keys({**ADDITION, **grid(flags)}), flags["pp"])
    assert words in str(error.value) and "\n" not in str(error.value)



def test_a_short_batch_runs_where_its_count_does_not_fit_the_schedule():
    """Interleaved over 2 ranks with 4 microbatches, then a batch of 3 samples (3 microbatches,
    not a multiple of pp): all forwards then all backwards on the same chunks, the same losses."""
    def body(comm):
        strategy = PipelineStrategy(comm, 1, 2, microbatches=4, schedule="interleaved",
                                    virtual_stages=2)
        strategy.setup(make_model("mlp", "float64"), lambda p: optim.SGD(p, lr=0.1))
        x, y = data("mlp", "float64")
        return [strategy.step(Batch(x[:n], y[:n], n, 0.1)).loss / n for n in (8, 3)]

    model = make_model("mlp", "float64")
    opt = optim.SGD(model.parameters(), lr=0.1)
    x, y = data("mlp", "float64")
    ref = []
    for n in (8, 3):
        loss = F.cross_entropy(model(Tensor(x[:n])), y[:n])
        ref.append(float(loss.item()))
        loss.backward()
        opt.step()
        opt.zero_grad()
    for losses in run_world(2, body):
        np.testing.assert_allclose(losses, ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("schedule, v, cp, tp", [("zb-v", 2, 2, 1), ("dualpipev", 2, 1, 2)])
def test_context_and_sequence_parallel_stages_under_the_v_schedules(schedule, v, cp, tp):
    """cp = 2 (each rank a half of every sequence) or tp = 2 with sequence parallelism, float64:
    the one-process losses within 1e-10."""
    ref = oracle("gpt", "float64")
    x, y = data("gpt", "float64")

    def body(comm):
        strategy = PipelineStrategy(comm, 1, 2, tp, microbatches=4, schedule=schedule,
                                    virtual_stages=v, cp=cp, sp=tp > 1,
                                    cp_balance="contiguous")
        strategy.setup(make_model("gpt", "float64"), lambda p: optim.Adam(p, lr=1e-2))
        return [(r := strategy.step(Batch(x, y, len(x), 1e-2))).loss / r.samples
                for _ in ref]

    for losses in run_world(2 * cp * tp, body):
        np.testing.assert_allclose(losses, ref, rtol=0, atol=1e-10)
