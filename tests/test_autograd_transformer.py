"""The transformer ops (embedding, layer norm, attention, batched matmul, sequence cross-entropy),
the GPT model and the sequence datasets: float64 gradchecks, a PyTorch oracle, and learning."""

import importlib.util

import numpy as np
import pytest

import mpdl.autograd.functional as F
from mpdl import datasets
from mpdl.autograd import Tensor, gradcheck, nn, no_grad, optim
from mpdl.models.gpt import GPT

HAVE_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is the optional oracle for "
                                                        "these tests")

rng = np.random.default_rng(0)
Q, K, V = (rng.standard_normal((2, 3, 5, 4)) for _ in range(3))
KV_LONG = rng.standard_normal((2, 3, 7, 4))
X = rng.standard_normal((2, 5, 6))
W6, B6 = rng.standard_normal(6), rng.standard_normal(6)
TABLE = rng.standard_normal((7, 6))
IDX = np.array([[1, 2, 1], [6, 1, 1]])
LOGITS = rng.standard_normal((2, 4, 7))
LABELS = np.array([[1, -100, 3, 6], [0, 0, -100, 2]])


def sdpa(causal):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)


# name: (ours, torch(torch module) or None, inputs)
CASES = {
    "embedding": (lambda w: F.embedding(IDX, w),
                  lambda t: lambda w: t.nn.functional.embedding(t.tensor(IDX), w), TABLE),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, 6, w, b),
                   lambda t: lambda x, w, b: t.nn.functional.layer_norm(x, (6,), w, b), X, W6, B6),
    "layer_norm_2d_no_affine": (lambda x: F.layer_norm(x, (5, 6), eps=1e-3),
                                lambda t: lambda x: t.nn.functional.layer_norm(x, (5, 6),
                                                                               eps=1e-3), X),
    "sdpa": (sdpa(False), lambda t: t.nn.functional.scaled_dot_product_attention, Q, K, V),
    "sdpa_causal": (sdpa(True),
                    lambda t: lambda q, k, v: t.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=True), Q, K, V),
    "sdpa_causal_longer_keys": (
        sdpa(True), lambda t: lambda q, k, v: t.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True), Q, KV_LONG, KV_LONG),
    "sdpa_broadcast_kv": (sdpa(False), lambda t: lambda q, k, v: (
        t.softmax(q @ k.transpose(-1, -2) / 2.0, -1) @ v), Q, K[:1, :1], V[:1]),
    "matmul_batched_broadcast": (lambda a, b: a @ b, lambda t: lambda a, b: a @ b,
                                 rng.standard_normal((2, 1, 3, 4)),
                                 rng.standard_normal((5, 4, 2))),
    "matmul_stack_times_matrix": (lambda a, b: a @ b, lambda t: lambda a, b: a @ b,
                                  rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5))),
    "matmul_matrix_times_stack": (lambda a, b: a @ b, lambda t: lambda a, b: a @ b,
                                  rng.standard_normal((3, 4)), rng.standard_normal((2, 4, 5))),
    "matmul_vector_times_stack": (lambda a, b: a @ b, lambda t: lambda a, b: a @ b,
                                  rng.standard_normal(4), rng.standard_normal((2, 4, 5))),
    "cross_entropy_ntv_ignore": (
        lambda x: F.cross_entropy(x, LABELS),
        lambda t: lambda x: t.nn.functional.cross_entropy(x.reshape(-1, 7),
                                                          t.tensor(LABELS).reshape(-1)), LOGITS),
    "cross_entropy_ntv_sum": (
        lambda x: F.cross_entropy(x, LABELS, reduction="sum"),
        lambda t: lambda x: t.nn.functional.cross_entropy(
            x.reshape(-1, 7), t.tensor(LABELS).reshape(-1), reduction="sum"), LOGITS),
    "cross_entropy_ntv_none": (
        lambda x: F.cross_entropy(x, LABELS, reduction="none"),
        lambda t: lambda x: t.nn.functional.cross_entropy(
            x.transpose(1, 2), t.tensor(LABELS), reduction="none"), LOGITS),
    "cross_entropy_2d_ignore_7": (
        lambda x: F.cross_entropy(x, np.array([1, 7, 3, 7]) % 7 + np.array([0, 7, 0, 7]),
                                  ignore_index=7),
        lambda t: lambda x: t.nn.functional.cross_entropy(x, t.tensor([1, 7, 3, 7]),
                                                          ignore_index=7), LOGITS[0]),
}


