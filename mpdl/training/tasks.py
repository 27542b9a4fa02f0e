"""What the training loop trains on: a task holds the data as (inputs, targets) arrays the loop
slices into batches, says the shape the model is built for, evaluates a model on a share of its
held-out part (as sums, so that ranks add theirs up) and turns those sums into the row's fields.

- `ImageTask` (digits, mnist, synthetic): images and class labels; test accuracy.
- `AdditionTask` (addition): n-digit addition as characters (`mpdl.datasets.addition`), the
  answer written reversed; next-token loss on the answer positions only. Held out: 1,000
  problems never seen in training (fewer for 1 and 2 digits), scored by token accuracy,
  validation loss and exact match of the greedily decoded answer.
- `TextTask` (text, shakespeare): a UTF-8 file as characters, cut into windows of block_size (the
  last 10% is the validation part); validation loss and bits per character, next to the unigram
  entropy of the file (the bits per character of a model that ignores context). Under
  --batch-sampling random the training samples are the windows at every offset.

A sequence task's "test_acc" is the next-token accuracy on the positions that have a target.
Its `validation_pool` holds the sequences --eval-interval's batches are drawn from
(`validation_indices`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from mpdl import datasets
from mpdl.autograd import functional as F
from mpdl.autograd.tensor import Tensor, no_grad
from mpdl.backend import to_host
from mpdl.training.config import (
    TEXT_BLOCK_SIZE,
    TEXT_DATASETS,
    ConfigError,
    TrainConfig,
    literal,
)

#: the fields of a sequence task's last row that its summary repeats
SUMMARY_FIELDS = ("val_loss", "exact_match", "bits_per_char", "unigram_bits_per_char",
                  "tokens_per_s", "flops_per_token", "flops_per_s", "mfu")
#: sequences or images per forward pass of an evaluation
EVAL_BATCH = 512


class Task:
    """The data of a run; see the module docstring."""

    #: tokens per sample (the sequence length) of a sequence task; 0 for images
    seq_len = 0
    #: extra table columns: (title, row field, width, format)
    columns: tuple[tuple[str, str, int, str], ...] = ()

    def __init__(self, xtr: np.ndarray, ytr: np.ndarray, xte: np.ndarray, yte: np.ndarray,
                 input_shape: tuple[int, ...], classes: int) -> None:
        self.xtr, self.ytr, self.xte, self.yte = xtr, ytr, xte, yte
        self.shape = (input_shape, classes)

    def eval_size(self) -> int:
        """The number of held-out items the ranks split among them."""
        return len(self.xte)

    def epoch_samples(self) -> int:
        """The samples an epoch stands for (under random batches too)."""
        return len(self.xtr)

    def evaluate(self, model: Any, lo: int, hi: int, device: Callable[[Any], Any]) -> list[float]:
        """Sums over held-out items lo..hi-1 (the model in eval mode, no graph)."""
        raise NotImplementedError

    def metrics(self, sums: Any) -> dict[str, float]:
        """The row's fields from the sums of every rank's `evaluate`."""
        raise NotImplementedError

    def notes(self) -> list[str]:
        """Lines to print under the run's header."""
        return []

    def model_info(self) -> dict[str, Any] | None:
        """What a checkpoint must record to rebuild the model outside a run (None: nothing)."""
        return None


