"""Sampling from the GPT checkpoint of a `mpdl train --model gpt` run (`mpdl generate`).

The run's state.json records what rebuilding the model takes (`model_info`: the vocabulary, the
block size, the layers, heads and width, the dtype and the dataset, and an addition model's
digits); model.npz holds the weights. An addition model reads a problem `a+b=` with operands
zero-padded to its digits and writes the sum reversed, least significant digit first
(`mpdl.datasets.Addition`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from mpdl.models.gpt import GPT
from mpdl.training.checkpoint import CheckpointError, load_checkpoint


def gpt_checkpoint(directory: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A GPT checkpoint's model state and `model_info`; CheckpointError when there is no whole
    checkpoint in directory or it is not a GPT's."""
    model_state, _, state = load_checkpoint(directory)
    info = state.get("model_info")
    if not info or info.get("name") != "gpt":
        model = state.get("config", {}).get("model", "?")  # a section, or before them a name
        model = model.get("name", "?") if isinstance(model, dict) else model
        raise CheckpointError(f"{directory}: not a GPT checkpoint (written by mpdl train --model "
                              f"{model})")
    return model_state, info


def load_gpt(directory: str | Path) -> tuple[GPT, dict[str, Any]]:
    """The GPT of a checkpoint and its `model_info`; CheckpointError when there is no whole
    checkpoint in directory or it is not a GPT's."""
    model_state, info = gpt_checkpoint(directory)
    model = GPT(len(info["vocab"]), info["block_size"], info["n_layer"], info["n_head"],
                info["n_embd"], dtype=np.dtype(info["dtype"]))
    model.load_state_dict(model_state)
    return model, info


def default_prompt(vocab: str) -> str:
    """A newline when the vocabulary has one (the start of a line of text), else its first
    character."""
    return "\n" if "\n" in vocab else vocab[0]


def check_prompt(vocab: str, prompt: str) -> None:
    """ValueError naming the prompt when it is empty or has characters the vocabulary lacks."""
    if not prompt:
        raise ValueError("prompt: give at least one character")
    unknown = sorted(set(prompt) - set(vocab))
    if unknown:
        raise ValueError(f"prompt: {''.join(unknown)!r} not in the model's vocabulary "
                         f"{vocab!r}")


def addition_digits(info: dict[str, Any]) -> int | None:
    """The operand digits of an addition model's `model_info`, None for another model (a
    checkpoint written before `digits` was recorded: from its block size, 3·digits + 2)."""
    if info.get("dataset") != "addition":
        return None
    return int(info.get("digits") or (info["block_size"] - 2) // 3)


def addition_example(digits: int) -> str:
    """The form of an addition model's prompt, in words and by a problem of `digits` digits."""
    operands = "1 digit" if digits == 1 else f"1 to {digits} digits"
    return f"a+b= with operands of {operands}, like {'123456789'[:digits]}+{'456789123'[:digits]}="


def addition_prompt(prompt: str, digits: int) -> str:
    """The problem `a+b=` of `prompt` with both operands zero-padded to `digits` digits, as an
    addition model of that many digits reads it; ValueError naming the prompt otherwise."""
    problem = re.fullmatch(r"(\d+)\+(\d+)=", prompt)
    if problem is None:
        raise ValueError(f"prompt: {prompt!r} is not an addition problem; this model reads "
                         f"{addition_example(digits)}")
    operands = [number.lstrip("0") or "0" for number in problem.groups()]
    if max(map(len, operands)) > digits:
        raise ValueError(f"prompt: {prompt!r} has an operand longer than this model's; it reads "
                         f"{addition_example(digits)}")
    return "+".join(number.zfill(digits) for number in operands) + "="


def addition_answer(generated: str, digits: int) -> int | None:
    """The sum an addition model wrote at the start of its generated text (`digits` + 1
    characters, least significant digit first); None when they are not all digits."""
    written = generated[:digits + 1]
    if len(written) < digits + 1 or not written.isdigit():
        return None
    return int(written[::-1])


def sample(model: GPT, vocab: str, prompt: str, max_new_tokens: int, temperature: float = 1.0,
           top_k: int | None = None, seed: int = 0) -> str:
    """`prompt` followed by `max_new_tokens` characters sampled from `model` (see
    `GPT.generate`); ValueError for a prompt `check_prompt` refuses."""
    check_prompt(vocab, prompt)
    ids = np.array([[vocab.index(ch) for ch in prompt]], dtype=np.int64)
    out = model.generate(ids, max_new_tokens, temperature=temperature, top_k=top_k,
                         rng=np.random.default_rng(seed))
    return "".join(vocab[int(i)] for i in out[0])