@pytest.mark.parametrize("name", CASES)
def test_gradcheck(name):
    ours, _, *inputs = CASES[name]
    assert gradcheck(ours, *inputs)


@needs_torch
@pytest.mark.parametrize("name", CASES)
def test_matches_torch(name):
    import torch

    ours_fn, make_theirs, *arrays = CASES[name]
    theirs_fn = make_theirs(torch)
    ours_in = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    theirs_in = [torch.tensor(a, requires_grad=True) for a in arrays]
    ours, theirs = ours_fn(*ours_in), theirs_fn(*theirs_in)
    np.testing.assert_allclose(ours.data, theirs.detach().numpy(), rtol=1e-7, atol=1e-10)
    cotangent = np.random.default_rng(1).standard_normal(ours.shape)
    ours.backward(cotangent)
    theirs.backward(torch.tensor(cotangent))
    for o, t in zip(ours_in, theirs_in, strict=True):
        np.testing.assert_allclose(o.grad, t.grad.numpy(), rtol=1e-7, atol=1e-10)


def test_embedding_repeated_indices_accumulate():
    w = Tensor(np.zeros((4, 2)), requires_grad=True)
    F.embedding(np.array([3, 1, 3, 3]), w).sum().backward()
    np.testing.assert_array_equal(w.grad, [[0, 0], [1, 1], [0, 0], [3, 3]])


def test_scatter_add_rows_matches_add_at():
    r = np.random.default_rng(3)
    idx, values = r.integers(0, 50, 1000), r.standard_normal((1000, 8))
    expected = np.zeros((60, 8))
    np.add.at(expected, idx, values)
    np.testing.assert_allclose(F.scatter_add_rows(idx, values, 60), expected, atol=1e-12)
    assert F.scatter_add_rows(idx[:0], values[:0], 5).shape == (5, 8)


def test_attention_is_causal_and_stable():
    q = Tensor(np.full((1, 1, 3, 2), 500.0))  # large scores: a naive softmax overflows
    v = Tensor(np.arange(6.0).reshape(1, 1, 3, 2))
    out = F.scaled_dot_product_attention(q, q, v, is_causal=True).data
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[0, 0, 0], v.data[0, 0, 0])  # the first query sees key 0 only
    np.testing.assert_allclose(out[0, 0, 2], v.data[0, 0].mean(axis=0))


def test_cross_entropy_all_ignored_is_nan_with_zero_gradient():
    x = Tensor(LOGITS.copy(), requires_grad=True)
    loss = F.cross_entropy(x, np.full((2, 4), -100))
    assert np.isnan(loss.item())
    F.cross_entropy(x, np.full((2, 4), -100), reduction="sum").backward()
    np.testing.assert_array_equal(x.grad, 0)


