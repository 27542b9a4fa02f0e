"""The process grid and pipeline parallelism on the in-process world.

Equivalence: every layout (dp, pp, tp) with dp × pp × tp ≤ 8, both schedules, several microbatch
counts, with and without ZeRO-1 on the dp axis, gives the loss of every step of a plain
one-process loop (no strategy, no communication: the whole global batch, one forward, one
backward, one optimizer step) on the same model, data and seed. Tolerance: float64 1e-10;
float32 1e-5 on a loss of about 2, i.e. about a hundred units of float32 round-off (2^-24 ≈ 6e-8
relative): a pipeline adds the microbatches' gradients, the data-parallel ranks' sums (an
all-reduce, or ZeRO-1's reduce-scatter) and the tensor-parallel partial sums in another order than
one batch's backward does, which changes the last bits of each gradient, and a few Adam steps
carry that into the loss at the same order (seen: at most 2e-7). ZeRO-1's update itself is
elementwise on each block, so it adds no round-off of its own.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from oracle import adam_losses

from mpdl.autograd import functional as F
from mpdl.autograd import nn, optim
from mpdl.autograd.tensor import Tensor
from mpdl.collectives import allreduce
from mpdl.models.gpt import GPT
from mpdl.parallel.grid import ProcessGrid
from mpdl.parallel.pipeline import (
    PipelineStrategy,
    bubble_formula,
    partition_by_weight,
    peak_in_flight,
    schedule_ops,
    slot_bubble,
    timed_bubble,
)
from mpdl.parallel.strategy import Batch
from mpdl.threadworld import ThreadWorld, run_world
from mpdl.training.checkpoint import load_checkpoint
from mpdl.training.config import TrainConfig
from mpdl.training.loop import Trainer

TOL = {"float32": 1e-5, "float64": 1e-10}
N, STEPS = 12, 3


def make_model(name: str, dtype: str):
    if name == "gpt":  # 4 pieces: embedding, 2 blocks, head (tied to the embedding)
        return GPT(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=6, seed=0,
                   dtype=np.dtype(dtype))
    layers: list[nn.Module] = [nn.Flatten()]  # 8 pieces (Linear with its ReLU)
    widths = [12, 10, 9, 9, 8, 8, 8, 8, 7]
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        layers += [nn.Linear(a, b, seed=i, dtype=dtype), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def data(name: str, dtype: str):
    rng = np.random.default_rng(3)
    if name == "gpt":
        return rng.integers(0, 11, (N, 6)), rng.integers(0, 11, (N, 6))
    return rng.standard_normal((N, 1, 3, 4)).astype(dtype), rng.integers(0, 7, N)


def oracle(name: str, dtype: str) -> list[float]:
    """The loss of each step of a plain loop on one process."""
    model = make_model(name, dtype)
    x, y = data(name, dtype)
    return adam_losses(model, x, y, STEPS, 1e-2)


def pipeline_losses(comm, name: str, dtype: str, dp: int, pp: int, m: int, schedule: str,
                    tp: int = 1, zero: int = 0, v: int = 1):
    strategy = PipelineStrategy(comm, dp, pp, tp, microbatches=m, schedule=schedule, zero=zero,
                                virtual_stages=v)
    strategy.setup(make_model(name, dtype), lambda p: optim.Adam(p, lr=1e-2))
    x, y = data(name, dtype)
    bounds = np.linspace(0, N, dp + 1).astype(int)
    d = strategy.data_comm.rank
    losses = []
    for _ in range(STEPS):
        r = strategy.step(Batch(x[bounds[d]:bounds[d + 1]], y[bounds[d]:bounds[d + 1]], N, 1e-2))
        total = allreduce(np.array([r.loss, r.samples]), comm=strategy.data_comm)
        losses.append(total[0] / total[1])
    with strategy.gathered():
        params = np.concatenate([p.data.ravel() for p in strategy.model.parameters()])
    return losses, params, strategy


LAYOUTS = [(1, 2), (2, 2), (1, 3), (1, 4), (2, 4), (4, 2), (1, 8), (2, 3)]


@pytest.mark.parametrize("name, dp, pp", [(name, dp, pp) for name in ("mlp", "gpt")
                                           for dp, pp in LAYOUTS
                                           if name == "mlp" or pp <= 4])  # the GPT has 4 pieces
@pytest.mark.parametrize("schedule", ["afab", "1f1b"])
@pytest.mark.parametrize("zero", [0, 1])
def test_layouts_follow_one_process(name, dp, pp, schedule, zero):
    dtype = "float32"
    ref = oracle(name, dtype)
    for m in (1, 3, 4):
        out = run_world(dp * pp, lambda c, m=m: pipeline_losses(c, name, dtype, dp, pp, m,
                                                                schedule, zero=zero))
        for losses, params, _ in out:
            np.testing.assert_allclose(losses, ref, rtol=0, atol=TOL[dtype])
            assert np.array_equal(params, out[0][1]), "the ranks' models differ after gathered()"
    assert ref[-1] < ref[0] - 1e-3, "nothing trained"


@pytest.mark.parametrize("dp, pp, tp", [(1, 1, 2), (2, 1, 2), (4, 1, 2), (1, 2, 2), (2, 2, 2),
                                        (1, 4, 2), (1, 3, 2)])
@pytest.mark.parametrize("schedule", ["afab", "1f1b"])
@pytest.mark.parametrize("zero", [0, 1])
def test_tensor_parallel_layouts_follow_one_process(dp, pp, tp, schedule, zero):
    ref = oracle("gpt", "float32")
    for m in (1, 3):
        out = run_world(dp * pp * tp, lambda c, m=m: pipeline_losses(
            c, "gpt", "float32", dp, pp, m, schedule, tp, zero))
        for losses, params, _ in out:
            np.testing.assert_allclose(losses, ref, rtol=0, atol=TOL["float32"])
            assert np.array_equal(params, out[0][1]), "the ranks' models differ after gathered()"


def test_tensor_parallel_float64_and_whole_model():
    ref = oracle("gpt", "float64")
    model = make_model("gpt", "float64")
    opt = optim.Adam(model.parameters(), lr=1e-2)
    x, y = data("gpt", "float64")
    for _ in range(STEPS):
        F.cross_entropy(model(Tensor(x)), y).backward()
        opt.step()
        opt.zero_grad()
    whole = np.concatenate([p.data.ravel() for p in model.parameters()])
    for layout in [(1, 1, 2, 0), (2, 2, 2, 0), (2, 2, 2, 1), (3, 1, 2, 1)]:
        dp, pp, tp, zero = layout
        for losses, params, _ in run_world(dp * pp * tp, lambda c: pipeline_losses(
                c, "gpt", "float64", dp, pp, 2, "1f1b", tp, zero)):
            np.testing.assert_allclose(losses, ref, rtol=0, atol=TOL["float64"])
            np.testing.assert_allclose(params, whole, rtol=0, atol=TOL["float64"])


def test_tensor_parallel_all_reduces_twice_per_block_each_way(no_verification):
    """Megatron: per block, 2 all-reduces forward (g) and 2 backward (f), over tp."""
    out, recorded = run_world(2, lambda c: pipeline_losses(c, "gpt", "float32", 1, 1, 1, "afab",
                                                           2)[2], message_log=True)
    # (gathered() at the end also agrees on two float64 memory figures: 16 bytes, left out)
    calls = [r for r in recorded if r[0].startswith("allreduce") and r[4] != 16]
    # n_layer = 2 blocks, 4 all-reduces each per step; 2 ranks: one message per rank each
    assert len(calls) == 2 * (2 * 4 * STEPS)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_float64_follows_one_process(name):
    ref = oracle(name, "float64")
    for dp, pp, m, schedule, zero in [(1, 4, 4, "1f1b", 0), (2, 2, 3, "afab", 0),
                                      (2, 2, 2, "1f1b", 0), (2, 2, 2, "1f1b", 1),
                                      (3, 2, 3, "afab", 1)]:
        for losses, _, _ in run_world(dp * pp, lambda c: pipeline_losses(
                c, name, "float64", dp, pp, m, schedule, zero=zero)):
            np.testing.assert_allclose(losses, ref, rtol=0, atol=TOL["float64"])


def test_one_f_one_b_idle_slots_and_peaks_follow_the_formulas(no_verification):
    pp, m = 4, 8
    held = {}
    for schedule in ("afab", "1f1b"):
        out, recorded = run_world(pp, lambda c, s=schedule: pipeline_losses(
            c, "mlp", "float32", 1, pp, m, s)[2], message_log=True)
        orders = [s.last_order for s in out]
        length, idle = slot_bubble(orders)
        assert length == 2 * (m + pp - 1)
        assert all(i == 2 * (pp - 1) for i in idle)
        assert idle[0] / length == pytest.approx(bubble_formula(pp, m)) == 3 / 11
        peaks = [s.last_peak for s in out]
        assert peaks == ([m] * pp if schedule == "afab" else [pp - i for i in range(pp)])
        held[schedule] = [s.last_peak_bytes for s in out]
        # per step: m activations and m gradients across each of the pp - 1 boundaries
        p2p = [r for r in recorded if r[0] == "p2p"]
        assert len(p2p) == STEPS * 2 * m * (pp - 1)
    # AFAB holds the outputs of all N samples; 1F1B those of its first pp - i microbatches (of
    # 2 samples each: 12 split into 8 is 2, 2, 2, 2, 1, 1, 1, 1)
    per_sample = [b / N for b in held["afab"]]
    assert held["1f1b"] == [2 * (pp - i) * per_sample[i] for i in range(pp)]


def test_timed_replay_by_hand():
    """Two stages, m = 2, 1F1B; stage 1 is twice as slow (forward 2, backward 4), stage 0 has
    forward 1, backward 2. By hand: stage 0 runs F0 [0,1] F1 [1,2], waits for B0 until stage 1
    has run F0 [1,3] B0 [3,7], so B0 [7,9]; stage 1 runs F1 [7,9] B1 [9,13]; stage 0 B1 [13,15].
    Length 15; idle 15 − 6 = 9 and 15 − 12 = 3. Unit times give the slot replay."""
    orders = [schedule_ops("1f1b", 2, 2, i) for i in range(2)]
    durations = [{("F", 0): 1, ("F", 1): 1, ("B", 0): 2, ("B", 1): 2},
                 {("F", 0): 2, ("F", 1): 2, ("B", 0): 4, ("B", 1): 4}]
    assert timed_bubble(orders, durations) == (15, [9, 3])
    assert timed_bubble(orders) == (6, [2, 2]) and slot_bubble(orders) == (6, [2, 2])


def test_schedules_by_hand():
    assert schedule_ops("1f1b", 3, 3, 0) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1),
                                             ("B", 2)]
    assert schedule_ops("1f1b", 4, 2, 0) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1),
                                             ("F", 3), ("B", 2), ("B", 3)]
    assert schedule_ops("1f1b", 4, 2, 1) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2),
                                             ("B", 2), ("F", 3), ("B", 3)]
    assert peak_in_flight(schedule_ops("afab", 5, 3, 2)) == 5
    with pytest.raises(ValueError, match="schedule"):
        schedule_ops("zigzag", 2, 2, 0)


def test_partition_balances_parameter_counts():
    assert partition_by_weight([1, 1, 1, 1], 2) == [0, 2, 4]
    assert partition_by_weight([10, 1, 1, 1, 1, 10], 3) == [0, 1, 5, 6]
    assert partition_by_weight([5], 1) == [0, 1]
    with pytest.raises(ValueError, match="pp: 3 stages"):
        partition_by_weight([1, 1], 3)


def test_grid_is_row_major_with_one_communicator_per_axis():
    def body(comm):
        g = ProcessGrid(comm, 2, 2, 2)
        sums = [int(allreduce(np.array([comm.rank]), comm=c)[0])
                for c in (g.dp_comm, g.pp_comm, g.tp_comm)]
        return (g.d, g.p, g.t), (g.dp_comm.rank, g.pp_comm.rank, g.tp_comm.rank), sums

    for rank, (coords, axis_ranks, sums) in enumerate(run_world(8, body)):
        d, p, t = coords
        assert rank == (d * 2 + p) * 2 + t and axis_ranks == coords
        assert sums == [sum(((dd * 2 + p) * 2 + t) for dd in range(2)),
                        sum(((d * 2 + pp) * 2 + t) for pp in range(2)),
                        sum(((d * 2 + p) * 2 + tt) for tt in range(2))]
    with pytest.raises(ValueError, match="must equal the number of ranks"):
        run_world(4, lambda c: ProcessGrid(c, 1, 3, 1))


def test_a_stage_that_raises_ends_the_job_within_the_timeout():
    world = ThreadWorld(4)

    def body(comm):
        comm.timeout = 3.0
        strategy = PipelineStrategy(comm, 1, 4, microbatches=4)
        model = make_model("mlp", "float32")
        strategy.setup(model, lambda p: optim.SGD(p, lr=0.1))
        if strategy.stage == 2:
            def boom(x):
                raise RuntimeError("stage 2 fails")
            strategy.pieces[0].forward = boom
        x, y = data("mlp", "float32")
        strategy.step(Batch(x, y, N, 0.1))

    start = time.monotonic()
    with pytest.raises((RuntimeError, TimeoutError)):
        world.run(body, timeout=30)
    assert time.monotonic() - start < 20


def test_train_pipeline_follows_one_rank():
    tiny = {"model.name": "gpt", "data.dataset": "addition", "data.digits": 1, "model.n_layer": 2,
            "model.n_head": 2, "model.n_embd": 8, "optim.global_batch_size": 12,
            "optim.optimizer": "adam", "output.progress": False, "optim.epochs": 1}

    def run(config, comm):
        out = io.StringIO()
        trainer = Trainer(config, comm=comm, out=out)
        trainer.setup()
        rows = trainer.run()
        with trainer.strategy.gathered():  # a stage holds only its own parameters
            params = np.concatenate([p.data.ravel() for p in trainer.model.parameters()])
        return params, rows, out.getvalue().split("\n", 1)[0]

    ref, ref_rows, _ = run_world(1, lambda c: run(TrainConfig.from_keys(tiny), c))[0]
    for kw, ranks in [(dict(pp=2, microbatches=3), "2 ranks (1 replica of 2 ranks), global "
                                                   "batch 12 (12 per replica)"),
                      (dict(pp=2, dp=2, schedule="afab", microbatches=2),
                       "4 ranks (2 replicas of 2 ranks), global batch 12 (6 per replica)"),
                      (dict(pp=2, dp=2, zero=1, microbatches=2), "4 ranks (2 replicas of 2")]:
        p = kw.get("dp", 1) * kw["pp"]
        results = run_world(p, lambda c, kw=kw: run(TrainConfig.from_keys({**tiny, **grid(kw)}), c))
        assert ranks in results[0][2], results[0][2]
        for params, rows, _ in results:
            np.testing.assert_allclose(params, ref, rtol=0, atol=1e-5)
            assert rows[0]["loss"] == pytest.approx(ref_rows[0]["loss"], abs=1e-5)
            assert rows[-1]["mode"] == "pipeline" and rows[-1]["pp"] == kw["pp"]
    tiny["model.n_head"] = 2
    for kw in (dict(tp=2, pp=2), dict(tp=2, dp=2, zero=1)):
        for params, rows, _ in run_world(4, lambda c, kw=kw: run(
                TrainConfig.from_keys({**tiny, **grid(kw)}), c)):
            np.testing.assert_allclose(params, ref, rtol=0, atol=1e-5)
            assert rows[-1]["zero_stage"] == kw.get("zero", 0)


def grid(kw: dict) -> dict:
    """The parallel section's options of a layout given by name (pp=2, dp=2, ...)."""
    return {f"parallel.{name}": value for name, value in kw.items()}


