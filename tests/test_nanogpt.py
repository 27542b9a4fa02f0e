"""`mpdl export` and `mpdl train --init-from`: a GPT checkpoint as a safetensors file under nanoGPT's
names, loaded into a nanoGPT-shaped PyTorch model (the optional oracle) whose logits must be
mpdl's within 1e-5, read back unchanged, and refused with one line when it does not fit."""

from __future__ import annotations

import io
import json
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from mpdl.autograd import no_grad
from mpdl.models.gpt import GPT
from mpdl.models.nanogpt import import_state, nanogpt_name
from mpdl.threadworld import run_world
from mpdl.training.checkpoint import save_checkpoint
from mpdl.training.config import TrainConfig
from mpdl.training.loop import Trainer

MPDL = str(Path(sys.executable).parent / "mpdl")
SHAPE = dict(vocab_size=12, block_size=5, n_layer=2, n_head=4, n_embd=16)  # addition, 1 digit
VOCAB = "0123456789+="


def gpt_checkpoint(directory: Path, seed: int = 5) -> GPT:
    """A GPT with random weights (biases and LayerNorms too) saved as `mpdl train` would."""
    gpt = GPT(**SHAPE, seed=seed)
    rng = np.random.default_rng(seed)
    for _, p in gpt.named_parameters():
        p.data[...] = rng.normal(0, 0.3, p.shape).astype(np.float32)
    info = {"name": "gpt", "vocab": VOCAB, "block_size": 5, "n_layer": 2, "n_head": 4,
            "n_embd": 16, "dtype": "float32"}
    save_checkpoint(directory, gpt.state_dict(), {"state": {}, "param_groups": []},
                    {"epoch": 1, "step": 1, "model_info": info, "config": {"model": "gpt"}})
    return gpt