@pytest.mark.parametrize("call, match", [
    (lambda: F.embedding(np.array([0, 7]), TABLE), "indices must lie in"),
    (lambda: F.embedding(np.array([0.5]), TABLE), "integer indices"),
    (lambda: F.embedding(np.array([0]), TABLE[0]), "weight must be 2-D"),
    (lambda: F.layer_norm(X, 5), "normalized_shape"),
    (lambda: F.layer_norm(X, 6, W6), "both weight and bias"),
    (lambda: F.layer_norm(X, 6, W6[:5], B6[:5]), "weight shape"),
    (lambda: F.scaled_dot_product_attention(Q, K[..., :3], V), "k's last axis"),
    (lambda: F.scaled_dot_product_attention(Q, K, KV_LONG), "v has 7 positions"),
    (lambda: F.scaled_dot_product_attention(Q, K[:, :2].repeat(2, 0)[:3], V), "broadcast"),
    (lambda: F.scaled_dot_product_attention(Q[0, 0, 0], K, V), "q must have at least 2"),
    (lambda: F.cross_entropy(LOGITS, LABELS[:, :3]), "labels shape"),
    (lambda: F.cross_entropy(LOGITS, LABELS + 200), "labels must lie in"),
    (lambda: F.cross_entropy(LOGITS[..., None], LABELS), "logits must be"),
    (lambda: nn.Embedding(0, 3), "num_embeddings"),
    (lambda: nn.LayerNorm(()), "normalized_shape"),
    (lambda: GPT(10, 8, 1, 3, 16), "divisible by n_head"),
    (lambda: GPT(10, 8, 0, 2, 16), "n_layer"),
    (lambda: GPT(10, 4, 1, 2, 8)(np.zeros((1, 5), np.int64)), "block_size=4"),
    (lambda: GPT(10, 4, 1, 2, 8).generate(np.zeros((1, 2), np.int64), 1, top_k=0), "top_k"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_module_list_and_gpt_parameter_names():
    stack = nn.ModuleList([nn.Linear(2, 2), nn.LayerNorm(2)])
    assert [n for n, _ in stack.named_parameters()] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert len(stack) == 2 and isinstance(stack[1], nn.LayerNorm)
    model = GPT(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16, seed=0)
    names = [n for n, _ in model.named_parameters()]
    for expected in ("token_embedding.weight", "position_embedding.weight",
                     "blocks.0.ln1.weight", "blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias",
                     "blocks.0.attn.proj.weight", "blocks.1.mlp.fc.weight",
                     "blocks.1.mlp.proj.bias", "blocks.1.ln2.bias", "ln_f.weight"):
        assert expected in names
    assert len(names) == 2 + 2 * 12 + 2  # the output projection is the token embedding
    counted = sum(int(np.prod(p.shape)) for p in model.parameters())
    assert model.num_parameters() == counted
    d, layers, t = 16, 2, 8
    per_block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    assert model.num_parameters(non_embedding=True) == 11 * d + layers * per_block + 2 * d
    assert model.flops_per_token() == 6 * (11 * d + layers * per_block + 2 * d) + 12 * layers * d * t


def _torch_gpt(torch, model):
    """The same GPT written in PyTorch, with ``model``'s weights (float64)."""
    tnn, TF = torch.nn, torch.nn.functional

    class Attn(tnn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.h, self.qkv, self.proj = h, tnn.Linear(d, 3 * d), tnn.Linear(d, d)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(x).split(c, dim=2)
            q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))
            y = TF.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, c))

    class Block(tnn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.ln1, self.attn, self.ln2 = tnn.LayerNorm(d), Attn(d, h), tnn.LayerNorm(d)
            self.mlp = tnn.Module()
            self.mlp.fc, self.mlp.proj = tnn.Linear(d, 4 * d), tnn.Linear(4 * d, d)

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp.proj(TF.gelu(self.mlp.fc(self.ln2(x))))

    class TorchGPT(tnn.Module):
        def __init__(self, m):
            super().__init__()
            self.token_embedding = tnn.Embedding(m.vocab_size, m.n_embd)
            self.position_embedding = tnn.Embedding(m.block_size, m.n_embd)
            self.blocks = tnn.ModuleList(Block(m.n_embd, m.n_head) for _ in range(m.n_layer))
            self.ln_f = tnn.LayerNorm(m.n_embd)

        def forward(self, idx):
            x = self.token_embedding(idx) + self.position_embedding(torch.arange(idx.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.ln_f(x) @ self.token_embedding.weight.T

    theirs = TorchGPT(model).double()
    theirs.load_state_dict({k: torch.tensor(v) for k, v in model.state_dict().items()})
    return theirs


@needs_torch
def test_gpt_matches_torch_end_to_end():
    import torch

    model = GPT(vocab_size=13, block_size=6, n_layer=2, n_head=2, n_embd=8, seed=1,
                dtype=np.float64)
    for p in model.parameters():  # move LayerNorm and biases away from their trivial init
        p.data += np.random.default_rng(2).normal(0, 0.1, p.shape)
    theirs = _torch_gpt(torch, model)
    idx = np.random.default_rng(3).integers(0, 13, (3, 5))
    targets = np.random.default_rng(4).integers(0, 13, (3, 5))
    targets[:, :2] = -100
    logits = model(idx)
    theirs_logits = theirs(torch.tensor(idx))
    np.testing.assert_allclose(logits.data, theirs_logits.detach().numpy(), rtol=1e-9, atol=1e-11)
    F.cross_entropy(logits, targets).backward()
    TF = torch.nn.functional
    TF.cross_entropy(theirs_logits.reshape(-1, 13), torch.tensor(targets).reshape(-1)).backward()
    theirs_params = dict(theirs.named_parameters())
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.grad, theirs_params[name].grad.numpy(), rtol=1e-7,
                                   atol=1e-11, err_msg=name)


def test_gpt_generate_shapes_greedy_and_seeded():
    model = GPT(vocab_size=7, block_size=4, n_layer=1, n_head=2, n_embd=8, seed=0)
    prompt = np.array([[1, 2], [3, 4]])
    greedy = model.generate(prompt, 5, top_k=1)
    assert greedy.shape == (2, 7) and (greedy[:, :2] == prompt).all()
    with no_grad():
        first = model(prompt).data[:, -1].argmax(axis=-1)
    np.testing.assert_array_equal(greedy[:, 2], first)
    a = model.generate(prompt, 5, temperature=2.0, top_k=3, rng=np.random.default_rng(5))
    b = model.generate(prompt, 5, temperature=2.0, top_k=3, rng=np.random.default_rng(5))
    np.testing.assert_array_equal(a, b)
    assert model.training


def test_gpt_float32_and_dropout_modes():
    model = GPT(vocab_size=9, block_size=6, n_layer=1, n_head=2, n_embd=8, dropout=0.5, seed=0)
    idx = np.random.default_rng(0).integers(0, 9, (2, 6))
    logits = model(idx)
    assert logits.dtype == np.float32 and logits.shape == (2, 6, 9)
    F.cross_entropy(logits, idx).backward()
    assert all(p.grad.dtype == np.float32 for p in model.parameters())
    assert not np.allclose(model(idx).data, logits.data)  # training: fresh dropout masks
    model.eval()
    np.testing.assert_array_equal(model(idx).data, model(idx).data)


# ---------------------------------------------------------------------- sequence data
def test_addition_format_split_and_targets():
    task = datasets.addition(digits=3, n_train=2000, n_test=300, seed=1)
    assert task.decode(task.sequences(np.array([[123, 456]]))[0]) == "123+456=9750"
    assert task.decode(task.sequences(np.array([[999, 7]]))[0]) == "999+007=6001"
    assert task.x_train.shape == (2000, 11) and task.x_test.shape == (300, 11)
    train = {tuple(p) for p in task.train_problems}
    test = {tuple(p) for p in task.test_problems}
    assert len(train) == 2000 and len(test) == 300 and not train & test
    x, y = task.x_train, task.y_train
    np.testing.assert_array_equal(x[:, 1:], np.where(y[:, :-1] < 0, x[:, 1:], y[:, :-1]))
    assert (y[:, :task.prompt_len - 1] == datasets.IGNORE_INDEX).all()
    assert (y[:, task.prompt_len - 1:] >= 0).all()
    again = datasets.addition(digits=3, n_train=2000, n_test=300, seed=1)
    np.testing.assert_array_equal(again.x_train, task.x_train)
    small = datasets.addition(digits=1, n_train=90, n_test=10)  # every 1-digit problem
    assert len({tuple(p) for p in small.train_problems} | {tuple(p) for p in
                                                            small.test_problems}) == 100


def test_addition_rejects_bad_arguments():
    with pytest.raises(ValueError, match="digits"):
        datasets.addition(digits=0)
    with pytest.raises(ValueError, match="n_train"):
        datasets.addition(digits=1, n_train=95, n_test=10)


class _Oracle:
    """Answers addition prompts by reading them; wrong on problems whose a is odd if asked."""

    def __init__(self, task, wrong_on_odd=False):
        self.task, self.wrong_on_odd = task, wrong_on_odd

    def generate(self, prompts, max_new_tokens, top_k=None):
        n = self.task.digits
        weights = 10 ** np.arange(n - 1, -1, -1)
        a, b = prompts[:, :n] @ weights, prompts[:, n + 1:2 * n + 1] @ weights
        answer = self.task.sequences(np.stack([a, b], 1))[:, self.task.prompt_len:]
        if self.wrong_on_odd:
            answer[a % 2 == 1, 0] = (answer[a % 2 == 1, 0] + 1) % 10
        return np.concatenate([prompts, answer[:, :max_new_tokens]], axis=1)


def test_exact_match_scores_answers():
    task = datasets.addition(digits=2, n_train=100, n_test=200, seed=0)
    assert datasets.exact_match(_Oracle(task), task, batch_size=64) == 1.0
    odd = float(np.mean(task.test_problems[:, 0] % 2 == 1))
    assert datasets.exact_match(_Oracle(task, True), task) == pytest.approx(1 - odd)
    untrained = GPT(len(task.vocab), task.block_size, 1, 1, 8, seed=0)
    assert datasets.exact_match(untrained, task) < 0.2


def test_text_dataset(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("hello wörld\n" * 50, encoding="utf-8")
    data = datasets.text(path, block_size=8, val_fraction=0.2)
    assert data.vocab == "".join(sorted(set("hello wörld\n")))
    assert len(data.train) + len(data.val) == 600 and len(data.val) == 120
    assert data.decode(data.train[:12]) == "hello wörld\n"
    x, y = data.batch("val", 5, np.random.default_rng(0))
    assert x.shape == y.shape == (5, 8)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    probs = np.array([3] + [1] * 9) / 12  # "l" three times, nine other characters once
    assert datasets.unigram_bits_per_char("hello wörld\n") == pytest.approx(
        -(probs * np.log2(probs)).sum())
    assert datasets.unigram_bits_per_char(np.array([0, 1, 0, 1])) == pytest.approx(1.0)


def test_text_dataset_errors(tmp_path):
    with pytest.raises(datasets.DatasetError, match="no such file"):
        datasets.text(tmp_path / "missing.txt", 8)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(datasets.DatasetError, match="empty"):
        datasets.text(tmp_path / "empty.txt", 8)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 100)
    with pytest.raises(datasets.DatasetError, match="not UTF-8"):
        datasets.text(tmp_path / "latin1.txt", 8)
    (tmp_path / "short.txt").write_text("abcdefghij")
    with pytest.raises(datasets.DatasetError, match="too few"):
        datasets.text(tmp_path / "short.txt", 8)


# ---------------------------------------------------------------------- it learns
def test_tiny_gpt_learns_two_digit_addition():
    task = datasets.addition(digits=2, n_train=9000, n_test=500, seed=0)
    model = GPT(len(task.vocab), task.block_size, n_layer=1, n_head=4, n_embd=64, seed=0)
    before = datasets.exact_match(model, task)
    opt = optim.Adam(model.parameters(), lr=6e-3)
    r = np.random.default_rng(0)
    losses = []
    for _ in range(400):
        pick = r.integers(0, len(task.x_train), 64)
        loss = F.cross_entropy(model(task.x_train[pick]), task.y_train[pick])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert np.mean(losses[-10:]) < 0.3 * np.mean(losses[:3])
    assert before < 0.05
    assert datasets.exact_match(model, task) > 0.5  # held-out problems, greedy decoding