def load_data(config: TrainConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test) with images as (N, C, H, W) in the model's dtype."""
    d = config.data
    if d.dataset == "digits":
        xtr, ytr, xte, yte = datasets.load_digits(seed=0)
        xtr, xte = xtr.reshape(-1, 1, 8, 8), xte.reshape(-1, 1, 8, 8)
    elif d.dataset == "mnist":
        xtr, ytr, xte, yte = datasets.load_mnist(d.path)
    else:
        n_test = max(d.synthetic_samples // 4, 1)
        xtr, ytr, xte, yte = datasets.synthetic(d.synthetic_shape, d.synthetic_samples, n_test,
                                                seed=config.optim.seed)
    dtype = np.dtype(config.model.dtype)
    return xtr.astype(dtype, copy=False), ytr, xte.astype(dtype, copy=False), yte


class ImageTask(Task):
    """Images and class labels: test accuracy."""

    def __init__(self, config: TrainConfig) -> None:
        xtr, ytr, xte, yte = load_data(config)
        classes = int(max(ytr.max(), yte.max() if len(yte) else 0)) + 1
        super().__init__(xtr, ytr, xte, yte, tuple(xtr.shape[1:]), classes)

    def evaluate(self, model: Any, lo: int, hi: int, device: Callable[[Any], Any]) -> list[float]:
        correct = 0.0
        with no_grad():
            for start in range(lo, hi, EVAL_BATCH):
                stop = min(start + EVAL_BATCH, hi)
                logits = model(Tensor(device(self.xte[start:stop])))
                correct += float((logits.data.argmax(axis=1) == device(self.yte[start:stop])).sum())
        return [correct, float(hi - lo)]

    def metrics(self, sums: Any) -> dict[str, float]:
        return {"test_acc": sums[0] / sums[1] if sums[1] else float("nan")}


class SequenceTask(Task):
    """Token sequences for the GPT: next-token targets, IGNORE_INDEX where there is none."""

    def __init__(self, config: TrainConfig, vocab: str, xtr: np.ndarray, ytr: np.ndarray,
                 xte: np.ndarray, yte: np.ndarray, block_size: int) -> None:
        super().__init__(xtr, ytr, xte, yte, (block_size,), len(vocab))
        self.vocab, self.config = vocab, config
        self.seq_len = xtr.shape[1]

    def token_sums(self, model: Any, lo: int, hi: int, device: Callable[[Any], Any]
                   ) -> list[float]:
        """[summed loss, positions with a target, right predictions] over sequences lo..hi-1."""
        sums = [0.0, 0.0, 0.0]
        with no_grad():
            for start in range(lo, hi, EVAL_BATCH):
                stop = min(start + EVAL_BATCH, hi)
                y = self.yte[start:stop]
                logits = model(device(self.xte[start:stop]))
                sums[0] += float(F.cross_entropy(logits, device(y), reduction="sum").item())
                counted = y >= 0
                sums[1] += float(counted.sum())
                sums[2] += float((to_host(logits.data.argmax(axis=-1)) == y)[counted].sum())
        return sums

    def validation_pool(self) -> tuple[np.ndarray, np.ndarray]:
        """The held-out (inputs, targets) sequences that --eval-interval's batches come from."""
        return self.xte, self.yte

    def loss_sums(self, model: Any, indices: np.ndarray, device: Callable[[Any], Any]
                  ) -> list[float]:
        """[summed loss, positions with a target] over the validation pool's `indices`."""
        x, y = self.validation_pool()
        sums = [0.0, 0.0]
        with no_grad():
            for start in range(0, len(indices), EVAL_BATCH):
                part = indices[start:start + EVAL_BATCH]
                targets = y[part]
                logits = model(device(x[part]))
                sums[0] += float(F.cross_entropy(logits, device(targets), reduction="sum").item())
                sums[1] += float((targets >= 0).sum())
        return sums

    def model_info(self) -> dict[str, Any]:
        c = self.config
        return {"name": "gpt", "vocab": self.vocab, "block_size": self.shape[0][0],
                "n_layer": c.model.n_layer, "n_head": c.model.n_head, "n_embd": c.model.n_embd,
                "dtype": c.model.dtype, "dataset": c.data.dataset}


class AdditionTask(SequenceTask):
    """n-digit addition; exact match of the greedily decoded answers to held-out problems."""

    columns = (("tok/s", "tokens_per_s", 9, ".0f"), ("MFU", "mfu", 7, ".2%"),
               ("val_loss", "val_loss", 8, ".4f"), ("exact", "exact_match", 6, ".3f"))

    def __init__(self, config: TrainConfig) -> None:
        space = 10 ** (2 * config.data.digits)
        n_test = min(1000, space // 10)
        self.data = datasets.addition(config.data.digits, n_train=min(50_000, space - n_test),
                                      n_test=n_test, seed=config.optim.seed)
        d = self.data
        super().__init__(config, d.vocab, d.x_train, d.y_train, d.x_test, d.y_test,
                         config.model.block_size or d.block_size)

    def evaluate(self, model: Any, lo: int, hi: int, device: Callable[[Any], Any]) -> list[float]:
        sums = self.token_sums(model, lo, hi, device)
        exact = 0.0
        if hi > lo:
            exact = (hi - lo) * datasets.exact_match(model, self.data,
                                                     self.data.test_problems[lo:hi])
        return [*sums, exact, float(hi - lo)]

    def metrics(self, sums: Any) -> dict[str, float]:
        nan = float("nan")
        return {"test_acc": sums[2] / sums[1] if sums[1] else nan,
                "val_loss": sums[0] / sums[1] if sums[1] else nan,
                "exact_match": sums[3] / sums[4] if sums[4] else nan}

    def model_info(self) -> dict[str, Any]:
        return {**super().model_info(), "digits": self.data.digits}

    def notes(self) -> list[str]:
        d = self.data
        return [f"# addition: {d.digits}-digit operands, written like "
                f"{d.decode(d.sequences(d.test_problems[:1])[0])} (the sum reversed); "
                f"{len(d.test_problems)} held-out problems never trained on; exact match = "
                f"greedily decoded answer exactly right"]


class TextTask(SequenceTask):
    """A UTF-8 text file as characters: validation loss and bits per character."""

    columns = (("tok/s", "tokens_per_s", 9, ".0f"), ("MFU", "mfu", 7, ".2%"),
               ("val_loss", "val_loss", 8, ".4f"), ("bpc", "bits_per_char", 6, ".3f"))

    def __init__(self, config: TrainConfig) -> None:
        block = config.model.block_size or TEXT_BLOCK_SIZE
        try:
            self.path = (datasets.shakespeare(config.data.path)
                         if config.data.dataset == "shakespeare" else config.data.path)
            self.data = datasets.text(self.path, block)
        except datasets.DatasetError as exc:
            where = "{data.dataset} shakespeare:" if config.data.dataset == "shakespeare" \
                else "{data.path}"
            raise ConfigError(f"{where} {literal(str(exc))}") from None
        d = self.data
        self.unigram = datasets.unigram_bits_per_char(np.concatenate([d.train, d.val]))
        self.random = config.data.batch_sampling == "random"
        train = offsets(d.train, block) if self.random else windows(d.train, block)
        super().__init__(config, d.vocab, *train, *windows(d.val, block), block)
        self.windows_per_epoch = len(windows(d.train, block)[0])

    def epoch_samples(self) -> int:
        return self.windows_per_epoch

    def validation_pool(self) -> tuple[np.ndarray, np.ndarray]:
        return offsets(self.data.val, self.seq_len) if self.random else (self.xte, self.yte)

    def evaluate(self, model: Any, lo: int, hi: int, device: Callable[[Any], Any]) -> list[float]:
        return self.token_sums(model, lo, hi, device)

    def metrics(self, sums: Any) -> dict[str, float]:
        nan = float("nan")
        loss = sums[0] / sums[1] if sums[1] else nan
        return {"test_acc": sums[2] / sums[1] if sums[1] else nan, "val_loss": loss,
                "bits_per_char": loss / math.log(2), "unigram_bits_per_char": self.unigram}

    def notes(self) -> list[str]:
        d = self.data
        sampled = (f"windows of {self.seq_len} at {len(self.xtr)} offsets drawn at random; an "
                   f"epoch is {self.windows_per_epoch} windows" if self.random else
                   f"{len(self.xtr)} train windows of {self.seq_len}")
        return [f"# {self.config.data.dataset} {self.path}: {len(d.train) + len(d.val)} "
                f"characters, vocabulary of {len(d.vocab)}, {sampled}, {len(self.xte)} "
                f"validation windows; unigram entropy {self.unigram:.3f} bits per character"]


def windows(ids: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping windows of `length` tokens and their next-token targets."""
    starts = np.arange(0, len(ids) - length, length)
    idx = starts[:, None] + np.arange(length)
    return ids[idx], ids[idx + 1]


def offsets(ids: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """The windows of `length` tokens at every offset that has a next-token target for each
    position (nanoGPT's len(data) - block_size of them) and their targets, as read-only views."""
    view = np.lib.stride_tricks.sliding_window_view
    return view(ids[:-1], length), view(ids[1:], length)


def validation_indices(pool_size: int, batches: int, batch_size: int, seed: int,
                       random: bool) -> np.ndarray:
    """The pool indices of --eval-steps `batches` validation batches of `batch_size`, batch after
    batch: at random with replacement (random), or distinct (a permutation's first ones)."""
    rng = np.random.default_rng([seed, 2])
    if random:
        return rng.integers(0, pool_size, batches * batch_size)
    return rng.permutation(pool_size)[:batches * batch_size]


def fetch_data(config: TrainConfig) -> None:
    """Fetch what the dataset needs at first use (the Shakespeare corpus); ConfigError when it
    cannot be had."""
    if config.data.dataset == "shakespeare":
        try:
            datasets.shakespeare(config.data.path)
        except datasets.DatasetError as exc:
            raise ConfigError(f"{{data.dataset}} shakespeare: {literal(str(exc))}") from None


def load_task(config: TrainConfig) -> Task:
    """The task of a (valid) configuration, its data loaded."""
    if config.data.dataset == "addition":
        return AdditionTask(config)
    if config.data.dataset in TEXT_DATASETS:
        return TextTask(config)
    return ImageTask(config)
