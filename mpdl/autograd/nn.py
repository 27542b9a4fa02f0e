"""Layers with parameters and buffers, composed into models (PyTorch-style ``Module``)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from mpdl.autograd import functional as F
from mpdl.autograd import partial
from mpdl.autograd.linear_gelu import linear_gelu
from mpdl.autograd.tensor import Tensor, _move
from mpdl.backend import get_array_module, to_host


class Parameter(Tensor):
    """A leaf Tensor that a Module trains (``requires_grad`` is True by default)."""

    __slots__ = ()

    def __init__(self, data: Any, requires_grad: bool = True) -> None:
        super().__init__(partial.admit(data), requires_grad=requires_grad)

    def __repr__(self) -> str:
        return f"Parameter(shape={self.shape}, dtype={self.dtype})"


class TableParameter(Parameter):
    """A lookup table's weight (`Embedding`): 2-D, but read by rows, so that matrix optimizers
    (Muon) leave it to AdamW."""

    __slots__ = ()
    lookup_table = True


def make_rng(rng: np.random.Generator | None = None, seed: int | None = None
             ) -> np.random.Generator:
    """The generator to initialise from: ``rng`` if given, else one seeded with ``seed``."""
    if rng is not None and seed is not None:
        raise ValueError("give rng or seed, not both")
    if rng is not None:
        if not isinstance(rng, np.random.Generator):
            raise TypeError(f"rng must be a numpy.random.Generator, not {type(rng).__name__}")
        return rng
    return np.random.default_rng(seed)


def kaiming_uniform(shape: tuple[int, ...], fan_in: int, rng: np.random.Generator,
                    dtype: Any = np.float32) -> np.ndarray:
    """PyTorch's default weight init: U(-1/√fan_in, 1/√fan_in), i.e. Kaiming-uniform, a=√5."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return rng.uniform(-bound, bound, size=shape).astype(dtype)


