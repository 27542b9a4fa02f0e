"""nanoGPT's optimizer recipe: AdamW decaying the matrices only, clipping by the global gradient
norm and the step-based cosine schedule, against PyTorch (the oracle) and NumPy references."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpdl.autograd import nn, optim
from mpdl.autograd.tensor import Tensor

torch = pytest.importorskip("torch", reason="PyTorch is the optional oracle for these tests")

SHAPES = {"weight": (4, 3), "bias": (3,), "embedding": (5, 4), "norm": (4,)}


def params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape) for name, shape in SHAPES.items()}


def grads(step: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return {name: scale * rng.standard_normal(shape) for name, shape in SHAPES.items()}


def run_ours(make, steps: int = 6, scale: float = 1.0, clip: float | None = None):
    ours = {k: nn.Parameter(v.copy()) for k, v in params().items()}
    opt = make(list(ours.values()))
    opt.max_grad_norm = clip
    norms = []
    for k in range(steps):
        for name, g in grads(k, scale).items():
            ours[name].grad = g.copy()
        opt.step()
        norms.append(opt.grad_norm)
    return {k: p.data for k, p in ours.items()}, norms


def run_torch(make, steps: int = 6, scale: float = 1.0, clip: float | None = None):
    theirs = {k: torch.tensor(v.copy(), requires_grad=True) for k, v in params().items()}
    opt = make(theirs)
    norms = []
    for k in range(steps):
        for name, g in grads(k, scale).items():
            theirs[name].grad = torch.tensor(g)
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(theirs.values()), clip)))
        opt.step()
    return {k: t.detach().numpy() for k, t in theirs.items()}, norms


def torch_adamw_matrices(theirs, **kw):
    """nanoGPT's configure_optimizers: decay the parameters of 2 or more dimensions only."""
    decay = [t for t in theirs.values() if t.dim() >= 2]
    other = [t for t in theirs.values() if t.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": other, "weight_decay": 0.0}], **kw)


def test_adamw_decays_the_matrices_as_nanogpt_does_with_pytorch():
    kw = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-7)
    ours, _ = run_ours(lambda p: optim.AdamW(p, weight_decay=0.1, decay="matrices", **kw))
    theirs, _ = run_torch(lambda t: torch_adamw_matrices(t, **kw))
    for name in SHAPES:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-12, atol=1e-12,
                                   err_msg=name)
    # and the decay matters: every parameter decayed is another trajectory
    everything, _ = run_ours(lambda p: optim.AdamW(p, weight_decay=0.1, decay="all", **kw))
    assert not np.allclose(everything["bias"], theirs["bias"], rtol=1e-6)
    np.testing.assert_allclose(everything["weight"], theirs["weight"], rtol=1e-12)


def test_adamw_flags_per_parameter_follow_pytorch_groups():
    flags = [True, True, False, False]  # weight, bias, embedding, norm
    ours, _ = run_ours(lambda p: optim.AdamW(p, lr=0.02, weight_decay=0.3, decay=flags))
    names = list(SHAPES)

    def groups(t):
        return torch.optim.AdamW(
            [{"params": [t[n] for n, f in zip(names, flags, strict=True) if f],
              "weight_decay": 0.3},
             {"params": [t[n] for n, f in zip(names, flags, strict=True) if not f],
              "weight_decay": 0.0}], lr=0.02)

    theirs, _ = run_torch(groups)
    for name in SHAPES:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="3 flags for 4 parameters"):
        optim.AdamW([nn.Parameter(v) for v in params().values()], decay=flags[:3])
    with pytest.raises(ValueError, match="decay must be one of all, matrices"):
        optim.AdamW([nn.Parameter(v) for v in params().values()], decay="vectors")


def test_a_shard_is_decayed_by_its_whole_tensors_dimensions():
    """Flat 1-D pieces of a matrix and of a bias (as ZeRO hands them over): the piece of the
    matrix decays, the piece of the bias does not; NumPy reference of one AdamW step."""
    rng = np.random.default_rng(3)
    w, b, gw, gb = (rng.standard_normal(6) for _ in range(4))
    pw, pb = Tensor(w.copy(), requires_grad=True), Tensor(b.copy(), requires_grad=True)
    opt = optim.AdamW([pw, pb], lr=0.1, weight_decay=0.5, decay="matrices")
    opt.shard({id(pw): 2, id(pb): 1}, lambda ps, sums: sums)
    pw.grad, pb.grad = gw.copy(), gb.copy()
    opt.step()

    def adamw(x, g, decay):  # step 1: m̂ = g, v̂ = g²
        return x * (1 - 0.1 * decay) - 0.1 * g / (np.abs(g) + 1e-8)

    np.testing.assert_allclose(pw.data, adamw(w, gw, 0.5), rtol=1e-12)
    np.testing.assert_allclose(pb.data, adamw(b, gb, 0.0), rtol=1e-12)