def mpdl_train(n: int, *flags: str) -> subprocess.CompletedProcess:
    binary = Path(sys.executable).parent
    cmd = ["timeout", "-k", "5", "120", str(binary / "mpiexec"), "-n", str(n),
           str(binary / "mpdl"), "train", "--no-progress", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=135, env=dict(os.environ))


@pytest.mark.parametrize("flags, message", [
    (["--pp", "3"], "--pp x --tp = 3 x 1 = 3 must divide the number of ranks (2)"),
    (["--dp", "2", "--pp", "2"], "--dp x --pp x --tp = 2 x 2 x 1 = 4 must equal the number of "
                                 "ranks (2)"),
    (["--pp", "2", "--zero", "2"], "--pp > 1 or --tp > 1 combine with --zero 1 only"),
    (["--pp", "2", "--schedule", "zigzag"], "--schedule: expected one of afab, 1f1b"),
    (["--microbatches", "4"], "--microbatches needs --pp > 1"),
    (["--tp", "2"], "--tp > 1 needs --model gpt"),
    (["--tp", "2", "--model", "gpt", "--n-head", "3", "--n-embd", "6"],
     "--tp 2 must divide --n-head 3"),
    (["--pp", "2", "--model", "resnet8"], "--pp needs --model mlp, lenet or gpt"),
])
def test_bad_grid_flags_exit_2_with_one_line(flags, message):
    out = mpdl_train(2, *flags)
    assert out.returncode == 2, (out.stdout, out.stderr)
    errors = out.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("mpdl train: error: "), out.stderr
    assert message in errors[0]


