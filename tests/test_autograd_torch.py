"""Forward values and gradients agree with PyTorch (an optional test oracle, CPU only)."""

import numpy as np
import pytest

import mpdl.autograd.functional as F
from mpdl.autograd import Tensor, nn, optim

torch = pytest.importorskip("torch", reason="PyTorch is the optional oracle for these tests")
TF = torch.nn.functional


def compare(ours_fn, torch_fn, *arrays, rtol=1e-7, atol=1e-9):
    """Run both on float64 copies of ``arrays``; compare outputs and input gradients."""
    ours_in = [Tensor(a.copy(), requires_grad=a.dtype.kind == "f") for a in arrays]
    theirs_in = [torch.tensor(a, requires_grad=a.dtype.kind == "f") for a in arrays]
    ours, theirs = ours_fn(*ours_in), torch_fn(*theirs_in)
    np.testing.assert_allclose(ours.data, theirs.detach().numpy(), rtol=rtol, atol=atol)
    cotangent = np.random.default_rng(0).standard_normal(ours.shape)
    ours.backward(cotangent)
    theirs.backward(torch.tensor(cotangent))
    for o, t in zip(ours_in, theirs_in, strict=True):
        if t.requires_grad:
            np.testing.assert_allclose(o.grad, t.grad.numpy(), rtol=rtol, atol=atol)


rng = np.random.default_rng(0)
A, B, ROW = rng.standard_normal((3, 4)), rng.standard_normal((3, 4)), rng.standard_normal((1, 4))
POS = np.abs(rng.standard_normal((3, 4))) + 0.2
M = rng.standard_normal((4, 5))
IMG, KERNEL = rng.standard_normal((2, 3, 7, 6)), rng.standard_normal((4, 3, 3, 3))
LABELS = np.array([0, 3, 2])

CASES = {
    "add": (lambda a, b: a + b, lambda a, b: a + b, A, ROW),
    "sub": (lambda a, b: a - b, lambda a, b: a - b, ROW, A),
    "mul": (lambda a, b: a * b, lambda a, b: a * b, A, ROW),
    "div": (lambda a, b: a / b, lambda a, b: a / b, A, POS),
    "pow": (lambda a, b: a ** b, lambda a, b: a ** b, POS, A),
    "pow_scalar": (lambda a: a ** 3, lambda a: a ** 3, A),
    "neg": (lambda a: -a, lambda a: -a, A),
    "matmul": (lambda a, b: a @ b, lambda a, b: a @ b, A, M),
    "sum": (lambda a: a.sum(axis=1, keepdims=True), lambda a: a.sum(1, keepdim=True), A),
    "mean": (lambda a: a.mean(axis=0), lambda a: a.mean(0), A),
    "max": (lambda a: a.max(axis=1), lambda a: a.amax(1), A),
    "max_all": (lambda a: a.max(), lambda a: a.amax(), A),
    "reshape": (lambda a: a.reshape(2, 6), lambda a: a.reshape(2, 6), A),
    "transpose": (lambda a: a.T, lambda a: a.T, A),
    "getitem": (lambda a: a[np.array([2, 0, 2]), 1:], lambda a: a[[2, 0, 2], 1:], A),
    "exp": (lambda a: a.exp(), torch.exp, A),
    "log": (lambda a: a.log(), torch.log, POS),
    "tanh": (F.tanh, torch.tanh, A),
    "sigmoid": (F.sigmoid, torch.sigmoid, A),
    "relu": (F.relu, torch.relu, A),
    "gelu": (F.gelu, TF.gelu, A),
    "gelu_tanh": (lambda a: F.gelu(a, approximate="tanh"),
                  lambda a: TF.gelu(a, approximate="tanh"), A),
    "softmax": (F.softmax, lambda a: torch.softmax(a, -1), A),
    "log_softmax": (lambda a: F.log_softmax(a, 0), lambda a: torch.log_softmax(a, 0), A),
    "cross_entropy": (F.cross_entropy, TF.cross_entropy, A, LABELS),
    "cross_entropy_sum": (lambda a, y: F.cross_entropy(a, y, reduction="sum"),
                          lambda a, y: TF.cross_entropy(a, y, reduction="sum"), A, LABELS),
    "cross_entropy_none": (lambda a, y: F.cross_entropy(a, y, reduction="none"),
                           lambda a, y: TF.cross_entropy(a, y, reduction="none"), A, LABELS),
    "mse_loss": (F.mse_loss, TF.mse_loss, A, B),
    "linear": (F.linear, TF.linear, A, M.T, M[0]),
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1),
               lambda x, w, b: TF.conv2d(x, w, b, stride=2, padding=1), IMG, KERNEL, M[0, :4]),
    "max_pool2d": (lambda x: F.max_pool2d(x, 3, 2, 1), lambda x: TF.max_pool2d(x, 3, 2, 1), IMG),
    "avg_pool2d": (lambda x: F.avg_pool2d(x, 2), lambda x: TF.avg_pool2d(x, 2), IMG),
    "batch_norm_train": (
        lambda x, w, b: F.batch_norm(x, np.zeros(3), np.ones(3), w, b, training=True),
        lambda x, w, b: TF.batch_norm(x, torch.zeros(3, dtype=torch.float64),
                                      torch.ones(3, dtype=torch.float64), w, b, training=True),
        IMG, M[1, :3], M[2, :3]),
    "batch_norm_eval": (
        lambda x, w, b: F.batch_norm(x, M[0, :3], POS[0, :3], w, b, training=False),
        lambda x, w, b: TF.batch_norm(x, torch.tensor(M[0, :3]), torch.tensor(POS[0, :3]), w, b),
        IMG, M[1, :3], M[2, :3]),
    "flatten": (F.flatten, lambda x: torch.flatten(x, 1), IMG),
}


