"""`mpdl train` under mpiexec: output, JSON, timeline, data readers, bad input, resume, a killed rank."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpdl.datasets import DatasetError, load_mnist, read_idx, synthetic

BIN = Path(sys.executable).parent
MPIEXEC = str(BIN / "mpiexec")
MPDL = str(BIN / "mpdl")


def train(n: int, *flags: str, timeout: float = 120, env: dict | None = None
          ) -> subprocess.CompletedProcess:
    cmd = ["timeout", "-k", "5", str(timeout), MPIEXEC, "-n", str(n), MPDL, "train",
           "--no-progress", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 15,
                          env={**os.environ, **(env or {})})


def json_lines(path: Path) -> list[dict]:
    """The rows of a --json file, after its first line: the run's configuration."""
    first, *rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert list(first) == ["config"] and list(first["config"]) == [
        "model", "data", "optim", "parallel", "communication", "checkpoint", "output"], first
    return rows


@pytest.mark.same_under_every_mpi
def test_default_run_reaches_95_percent_on_4_ranks(tmp_path):
    out = train(4, "--json", str(tmp_path / "run.jsonl"), timeout=240)
    assert out.returncode == 0, out.stderr
    rows = json_lines(tmp_path / "run.jsonl")
    assert rows[-1]["summary"] and rows[-1]["ranks"] == 4
    assert rows[-2]["test_acc"] >= 0.95
    assert out.stdout.count("\n") == 2 + 15 + 1  # header, column names, 15 epochs, done


def test_output_json_and_timeline(tmp_path):
    out = train(2, "--epochs", "2", "--json", str(tmp_path / "r.jsonl"), "--timeline",
                str(tmp_path / "t.json"), "--bucket-mb", "0.01", "--first-bucket-mb", "0.001")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("# mpdl train: mlp on digits") and "2 ranks" in lines[0]
    assert lines[1].split() == ["epoch", "loss", "train_acc", "test_acc", "samples/s", "step_ms",
                                "compute", "comm", "exposed"]
    assert [line.split()[0] for line in lines[2:4]] == ["1", "2"]
    rows = json_lines(tmp_path / "r.jsonl")
    assert len(rows) == 3 and rows[2]["summary"]
    for row in rows[:2]:
        assert set(row) >= {"epoch", "loss", "train_acc", "test_acc", "samples_per_s", "compute_s",
                            "comm_s", "exposed_comm_s", "ranks", "algorithm"}
        assert row["ranks"] == 2 and row["algorithm"] == "auto" and row["comm_s"] > 0
    assert rows[2]["buckets"] > 2
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    names = {e["name"] for e in spans}
    assert {"forward", "backward", "optimizer step", "all-reduce bucket 0",
            f"all-reduce bucket {rows[2]['buckets'] - 1}"} <= names
    assert all(e["tid"] == 1 for e in spans if e["name"].startswith("all-reduce"))


@pytest.mark.parametrize("flags, message", [
    (["--global-batch-size", "1"], "smaller than the number of ranks"),
    (["--model", "vgg"], "--model: expected one of mlp, lenet, resnet8"),
    (["--algorithm", "nope"], "--algorithm: expected one of auto, ring"),
    (["--epochs", "0"], "--epochs: expected a positive number"),
    (["--dataset", "mnist"], "needs --data PATH"),
    (["--dataset", "mnist", "--data", "/nonexistent/mnist"], "no such file or directory"),
    (["--resume"], "--resume needs --checkpoint"),
    (["--device", "gpu"], "--device gpu: CuPy is not installed or sees no GPU"),
    (["--emulate", "inter=fast"], "--emulate: MPDL_EMULATE: latency 'fast'"),
    (["--emulate", "outer=1Gbit/s"], "--emulate: MPDL_EMULATE: unknown link 'outer'"),
    (["--model", "gpt", "--n-head", "5"], "--n-embd 64 must be divisible by --n-head 5"),
    (["--model", "gpt", "--n-layer", "0"], "--n-layer: expected a positive number, got 0"),
    (["--model", "gpt", "--block-size", "8"], "--block-size 8 is shorter than the sequences"),
    (["--model", "gpt", "--dataset", "digits"],
     "--model gpt trains on --dataset addition, text or shakespeare"),
    (["--model", "gpt", "--dataset", "text"], "--dataset text needs --data FILE"),
    (["--dataset", "addition"], "--dataset addition is a token sequence task: it needs --model gpt"),
])
def test_bad_input_exits_2_with_one_line(flags, message):
    out = train(2, *flags, timeout=60, env={"MPDL_NO_CUPY": "1"})
    assert out.returncode == 2, (out.stdout, out.stderr)
    errors = out.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("mpdl train: error: "), out.stderr
    assert message in errors[0]


