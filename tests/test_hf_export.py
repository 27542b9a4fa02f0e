"""`mpdl export --format hf`: a GPT checkpoint as a transformers GPT-2 directory that
AutoModelForCausalLM and AutoTokenizer load, whose greedy text is `mpdl generate --top-k 1`'s, and
that `mpdl train --init-from` starts from."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpdl.models.gpt import GPT
from mpdl.training.checkpoint import save_checkpoint
from mpdl.training.config import TrainConfig
from mpdl.training.loop import Trainer

# the files and transformers' reading of them, not the MPI library: the Open MPI rerun leaves it out
pytestmark = pytest.mark.same_under_every_mpi

MPDL = str(Path(sys.executable).parent / "mpdl")
VOCAB = "\n !,.abcdehilorsw"  # a newline and spaces: decoding must give them back exactly


def gpt_checkpoint(directory: Path, vocab: str = VOCAB, block_size: int = 24) -> GPT:
    """A GPT with random weights (biases and LayerNorms too) saved as `mpdl train` would."""
    gpt = GPT(len(vocab), block_size, 2, 4, 16, seed=3)
    rng = np.random.default_rng(3)
    for _, p in gpt.named_parameters():
        p.data[...] = rng.normal(0, 0.3, p.shape).astype(np.float32)
    info = {"name": "gpt", "vocab": vocab, "block_size": block_size, "n_layer": 2, "n_head": 4,
            "n_embd": 16, "dtype": "float32"}
    save_checkpoint(directory, gpt.state_dict(), {"state": {}, "param_groups": []},
                    {"epoch": 1, "step": 1, "model_info": info, "config": {"model": "gpt"}})
    return gpt


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[GPT, Path, Path]:
    root = tmp_path_factory.mktemp("hf")
    gpt = gpt_checkpoint(root / "ckpt")
    export_hf(root / "ckpt", root / "hf")
    return gpt, root / "ckpt", root / "hf"


def test_the_directory_holds_gpt2_config_conv1d_weights_and_a_tokenizer(exported):
    from safetensors.numpy import load_file  # noqa: PLC0415

    gpt, _, hf = exported
    config = json.loads((hf / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["n_positions"], config["n_layer"],
            config["n_head"], config["n_embd"], config["activation_function"]) == (
        "gpt2", len(VOCAB), 24, 2, 4, 16, "gelu")
    tensors = load_file(str(hf / "model.safetensors"))
    assert tensors["transformer.h.1.attn.c_attn.weight"].shape == (16, 48)  # Conv1D: (in, out)
    np.testing.assert_array_equal(tensors["transformer.h.0.mlp.c_proj.weight"],
                                  gpt.blocks[0].mlp.proj.weight.data.T)
    np.testing.assert_array_equal(tensors["transformer.wpe.weight"],
                                  gpt.position_embedding.weight.data)
    assert (hf / "tokenizer.json").is_file() and (hf / "tokenizer_config.json").is_file()


def test_transformers_loads_it_and_greedy_text_is_mpdl_generates(exported):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    gpt, ckpt, hf = exported
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    text = "hello, world.\n  cab!\n"
    ids = tok(text)["input_ids"]
    assert ids == [VOCAB.index(ch) for ch in text]
    assert tok.decode(ids) == text
    model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    batch = np.random.default_rng(0).integers(0, len(VOCAB), (2, 24))
    with torch.no_grad():
        theirs = model(torch.from_numpy(batch)).logits.numpy()
    assert np.abs(theirs - gpt(batch).data).max() < 1e-5
    prompt = "he said, "
    with torch.no_grad():
        out = model.generate(torch.tensor([tok(prompt)["input_ids"]]), max_new_tokens=12,
                             do_sample=False)
    ours = subprocess.run([MPDL, "generate", "--checkpoint", str(ckpt), "--prompt", prompt,
                           "--max-new-tokens", "12", "--top-k", "1"],
                          capture_output=True, text=True, timeout=60)
    assert ours.returncode == 0, ours.stderr
    assert len(out[0]) == len(prompt) + 12
    assert tok.decode(out[0].tolist()) + "\n" == ours.stdout


def export_hf(ckpt: Path, out: Path) -> None:
    done = subprocess.run([MPDL, "export", "--checkpoint", str(ckpt), "--format", "hf", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_run_starts_from_the_directory_and_refuses_another_vocabulary(exported, tmp_path):
    gpt = gpt_checkpoint(tmp_path / "ckpt", "0123456789+=", 5)  # addition with 1 digit
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    keys = {"model.name": "gpt", "data.dataset": "addition", "data.digits": 1,
            "model.n_layer": 2, "model.n_head": 4, "model.n_embd": 16, "optim.epochs": 1,
            "output.progress": False}
    trainer = Trainer(TrainConfig.from_keys({**keys, "checkpoint.init_from": str(tmp_path / "hf")}),
                      out=io.StringIO())
    trainer.setup()
    for name, value in gpt.state_dict().items():
        np.testing.assert_array_equal(trainer.model.state_dict()[name], value)
    other = exported[2]
    out = subprocess.run([MPDL, "train", "--model", "gpt", "--dataset", "addition", "--digits", "1",
                          "--n-layer", "2", "--n-head", "4", "--n-embd", "16", "--epochs", "1",
                          "--no-progress", "--init-from", str(other)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert f"--init-from: {other}/model.safetensors: written for the vocabulary" in out.stderr