class Module:
    """A model part: holds Parameters, buffers and sub-Modules, and maps inputs in ``forward``."""

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_buffers", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "training", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__}: call super().__init__() before "
                                 f"assigning attributes")
        params, buffers, modules = self._parameters, self._buffers, self._modules
        if isinstance(value, Parameter):
            modules.pop(name, None)
            params[name] = value
        elif isinstance(value, Module):
            params.pop(name, None)
            modules[name] = value
        elif name in buffers:
            buffers[name] = value if value is None or isinstance(value, Tensor) else Tensor(value)
        else:
            params.pop(name, None)
            modules.pop(name, None)
            object.__setattr__(self, name, value)
            return
        self.__dict__.pop(name, None)

    def __getattr__(self, name: str) -> Any:
        for registry in ("_parameters", "_buffers", "_modules"):
            table = self.__dict__.get(registry)
            if table is not None and name in table:
                return table[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def register_buffer(self, name: str, value: Any) -> None:
        """Keep ``value`` (an array or Tensor, not trained) in the state dict under ``name``."""
        self._buffers[name] = None if value is None else (
            value if isinstance(value, Tensor) else Tensor(value))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    # ------------------------------------------------------------------ traversal
    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        """This module and every sub-module, depth first, with dotted names."""
        yield prefix, self
        for name, module in self._modules.items():
            yield from module.named_modules(f"{prefix}.{name}" if prefix else name)

    def children(self) -> Iterator[Module]:
        """The direct sub-modules in registration order."""
        yield from self._modules.values()

    def named_parameters(self) -> Iterator[tuple[str, Parameter]]:
        """(name, parameter) in registration order, each shared parameter once."""
        seen: set[int] = set()
        for prefix, module in self.named_modules():
            for name, p in module._parameters.items():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{prefix}.{name}" if prefix else name), p

    def parameters(self) -> list[Parameter]:
        """Every parameter in registration order."""
        return [p for _, p in self.named_parameters()]

    def named_buffers(self) -> Iterator[tuple[str, Tensor]]:
        """(name, buffer) in registration order, e.g. batch norm's running statistics."""
        for prefix, module in self.named_modules():
            for name, b in module._buffers.items():
                if b is not None:
                    yield (f"{prefix}.{name}" if prefix else name), b

    def buffers(self) -> list[Tensor]:
        """Every buffer in registration order."""
        return [b for _, b in self.named_buffers()]

    # ------------------------------------------------------------------ modes and devices
    def train(self, mode: bool = True) -> Module:
        """Switch this module and its sub-modules to training (or evaluation) mode."""
        for _, module in self.named_modules():
            object.__setattr__(module, "training", mode)
        return self

    def eval(self) -> Module:
        """Switch to evaluation mode (running statistics, no dropout)."""
        return self.train(False)

    def zero_grad(self) -> None:
        """Set every parameter's gradient to None."""
        for p in self.parameters():
            p.grad = None

    def to(self, device: str) -> Module:
        """Move every parameter and buffer to ``device`` ("cpu" or "gpu") in place."""
        if device not in ("cpu", "gpu"):
            raise ValueError(f"to(): device must be 'cpu' or 'gpu', not {device!r}")
        for t in [*self.parameters(), *self.buffers()]:
            t.data = _move(t.data, device)
            if t.grad is not None:
                t.grad = _move(t.grad, device)
        return self

    # ------------------------------------------------------------------ checkpoints
    def _named_state(self) -> Iterator[tuple[str, Tensor]]:
        """Parameters then buffers of each module in turn (PyTorch's state-dict order)."""
        seen: set[int] = set()
        for prefix, module in self.named_modules():
            for name, t in [*module._parameters.items(), *module._buffers.items()]:
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    yield (f"{prefix}.{name}" if prefix else name), t

    def state_dict(self) -> dict[str, np.ndarray]:
        """Host copies of every parameter and buffer, by name, in PyTorch's order."""
        return {name: np.array(to_host(t.data), copy=True) for name, t in self._named_state()}

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Copy values into the parameters and buffers in place; names and shapes must match."""
        targets = dict(self._named_state())
        missing = [k for k in targets if k not in state]
        unexpected = [k for k in state if k not in targets]
        if strict and (missing or unexpected):
            raise ValueError(f"load_state_dict: missing keys {missing}, unexpected keys "
                           f"{unexpected}")
        for name, t in targets.items():
            if name not in state:
                continue
            value = np.asarray(to_host(state[name]))
            if value.shape != t.data.shape:
                raise ValueError(f"load_state_dict: {name!r} has shape {value.shape} in the "
                                 f"state dict but {t.shape} in the model")
        for name, t in targets.items():
            if name in state:
                xp = get_array_module(t.data)
                t.data[...] = xp.asarray(np.asarray(to_host(state[name]), dtype=t.dtype))

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"  ({name}): " + repr(m).replace("\n", "\n  ") for name, m in
                 self._modules.items()]
        head = f"{type(self).__name__}({self.extra_repr()}"
        return head + ("\n" + "\n".join(lines) + "\n)" if lines else ")")


class Linear(Module):
    """y = x @ W.T + b with W of shape (out_features, in_features)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 rng: np.random.Generator | None = None, seed: int | None = None,
                 dtype: Any = np.float32) -> None:
        super().__init__()
        g = make_rng(rng, seed)
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(kaiming_uniform((out_features, in_features), in_features, g,
                                                dtype))
        self.bias = Parameter(kaiming_uniform((out_features,), in_features, g, dtype)) \
            if bias else None

    def forward(self, x: Tensor, activation: str | None = None) -> Tensor:
        """x @ W.T + b; with ``activation="gelu"``, gelu of it (one node with a bias)."""
        if activation not in (None, "gelu"):
            raise ValueError(f"Linear: activation must be None or 'gelu', not {activation!r}")
        if activation is None:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return F.gelu(F.linear(x, self.weight))
        return linear_gelu(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}"


class Conv2d(Module):
    """2-D convolution over NCHW input with an OIHW weight."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int],
                 stride: int = 1, padding: int | tuple[int, int] = 0, bias: bool = True, *,
                 rng: np.random.Generator | None = None, seed: int | None = None,
                 dtype: Any = np.float32) -> None:
        super().__init__()
        g = make_rng(rng, seed)
        kh, kw = (kernel_size, kernel_size) if isinstance(kernel_size, int) else kernel_size
        fan_in = in_channels * kh * kw
        self.stride, self.padding = stride, padding
        self.weight = Parameter(kaiming_uniform((out_channels, in_channels, kh, kw), fan_in, g,
                                                dtype))
        self.bias = Parameter(kaiming_uniform((out_channels,), fan_in, g, dtype)) \
            if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.conv2d(x, self.weight, self.bias, stride=self.stride, padding=self.padding)

    def extra_repr(self) -> str:
        o, c, kh, kw = self.weight.shape
        return f"{c}, {o}, kernel_size=({kh}, {kw}), stride={self.stride}, padding={self.padding}"


class _BatchNorm(Module):
    _ndims: tuple[int, ...] = ()

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 affine: bool = True, track_running_stats: bool = True, *,
                 dtype: Any = np.float32) -> None:
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.weight = Parameter(np.ones(num_features, dtype)) if affine else None
        self.bias = Parameter(np.zeros(num_features, dtype)) if affine else None
        if track_running_stats:
            self.register_buffer("running_mean", np.zeros(num_features, dtype))
            self.register_buffer("running_var", np.ones(num_features, dtype))
            self.register_buffer("num_batches_tracked", np.zeros((), np.int64))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim not in self._ndims or x.shape[1] != self.num_features:
            raise ValueError(f"{type(self).__name__}({self.num_features}): expected input of "
                             f"{' or '.join(f'{n}-D' for n in self._ndims)} shape with "
                             f"{self.num_features} channels, got {x.shape}")
        rm, rv = self._buffers["running_mean"], self._buffers["running_var"]
        use_batch = self.training or rm is None
        if self.training and rm is not None:
            self.num_batches_tracked.data += 1
        return F.batch_norm(x, None if rm is None else rm.data, None if rv is None else rv.data,
                            self.weight, self.bias, training=use_batch, momentum=self.momentum,
                            eps=self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}"


class BatchNorm1d(_BatchNorm):
    """Batch normalisation over (N, C) or (N, C, L) input."""

    _ndims = (2, 3)


class BatchNorm2d(_BatchNorm):
    """Batch normalisation over (N, C, H, W) input."""

    _ndims = (4,)


class MaxPool2d(Module):
    """Maximum over kernel windows of NCHW input."""

    def __init__(self, kernel_size: int | tuple[int, int], stride: int | None = None,
                 padding: int | tuple[int, int] = 0) -> None:
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding

    def forward(self, x: Tensor) -> Tensor:
        return F.max_pool2d(x, self.kernel_size, self.stride, self.padding)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AvgPool2d(MaxPool2d):
    """Mean over kernel windows of NCHW input."""

    def forward(self, x: Tensor) -> Tensor:
        return F.avg_pool2d(x, self.kernel_size, self.stride, self.padding)


class ReLU(Module):
    """max(x, 0)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x)