@pytest.mark.parametrize("content, message", [
    (None, "no such file"), (b"", "the file is empty"),
    (b"caf\xe9 au lait " * 10, "not UTF-8 text (invalid byte at offset 3)"),
    (b"tiny", "the train part has 4 characters, too few for block_size=64"),
])
def test_bad_text_file_exits_2_with_one_line_naming_data(tmp_path, content, message):
    path = tmp_path / "text.txt"
    if content is not None:
        path.write_bytes(content)
    out = train(2, "--model", "gpt", "--dataset", "text", "--data", str(path), timeout=60)
    assert out.returncode == 2, (out.stdout, out.stderr)
    errors = out.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"mpdl train: error: --data {path}: ")
    assert message in errors[0]


def test_emulated_run_says_so(tmp_path):
    """--emulate slows the links between the nodes of MPDL_RANKS_PER_NODE; the header and every
    JSON row say so, and --emulate off overrides MPDL_EMULATE."""
    out = train(2, "--epochs", "1", "--emulate", "inter=10Gbit/s,20us", "--json",
                str(tmp_path / "e.jsonl"), env={"MPDL_RANKS_PER_NODE": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].endswith(", EMULATED links inter=10Gbit/s,20us")
    rows = json_lines(tmp_path / "e.jsonl")
    assert all(r["emulated"] == "inter=10Gbit/s,20us" for r in rows)
    out = train(2, "--epochs", "1", "--emulate", "off", "--json", str(tmp_path / "off.jsonl"),
                env={"MPDL_EMULATE": "inter=1Gbit/s"})
    assert out.returncode == 0, out.stderr
    assert "EMULATED" not in out.stdout
    rows = json_lines(tmp_path / "off.jsonl")
    assert all(r["emulated"] == "" for r in rows) and rows[0]["mode"] == "allreduce"


def write_idx(path: Path, array: np.ndarray, compress: bool) -> None:
    codes = {np.dtype(np.uint8): 0x08}
    header = bytes([0, 0, codes[array.dtype], array.ndim])
    header += b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    data = header + array.tobytes()
    if compress:
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)