FAILING_STAGE = """
import numpy as np
from mpi4py import MPI
from mpdl.autograd import nn, optim
from mpdl.comm import as_communicator
from mpdl.parallel.pipeline import PipelineStrategy
from mpdl.parallel.strategy import Batch

comm = as_communicator(MPI.COMM_WORLD)
strategy = PipelineStrategy(comm, 1, 2, microbatches=2)
model = nn.Sequential(nn.Linear(4, 4, seed=0), nn.ReLU(), nn.Linear(4, 3, seed=1))
strategy.setup(model, lambda p: optim.SGD(p, lr=0.1))
if strategy.stage == 1:
    def boom(x):
        raise RuntimeError("stage 1 fails")
    strategy.pieces[0].forward = boom
x = np.ones((4, 4), dtype=np.float32)
strategy.step(Batch(x, np.zeros(4, dtype=np.int64), 4, 0.1))
"""


def test_a_stage_that_raises_ends_the_mpi_job(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(FAILING_STAGE)
    binary = Path(sys.executable).parent
    start = time.monotonic()
    out = subprocess.run(["timeout", "-k", "5", "60", str(binary / "mpiexec"), "-n", "2",
                          sys.executable, "-m", "mpi4py", str(script)], capture_output=True,
                         text=True, timeout=75, env={**os.environ, "MPDL_TIMEOUT": "10"},
                         cwd=tmp_path)  # its flight records land there, not in the checkout
    assert out.returncode not in (0, 124), (out.stdout, out.stderr)
    assert "stage 1 fails" in out.stderr
    assert time.monotonic() - start < 40


@pytest.mark.parametrize("first, second", [(dict(pp=2, tp=2), dict(pp=2, dp=2)),
                                           (dict(tp=2, dp=2), dict()),
                                           (dict(), dict(pp=3, microbatches=2)),
                                           (dict(pp=2, dp=2), dict(tp=2, pp=2)),
                                           (dict(pp=2, dp=2, zero=1), dict(tp=2, dp=2, zero=1)),
                                           (dict(tp=2, dp=2, zero=1), dict(pp=4)),
                                           (dict(pp=4, schedule="afab"), dict()),
                                           (dict(dp=3, zero=1, tp=2), dict(zero=1, dp=2))])
def test_checkpoint_continues_on_another_layout(tmp_path, first, second):
    """Each stage and tensor-parallel shard writes its part (with ZeRO-1 each dp rank its block
    of the optimizer state); any layout (or one rank without a pipeline) continues from them and
    ends where the uninterrupted run ends."""
    tiny = {"model.name": "gpt", "data.dataset": "addition", "data.digits": 1, "model.n_layer": 2,
            "model.n_head": 2, "model.n_embd": 8, "optim.global_batch_size": 12,
            "optim.optimizer": "adam", "output.progress": False,
            "optim.lr_schedule": "constant"}

    def run(config, comm):
        trainer = Trainer(config, comm=comm, out=io.StringIO())
        trainer.setup()
        trainer.run()
        with trainer.strategy.gathered():
            return np.concatenate([p.data.ravel() for p in trainer.model.parameters()])

    def size(kw):
        return kw.get("dp", 1) * kw.get("pp", 1) * kw.get("tp", 1)

    ref = run_world(1, lambda c: run(TrainConfig.from_keys({**tiny, "optim.epochs": 2}), c))[0]
    ckpt = str(tmp_path / "ckpt")
    saved = run_world(size(first), lambda c: run(TrainConfig.from_keys(
        {**tiny, "optim.epochs": 1, "checkpoint.dir": ckpt, **grid(first)}), c))[0]
    files = sorted(os.listdir(ckpt))
    if first.get("pp", 1) * first.get("tp", 1) > 1:  # a part per stage and shard, none whole
        parts = first.get("pp", 1) * first.get("tp", 1) * (first.get("dp", 1) if first.get(
            "zero") else 1)
        assert files == [f for f in files if f.startswith("shard-")] + ["state.json"]
        assert len(files) - 1 == parts, files
    model_state, _, _ = load_checkpoint(ckpt)
    np.testing.assert_array_equal(np.concatenate([model_state[n].ravel() for n, _ in make_gpt(
        tiny).named_parameters()]), saved)
    for params in run_world(size(second), lambda c: run(TrainConfig.from_keys(
            {**tiny, "optim.epochs": 2, "checkpoint.dir": ckpt, "checkpoint.resume": True,
             **grid(second)}), c)):
        np.testing.assert_allclose(params, ref, rtol=0, atol=1e-5)


def make_gpt(tiny: dict):
    """A GPT of the tiny run's shape (for its parameter names and order)."""
    return GPT(vocab_size=13, block_size=3, n_layer=tiny["model.n_layer"],
               n_head=tiny["model.n_head"], n_embd=tiny["model.n_embd"], seed=0)


def test_compare_runs_reads_per_stage_checkpoints(tmp_path):
    """tools/compare_runs.py compares a one-rank run with a dp 2 × pp 2 × ZeRO-1 one from their
    JSON rows and their checkpoints (whole against parts)."""
    tiny = {"model.name": "gpt", "data.dataset": "addition", "data.digits": 1, "model.n_layer": 2,
            "model.n_head": 2, "model.n_embd": 8, "optim.global_batch_size": 12,
            "optim.optimizer": "adam", "output.progress": False, "optim.epochs": 2}

    def run(prefix, comm, **kw):
        trainer = Trainer(TrainConfig.from_keys({**tiny, "checkpoint.dir": str(tmp_path / prefix),
                                                 "output.json": str(tmp_path / f"{prefix}.jsonl"),
                                                 **grid(kw)}), comm=comm, out=io.StringIO())
        trainer.setup()
        trainer.run()

    run_world(1, lambda c: run("one", c))
    run_world(4, lambda c: run("grid", c, pp=2, dp=2, zero=1, microbatches=2))
    tool = Path(__file__).resolve().parents[1] / "tools" / "compare_runs.py"
    out = subprocess.run([sys.executable, str(tool), str(tmp_path / "one"),
                          str(tmp_path / "grid"), "--atol", "1e-5"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and ": same" in out.stdout, (out.stdout, out.stderr)


def test_timeline_shows_each_microbatch_and_message_per_rank(tmp_path):
    path = str(tmp_path / "trace.json")
    config = TrainConfig.from_keys({
        "model.name": "gpt", "data.dataset": "addition", "data.digits": 1, "model.n_layer": 2,
        "model.n_head": 2, "model.n_embd": 8, "optim.global_batch_size": 12, "optim.epochs": 1,
        "optim.optimizer": "adam", "output.progress": False, "parallel.pp": 2,
        "parallel.microbatches": 2, "output.timeline": path})

    def body(comm):
        trainer = Trainer(config, comm=comm, out=io.StringIO())
        trainer.setup()
        trainer.run()

    run_world(2, body)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    names = {pid: {e["name"] for e in events if e["pid"] == pid} for pid in (0, 1)}
    assert {"forward 0", "forward 1", "backward 0", "backward 1", "send act 0", "send act 1",
            "recv grad 0", "recv grad 1"} <= names[0]
    assert {"forward 0", "backward 1", "recv act 0", "recv act 1", "send grad 0",
            "send grad 1"} <= names[1]
    assert not {"recv act 0", "send grad 0"} & names[0]


def test_a_stage_holds_only_its_own_parameters():
    """Parameter bytes per rank (the most of any rank) at pp = 2 and 4 are about 1/pp of one
    rank's for a GPT of 8 blocks (the tied embedding is held by both end stages), tp = 2 halves
    the blocks' share; the whole model, gathered, is the one a single rank builds (same seed)."""
    def make():
        return GPT(vocab_size=11, block_size=6, n_layer=8, n_head=2, n_embd=16, seed=0)

    whole = np.concatenate([p.data.ravel() for p in make().parameters()])
    x, y = data("gpt", "float32")

    def body(comm, pp, tp):
        strategy = PipelineStrategy(comm, 1, pp, tp, microbatches=2)
        strategy.setup(make(), lambda p: optim.SGD(p, lr=0.0))
        with strategy.gathered():
            params = np.concatenate([p.data.ravel() for p in strategy.model.parameters()])
        strategy.step(Batch(x, y, N, 0.0))
        with strategy.gathered():
            pass
        return params, strategy.rank_parameter_bytes, strategy.parameter_bytes, \
            strategy.model_state_bytes

    held = {}
    for pp, tp in [(1, 1), (2, 1), (4, 1), (1, 2)]:
        out = run_world(pp * tp, lambda c, pp=pp, tp=tp: body(c, pp, tp))
        for params, _, most, _ in out:
            np.testing.assert_array_equal(params, whole)
            assert most == max(o[1] for o in out)
        held[pp, tp] = out[0][2]
    assert held[1, 1] == whole.nbytes
    assert held[2, 1] <= 0.6 * held[1, 1]
    assert held[4, 1] <= 0.35 * held[1, 1]
    assert held[1, 2] <= 0.6 * held[1, 1]


def test_receives_are_kept_for_two_batch_sizes_and_give_the_same_steps():
    """Steps alternating a full batch and a short one (an epoch's last) reuse each shape's
    persistent receives (at most 4 m per stage: two kinds, m microbatches, two batch sizes) and
    reach the bytes of a one-process loop over the same microbatches."""
    m, sizes = 3, [12, 7, 12, 7, 12]
    x, y = data("mlp", "float64")

    def body(c):
        s = PipelineStrategy(c, 1, 3, microbatches=m, schedule="1f1b")
        s.setup(make_model("mlp", "float64"), lambda p: optim.Adam(p, lr=1e-2))
        seen = []
        for n in sizes:
            s.step(Batch(x[:n], y[:n], n, 1e-2))
            seen.append({k: id(r) for k, r in s._receives.items()})
        with s.gathered():
            params = np.concatenate([p.data.ravel() for p in s.model.parameters()])
        return seen, params

    model = make_model("mlp", "float64")
    opt = optim.Adam(model.parameters(), lr=1e-2)
    for n in sizes:
        for idx in np.array_split(np.arange(n), m):
            (F.cross_entropy(model(Tensor(x[idx])), y[idx]) * (len(idx) / n)).backward()
        opt.step()
        opt.zero_grad()
    expected = np.concatenate([p.data.ravel() for p in model.parameters()])
    for stage, (seen, params) in enumerate(run_world(3, body)):
        kinds = {0: 1, 1: 2, 2: 1}[stage]  # the middle stage receives activations and gradients
        assert len(seen[1]) == len(seen[-1]) == 2 * kinds * m
        assert seen[2].items() >= seen[0].items() and seen[-1] == seen[1]  # reused, not remade
        assert params.tobytes() == expected.tobytes()
