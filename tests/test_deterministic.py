"""Deterministic training on the in-process world: exact sums of atom gradients whatever the
number of ranks and the order, the sampler's atoms, the same parameter hash on 1 and 3 ranks,
and the one-line refusals of what the mode does not cover."""

from __future__ import annotations

import hashlib
import io

import numpy as np
import pytest

from mpdl.parallel import DistributedSampler
from mpdl.parallel.deterministic import exact_sum, grid_bits, param_sha256
from mpdl.threadworld import run_world
from mpdl.training.config import ConfigError, TrainConfig, validate
from mpdl.training.loop import Trainer

RNG = np.random.default_rng(3)
SIZES = [5, 1, 7]
#: 7 atoms of gradients spanning many magnitudes, so that float sums depend on their order
ATOMS = [(RNG.standard_normal(13) * 10.0 ** RNG.integers(-6, 6, 13)).astype(np.float32)
         for _ in range(7)]


def summed(p: int, order: list[int], shard: bool = False) -> list[np.ndarray]:
    def body(comm):
        mine = [ATOMS[a] for a in np.array_split(np.array(order), p)[comm.rank]]
        return exact_sum(mine, SIZES, len(ATOMS), comm, shard=shard)
    return run_world(p, body)


def test_exact_sum_is_the_same_bits_on_any_rank_count_and_order():
    reference = summed(1, list(range(7)))[0]
    exact = np.sum(np.array(ATOMS, dtype=np.float64), axis=0)
    np.testing.assert_allclose(reference, exact, rtol=1e-6)
    for p, order in ((2, [6, 5, 4, 3, 2, 1, 0]), (3, [2, 0, 6, 1, 5, 3, 4]), (4, list(range(7))),
                     (5, [1, 3, 5, 0, 2, 4, 6])):
        for result in summed(p, order):
            assert result.tobytes() == reference.tobytes(), (p, order)


def test_exact_sum_shards_are_blocks_of_the_whole():
    whole = summed(1, list(range(7)))[0]
    blocks = summed(3, [4, 2, 0, 1, 3, 5, 6], shard=True)
    assert np.concatenate(blocks).tobytes() == whole.tobytes()
    assert [len(b) for b in blocks] == [5, 4, 4]


def test_float_sums_of_these_atoms_do_depend_on_the_order():
    forward = np.float32(0) + np.zeros(13, np.float32)
    for g in ATOMS:
        forward = forward + g
    backward = np.zeros(13, np.float32)
    for g in reversed(ATOMS):
        backward = backward + g
    assert forward.tobytes() != backward.tobytes()


def test_grid_leaves_room_for_every_atom():
    assert grid_bits(1) == 62 and grid_bits(8) == 59 and grid_bits(9) == 58
    assert 9 * 2 ** grid_bits(9) <= 2 ** 63 - 1


def test_sampler_gives_each_rank_whole_atoms():
    # 10 samples in 4 atoms: 3, 3, 2, 2; on 3 ranks the atoms split 2, 1, 1
    slices = [DistributedSampler(10, 10, rank=r, num_replicas=3, shuffle=False, atoms=4)
              for r in range(3)]
    got = [next(iter(s)) for s in slices]
    assert [list(idx) for idx, _ in got] == [[0, 1, 2, 3, 4, 5], [6, 7], [8, 9]]
    assert [s.local_atoms(10) for s in slices] == [[3, 3], [2], [2]]
    assert DistributedSampler(10, 10, rank=4, num_replicas=5, atoms=4).local_atoms(10) == []
    with pytest.raises(ValueError, match="atoms: expected an integer >= 0"):
        DistributedSampler(10, 10, atoms=-1)


def test_param_sha256_hashes_names_shapes_and_bytes():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    h = hashlib.sha256()
    h.update(b"w:<f4:(2, 3);")
    h.update(a.tobytes())
    assert param_sha256([("w", a)]) == h.hexdigest()
    assert param_sha256([("w", a.reshape(3, 2))]) != param_sha256([("w", a)])


#: an MLP on the shipped digits, 1797 = 28 x 64 + 5 samples: the last batch of each epoch is short
MLP = {"optim.epochs": 1, "optim.seed": 4, "optim.deterministic": True, "optim.atoms": 5,
       "output.progress": False}


def digest(p: int, changes: dict) -> list[str]:
    def body(comm):
        trainer = Trainer(TrainConfig.from_keys({**MLP, **changes}), comm=comm, out=io.StringIO())
        trainer.setup()
        return trainer.run()[-1]["param_sha256"]
    return run_world(p, body)


def test_mlp_has_the_same_hash_on_one_and_three_ranks_and_with_zero():
    one = digest(1, {})[0]
    assert set(digest(3, {"communication.algorithm": "ring"})) == {one}
    assert set(digest(2, {"parallel.zero": 3})) == {one}
    assert digest(1, {"optim.atoms": 4})[0] != one  # other atoms, other roundings


#: a 2-layer GPT on 1-digit addition: 90 problems in batches of 32, the last one of 26
GPT = {"model.name": "gpt", "data.dataset": "addition", "data.digits": 1, "model.n_layer": 2,
       "model.n_head": 2, "model.n_embd": 16, "optim.global_batch_size": 32, "optim.lr": 0.05,
       "optim.optimizer": "sgd", "optim.seed": 6, "optim.epochs": 1, "optim.atoms": 5,
       "optim.deterministic": True, "output.progress": False}


