"""Sampling from the GPT checkpoint of a `mpdl train --model gpt` run (`mpdl generate`).

The run's state.json records what rebuilding the model takes (`model_info`: the vocabulary, the
block size, the layers, heads and width, the dtype and the dataset); model.npz holds the weights.
"""

from __future__ import annotations

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


def sample(model: GPT, vocab: str, prompt: str, max_new_tokens: int, temperature: float = 1.0,
           top_k: int | None = None, seed: int = 0) -> str:
    """`prompt` followed by `max_new_tokens` characters sampled from `model` (see
    `GPT.generate`); ValueError for a prompt `check_prompt` refuses."""
    check_prompt(vocab, prompt)
    ids = np.array([[vocab.index(ch) for ch in prompt]], dtype=np.int64)
    out = model.generate(ids, max_new_tokens, temperature=temperature, top_k=top_k,
                         rng=np.random.default_rng(seed))
    return "".join(vocab[int(i)] for i in out[0])
