"""Modules, optimizers, schedules, and an MLP trained on the UCI handwritten digits."""

import contextlib
import json

import numpy as np
import pytest

import mpdl.autograd.functional as F
from mpdl.autograd import Tensor, nn, no_grad, optim
from mpdl.datasets import load_digits


def small_cnn(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1, rng=rng, dtype=dtype), nn.BatchNorm2d(4, dtype=dtype),
        nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 4 * 4, 10, rng=rng, dtype=dtype),
        nn.BatchNorm1d(10, dtype=dtype), nn.Dropout(0.1, seed=seed))


def test_named_parameters_and_buffers_follow_registration_order():
    model = small_cnn()
    assert [n for n, _ in model.named_parameters()] == [
        "0.weight", "0.bias", "1.weight", "1.bias", "5.weight", "5.bias", "6.weight", "6.bias"]
    assert [n for n, _ in model.named_buffers()] == [
        "1.running_mean", "1.running_var", "1.num_batches_tracked",
        "6.running_mean", "6.running_var", "6.num_batches_tracked"]
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in model.parameters())
    assert len(model.buffers()) == 6 and len(model) == 8 and isinstance(model[0], nn.Conv2d)


def test_nested_modules_and_shared_parameters():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(3, 4, seed=0)
            self.body = nn.Sequential(nn.ReLU(), nn.Linear(4, 4, bias=False, seed=1))
            self.tied = self.fc1

        def forward(self, x):
            return self.body(self.fc1(x))

    net = Net()
    assert [n for n, _ in net.named_parameters()] == ["fc1.weight", "fc1.bias", "body.1.weight"]
    assert net(Tensor(np.ones((2, 3), np.float32))).shape == (2, 4)
    with pytest.raises(AttributeError, match="nothing"):
        _ = net.nothing

    class Broken(nn.Module):
        def __init__(self):
            self.fc = nn.Linear(2, 2)

    with pytest.raises(AttributeError, match="super"):
        Broken()


def test_same_seed_builds_identical_models_and_init_matches_pytorch_bounds():
    a, b, c = small_cnn(seed=3), small_cnn(seed=3), small_cnn(seed=4)
    for (_, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        np.testing.assert_array_equal(pa.data, pb.data)
        assert pa.dtype == np.float32
    assert not np.array_equal(a[0].weight.data, c[0].weight.data)
    lin = nn.Linear(400, 30, seed=0, dtype=np.float64)
    assert lin.weight.dtype == np.float64
    bound = 1 / np.sqrt(400)
    assert np.abs(lin.weight.data).max() <= bound and np.abs(lin.weight.data).max() > 0.9 * bound
    assert np.abs(lin.bias.data).max() <= bound
    conv = nn.Conv2d(3, 8, 5, seed=0)
    assert np.abs(conv.weight.data).max() <= 1 / np.sqrt(75)
    with pytest.raises(ValueError, match="not both"):
        nn.Linear(2, 2, rng=np.random.default_rng(0), seed=0)


def test_state_dict_round_trip_and_errors():
    model, other = small_cnn(seed=0), small_cnn(seed=1)
    model.train()
    model(Tensor(np.random.default_rng(0).random((5, 1, 8, 8), dtype=np.float32)))
    state = model.state_dict()
    assert all(isinstance(v, np.ndarray) for v in state.values())
    assert int(state["1.num_batches_tracked"]) == 1
    state["0.weight"] += 0  # a host copy: editing it leaves the model alone
    other.load_state_dict(state)
    for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items(),
                                 strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)
    with pytest.raises(ValueError, match="missing keys"):
        other.load_state_dict({k: v for k, v in state.items() if k != "0.bias"})
    with pytest.raises(ValueError, match="unexpected keys"):
        other.load_state_dict({**state, "extra": np.zeros(1)})
    with pytest.raises(ValueError, match=r"'0.weight'.*\(4, 1, 3, 3\)"):
        other.load_state_dict({**state, "0.weight": np.zeros((4, 1, 2, 2))})


