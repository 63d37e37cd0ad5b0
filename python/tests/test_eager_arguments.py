"""spillway.offload_activations (activations/eager.py) as a new user first calls it.

Every bad argument is a ValueError whose message starts with "[eager]" and
names the argument and the value received; scope "*" finds the layers of a
model without an nn.ModuleList (an nn.Sequential, a module with block1 and
block2) and refuses a model with nothing to offload; a CPU model without
device= warns that nothing will move instead of doing nothing silently.
Gradients are compared bit for bit with the run without offload; bytes moved
are read from the context's statistics (the fake backend moves CPU tensors).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

# The adversarial module imports spillway.ops (or skips); its helpers serve here too.
from test_eager_adversarial import D, _assert_same_grads, _grads, _input, no_leaks  # noqa: F401

from spillway.activations.eager import offload_activations  # noqa: E402


def _seeded(build, seed=0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def _mlp() -> nn.Sequential:
    """A plain MLP: five children, two of them without parameters."""
    return _seeded(lambda: nn.Sequential(nn.Linear(D, 2 * D), nn.ReLU(), nn.Linear(2 * D, 2 * D),
                                         nn.Tanh(), nn.Linear(2 * D, 1)))


class Residual(nn.Module):
    """Saves its input (fc1's operand) and tanh's output (fc2's operand)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class TwoBlocks(nn.Module):
    """No layer list: two blocks, a parameter-free activation and a head, as attributes."""

    def __init__(self):
        super().__init__()
        self.block1 = Residual()
        self.act = nn.GELU()
        self.block2 = Residual()
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        return self.head(self.act(self.block2(self.act(self.block1(x)))))


class Wrapper(nn.Module):
    """A lone child holding the layers (self.net): '*' looks inside it."""

    def __init__(self):
        super().__init__()
        self.net = TwoBlocks()

    def forward(self, x):
        return self.net(x)


def _loss(model, x):
    return model(x).square().mean()


def _offloaded_step(model, x, **kwargs):
    """Gradients without offload, then under the context; returns both and the stats."""
    model.zero_grad(set_to_none=True)
    _loss(model, x).backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    kwargs = {"scope": "*", "min_bytes": 0, "device": "cpu", **kwargs}
    with offload_activations(model, **kwargs) as ctx:
        loss = _loss(model, x)
    loss.backward()
    return _grads(model), want, ctx.stats()


# ---- bad arguments ----------------------------------------------------------


@pytest.mark.parametrize("kwargs, argument, shown", [
    ({"scope": 123}, "scope", "123 (int)"),
    ({"scope": 1.5}, "scope", "1.5 (float)"),
    ({"scope": []}, "scope", "[] (list)"),
    ({"scope": ()}, "scope", "() (tuple)"),
    ({"scope": ["fc1", 3]}, "scope", "3 (int) in ['fc1', 3] (list)"),
    ({"scope": ["fc1", None]}, "scope", "None (NoneType)"),
    ({"scope": ""}, "scope", "'' (str)"),
    ({"scope": nn.Linear}, "scope", "scope='Linear'"),
    ({"min_bytes": -1}, "min_bytes", "got -1"),
    ({"min_bytes": True}, "min_bytes", "True (bool)"),
    ({"min_bytes": "1"}, "min_bytes", "'1' (str)"),
    ({"prefetch": -2}, "prefetch", "got -2"),
    ({"prefetch": 1.5}, "prefetch", "1.5 (float)"),
    ({"prefetch": False}, "prefetch", "False (bool)"),
    ({"lag": -1}, "lag", "got -1"),
    ({"lag": None}, "lag", "None (NoneType)"),
    ({"lag": 2.0}, "lag", "2.0 (float)"),
    ({"layers": [0, 5]}, "layers", "layers=[0, 5]: layer position 5 is out of range"),
    ({"layers": [-1]}, "layers", "layer position -1 is out of range"),
    ({"layers": ["0"]}, "layers", "'0' (str) in ['0'] (list)"),
    ({"layers": [True]}, "layers", "True (bool)"),
    ({"layers": [1.0]}, "layers", "1.0 (float)"),
    ({"layers": 3}, "layers", "3 (int)"),
    ({"device": "tpu"}, "device", "'tpu' (str)"),
    ({"device": "meta"}, "device", "'meta' (str)"),
    ({"device": torch.device("meta")}, "device", "device(type='meta') (device)"),
    ({"device": 1.5}, "device", "1.5 (float)"),
    ({"device": "cuda:99"}, "device", "cuda:99"),  # no CUDA, or too few devices
], ids=lambda v: v if isinstance(v, str) else None)
def test_each_bad_argument_is_a_value_error_naming_it_and_its_value(kwargs, argument, shown):
    with pytest.raises(ValueError) as info:
        offload_activations(_mlp(), **{"scope": "*", "device": "cpu", **kwargs})
    text = str(info.value)
    assert text.startswith("[eager] "), text
    assert argument in text and shown in text, text


@pytest.mark.parametrize("model, shown", [
    (lambda x: x, "<function <lambda>"),
    (torch.zeros(2), "tensor([0., 0.]) (Tensor)"),
    (None, "None (NoneType)"),
])
def test_model_that_is_not_a_module_is_a_value_error(model, shown):
    with pytest.raises(ValueError) as info:
        offload_activations(model, device="cpu")
    assert str(info.value).startswith("[eager] model must be a torch.nn.Module, got ")
    assert shown in str(info.value)


def test_scope_matching_nothing_names_the_scope_and_lists_modules():
    with pytest.raises(ValueError) as info:
        offload_activations(TwoBlocks(), scope="self_attn", device="cpu")
    text = str(info.value)
    assert text.startswith("[eager] scope 'self_attn' matches no module of TwoBlocks")
    assert "block1 (Residual)" in text and "act (GELU)" in text


# ---- scope "*" without a layer list ----------------------------------------


@pytest.mark.parametrize("scope", ["*", None])
def test_star_on_a_sequential_takes_every_child(scope, no_leaks):
    got, want, stats = _offloaded_step(_mlp(), _input(), scope=scope)
    _assert_same_grads(got, want)
    assert stats["layers"] == 5  # Linear, ReLU, Linear, Tanh, Linear
    # Every tensor the model saves is in a layer; only the loss's square is not.
    assert stats["skipped"]["outside_scope"] == 1
    assert stats["bytes_offloaded"] > 0 and stats["bytes_reloaded"] > 0, stats


@pytest.mark.parametrize("factory", [TwoBlocks, Wrapper])
def test_star_on_a_module_without_a_list_takes_its_children_with_parameters(factory, no_leaks):
    model, x = _seeded(factory), _input()
    got, want, stats = _offloaded_step(model, x)
    _assert_same_grads(got, want)
    assert stats["layers"] == 3  # block1, block2, head; act has no parameters
    assert stats["bytes_offloaded"] > 0 and stats["bytes_reloaded"] > 0, stats
    # Position 1 is block2: its input and tanh's output move, nothing else.
    got, want, stats = _offloaded_step(model, x, layers=[1])
    _assert_same_grads(got, want)
    assert stats["bytes_offloaded"] == 8 * D * 4 + 8 * 2 * D * 4, stats
    assert stats["bytes_reloaded"] == stats["bytes_offloaded"]  # not in the tail (lag 1)


class Bare(nn.Module):
    """Parameters of its own, no submodule."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(D, D))

    def forward(self, x):
        return x @ self.w


@pytest.mark.parametrize("model, why", [
    (Bare(), "Bare has no submodules"),
    (nn.Sequential(nn.ReLU(), nn.Tanh()), "Sequential has no submodule with parameters"),
    (nn.Sequential(), "Sequential has no submodules"),
], ids=["bare", "no-parameters", "empty"])
@pytest.mark.parametrize("scope", ["*", None])
def test_star_on_a_model_with_nothing_to_offload_says_so(model, why, scope):
    with pytest.raises(ValueError) as info:
        offload_activations(model, scope=scope, device="cpu")
    text = str(info.value)
    assert text.startswith("[eager] scope '*': a model with no layers to offload: "), text
    assert why in text


# ---- a CPU model without device= -------------------------------------------


def test_cpu_model_without_device_warns_once_and_stats_say_why(no_leaks):
    model, x = _mlp(), _input()
    model.zero_grad(set_to_none=True)
    _loss(model, x).backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    ctx = offload_activations(model, scope="*", min_bytes=0)
    with pytest.warns(UserWarning, match=r"\[eager\] offload_activations will offload nothing: "
                      r"the model is on the CPU.*device='cpu'.*fake copy backend"):
        with ctx:
            _loss(model, x).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per context: entering again stays quiet
        with ctx:
            pass
    _assert_same_grads(_grads(model), want)
    stats = ctx.stats()
    assert stats["bytes_offloaded"] == 0 and stats["tensors_seen"] == 0
    assert "the model is on cpu and device= was not given" in stats["inactive"]
    assert "device='cpu'" in stats["inactive"]


def test_cpu_model_with_device_cpu_does_not_warn(no_leaks):
    model, x = _mlp(), _input()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with offload_activations(model, scope="*", min_bytes=0, device="cpu") as ctx:
            loss = _loss(model, x)
    loss.backward()
    assert ctx.stats()["inactive"] is None and ctx.stats()["bytes_offloaded"] > 0
