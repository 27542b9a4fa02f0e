"""`mpdl generate` on a tiny checkpoint of `mpdl train --model gpt`: what it prints, that a seed
repeats it, and its errors (exit 2, one line)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mpdl.inference.generation import (
    addition_answer,
    addition_example,
    addition_prompt,
    load_gpt,
    sample,
)
from mpdl.threadworld import ThreadWorld
from mpdl.training.config import TrainConfig
from mpdl.training.loop import Trainer

MPDL = str(Path(sys.executable).parent / "mpdl")
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
#: a tiny GPT on 1-digit addition, one epoch
TINY = {"model.name": "gpt", "data.dataset": "addition", "data.digits": 1, "model.n_layer": 1,
        "model.n_head": 2, "model.n_embd": 8, "optim.global_batch_size": 12, "optim.epochs": 1,
        "optim.optimizer": "adam", "output.progress": False}


def run(config: TrainConfig) -> None:
    trainer = Trainer(config, comm=ThreadWorld(1).comm(0), out=io.StringIO())
    trainer.setup()
    trainer.run()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    directory = tmp_path_factory.mktemp("generate") / "ckpt"
    run(TrainConfig.from_keys({**TINY, "checkpoint.dir": str(directory)}))
    return directory


def generate_in(ckpt: Path, *flags: str, ranks: int = 0) -> subprocess.CompletedProcess:
    """`mpdl generate --checkpoint ckpt flags`, under `mpiexec -n ranks` when ranks > 0."""
    launch = [MPIEXEC, "-n", str(ranks)] if ranks else []
    return subprocess.run([*launch, MPDL, "generate", "--checkpoint", str(ckpt), *flags],
                          capture_output=True, text=True, timeout=90,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def with_answer(text: str, prompt: str) -> str:
    """The line `mpdl generate` prints for a 1-digit addition model's text: the two characters
    after the prompt are the sum, least significant digit first."""
    written = text[len(prompt):len(prompt) + 2]
    if not written.isdigit():
        return f"{text}  # no answer: the 2 characters after '=' are not all digits"
    return (f"{text}  # = {int(written[1] + written[0])} (the sum is written reversed, least "
            f"significant digit first)")


def test_generate_from_a_tiny_checkpoint(ckpt):
    model, info = load_gpt(ckpt)
    assert info["vocab"] == "0123456789+=" and info["block_size"] == 5 and info["digits"] == 1
    expected = sample(model, info["vocab"], "3+4=", 2, top_k=1)

    def generate(*flags: str) -> subprocess.CompletedProcess:
        return generate_in(ckpt, *flags)

    out = generate("--prompt", "3+4=", "--max-new-tokens", "2", "--top-k", "1")
    assert out.returncode == 0, out.stderr
    assert out.stdout == with_answer(expected, "3+4=") + "\n" and len(expected) == 6
    sampled = [generate("--prompt", "3+4=", "--max-new-tokens", "20", "--seed", s).stdout
               for s in ("1", "1", "2")]
    assert sampled[0] == sampled[1] != sampled[2] and sampled[0].index("  # ") == 4 + 20
    # by default an addition model stops after the answer: 1 + 1 digits
    out = generate("--prompt", "3+4=", "--top-k", "1")
    assert out.stdout == with_answer(expected, "3+4=") + "\n"
    for flags, message in [
            (["--prompt", "3*4="], "--prompt: '*' not in the model's vocabulary"),
            (["--prompt", "3+4"], "--prompt: '3+4' is not an addition problem; this model reads "
                                  "a+b= with operands of 1 digit, like 1+4="),
            (["--prompt", "12+3="], "--prompt: '12+3=' has an operand longer than this model's; "
                                    "it reads a+b= with operands of 1 digit"),
            (["--prompt", "3+4=5"], "--prompt: '3+4=5' is not an addition problem"),
            ([], "--prompt: give the problem this addition model answers"),
            (["--temperature", "0"], "--temperature: expected a positive"),
            (["--top-k", "0"], "--top-k: expected a positive")]:
        out = generate(*flags)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert out.stderr.startswith("mpdl generate: error: ") and message in out.stderr


def test_an_addition_prompt_is_padded_and_its_answer_read_reversed():
    assert addition_prompt("2+2=", 3) == "002+002=" and addition_prompt("0042+7=", 3) == "042+007="
    assert addition_prompt("123+456=", 3) == "123+456="
    assert "1 to 3 digits, like 123+456=" in addition_example(3)
    for prompt in ("1234+1=", "12+3", "+3=", "1+2=3", " 1+2="):
        with pytest.raises(ValueError, match=f"prompt: '{re.escape(prompt)}' "):
            addition_prompt(prompt, 3)
    assert addition_answer("9750", 3) == 579 and addition_answer("9750123", 3) == 579
    assert addition_answer("0100", 3) == 10
    assert addition_answer("97+0", 3) is None and addition_answer("975", 3) is None


def test_a_checkpoint_of_text_samples_freely(tmp_path):
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    directory = tmp_path / "ckpt"
    run(TrainConfig.from_keys({"model.name": "gpt", "data.dataset": "text",
                               "data.path": str(tmp_path / "text.txt"), "model.block_size": 8,
                               "model.n_layer": 1, "model.n_head": 2, "model.n_embd": 8,
                               "optim.global_batch_size": 16, "optim.epochs": 1,
                               "output.progress": False, "checkpoint.dir": str(directory)}))
    model, info = load_gpt(directory)
    assert "digits" not in info
    out = generate_in(directory, "--prompt", "the ", "--top-k", "1")
    # by default as many characters as the model sees at once: its block size, 8
    assert out.returncode == 0, out.stderr
    assert out.stdout == sample(model, info["vocab"], "the ", 8, top_k=1) + "\n"
    sampled = [generate_in(directory, "--max-new-tokens", "20", "--seed", s).stdout
               for s in ("1", "1", "2")]
    assert sampled[0] == sampled[1] != sampled[2] and len(sampled[0]) == 1 + 20 + 1


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


def test_prompts_file_json_and_timings_on_two_tensor_parallel_ranks(ckpt, tmp_path):
    model, info = load_gpt(ckpt)
    prompts, read = ["3+4=", "1+1=", "09+9="], ["3+4=", "1+1=", "9+9="]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    expected = [sample(model, info["vocab"], p, 3, top_k=1) for p in read]
    out = generate_in(ckpt, "--prompts", str(tmp_path / "prompts.txt"), "--max-new-tokens", "3",
                      "--top-k", "1", "--tp", "2", "--json", str(tmp_path / "out.jsonl"),
                      ranks=2)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:3] == [with_answer(text, p) for text, p in zip(expected, read, strict=True)]
    assert lines[3].startswith("# 3 prompts, 3 new tokens each, dp 1 x pp 1 x tp 2")
    assert [line.split()[1:3] for line in lines[5:7]] == [["0", "(0,0,0)"], ["1", "(0,0,1)"]]
    assert lines[7].startswith("# total 9 new tokens in ") and "p99" in lines[7]
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["text"] for r in rows[:3]] == expected and len(rows) == 4
    for row, p, text in zip(rows, read, expected, strict=False):
        written = text[len(p):len(p) + 2]
        assert row["answer"] == (int(written[::-1]) if written.isdigit() else None)
        assert row["prompt"] == p and row["new_tokens"] == 3
        assert row["tokens"] == [info["vocab"].index(ch) for ch in text[len(p):]]
        assert row["ttft_s"] > 0 and row["tokens_per_s"] > 0
        assert 0 <= row["latency_p50_s"] <= row["latency_p99_s"]
    summary = rows[3]
    assert summary["summary"] and summary["tp"] == 2 and summary["new_tokens"] == 9
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert summary["tokens_per_s"] == pytest.approx(9 / summary["wall_s"])


def test_bad_input_exits_2_on_every_rank_with_one_line(ckpt, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.txt").write_text("3+4=\n3*4=\n")
    for flags, message in [
            (["--prompts", str(tmp_path / "empty.txt")], f"--prompts: {tmp_path}/empty.txt holds "
                                                          f"no prompts (expected one per line)"),
            (["--prompts", str(tmp_path / "bad.txt")], "--prompts: " + str(tmp_path / "bad.txt")
             + " line 2: '*' not in the model's vocabulary"),
            (["--tp", "4"], "--tp: 4 tensor-parallel ranks must divide the model's 2 heads"),
            (["--pp", "2"], "--pp: 2 pipeline stages need at least as many blocks, the model "
                            "has 1"),
            (["--dp", "3"], "--dp × --pp × --tp = 3 × 1 × 1 = 3 must equal the 2 ranks")]:
        out = generate_in(ckpt, *flags, *([] if "--prompts" in flags else ["--prompt", "3+4="]),
                          ranks=2)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert out.stderr.startswith(f"mpdl generate: error: {message}"), out.stderr
