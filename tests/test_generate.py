"""`mpdl generate` on a tiny checkpoint of `mpdl train --model gpt`: what it prints, that a seed
repeats it, and its errors (exit 2, one line)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from mpdl.threadworld import ThreadWorld
from mpdl.training.config import TrainConfig
from mpdl.training.generation import load_gpt, sample
from mpdl.training.loop import Trainer

MPDL = str(Path(sys.executable).parent / "mpdl")
#: a tiny GPT on 1-digit addition, one epoch
TINY = {"model.name": "gpt", "data.dataset": "addition", "data.digits": 1, "model.n_layer": 1,
        "model.n_head": 2, "model.n_embd": 8, "optim.global_batch_size": 12, "optim.epochs": 1,
        "optim.optimizer": "adam", "output.progress": False}


def run(config: TrainConfig) -> None:
    trainer = Trainer(config, comm=ThreadWorld(1).comm(0), out=io.StringIO())
    trainer.setup()
    trainer.run()


def test_generate_from_a_tiny_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    run(TrainConfig.from_keys({**TINY, "checkpoint.dir": str(ckpt)}))
    model, info = load_gpt(ckpt)
    assert info["vocab"] == "0123456789+=" and info["block_size"] == 5
    expected = sample(model, info["vocab"], "3+4=", 2, top_k=1)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def generate(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([MPDL, "generate", "--checkpoint", str(ckpt), *flags],
                              capture_output=True, text=True, timeout=60, env=env)

    out = generate("--prompt", "3+4=", "--max-new-tokens", "2", "--top-k", "1")
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n" and len(expected) == 6
    sampled = [generate("--max-new-tokens", "20", "--seed", s).stdout for s in ("1", "1", "2")]
    assert sampled[0] == sampled[1] != sampled[2] and len(sampled[0]) == 1 + 20 + 1
    for flags, message in [(["--prompt", "3*4="], "--prompt: '*' not in the model's vocabulary"),
                           (["--temperature", "0"], "--temperature: expected a positive"),
                           (["--top-k", "0"], "--top-k: expected a positive")]:
        out = generate(*flags)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert out.stderr.startswith("mpdl generate: error: ") and message in out.stderr


def test_generate_refuses_what_is_not_a_gpt_checkpoint(tmp_path):
    run(TrainConfig.from_keys({"model.name": "mlp", "optim.epochs": 1, "output.progress": False,
                               "checkpoint.dir": str(tmp_path / "mlp")}))
    for directory, message in [(tmp_path / "mlp", "not a GPT checkpoint (written by mpdl train "
                                                  "--model mlp)"),
                               (tmp_path / "none", "not a checkpoint")]:
        out = subprocess.run([MPDL, "generate", "--checkpoint", str(directory)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert f"--checkpoint: {directory}: {message}" in out.stderr