class Flatten(Module):
    """Merge the axes from ``start_dim`` on."""

    def __init__(self, start_dim: int = 1) -> None:
        super().__init__()
        self.start_dim = start_dim

    def forward(self, x: Tensor) -> Tensor:
        return F.flatten(x, self.start_dim)


class Dropout(Module):
    """Zero elements with probability ``p`` in training, drawing masks from its own generator."""

    def __init__(self, p: float = 0.5, *, rng: np.random.Generator | None = None,
                 seed: int | None = None) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"Dropout: p must lie in [0, 1], not {p!r}")
        self.p, self.rng = p, make_rng(rng, seed)

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, self.training, self.rng)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class ModuleList(Module):
    """A list of sub-modules named "0", "1", ... (no forward of its own)."""

    def __init__(self, modules: Any = ()) -> None:
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, module: Module) -> ModuleList:
        """Add ``module`` at the end, named by its position."""
        if not isinstance(module, Module):
            raise TypeError(f"ModuleList: expected a Module, not {type(module).__name__}")
        setattr(self, str(len(self._modules)), module)
        return self

    def __getitem__(self, i: int) -> Module:
        return list(self._modules.values())[i]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())


class Sequential(ModuleList):
    """Modules applied in order; sub-modules are named "0", "1", ..."""

    def __init__(self, *modules: Module) -> None:
        for i, m in enumerate(modules):
            if not isinstance(m, Module):
                raise TypeError(f"Sequential: argument {i} is a {type(m).__name__}, not a Module")
        super().__init__(modules)

    def forward(self, x: Any) -> Any:
        for m in self._modules.values():
            x = m(x)
        return x


class Embedding(Module):
    """A lookup table: row i of ``weight`` (num_embeddings, embedding_dim) for index i,
    initialised N(0, 1) as in PyTorch."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *,
                 rng: np.random.Generator | None = None, seed: int | None = None,
                 dtype: Any = np.float32) -> None:
        super().__init__()
        for name, n in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"Embedding: {name} must be a positive int, not {n!r}")
        g = make_rng(rng, seed)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = TableParameter(
            g.standard_normal((num_embeddings, embedding_dim)).astype(dtype))

    def forward(self, indices: Any) -> Tensor:
        return F.embedding(indices, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LayerNorm(Module):
    """Layer normalisation over the trailing ``normalized_shape`` axes, with a learnt scale
    (ones) and shift (zeros) when ``elementwise_affine``."""

    def __init__(self, normalized_shape: int | tuple[int, ...], eps: float = 1e-5,
                 elementwise_affine: bool = True, *, dtype: Any = np.float32) -> None:
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(
            normalized_shape)
        if not shape or not all(isinstance(n, int) and n > 0 for n in shape):
            raise ValueError(f"LayerNorm: normalized_shape must be a positive int or a non-empty "
                             f"tuple of them, not {normalized_shape!r}")
        self.normalized_shape, self.eps = shape, eps
        self.weight = Parameter(np.ones(shape, dtype)) if elementwise_affine else None
        self.bias = Parameter(np.zeros(shape, dtype)) if elementwise_affine else None

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, " \
               f"elementwise_affine={self.weight is not None}"