def fake_mnist(directory: Path, compress: bool, n: int = 48) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {"x_train": rng.integers(0, 256, (n, 28, 28), dtype=np.uint8),
              "y_train": rng.integers(0, 10, n, dtype=np.uint8),
              "x_test": rng.integers(0, 256, (n // 4, 28, 28), dtype=np.uint8),
              "y_test": rng.integers(0, 10, n // 4, dtype=np.uint8)}
    directory.mkdir(exist_ok=True)
    names = {"x_train": "train-images-idx3-ubyte", "y_train": "train-labels-idx1-ubyte",
             "x_test": "t10k-images-idx3-ubyte", "y_test": "t10k-labels-idx1-ubyte"}
    for key, name in names.items():
        write_idx(directory / name, arrays[key], compress)
    return arrays


@pytest.mark.parametrize("compress", [False, True])
def test_mnist_idx_reader(tmp_path, compress):
    arrays = fake_mnist(tmp_path / "mnist", compress)
    xtr, ytr, xte, yte = load_mnist(tmp_path / "mnist")
    assert xtr.shape == (48, 1, 28, 28) and xtr.dtype == np.float32 and xte.shape == (12, 1, 28, 28)
    np.testing.assert_allclose(xtr[:, 0] * 255, arrays["x_train"], atol=1e-4)
    assert np.array_equal(ytr, arrays["y_train"]) and ytr.dtype == np.int64
    np.savez(tmp_path / "m.npz", **arrays)
    for a, b in zip(load_mnist(tmp_path / "m.npz"), (xtr, ytr, xte, yte), strict=True):
        assert np.array_equal(a, b)


def test_malformed_data_gets_a_clear_error(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x00\x00\x08\x03" + (5).to_bytes(4, "big") * 3 + b"xx")
    with pytest.raises(DatasetError, match="IDX header says shape"):
        read_idx(tmp_path / "bad")
    (tmp_path / "junk").write_bytes(b"hello world")
    with pytest.raises(DatasetError, match="not an IDX file"):
        read_idx(tmp_path / "junk")
    np.savez(tmp_path / "partial.npz", x_train=np.zeros((2, 28, 28)))
    with pytest.raises(DatasetError, match="missing arrays"):
        load_mnist(tmp_path / "partial.npz")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no train-images-idx3-ubyte"):
        load_mnist(tmp_path / "empty")
    out = train(2, "--dataset", "mnist", "--data", str(tmp_path / "junk"), timeout=60)
    assert out.returncode == 2 and "not a readable .npz" in out.stderr


def test_bad_labels_or_images_in_an_npz_are_named_up_front_with_one_line(tmp_path):
    arrays = fake_mnist(tmp_path / "mnist", compress=False)
    arrays["y_train"] = arrays["y_train"].astype(np.int64)
    arrays["y_train"][[5, 7]] = -1
    np.savez(tmp_path / "m.npz", **arrays)
    expected = (f"{tmp_path}/m.npz: y_train holds the label -1 at index 5; labels are class "
                f"numbers, integers from 0 to {arrays['y_train'].max()} here")
    with pytest.raises(DatasetError) as caught:
        load_mnist(tmp_path / "m.npz")
    assert str(caught.value) == expected
    out = train(2, "--dataset", "mnist", "--data", str(tmp_path / "m.npz"), "--model", "lenet",
                timeout=60)
    assert out.returncode == 2 and out.stderr == f"mpdl train: error: {expected}\n", out.stderr
    y_test = arrays["y_test"].astype(np.float64)
    y_test[3] = 2.5
    images = arrays["x_train"] / np.float32(255)
    images[4, 1, 2] = np.nan
    for changed, message in [({"y_test": y_test}, "y_test holds the label 2.5 at index 3"),
                             ({"x_train": images}, "x_train holds NaN or inf in 1 image, the "
                                                   "first at index 4; images must be finite")]:
        np.savez(tmp_path / "bad.npz", **{**fake_mnist(tmp_path / "again", False), **changed})
        with pytest.raises(DatasetError, match=f"^{tmp_path}/bad.npz: {re.escape(message)}"):
            load_mnist(tmp_path / "bad.npz")


@pytest.mark.same_under_every_mpi
def test_train_on_mnist_files_and_synthetic(tmp_path):
    fake_mnist(tmp_path / "mnist", compress=True)
    out = train(2, "--dataset", "mnist", "--data", str(tmp_path / "mnist"), "--epochs", "1",
                "--model", "lenet", "--global-batch-size", "16")
    assert out.returncode == 0, out.stderr
    assert "lenet on mnist (48 train / 12 test)" in out.stdout
    out = train(2, "--dataset", "synthetic", "--synthetic-shape", "cifar", "--synthetic-samples",
                "16", "--model", "resnet8", "--epochs", "1", "--global-batch-size", "8")
    assert out.returncode == 0, out.stderr
    x, y, xt, yt = synthetic("cifar", 10, 3)
    assert x.shape == (10, 3, 32, 32) and xt.shape == (3, 3, 32, 32) and y.dtype == np.int64


@pytest.mark.same_under_every_mpi
def test_resume_with_another_number_of_ranks(tmp_path):
    common = ["--dtype", "float64", "--lr-schedule", "constant", "--global-batch-size", "128"]
    ckpt = tmp_path / "ckpt"
    assert train(2, *common, "--epochs", "2", "--checkpoint", str(ckpt)).returncode == 0
    out = train(3, *common, "--epochs", "3", "--checkpoint", str(ckpt), "--resume",
                "--json", str(tmp_path / "resumed.jsonl"))
    assert out.returncode == 0, out.stderr
    assert "resumed from" in out.stdout
    resumed = dict(np.load(ckpt / "model.npz"))
    straight_dir = tmp_path / "straight"
    assert train(1, *common, "--epochs", "3", "--checkpoint", str(straight_dir)).returncode == 0
    straight = dict(np.load(straight_dir / "model.npz"))
    for name in straight:
        np.testing.assert_allclose(resumed[name], straight[name], rtol=0, atol=1e-10)
    rows = json_lines(tmp_path / "resumed.jsonl")
    assert [r["epoch"] for r in rows[:-1]] == [1, 2, 3] and rows[2]["ranks"] == 3
    out = train(1, "--checkpoint", str(ckpt), "--resume", "--model", "lenet", timeout=60)
    assert out.returncode == 2 and "written with --model='mlp'" in out.stderr


@pytest.mark.same_under_every_mpi
def test_gpt_json_timeline_resume_and_generate(tmp_path):
    """A tiny GPT under mpiexec: its table and JSON fields, the timeline, a resume on another
    number of ranks that follows the straight run, a shape that differs from the checkpoint's,
    and `mpdl generate` from the checkpoint."""
    common = ["--model", "gpt", "--digits", "1", "--n-layer", "1", "--n-head", "2", "--n-embd",
              "8", "--global-batch-size", "12", "--dtype", "float64", "--lr-schedule", "constant"]
    ckpt = tmp_path / "ckpt"
    out = train(3, *common, "--epochs", "1", "--checkpoint", str(ckpt), "--timeline",
                str(tmp_path / "t.json"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("# mpdl train: gpt (1 layers, 2 heads, width 8, block 5, ")
    assert "on addition (90 train / 10 test), 3 ranks" in lines[0]
    assert "peak" in lines[2] and "GFLOP/s per core x 3" in lines[2]
    assert lines[3].split()[-4:] == ["tok/s", "MFU", "val_loss", "exact"]
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert {e["pid"] for e in trace if e["ph"] == "X"} == {0, 1, 2}
    out = train(2, *common, "--epochs", "2", "--checkpoint", str(ckpt), "--resume", "--json",
                str(tmp_path / "resumed.jsonl"))
    assert out.returncode == 0, out.stderr
    straight = tmp_path / "straight"
    assert train(1, *common, "--epochs", "2", "--checkpoint", str(straight)).returncode == 0
    resumed, expected = dict(np.load(ckpt / "model.npz")), dict(np.load(straight / "model.npz"))
    assert set(resumed) == set(expected) and "blocks.0.attn.qkv.weight" in resumed
    for name in expected:
        np.testing.assert_allclose(resumed[name], expected[name], rtol=0, atol=1e-10)
    rows = json_lines(tmp_path / "resumed.jsonl")
    assert [r["epoch"] for r in rows[:-1]] == [1, 2] and rows[1]["ranks"] == 2
    for row in rows:
        assert {"tokens_per_s", "mfu", "val_loss", "exact_match", "flops_per_token"} <= set(row)
    out = train(1, *common, "--n-embd", "16", "--epochs", "2", "--checkpoint", str(ckpt),
                "--resume", timeout=60)
    assert out.returncode == 2 and "written with --n-embd=8, this run has 16" in out.stderr
    out = subprocess.run([MPIEXEC, "-n", "2", MPDL, "generate", "--checkpoint", str(ckpt),
                          "--prompt", "3+4=", "--max-new-tokens", "2", "--top-k", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and len(out.stdout.splitlines()) == 1, out
    answer = out.stdout.split("  # = ")[0]  # generate reads the reversed sum after "  # = "
    assert answer.startswith("3+4=") and len(answer.strip()) == 6, out.stdout


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _rank_pid(mpiexec_pid: int, rank: int) -> int | None:
    for pid in _descendants(mpiexec_pid):
        try:
            env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        # the rank as MPICH's launcher (PMI_RANK) or Open MPI's (OMPI_COMM_WORLD_RANK) says
        ranks = {f"PMI_RANK={rank}".encode(), f"OMPI_COMM_WORLD_RANK={rank}".encode()}
        if ranks & set(env) and any(b"mpdl" in a for a in
                                                      (Path("/proc") / str(pid) / "cmdline")
                                                      .read_bytes().split(b"\0")):
            return pid
    return None


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the rank's process through /proc")
def test_killed_rank_ends_the_job_and_the_checkpoint_stays_loadable(tmp_path):
    from mpdl.models.zoo import build_model
    from mpdl.training.checkpoint import load_checkpoint

    ckpt = tmp_path / "ckpt"
    job = subprocess.Popen([MPIEXEC, "-n", "2", MPDL, "train", "--no-progress", "--epochs", "500",
                            "--checkpoint", str(ckpt)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while not (ckpt / "state.json").exists() and job.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.1)
        pid = _rank_pid(job.pid, 1)
        assert pid is not None, "rank 1 not found"
        os.kill(pid, signal.SIGKILL)
        job.wait(timeout=60)  # bounded: raises TimeoutExpired if the job hangs
        assert job.returncode != 0
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    model_state, optimizer_state, state = load_checkpoint(ckpt)
    assert 1 <= state["epoch"] < 500 and state["config"]["model"]["name"] == "mlp"
    model = build_model("mlp", (1, 8, 8), 10)
    model.load_state_dict(model_state)
    assert optimizer_state["state"]


@pytest.mark.same_under_every_mpi
@pytest.mark.parametrize("compression, flags", [
    ("fp16", ()), ("topk", ()), ("qsgd", ()), ("powersgd", ()), ("signsgd", ()),
])
def test_compressed_training_under_mpiexec(tmp_path, compression, flags):
    """Every compressor through `mpdl train` on 2 real ranks still learns the digits."""
    out = train(2, "--compression", compression, *flags, "--json", str(tmp_path / "run.jsonl"),
                timeout=180)
    assert out.returncode == 0, out.stderr
    rows = json_lines(tmp_path / "run.jsonl")
    assert rows[-2]["test_acc"] >= 0.93, f"{compression}: test accuracy {rows[-2]['test_acc']}"


@pytest.mark.same_under_every_mpi
def test_local_sgd_under_mpiexec(tmp_path):
    out = train(2, "--sync-every", "4", "--json", str(tmp_path / "run.jsonl"), timeout=180)
    assert out.returncode == 0, out.stderr
    assert json_lines(tmp_path / "run.jsonl")[-2]["test_acc"] >= 0.93