def export(ckpt: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([MPDL, "export", "--checkpoint", str(ckpt), str(out)],
                          capture_output=True, text=True, timeout=60)


def test_export_writes_nanogpt_names_layout_and_config(tmp_path):
    gpt = gpt_checkpoint(tmp_path / "ckpt")
    out = export(tmp_path / "ckpt", tmp_path / "model.safetensors")
    assert out.returncode == 0, out.stderr
    tensors = load_file(str(tmp_path / "model.safetensors"))
    names = {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight",
             "transformer.ln_f.bias"} | {
        f"transformer.h.{n}.{m}.{leaf}" for n in range(2) for leaf in ("weight", "bias")
        for m in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")}
    assert set(tensors) == names  # lm_head.weight is tied to wte: not written
    assert tensors["transformer.h.1.attn.c_attn.weight"].shape == (48, 16)  # (out, in)
    assert tensors["transformer.h.0.mlp.c_proj.weight"].shape == (16, 64)
    np.testing.assert_array_equal(tensors["transformer.h.1.mlp.c_fc.bias"],
                                  gpt.blocks[1].mlp.fc.bias.data)
    with safe_open(str(tmp_path / "model.safetensors"), framework="np") as f:
        meta = f.metadata()
    assert json.loads(meta["config"]) == {"block_size": 5, "vocab_size": 12, "n_layer": 2,
                                          "n_head": 4, "n_embd": 16, "dropout": 0.0,
                                          "bias": True}
    assert json.loads(meta["vocab"]) == VOCAB
    back = import_state(tmp_path / "model.safetensors", GPT(**SHAPE, seed=0), VOCAB)
    for name, value in gpt.state_dict().items():
        np.testing.assert_array_equal(back[name], value)


def test_pytorch_nanogpt_loads_the_file_and_gives_the_same_logits(tmp_path):
    torch = pytest.importorskip("torch")
    nn, F = torch.nn, torch.nn.functional
    gpt = gpt_checkpoint(tmp_path / "ckpt")
    assert export(tmp_path / "ckpt", tmp_path / "model.safetensors").returncode == 0

    class Attention(nn.Module):
        def __init__(self, c: int, h: int) -> None:
            super().__init__()
            self.c_attn, self.c_proj, self.h = nn.Linear(c, 3 * c), nn.Linear(c, c), h

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2)
                       for z in self.c_attn(x).split(c, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))

    class MLP(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.c_fc, self.gelu, self.c_proj = nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c)

        def forward(self, x):
            return self.c_proj(self.gelu(self.c_fc(x)))

    class Block(nn.Module):
        def __init__(self, c: int, h: int) -> None:
            super().__init__()
            self.ln_1, self.attn = nn.LayerNorm(c), Attention(c, h)
            self.ln_2, self.mlp = nn.LayerNorm(c), MLP(c)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class NanoGPT(nn.Module):
        def __init__(self, config: dict) -> None:
            super().__init__()
            c = config["n_embd"]
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(config["vocab_size"], c),
                wpe=nn.Embedding(config["block_size"], c),
                h=nn.ModuleList(Block(c, config["n_head"]) for _ in range(config["n_layer"])),
                ln_f=nn.LayerNorm(c)))
            self.lm_head = nn.Linear(c, config["vocab_size"], bias=False)
            self.transformer.wte.weight = self.lm_head.weight  # tied, as nanoGPT does

        def forward(self, idx):
            pos = torch.arange(idx.shape[1])
            x = self.transformer.wte(idx) + self.transformer.wpe(pos)
            for block in self.transformer.h:
                x = block(x)
            return self.lm_head(self.transformer.ln_f(x))

    from safetensors.torch import load_file as load_torch  # noqa: PLC0415

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        config = json.loads(f.metadata()["config"])
    model = NanoGPT(config)
    missing, unexpected = model.load_state_dict(load_torch(str(tmp_path / "model.safetensors")),
                                                strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []
    ids = np.random.default_rng(0).integers(0, 12, (3, 5))
    with torch.no_grad():
        theirs = model(torch.from_numpy(ids)).numpy()
    with no_grad():
        ours = gpt(ids).data
    assert np.abs(theirs - ours).max() < 1e-5


def test_init_from_and_export_refuse_what_does_not_fit(tmp_path):
    gpt = gpt_checkpoint(tmp_path / "ckpt")
    state = {nanogpt_name(k): v for k, v in gpt.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    base = ["train", "--model", "gpt", "--dataset", "addition", "--digits", "1", "--n-layer", "2",
            "--n-head", "4", "--epochs", "1", "--no-progress"]
    save_checkpoint(tmp_path / "mlp", {"w": np.zeros(3)}, {"state": {}, "param_groups": []},
                    {"epoch": 1, "step": 1, "config": {"model": "mlp"}})
    # today's checkpoints record the configuration by section
    save_checkpoint(tmp_path / "mlp2", {"w": np.zeros(3)}, {"state": {}, "param_groups": []},
                    {"epoch": 1, "step": 1, "config": {"model": {"name": "mlp", "n_layer": 2}}})
    for args, message in [
            ([*base, "--n-embd", "8", "--init-from", str(tmp_path / "model.safetensors")],
             "--init-from: " + str(tmp_path / "model.safetensors") + ": transformer.wte.weight has "
             "shape (12, 16), this run's model needs (12, 8)"),
            ([*base, "--init-from", str(tmp_path / "junk.safetensors")],
             "--init-from: " + str(tmp_path / "junk.safetensors") + ": not a readable safetensors"),
            (["export", "--checkpoint", str(tmp_path / "mlp"), str(tmp_path / "x.safetensors")],
             "--checkpoint: " + str(tmp_path / "mlp") + ": not a GPT checkpoint (written by mpdl "
             "train --model mlp)"),
            (["export", "--checkpoint", str(tmp_path / "mlp2"), str(tmp_path / "x.safetensors")],
             "--checkpoint: " + str(tmp_path / "mlp2") + ": not a GPT checkpoint (written by mpdl "
             "train --model mlp)"),
            (["export", "--checkpoint", str(tmp_path / "ckpt"),
              str(tmp_path / "missing" / "x.safetensors")],
             "OUT: " + str(tmp_path / "missing" / "x.safetensors") + ": the folder "
             + str(tmp_path / "missing") + " does not exist")]:
        out = subprocess.run([MPDL, *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert message in out.stderr, out.stderr
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_the_exported_file_has_the_mode_the_umask_gives(tmp_path, umask, mode):
    """Not the private temporary file's 0600 whatever the umask."""
    gpt_checkpoint(tmp_path / "ckpt")
    out = subprocess.run(["sh", "-c", f"umask {umask:03o} && exec {MPDL} export --checkpoint "
                          f"{tmp_path / 'ckpt'} {tmp_path / 'model.safetensors'}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert stat.S_IMODE((tmp_path / "model.safetensors").stat().st_mode) == mode


@pytest.mark.parametrize("layout", [{}, {"parallel.pp": 2}, {"parallel.zero": 3}])
def test_a_run_starts_from_the_file(tmp_path, layout):
    """One rank, and two ranks of the in-process world as a pipeline or with ZeRO-3: the whole
    model gathered after setup is the file's."""
    gpt = gpt_checkpoint(tmp_path / "ckpt")
    assert export(tmp_path / "ckpt", tmp_path / "model.safetensors").returncode == 0
    config = TrainConfig.from_keys({
        "model.name": "gpt", "data.dataset": "addition", "data.digits": 1, "model.n_layer": 2,
        "model.n_head": 4, "model.n_embd": 16, "optim.epochs": 1, "output.progress": False,
        **layout, "checkpoint.init_from": str(tmp_path / "model.safetensors")})

    def body(comm):
        trainer = Trainer(config, comm=comm, out=io.StringIO())
        trainer.setup()
        with trainer.strategy.gathered():
            return trainer.model.state_dict(), trainer.initialized

    for state, note in run_world(2 if layout else 1, body):
        for name, value in gpt.state_dict().items():
            np.testing.assert_array_equal(state[name], value)
        # the header's note: (n_embd 16) wte 12·16, wpe 5·16, per block 12·16² + 13·16, ln_f 2·16
        assert note == (f"# weights loaded from {tmp_path / 'model.safetensors'} (--init-from): "
                        f"28 tensors, {12 * 16 + 5 * 16 + 2 * (12 * 256 + 13 * 16) + 2 * 16:,} "
                        f"parameters")