@pytest.mark.parametrize("name", CASES)
def test_op_matches_pytorch(name):
    ours, theirs, *arrays = CASES[name]
    compare(ours, theirs, *arrays)


def test_batch_norm_running_statistics_match_pytorch():
    ours, theirs = nn.BatchNorm2d(3, dtype=np.float64), torch.nn.BatchNorm2d(3).double()
    for _ in range(3):
        ours(Tensor(IMG))
        theirs(torch.tensor(IMG))
    np.testing.assert_allclose(ours.running_mean.data, theirs.running_mean.numpy(), rtol=1e-12)
    np.testing.assert_allclose(ours.running_var.data, theirs.running_var.numpy(), rtol=1e-12)


def torch_cnn():
    tnn = torch.nn
    return tnn.Sequential(tnn.Conv2d(1, 6, 3, padding=1), tnn.BatchNorm2d(6), tnn.ReLU(),
                          tnn.MaxPool2d(2), tnn.Flatten(), tnn.Linear(6 * 4 * 4, 10))


def cnn():
    g = np.random.default_rng(0)
    return nn.Sequential(nn.Conv2d(1, 6, 3, padding=1, rng=g), nn.BatchNorm2d(6), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(6 * 4 * 4, 10, rng=g))


def test_small_cnn_matches_pytorch_over_training_steps():
    ours, theirs = cnn(), torch_cnn()
    with torch.no_grad():
        for (_, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(),
                                  strict=True):
            q.copy_(torch.tensor(p.data))
    opt = optim.SGD(ours.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    topt = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    data = np.random.default_rng(1)
    for _ in range(3):
        x = data.random((16, 1, 8, 8), dtype=np.float32)
        y = data.integers(0, 10, 16)
        loss = F.cross_entropy(ours(Tensor(x)), y)
        tloss = TF.cross_entropy(theirs(torch.tensor(x)), torch.tensor(y))
        np.testing.assert_allclose(loss.item(), tloss.item(), rtol=1e-5)
        opt.zero_grad()
        topt.zero_grad()
        loss.backward()
        tloss.backward()
        for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(),
                                     strict=True):
            np.testing.assert_allclose(p.grad, q.grad.numpy(), rtol=1e-4, atol=1e-5,
                                       err_msg=name)
        opt.step()
        topt.step()
    ours_state = ours.state_dict()
    assert list(ours_state) == list(theirs.state_dict())
    for name, value in theirs.state_dict().items():
        np.testing.assert_allclose(ours_state[name], value.numpy(), rtol=1e-4, atol=1e-5,
                                   err_msg=name)


@pytest.mark.parametrize("make", [
    (lambda p: optim.Adam(p, lr=0.01, weight_decay=0.1),
     lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1)),
    (lambda p: optim.AdamW(p, lr=0.01, weight_decay=0.1),
     lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)),
    (lambda p: optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True)),
], ids=["adam", "adamw", "nesterov"])
def test_optimizer_steps_match_pytorch(make):
    ours_opt, torch_opt = make
    start = np.random.default_rng(2).standard_normal((3, 4))
    p, q = nn.Parameter(start.copy()), torch.tensor(start.copy(), requires_grad=True)
    opt, topt = ours_opt([p]), torch_opt([q])
    for k in range(5):
        grad = np.random.default_rng(10 + k).standard_normal((3, 4))
        p.grad, q.grad = grad.copy(), torch.tensor(grad)
        opt.step()
        topt.step()
    np.testing.assert_allclose(p.data, q.detach().numpy(), rtol=1e-10)


def test_default_init_has_pytorch_bounds():
    torch.manual_seed(0)
    theirs = torch.nn.Linear(300, 20).weight.detach().numpy()
    ours = nn.Linear(300, 20, seed=0).weight.data
    assert abs(np.abs(theirs).max() - np.abs(ours).max()) < 0.01
    assert abs(theirs.std() - ours.std()) < 0.005
