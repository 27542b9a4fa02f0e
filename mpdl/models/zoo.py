"""The model zoo of `mpdl train`: mlp, lenet and resnet8, built for any (C, H, W) input, and the
GPT language model (`mpdl.models.gpt`) for the sequence tasks."""

from __future__ import annotations

from typing import Any

import numpy as np

from mpdl.autograd import nn
from mpdl.autograd.tensor import Tensor
from mpdl.models.gpt import GPT
from mpdl.models.moe import MoESettings

__all__ = ["GPT", "IMAGE_MODELS", "MODELS", "build_model", "describe_model"]

#: the image classifiers (input (C, H, W), a class per image)
IMAGE_MODELS = ("mlp", "lenet", "resnet8")
#: every model of the zoo; gpt reads token ids (block_size,) and predicts the next token
MODELS = (*IMAGE_MODELS, "gpt")


def mlp(input_shape: tuple[int, ...], classes: int, rng: np.random.Generator,
        hidden: tuple[int, ...] = (128,), dtype: Any = np.float32) -> nn.Module:
    """Flatten, then Linear + ReLU per hidden width, then a Linear classifier."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = int(np.prod(input_shape))
    for h in hidden:
        layers += [nn.Linear(width, h, rng=rng, dtype=dtype), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, classes, rng=rng, dtype=dtype))
    return nn.Sequential(*layers)


def lenet(input_shape: tuple[int, ...], classes: int, rng: np.random.Generator,
          dtype: Any = np.float32) -> nn.Module:
    """LeNet-5 style: two 5×5 convolutions (6 and 16 channels, padding 2) with 2×2 max pooling,
    then 120-84-classes fully connected layers, initialised for ReLU (`he_init`)."""
    c, h, w = input_shape
    flat = 16 * (h // 4) * (w // 4)
    return he_init(rng, nn.Sequential(
        nn.Conv2d(c, 6, 5, padding=2, rng=rng, dtype=dtype), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5, padding=2, rng=rng, dtype=dtype), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(flat, 120, rng=rng, dtype=dtype), nn.ReLU(),
        nn.Linear(120, 84, rng=rng, dtype=dtype), nn.ReLU(),
        nn.Linear(84, classes, rng=rng, dtype=dtype)))


def he_init(rng: np.random.Generator, model: nn.Module) -> nn.Module:
    """Draw every Linear and Conv2d weight from N(0, 2/fan_in) and zero the biases (He et al.
    2015), in place; returns model. With the default U(±1/√fan_in), each ReLU layer shrinks the
    signal's variance about sixfold, and a five-layer network without batch norm (LeNet) sits
    at chance for epochs before SGD finds its way."""
    for _, module in model.named_modules():
        if isinstance(module, nn.Linear | nn.Conv2d):
            weight = module.weight.data
            fan_in = int(np.prod(weight.shape[1:]))
            weight[...] = rng.normal(0.0, np.sqrt(2.0 / fan_in), weight.shape)
            if module.bias is not None:
                module.bias.data[...] = 0
    return model


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with batch norm and an identity (or 1×1 projection) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int, rng: np.random.Generator,
                 dtype: Any) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False, rng=rng,
                               dtype=dtype)
        self.bn1 = nn.BatchNorm2d(cout, dtype=dtype)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False, rng=rng, dtype=dtype)
        self.bn2 = nn.BatchNorm2d(cout, dtype=dtype)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False, rng=rng, dtype=dtype),
                nn.BatchNorm2d(cout, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        out = self.bn1(self.conv1(x)).relu()
        out = self.bn2(self.conv2(out))
        skip = x if self.shortcut is None else self.shortcut(x)
        return (out + skip).relu()


class ResNet8(nn.Module):
    """A CIFAR-style ResNet with 8 weighted layers: a 3×3 stem, three basic blocks (16, 32, 64
    channels; the last two halve the resolution), global average pooling and a classifier."""

    def __init__(self, input_shape: tuple[int, ...], classes: int, rng: np.random.Generator,
                 dtype: Any = np.float32) -> None:
        super().__init__()
        self.stem = nn.Conv2d(input_shape[0], 16, 3, padding=1, bias=False, rng=rng, dtype=dtype)
        self.bn = nn.BatchNorm2d(16, dtype=dtype)
        self.layer1 = BasicBlock(16, 16, 1, rng, dtype)
        self.layer2 = BasicBlock(16, 32, 2, rng, dtype)
        self.layer3 = BasicBlock(32, 64, 2, rng, dtype)
        self.fc = nn.Linear(64, classes, rng=rng, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        x = self.bn(self.stem(x)).relu()
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(x.mean(axis=(2, 3)))


def build_model(name: str, input_shape: tuple[int, ...], classes: int, seed: int = 0,
                dtype: Any = np.float32, moe: MoESettings | None = None, dropout: float = 0.0,
                **shape: int) -> nn.Module:
    """A zoo model, initialised from a generator seeded with `seed`. For gpt, input_shape is
    (block_size,), classes the vocabulary size, `shape` gives n_layer, n_head and n_embd, `moe`
    its mixture-of-experts layers and `dropout` its dropout probability."""
    rng = np.random.default_rng(seed)
    if name == "gpt":
        return GPT(classes, input_shape[0], shape["n_layer"], shape["n_head"], shape["n_embd"],
                   dropout, rng=rng, dtype=dtype, moe=moe)
    if name == "mlp":
        return mlp(input_shape, classes, rng, dtype=dtype)
    if name == "lenet":
        return lenet(input_shape, classes, rng, dtype=dtype)
    if name == "resnet8":
        return ResNet8(input_shape, classes, rng, dtype=dtype)
    raise ValueError(f"model: expected one of {', '.join(MODELS)}, got {name!r}")


def describe_model(name: str, model: nn.Module) -> str:
    """The model's name, with its shape and size for a GPT."""
    if not isinstance(model, GPT):
        return name
    return (f"gpt ({model.n_layer} layers, {model.n_head} heads, width {model.n_embd}, block "
            f"{model.block_size}, {model.num_parameters():,} parameters)")