def gpt_digest(p: int, changes: dict) -> list[str]:
    def body(comm):
        trainer = Trainer(TrainConfig.from_keys({**GPT, **changes}), comm=comm, out=io.StringIO())
        trainer.setup()
        return trainer.run()[-1]["param_sha256"]
    return run_world(p, body)


def test_gpt_pipeline_has_one_ranks_hash():
    one = gpt_digest(1, {})[0]
    assert set(gpt_digest(2, {"parallel.pp": 2, "parallel.microbatches": 2})) == {one}
    assert set(gpt_digest(3, {"parallel.pp": 3})) == {one}  # the tied halves on two stages of 3
    assert gpt_digest(1, {"optim.atoms": 4})[0] != one  # other atoms, other roundings


#: the GPT with a MoE layer (4 experts, top-2, dropless) in each block, trained by Adam for 2 epochs
MOE = {**GPT, "model.moe_experts": 4, "optim.optimizer": "adam", "optim.lr": 0.01,
       "optim.epochs": 2, "output.log_interval": 1}


def moe_steps(p: int, changes: dict) -> list[tuple[list[float], str]]:
    """Per rank: (rank 0's loss of every step, the final parameter hash)."""
    def body(comm):
        trainer = Trainer(TrainConfig.from_keys({**MOE, **changes}), comm=comm, out=io.StringIO())
        trainer.setup()
        digest = trainer.run()[-1]["param_sha256"]
        return [f["loss"] for _, f in trainer.report.events if "loss" in f], digest
    return run_world(p, body)


def test_experts_over_ranks_have_one_ranks_losses_and_hash():
    (losses, digest), = moe_steps(1, {})
    assert len(losses) == 6 and len(set(losses)) == 6
    for p, ep in ((2, 2), (3, 1), (4, 4), (4, 2)):
        runs = moe_steps(p, {"parallel.ep": ep})
        assert runs[0][0] == losses, (p, ep)  # every step's loss to the bit
        assert {d for _, d in runs} == {digest}, (p, ep)
    assert moe_steps(1, {"model.moe_aux_loss_coef": 0.0})[0][1] != digest  # the aux loss trains


@pytest.mark.parametrize("changes, words", [
    ({"parallel.pp": 2, "parallel.schedule": "afab"}, "parallel.schedule: only the 1f1b"),
    ({**MOE, "parallel.ep": 2, "parallel.zero": 1},
     "parallel.zero: with parallel.pp or parallel.ep the update is not"),
    ({**MOE, "parallel.pp": 2}, "model.moe_experts: a pipeline's stages do not run experts"),
    ({"parallel.pp": 2, "parallel.zero": 1}, "parallel.zero: with parallel.pp or parallel.ep"),
    ({"parallel.tp": 2, "model.name": "gpt", "data.dataset": "addition"},
     "parallel.tp: tensor parallelism splits each GEMM"),
    ({"communication.compression": "fp16"}, "communication.compression: compression is lossy"),
    ({"optim.precision": "bf16"}, "optim.precision: it needs fp32"),
    ({"parallel.zero": 1, "optim.optimizer": "lars"}, "lars, lamb and muon need whole tensors"),
])
def test_what_deterministic_does_not_cover_is_refused_in_one_line(changes, words):
    with pytest.raises(ConfigError) as info:
        validate(TrainConfig.from_keys({**MLP, **changes}), 2)
    message = str(info.value)
    assert message.startswith("optim.deterministic cannot be combined with ")
    assert words in message and "\n" not in message


def counted_run(p: int, grad_accum: int, use_count: bool) -> list[np.ndarray]:
    """A tiny GPT, 3 steps of 12 sequences whose targets are masked (-100) unevenly, by
    AllReduceStrategy on p in-process ranks."""
    from mpdl.autograd import optim  # noqa: PLC0415
    from mpdl.models.zoo import build_model  # noqa: PLC0415
    from mpdl.parallel.data_parallel import AllReduceStrategy  # noqa: PLC0415
    from mpdl.parallel.strategy import Batch  # noqa: PLC0415

    rng = np.random.default_rng(5)
    x = rng.integers(0, 7, (36, 6))
    y = rng.integers(0, 7, (36, 6))
    y[np.arange(6) >= rng.integers(1, 7, 36)[:, None]] = -100  # 1 to 6 targets a sequence

    def body(comm):
        s = AllReduceStrategy(comm, algorithm="ring", grad_accum=grad_accum)
        s.setup(build_model("gpt", (6,), 7, seed=2, dtype=np.float64, n_layer=1, n_head=2,
                            n_embd=8), lambda params: optim.SGD(params, lr=0.5))
        for step in range(3):
            rows = np.arange(12 * step, 12 * step + 12)
            mine = np.array_split(rows, comm.size)[comm.rank]
            count = int((y[rows] >= 0).sum()) if use_count else 0
            s.step(Batch(x[mine], y[mine], 12, 0.5, count=count))
        return [p.data.copy() for p in s.model.parameters()]
    return run_world(p, body)[0]


def test_ranks_and_microbatches_weight_by_the_step_count_of_targets():
    reference = counted_run(1, 1, True)
    for p, accum in ((3, 1), (2, 2), (1, 4)):
        for a, b in zip(counted_run(p, accum, True), reference, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
    # the per-part mean weighted by samples is another (wrong) gradient when counts differ
    wrong = counted_run(3, 1, False)
    assert max(np.max(np.abs(a - b)) for a, b in zip(wrong, reference, strict=True)) > 1e-4