def test_train_eval_switch_batch_norm_statistics_and_dropout():
    bn = nn.BatchNorm1d(3)
    x = np.random.default_rng(0).normal(2.0, 3.0, size=(64, 3)).astype(np.float32)
    y = bn(Tensor(x))
    np.testing.assert_allclose(y.data.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(bn.running_mean.data, 0.1 * x.mean(0), rtol=1e-5)
    np.testing.assert_allclose(bn.running_var.data, 0.9 + 0.1 * x.var(0, ddof=1), rtol=1e-5)
    bn.eval()
    expected = (x - bn.running_mean.data) / np.sqrt(bn.running_var.data + 1e-5)
    np.testing.assert_allclose(bn(Tensor(x)).data, expected, rtol=1e-5, atol=1e-6)
    assert int(bn.num_batches_tracked.data) == 1
    with pytest.raises(ValueError, match="3 channels"):
        bn(Tensor(np.ones((2, 4), np.float32)))
    model = small_cnn().eval()
    assert not any(m.training for _, m in model.named_modules())
    x = Tensor(np.ones((2, 1, 8, 8), np.float32))
    np.testing.assert_array_equal(model(x).data, model(x).data)


def quadratic_problem(opt_factory, steps=200):
    """Minimise ||W - T||² + ||b - t||² under warmup + cosine decay; return the final distance."""
    rng = np.random.default_rng(0)
    w = nn.Parameter(rng.standard_normal((4, 3)).astype(np.float32))
    b = nn.Parameter(rng.standard_normal(3).astype(np.float32))
    target_w, target_b = np.ones((4, 3), np.float32), np.full(3, 0.5, np.float32)
    opt = opt_factory([w, b])
    schedule = optim.WarmupSchedule(opt.lr, warmup_steps=10, total_steps=steps, kind="cosine")
    for i in range(steps):
        opt.lr = schedule(i)
        loss = ((w - target_w) ** 2).sum() + ((b - target_b) ** 2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert w.dtype == np.float32 and b.dtype == np.float32
    return float(np.abs(w.data - target_w).max() + np.abs(b.data - target_b).max())


@pytest.mark.parametrize("factory", [
    lambda p: optim.SGD(p, lr=0.1),
    lambda p: optim.SGD(p, lr=0.05, momentum=0.9),
    lambda p: optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    lambda p: optim.Adam(p, lr=0.05),
    lambda p: optim.AdamW(p, lr=0.05, weight_decay=0.0),
    lambda p: optim.LARS(p, lr=1.0, momentum=0.9, eta=0.02),
    lambda p: optim.LAMB(p, lr=0.05),
], ids=["sgd", "momentum", "nesterov", "adam", "adamw", "lars", "lamb"])
def test_optimizers_converge_on_a_quadratic(factory):
    assert quadratic_problem(factory, steps=300) < 0.05


def test_sgd_matches_the_pytorch_update_rule_by_hand():
    p = nn.Parameter(np.array([1.0, -2.0]))
    opt = optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    grads = [np.array([0.5, 0.25]), np.array([-1.0, 2.0])]
    w, buf = np.array([1.0, -2.0]), None
    for g in grads:
        p.grad = g.copy()
        opt.step()
        d = g + 0.01 * w
        buf = d if buf is None else 0.9 * buf + d
        w = w - 0.1 * (d + 0.9 * buf)
        np.testing.assert_allclose(p.data, w)


def test_lars_trust_ratio_and_1d_exclusion():
    w = nn.Parameter(np.full((2, 2), 3.0))
    b = nn.Parameter(np.full(2, 3.0))
    opt = optim.LARS([w, b], lr=1.0, momentum=0.0, weight_decay=0.1, eta=0.01)
    w.grad, b.grad = np.full((2, 2), 0.5), np.full(2, 0.5)
    opt.step()
    w_norm, g_norm = 6.0, 1.0
    trust = 0.01 * w_norm / (g_norm + 0.1 * w_norm)
    np.testing.assert_allclose(w.data, 3.0 - trust * (0.5 + 0.1 * 3.0))
    np.testing.assert_allclose(b.data, 3.0 - 0.5)


def test_lamb_trust_ratio_by_hand():
    w = nn.Parameter(np.full((2, 2), 2.0))
    opt = optim.LAMB([w], lr=0.1, weight_decay=0.5, eps=0.0)
    w.grad = np.array([[1.0, -1.0], [2.0, -3.0]])
    opt.step()
    update = np.sign(w.grad) + 0.5 * 2.0  # Adam's first step is sign(g)
    trust = np.linalg.norm(np.full((2, 2), 2.0)) / np.linalg.norm(update)
    np.testing.assert_allclose(w.data, 2.0 - 0.1 * trust * update)


def test_adamw_decay_is_decoupled():
    p, q = nn.Parameter(np.array([1.0])), nn.Parameter(np.array([1.0]))
    adamw, adam = optim.AdamW([p], lr=0.1, weight_decay=0.5), optim.Adam([q], lr=0.1)
    p.grad, q.grad = np.array([0.2]), np.array([0.2])
    adamw.step()
    adam.step()
    np.testing.assert_allclose(p.data, q.data - 0.1 * 0.5 * 1.0)


def test_optimizer_state_dict_survives_json_and_npz(tmp_path):
    def run(opt, params, steps):
        for i in range(steps):
            for k, p in enumerate(params):
                p.grad = np.full(p.shape, 0.1 * (i + k + 1), np.float32)
            opt.step()

    def make():
        params = [nn.Parameter(np.ones((2, 3), np.float32)), nn.Parameter(np.ones(3, np.float32))]
        return params, optim.Adam([{"params": params[:1]}, {"params": params[1:], "lr": 0.01}],
                                  lr=0.1)

    params, opt = make()
    run(opt, params, 3)
    sd = opt.state_dict()
    arrays = {f"{k}/{name}": v for k, entry in sd["state"].items() for name, v in entry.items()
              if isinstance(v, np.ndarray)}
    np.savez(tmp_path / "opt.npz", **arrays)
    meta = json.dumps({"param_groups": sd["param_groups"],
                       "scalars": {k: {n: v for n, v in e.items() if not isinstance(v, np.ndarray)}
                                   for k, e in sd["state"].items()}})
    restored_params, restored = make()
    for p, q in zip(restored_params, params, strict=True):
        p.data[...] = q.data
    loaded = json.loads(meta)
    with np.load(tmp_path / "opt.npz") as npz:
        state = {k: {**v, **{name.split("/")[1]: npz[name] for name in npz.files
                             if name.split("/")[0] == k}} for k, v in loaded["scalars"].items()}
    restored.load_state_dict({"state": state, "param_groups": loaded["param_groups"]})
    assert restored.param_groups[1]["lr"] == 0.01
    run(opt, params, 2)
    run(restored, restored_params, 2)
    for p, q in zip(params, restored_params, strict=True):
        np.testing.assert_array_equal(p.data, q.data)
    with pytest.raises(ValueError, match="groups"):
        optim.Adam(params, lr=0.1).load_state_dict(sd)


def test_lr_is_settable_and_options_are_checked():
    p = nn.Parameter(np.ones(2, np.float32))
    opt = optim.SGD([p], lr=0.1)
    opt.lr = np.float64(0.5)
    assert opt.lr == 0.5 and type(opt.lr) is float
    p.grad = np.ones(2, np.float32)
    opt.step()
    assert p.dtype == np.float32
    np.testing.assert_allclose(p.data, 0.5)
    opt.zero_grad()
    assert p.grad is None
    with pytest.raises(ValueError, match="empty"):
        optim.SGD([], lr=0.1)
    with pytest.raises(ValueError, match="momentum"):
        optim.SGD([p], lr=0.1, momentum=-1)
    with pytest.raises(ValueError, match="unknown"):
        optim.SGD([{"params": [p], "betas": (0.9, 0.9)}], lr=0.1)
    with pytest.raises(TypeError, match="require grad"):
        optim.SGD([Tensor(np.ones(2))], lr=0.1)


def test_warmup_schedules_and_linear_scaling():
    cosine = optim.WarmupSchedule(1.0, warmup_steps=4, total_steps=14, kind="cosine")
    assert [cosine(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cosine(4) == 1.0 and cosine(9) == pytest.approx(0.5) and cosine(14) == pytest.approx(0)
    assert cosine(100) == pytest.approx(0)
    step = optim.WarmupSchedule(0.8, warmup_steps=2, kind="step", milestones=[5, 8], gamma=0.5)
    assert [step(s) for s in (0, 1, 4, 5, 7, 8, 20)] == [0.4, 0.8, 0.8, 0.4, 0.4, 0.2, 0.2]
    assert optim.WarmupSchedule(0.3, kind="constant")(7) == 0.3
    assert optim.scale_lr(0.1, 1024, 256) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="kind"):
        optim.WarmupSchedule(0.1, kind="linear")
    with pytest.raises(ValueError, match="total_steps"):
        optim.WarmupSchedule(0.1, warmup_steps=5, total_steps=5)
    with pytest.raises(ValueError, match="positive"):
        optim.scale_lr(0.1, 0)


def test_load_digits_split():
    x_train, y_train, x_test, y_test = load_digits()
    assert x_train.dtype == np.float32 and x_train.shape[1] == 64
    assert len(x_train) + len(x_test) == 1797 and abs(len(x_test) - 0.2 * 1797) < 10
    assert 0.0 <= x_train.min() and x_train.max() == 1.0
    assert set(np.unique(y_test)) == set(range(10)) and y_train.dtype == np.int64
    again = load_digits()
    np.testing.assert_array_equal(again[0], x_train)
    assert not np.array_equal(load_digits(seed=1)[3], y_test)
    with pytest.raises(ValueError, match="test_fraction"):
        load_digits(test_fraction=1.0)


def one_blas_thread():
    """Limit BLAS to one thread when threadpoolctl is present: on a busy machine, multithreaded
    BLAS on small matrices spends its time waiting for cores."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(1, user_api="blas")


def test_mlp_learns_the_handwritten_digits():
    with one_blas_thread():
        accuracy = train_digits_mlp()
    assert accuracy >= 0.95, f"test accuracy {accuracy:.3f}"


def train_digits_mlp():
    x_train, y_train, x_test, y_test = load_digits(seed=0)
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(64, 128, rng=rng), nn.ReLU(), nn.Linear(128, 128, rng=rng),
                          nn.ReLU(), nn.Linear(128, 10, rng=rng))
    epochs, batch_size = 20, 32
    opt = optim.Adam(model.parameters(), lr=3e-3)
    steps_per_epoch = -(-len(x_train) // batch_size)
    schedule = optim.WarmupSchedule(3e-3, warmup_steps=steps_per_epoch,
                                    total_steps=epochs * steps_per_epoch, kind="cosine")
    order = np.random.default_rng(1)
    step = 0
    for _ in range(epochs):
        perm = order.permutation(len(x_train))
        for i in range(0, len(perm), batch_size):
            batch = perm[i:i + batch_size]
            opt.lr = schedule(step)
            loss = F.cross_entropy(model(Tensor(x_train[batch])), y_train[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
    model.eval()
    with no_grad():
        return (model(Tensor(x_test)).data.argmax(axis=1) == y_test).mean()
