"""--batch-sampling random (nanoGPT's random windows from one stream that p ranks slice), the
interval evaluations (--eval-interval, --eval-steps: fixed validation batches, the same on every
layout), the step log (--log-interval) and --dropout, on the in-process world and under
mpiexec."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpdl.parallel.sampler import RandomBatchSampler
from mpdl.threadworld import ThreadWorld, run_world
from mpdl.training.config import ConfigError, TrainConfig, validate
from mpdl.training.loop import Trainer
from mpdl.training.tasks import load_task, validation_indices

EXCERPT = Path(__file__).parent / "data" / "shakespeare_excerpt.txt"
BIN = Path(sys.executable).parent
#: a tiny GPT on the Shakespeare excerpt: 17,959 training characters, 1,122 windows of 16, so
#: 24 steps an epoch of 48
TINY = {"model.name": "gpt", "data.dataset": "text", "data.path": str(EXCERPT),
        "model.block_size": 16, "model.n_layer": 1, "model.n_head": 2, "model.n_embd": 16,
        "optim.global_batch_size": 48, "optim.epochs": 1, "optim.optimizer": "adam",
        "model.dtype": "float64", "data.batch_sampling": "random", "output.progress": False}


def test_p_ranks_slice_the_same_random_global_batches():
    one = RandomBatchSampler(1000, 10, steps_per_epoch=3, seed=5)
    for epoch in (0, 1):
        one.set_epoch(epoch)
        reference = [local for local, _ in one]
        for p in (2, 3, 4, 13):
            ranks = [RandomBatchSampler(1000, 10, 3, rank=r, num_replicas=p, seed=5)
                     for r in range(p)]
            for s in ranks:
                s.set_epoch(epoch)
            steps = list(zip(*[[local for local, _ in s] for s in ranks], strict=True))
            assert len(steps) == 3
            for step, slices in enumerate(steps):
                assert [len(x) for x in slices] == [len(a) for a in
                                                    np.array_split(np.arange(10), p)]
                np.testing.assert_array_equal(np.concatenate(slices), reference[step])
    one.set_epoch(0)
    first = [local for local, _ in one]
    assert not any(np.array_equal(a, b) for a in first for b in reference), "epochs repeat"
    other = RandomBatchSampler(1000, 10, 3, seed=6)
    assert not np.array_equal(next(iter(other))[0], first[0]), "the seed is not used"


def test_random_batches_draw_uniformly_with_replacement():
    s = RandomBatchSampler(7, 10_000, steps_per_epoch=1, seed=0)
    batch = next(iter(s))[0]
    counts = np.bincount(batch, minlength=7)
    assert batch.min() == 0 and batch.max() == 6
    # chi-square with 6 degrees of freedom: above 22.5 one time in 1,000
    assert ((counts - 10_000 / 7) ** 2 / (10_000 / 7)).sum() < 22.5


def test_random_batches_resume_where_they_stopped():
    straight = RandomBatchSampler(500, 8, steps_per_epoch=5, rank=1, num_replicas=2, seed=3)
    straight.set_epoch(2)
    expected = [local for local, _ in straight]
    first = RandomBatchSampler(500, 8, 5, rank=1, num_replicas=2, seed=3)
    first.set_epoch(2)
    batches = iter(first)
    done = [next(batches)[0], next(batches)[0]]
    resumed = RandomBatchSampler(500, 8, 5, rank=0, num_replicas=1, seed=0)
    resumed.load_state_dict(first.state_dict())
    resumed.rank, resumed.num_replicas = 1, 2
    resumed.set_epoch(2)
    rest = [local for local, _ in resumed]
    for got, want in zip(done + rest, expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_random_windows_are_nanogpt_windows_at_every_offset():
    task = load_task(TrainConfig.from_keys(TINY))
    stream, T = task.data.train, 16
    assert len(task.xtr) == len(stream) - T  # torch.randint(len(data) - block_size)
    assert task.epoch_samples() == (len(stream) - 1) // T == 1122
    for i in (0, 1, 777, len(stream) - T - 1):
        np.testing.assert_array_equal(task.xtr[i], stream[i:i + T])
        np.testing.assert_array_equal(task.ytr[i], stream[i + 1:i + T + 1])
    x, y = task.validation_pool()
    assert len(x) == len(task.data.val) - T
    np.testing.assert_array_equal(x[5], task.data.val[5:5 + T])
    np.testing.assert_array_equal(y[5], task.data.val[6:6 + T])


def test_validation_indices_are_fixed_and_distinct_under_epoch_sampling():
    random = validation_indices(100, 3, 7, seed=0, random=True)
    assert random.shape == (21,) and random.min() >= 0 and random.max() < 100
    np.testing.assert_array_equal(random, validation_indices(100, 3, 7, seed=0, random=True))
    distinct = validation_indices(21, 3, 7, seed=0, random=False)
    assert sorted(distinct) == list(range(21))


def run(keys: dict, comm=None) -> tuple[Trainer, list[dict], str]:
    out = io.StringIO()
    trainer = Trainer(TrainConfig.from_keys(keys), comm=comm, out=out)
    trainer.setup()
    trainer.run()
    return trainer, trainer.report.events, out.getvalue()


def events(keys: dict, p: int) -> list[dict]:
    if p == 1:
        return [e for _, e in run(keys, ThreadWorld(1).comm(0))[1]]
    return [e for _, e in run_world(p, lambda c: run(keys, c))[0][1]]


@pytest.mark.parametrize("p", [2, 3])
def test_evaluations_and_logs_follow_one_rank(p):
    keys = {**TINY, "output.eval_interval": 10, "output.eval_steps": 3, "output.log_interval": 7}
    reference = events(keys, 1)
    evals = [e for e in reference if "val_loss" in e]
    assert [e["step"] for e in evals] == [0, 10, 20, 24]  # step 0 and the last step too
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.3
    logs = [e for e in reference if "loss" in e]
    assert [e["step"] for e in logs] == [7, 14, 21]
    for e in logs:
        assert set(e) == {"step", "loss", "lr", "grad_norm", "step_ms", "tokens_per_s"}
        assert e["step_ms"] > 0 and e["tokens_per_s"] > 0 and 0 < e["lr"] <= 3e-3
    got = events(keys, p)
    assert [sorted(e) for e in got] == [sorted(e) for e in reference]
    for mine, one in zip(got, reference, strict=True):
        assert mine["step"] == one["step"]
        for key in ("val_loss", "loss", "lr"):
            if key in one:
                assert mine[key] == pytest.approx(one[key], rel=0, abs=1e-9), (key, mine, one)


def test_deterministic_random_batches_give_the_same_bits_on_any_number_of_ranks():
    keys = {**TINY, "model.dtype": "float32", "optim.deterministic": True}

    def digest(comm) -> str:
        trainer = Trainer(TrainConfig.from_keys(keys), comm=comm, out=io.StringIO())
        trainer.setup()
        return trainer.run()[-1]["param_sha256"]

    one = digest(ThreadWorld(1).comm(0))
    for p in (2, 3):
        assert run_world(p, digest) == [one] * p


def test_the_step_0_evaluation_is_the_mean_cross_entropy_on_the_fixed_windows():
    from mpdl.models.zoo import build_model
    keys = {**TINY, "output.eval_interval": 100, "output.eval_steps": 2}
    first = events(keys, 1)[0]
    task = load_task(TrainConfig.from_keys(keys))
    x, y = task.validation_pool()
    idx = validation_indices(len(x), 2, 48, seed=0, random=True)
    model = build_model("gpt", (16,), len(task.vocab), seed=0, dtype=np.float64, n_layer=1,
                        n_head=2, n_embd=16)
    model.eval()
    logits = model(x[idx]).data
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, y[idx][..., None], axis=-1).mean()
    assert first == {"step": 0, "val_loss": pytest.approx(expected, rel=1e-12)}


def test_dropout_reaches_the_gpt_and_only_training():
    trainer, evs, _ = run({**TINY, "model.dropout": 0.25, "output.eval_interval": 24,
                           "output.eval_steps": 2})
    drops = [m for name, m in trainer.model.named_modules() if name.endswith("dropout")]
    assert len(drops) == 3 and all(m.p == 0.25 for m in drops)  # embeddings, attn, mlp
    _, plain, _ = run({**TINY, "output.eval_interval": 24, "output.eval_steps": 2})
    assert evs[0][1] == plain[0][1], "evaluation is not in eval mode"
    assert evs[-1][1]["val_loss"] != plain[-1][1]["val_loss"], "dropout changed nothing"


@pytest.mark.parametrize("changes, message", [
    ({"model.name": "mlp", "data.dataset": "digits", "model.dropout": 0.1},
     "model.dropout needs model.name gpt"),
    ({"model.dropout": 1.0}, "model.dropout: expected a probability in [0, 1)"),
    ({"model.name": "mlp", "data.dataset": "digits", "output.eval_interval": 5},
     "output.eval_interval needs model.name gpt"),
    ({"data.batch_sampling": "shuffle"}, "data.batch_sampling: expected one of epoch, random"),
    ({"output.eval_steps": 0}, "output.eval_steps: expected a positive number"),
])
def test_bad_options_are_refused(changes, message):
    keys = {**TINY, **changes}
    if keys["data.dataset"] == "digits":
        keys = {k: v for k, v in keys.items() if not k.startswith(("model.n", "model.block",
                                                                  "data.path"))}
    with pytest.raises(ConfigError) as info:
        validate(TrainConfig.from_keys(keys), 1)
    assert message in str(info.value)


# -- under mpiexec -----------------------------------------------------------------------------

def train(n: int, *flags: str) -> subprocess.CompletedProcess:
    cmd = ["timeout", "-k", "5", "150", str(BIN / "mpiexec"), "-n", str(n), str(BIN / "mpdl"),
           "train", "--model", "gpt", "--dataset", "text", "--data", str(EXCERPT),
           "--block-size", "16", "--n-layer", "2", "--n-head", "2", "--n-embd", "16",
           "--global-batch-size", "12", "--dtype", "float64", "--optimizer", "adam",
           "--batch-sampling", "random", "--epochs", "1", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=165,
                          env={**os.environ, "MPDL_NO_CUPY": "1"})


def lines_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()][1:]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    path = tmp_path_factory.mktemp("one") / "r.jsonl"
    out = train(1, "--eval-interval", "40", "--eval-steps", "4", "--log-interval", "30",
                "--json", str(path))
    assert out.returncode == 0, out.stderr
    return out, lines_of(path)


def test_log_and_evaluation_lines_without_a_terminal(one_rank):
    out, lines = one_rank
    printed = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in printed] == [
        "step 0", "step 30", "step 40", "step 60", "step 80", "step 90", "step 94"]
    assert printed[1].startswith("step 30: loss ") and "grad norm" in printed[1]
    assert printed[0].startswith("step 0: val loss ")
    assert [e["step"] for e in lines if "step" in e and "val_loss" in e] == [0, 40, 80, 94]
    # the epoch row, the evaluation after the last step, the summary
    assert "epoch" in lines[-3] and lines[-2]["step"] == 94 and lines[-1]["summary"] is True


@pytest.mark.parametrize("n, layout", [(2, []), (3, []), (2, ["--tp", "2"]),
                                       (2, ["--pp", "2"]), (2, ["--zero", "3"]),
                                       (4, ["--pp", "2", "--tp", "2"])])
def test_every_layout_follows_one_rank(tmp_path, one_rank, n, layout):
    path = tmp_path / "r.jsonl"
    out = train(n, *layout, "--eval-interval", "40", "--eval-steps", "4", "--log-interval",
                "30", "--json", str(path))
    assert out.returncode == 0, out.stderr
    got, want = lines_of(path), one_rank[1]
    steps = [(e.get("step"), "val_loss" in e) for e in want if "epoch" not in e]
    assert [(e.get("step"), "val_loss" in e) for e in got if "epoch" not in e] == steps
    for mine, one in zip(got, want, strict=True):
        for key in ("val_loss", "loss"):
            if key in one and "step" in one:
                assert mine[key] == pytest.approx(one[key], rel=0, abs=1e-8), (layout, mine)


def test_more_eval_steps_than_the_split_holds_exit_2_with_one_line():
    out = train(2, "--eval-interval", "10", "--eval-steps", "200", "--global-batch-size", "12",
                "--batch-sampling", "epoch")
    assert out.returncode == 2, (out.stdout, out.stderr)
    errors = out.stderr.strip().splitlines()
    assert errors == ["mpdl train: error: --eval-steps 200 x --global-batch-size 12 = 2400 "
                      "validation sequences, more than the 124 that the validation split "
                      "holds"], out.stderr