@pytest.mark.parametrize("scale,clip", [(1.0, 0.5), (1.0, 100.0), (30.0, 1.0)],
                         ids=["binding", "loose", "large-gradients"])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_clipping_by_the_global_norm_matches_pytorch(kind, scale, clip):
    if kind == "sgd":
        ours_make = lambda p: optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
        theirs_make = lambda t: torch.optim.SGD(list(t.values()), lr=0.1, momentum=0.9)  # noqa: E731
    else:
        ours_make = lambda p: optim.AdamW(p, lr=0.01, weight_decay=0.1, decay="matrices")  # noqa: E731
        theirs_make = lambda t: torch_adamw_matrices(t, lr=0.01)  # noqa: E731
    ours, our_norms = run_ours(ours_make, scale=scale, clip=clip)
    theirs, their_norms = run_torch(theirs_make, scale=scale, clip=clip)
    np.testing.assert_allclose(our_norms, their_norms, rtol=1e-12)
    for name in SHAPES:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-10, atol=1e-12)
    unclipped, _ = run_ours(ours_make, scale=scale)
    binds = max(their_norms) > clip
    assert binds == (not np.allclose(unclipped["weight"], ours["weight"], rtol=1e-9))


def test_the_clipped_gradient_and_norm_from_numpy():
    """One SGD step at lr 1: the update is the clipped gradient g·c/(‖g‖ + 1e-6)."""
    g = {"a": np.array([[3.0, 0.0]]), "b": np.array([4.0])}  # global norm 5
    ps = [nn.Parameter(np.zeros((1, 2))), nn.Parameter(np.zeros(1))]
    opt = optim.SGD(ps, lr=1.0)
    opt.max_grad_norm = 2.0
    ps[0].grad, ps[1].grad = g["a"].copy(), g["b"].copy()
    opt.step()
    assert opt.grad_norm == 5.0
    coef = 2.0 / (5.0 + 1e-6)
    np.testing.assert_allclose(ps[0].data, -g["a"] * coef, rtol=1e-15)
    np.testing.assert_allclose(ps[1].data, -g["b"] * coef, rtol=1e-15)


def test_a_declared_total_counts_the_whole_model():
    """`global_norm`: the norm is that of the total the strategy returns (here: the other ranks'
    pieces add 11), and the hook sees each parameter's own sum of squares."""
    seen = []
    p = nn.Parameter(np.zeros(2))
    opt = optim.SGD([p], lr=1.0)
    opt.max_grad_norm = 1.0
    opt.global_norm(lambda params, sums: seen.append((params, sums)) or sum(sums) + 11.0)
    p.grad = np.array([1.0, 2.0])
    opt.step()
    assert seen == [([p], [5.0])]
    assert opt.grad_norm == 4.0
    np.testing.assert_allclose(p.data, -np.array([1.0, 2.0]) / (4.0 + 1e-6), rtol=1e-15)


def nanogpt_get_lr(it: int, lr: float, warmup: int, decay: int, min_lr: float) -> float:
    """nanoGPT's train.py get_lr, verbatim but for the names."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay:
        return min_lr
    decay_ratio = (it - warmup) / (decay - warmup)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (lr - min_lr)


@pytest.mark.parametrize("warmup,decay", [(100, 2000), (0, 50), (10, 10)])
def test_the_step_schedule_is_nanogpts(warmup, decay):
    schedule = optim.CosineSchedule(1e-3, warmup, decay, 1e-4)
    for step in range(decay + 100):
        if warmup == decay == step:  # nanoGPT divides by zero there; its limit is min_lr
            assert schedule(step) == 1e-4
            continue
        assert schedule(step) == pytest.approx(nanogpt_get_lr(step, 1e-3, warmup, decay, 1e-4),
                                               rel=1e-12)


def test_the_step_schedule_at_its_anchors():
    schedule = optim.CosineSchedule(1e-3, 100, 2000, 1e-4)
    assert schedule(0) == pytest.approx(1e-3 / 101)
    assert schedule(99) == pytest.approx(1e-3 * 100 / 101)
    assert schedule(100) == pytest.approx(1e-3)
    assert schedule(1050) == pytest.approx((1e-3 + 1e-4) / 2)
    assert schedule(2000) == schedule(5000) == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="decay_steps 5 must not be below warmup_steps 6"):
        optim.CosineSchedule(1e-3, 6, 5)
    with pytest.raises(ValueError, match="min_lr"):
        optim.CosineSchedule(1e-3, 0, 5, min_lr=1e-2)
