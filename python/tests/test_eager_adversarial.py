"""spillway.offload_activations (activations/eager.py) where autograd gets awkward.

Each test is one situation: in-place writes after saving, checkpointing in
both nestings, contexts on two models nested, forward without backward,
gradient accumulation, tensors shared between layers, views and aliases of one
storage, a backward returning a view of a reloaded tensor, retain_graph and
double backward, failures inside the forward, and scopes (bad arguments are in
test_eager_arguments.py). Gradients are compared bit for bit with the run
without offload; leaks are checked on the runtime (pending waits, live pinned
bytes). CPU tensors stand for device memory (device="cpu", the fake backend).
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

if os.environ.get("SPILLWAY_REQUIRE_EXTENSION") == "1":
    from spillway import ops  # scripts/test built it: failing to import is a failure
else:
    ops = pytest.importorskip(
        "spillway.ops", reason="spillway._C is not built (cmake --preset python && "
        "cmake --build --preset python)", exc_type=ImportError)

from spillway import _C  # noqa: E402
from spillway.activations.eager import _scope_modules, offload_activations  # noqa: E402

from _models import SyntheticGrad, tiny_llama  # noqa: E402

D = 32  # toy width: a (8, 32) float32 activation is 1 KiB

CUDA = torch.cuda.is_available() and ops.cuda_built()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device and spillway._C with CUDA")


class Block(nn.Module):
    """A layer whose `attn` saves activations (tanh output, matmul inputs)."""

    def __init__(self, ckpt_mlp=False):
        super().__init__()
        self.attn = nn.Linear(D, D)
        self.mlp = nn.Linear(D, D)
        self.ckpt_mlp = ckpt_mlp
        self.last_hidden = None  # exposed so a test can write it in place

    def forward(self, x, shared=None):
        h = torch.tanh(self.attn(x))
        if shared is not None:
            h = h * shared  # every layer saves the same `shared` storage
        self.last_hidden = h
        if self.ckpt_mlp:
            m = checkpoint(lambda t: torch.sigmoid(self.mlp(t)) * t, h, use_reentrant=False)
        else:
            m = torch.sigmoid(self.mlp(h)) * h
        return x + m


class Toy(nn.Module):
    def __init__(self, layers=3, seed=0, ckpt_mlp=False, shared=False):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.layers = nn.ModuleList(Block(ckpt_mlp) for _ in range(layers))
            self.gate = nn.Linear(D, D) if shared else None
            self.head = nn.Linear(D, 1)

    def forward(self, x):
        shared = torch.sigmoid(self.gate(x)) if self.gate is not None else None
        for layer in self.layers:
            x = layer(x, shared)
        return self.head(x).square().mean()


def _input(seed=0, rows=8, device="cpu"):
    return torch.randn(rows, D, generator=torch.Generator().manual_seed(seed)).to(device)


def _pool(device) -> str:
    return "cpu" if torch.device(device).type == "cpu" else "cuda:0"


def _live_bytes() -> tuple[int, ...]:
    pools = ["cpu", "cuda:0"] if CUDA else ["cpu"]
    return tuple(ops.pool_stats(p)["bytes_live"] for p in pools)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(got, want):
    assert got.keys() == want.keys()
    for name, g in want.items():
        assert torch.equal(got[name], g), f"gradient of {name} differs"


def _ctx(model, **kwargs):
    kwargs.setdefault("scope", "attn")
    kwargs.setdefault("min_bytes", 0)
    kwargs.setdefault("device", "cpu")
    return offload_activations(model, **kwargs)


@pytest.fixture
def no_leaks():
    """Asserts, after the test, that no wait is pending and no host copy is alive."""
    gc.collect()
    ops.synchronize()
    before = _live_bytes()
    yield
    gc.collect()
    ops.synchronize()
    assert ops.pending_waits() == 0
    assert _live_bytes() == before


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=needs_cuda)])
def device(request):
    """Where the toy model runs: cpu (the fake backend) or cuda (the copy engine)."""
    return request.param


@pytest.fixture
def copy_delay():
    _C.set_fake_copy_delay(0, 2000, 11)
    yield
    _C.set_fake_copy_delay(0, 0, 0)


def _reference(model, x, steps=1):
    model.zero_grad(set_to_none=True)
    for i in range(steps):
        model(x + i).backward()
    return _grads(model)


# ---- in-place writes --------------------------------------------------------


@pytest.mark.parametrize("min_bytes", [0, 1 << 30], ids=["offloaded", "kept"])
def test_inplace_write_after_saving_raises_autograds_error(device, min_bytes, no_leaks):
    model, x = Toy().to(device), _input(device=device)
    model(x)  # sanity: without the context autograd itself raises
    loss = model(x)
    model.layers[0].last_hidden.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    del loss

    with _ctx(model, device=device, min_bytes=min_bytes) as ctx:
        loss = model(x)
    model.layers[1].last_hidden.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    del loss
    for layer in model.layers:
        layer.last_hidden = None  # frees the graph, so the fixture can check for leaks
    if min_bytes == 0:
        assert ctx.stats()["bytes_offloaded"] > 0


def _assert_offloaded_step_matches_reference(model, x):
    want = _reference(model, x)
    model.zero_grad(set_to_none=True)
    with _ctx(model):
        loss = model(x)
    loss.backward()
    _assert_same_grads(_grads(model), want)


def test_inplace_write_before_saving_is_fine(no_leaks):
    _assert_offloaded_step_matches_reference(Toy(), _input())


# ---- checkpointing ----------------------------------------------------------


def test_checkpoint_inside_the_context(device, no_leaks, copy_delay):
    model, x = Toy(ckpt_mlp=True).to(device), _input(device=device)
    want = _reference(model, x)
    model.zero_grad(set_to_none=True)
    with _ctx(model, device=device) as ctx:
        loss = model(x)
    loss.backward()
    _assert_same_grads(_grads(model), want)
    stats = ctx.stats()
    assert stats["bytes_offloaded"] > 0 and stats["bytes_reloaded"] > 0


def test_context_inside_a_checkpointed_function_leaves_it_to_checkpoint(device, no_leaks):
    model, x = Toy().to(device), _input(device=device).requires_grad_()
    want = _reference(model, x)
    want_x = x.grad.clone()
    x.grad = None
    model.zero_grad(set_to_none=True)
    contexts = []

    def run(inp):
        ctx = _ctx(model, device=device)
        contexts.append(ctx)
        with ctx:
            return model(inp)

    loss = checkpoint(run, x, use_reentrant=False)
    loss.backward()
    _assert_same_grads(_grads(model), want)
    assert torch.equal(x.grad, want_x)
    assert len(contexts) == 2  # the forward and the recomputation
    for ctx in contexts:
        stats = ctx.stats()
        assert stats["inactive"] and "saved-tensor hooks" in stats["inactive"]
        assert stats["tensors_seen"] == 0


def test_hf_gradient_checkpointing_inside_the_context(no_leaks):
    model, ids = tiny_llama(0, layers=2)
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()
    want = _grads(model)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.zero_grad(set_to_none=True)
    with offload_activations(model, scope="self_attn", min_bytes=0, device="cpu"):
        loss = model(ids, labels=ids).loss
    loss.backward()
    _assert_same_grads(_grads(model), want)


# ---- two models, nested contexts -------------------------------------------


def _stack(seed, device):
    """Three Blocks in an nn.Sequential: a model that returns a hidden state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(Block(), Block(), Block()).to(device)


def _assert_both_moved(*contexts):
    for ctx in contexts:
        stats = ctx.stats()
        assert stats["inactive"] is None, stats
        assert stats["bytes_offloaded"] > 0 and stats["bytes_reloaded"] > 0, stats


@pytest.mark.parametrize("inner", ["b", "a"], ids=["first-model-inner", "first-model-outer"])
def test_nested_contexts_on_a_chain_of_two_models(device, inner, no_leaks, copy_delay):
    a, b, x = _stack(1, device), _stack(2, device), _input(device=device)
    a(b(x)).square().mean().backward()
    want_a, want_b = _grads(a), _grads(b)
    a.zero_grad(set_to_none=True)
    b.zero_grad(set_to_none=True)
    outer_model, inner_model = (a, b) if inner == "b" else (b, a)
    with _ctx(outer_model, device=device) as outer:
        with _ctx(inner_model, device=device) as nested:
            loss = a(b(x)).square().mean()  # b runs first and feeds a
    loss.backward()
    _assert_same_grads(_grads(a), want_a)
    _assert_same_grads(_grads(b), want_b)
    _assert_both_moved(outer, nested)
    # What the inner model saved outside its layers, and all the outer model
    # saved, went through the inner context to the outer one.
    assert nested.stats()["handed_to_outer"] > 0
    assert outer.stats()["tensors_seen"] > 0
    del loss
    for block in (*a, *b):
        block.last_hidden = None


def test_nested_contexts_with_two_independent_losses(device, no_leaks, copy_delay):
    a, b, x = _stack(3, device), _stack(4, device), _input(device=device)
    b(x * 2).square().mean().backward()
    a(x).square().mean().backward()
    want_a, want_b = _grads(a), _grads(b)
    a.zero_grad(set_to_none=True)
    b.zero_grad(set_to_none=True)
    with _ctx(a, device=device) as ctx_a:
        with _ctx(b, device=device) as ctx_b:
            loss_a = a(x).square().mean()
            loss_b = b(x * 2).square().mean()
    loss_b.backward()
    loss_a.backward()
    _assert_same_grads(_grads(a), want_a)
    _assert_same_grads(_grads(b), want_b)
    _assert_both_moved(ctx_a, ctx_b)
    for block in (*a, *b):
        block.last_hidden = None


def test_nested_context_under_a_foreign_hook_under_spillway_stays_inactive(no_leaks):
    a, b, x = _stack(5, "cpu"), _stack(6, "cpu"), _input()
    a(b(x)).sum().backward()
    want_a, want_b = _grads(a), _grads(b)
    a.zero_grad(set_to_none=True)
    b.zero_grad(set_to_none=True)
    with _ctx(a) as outer:
        with torch.autograd.graph.save_on_cpu():  # another library's hooks, innermost
            with _ctx(b) as nested:
                loss = a(b(x)).sum()
    loss.backward()
    _assert_same_grads(_grads(a), want_a)
    _assert_same_grads(_grads(b), want_b)
    assert "saved-tensor hooks" in nested.stats()["inactive"]
    assert outer.stats()["tensors_seen"] == 0  # save_on_cpu owned every saved tensor
    del loss
    for block in (*a, *b):
        block.last_hidden = None


# ---- lifetimes --------------------------------------------------------------


def test_forward_without_backward_frees_everything(device, no_leaks):
    model, x = Toy().to(device), _input(device=device)
    live = ops.pool_stats(_pool(device))["bytes_live"]
    with _ctx(model, device=device) as ctx:
        loss = model(x)
    assert ops.pending_waits() == 0
    assert ops.pool_stats(_pool(device))["bytes_live"] > live  # host copies held by the graph
    for layer in model.layers:
        layer.last_hidden = None
    del loss
    gc.collect()
    assert ops.pool_stats(_pool(device))["bytes_live"] == live
    assert ctx.stats()["bytes_offloaded"] > 0


def test_released_layers_let_their_device_memory_go(device, no_leaks):
    model, x = Toy(layers=3).to(device), _input(device=device)
    seen = []  # the storage entering each block: what its attn Linear saves
    hooks = [block.register_forward_pre_hook(
        lambda module, args: seen.append(StorageWeakRef(args[0].untyped_storage())))
        for block in model.layers]

    def alive():
        return [not ref.expired() for ref in seen]

    loss = model(x)
    assert alive() == [True, True, True]  # autograd keeps every saved input
    del loss
    seen.clear()
    with _ctx(model, device=device) as ctx:
        loss = model(x)
    # Block 0's input is x (held here); block 1's was released at the end of
    # block 2 (lag 1); block 2 is the resident tail.
    assert alive() == [True, False, True]
    assert ctx.stats()["kept_resident"] > 0
    loss.backward()
    for h in hooks:
        h.remove()
    for layer in model.layers:
        layer.last_hidden = None


def test_exception_inside_the_forward_leaves_no_hook_or_wait(no_leaks):
    model, x = Toy(), _input()

    def explode(module, args, output):
        raise ValueError("boom")

    handle = model.layers[1].mlp.register_forward_hook(explode)
    with pytest.raises(ValueError, match="boom"):
        with _ctx(model):
            model(x)
    handle.remove()
    for layer in model.layers:
        layer.last_hidden = None
    gc.collect()
    assert ops.pending_waits() == 0
    # The model works again, and a new context can be entered.
    _assert_offloaded_step_matches_reference(model, x)


def test_retain_graph_backward_twice_reloads_again(device, no_leaks, copy_delay):
    model, x = Toy(layers=4).to(device), _input(device=device)
    model.zero_grad(set_to_none=True)
    loss = model(x)
    loss.backward(retain_graph=True)
    loss.backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    with _ctx(model, device=device) as ctx:
        loss = model(x)
    loss.backward(retain_graph=True)
    first = ctx.stats()["bytes_reloaded"]
    loss.backward()
    stats = ctx.stats()
    _assert_same_grads(_grads(model), want)
    assert first > 0
    # The second backward finds no device copy left and reloads every storage.
    assert stats["bytes_reloaded"] - first == stats["bytes_offloaded"]
    del loss


def test_double_backward(device, no_leaks):
    model, x = Toy().to(device), _input(device=device)

    def hvp(loss):
        params = list(model.parameters())
        grads = torch.autograd.grad(loss, params, create_graph=True)
        dot = sum((g * g).sum() for g in grads)
        return torch.autograd.grad(dot, params)

    want = hvp(model(x))
    with _ctx(model, device=device) as ctx:
        loss = model(x)
    got = hvp(loss)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert ctx.stats()["bytes_offloaded"] > 0
    del loss


# ---- accumulation, sharing, views -------------------------------------------


@pytest.mark.parametrize("one_context", [True, False], ids=["one-context", "context-per-step"])
def test_gradient_accumulation_over_micro_steps(device, one_context, no_leaks, copy_delay):
    model, x = Toy().to(device), _input(device=device)
    want = _reference(model, x, steps=3)
    model.zero_grad(set_to_none=True)
    if one_context:
        with _ctx(model, device=device) as ctx:
            for i in range(3):
                model(x + i).backward()
        assert ctx.stats()["layers"] == 9
    else:
        for i in range(3):
            with _ctx(model, device=device):
                loss = model(x + i)
            loss.backward()
    _assert_same_grads(_grads(model), want)


def test_two_forwards_then_one_backward(device, no_leaks, copy_delay):
    model, x = Toy().to(device), _input(device=device)
    model.zero_grad(set_to_none=True)
    (model(x) + model(x * 2)).backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    with _ctx(model, device=device, prefetch=2) as ctx:
        loss = model(x) + model(x * 2)
    loss.backward()
    _assert_same_grads(_grads(model), want)
    assert ctx.stats()["reloads_prefetched"] > 0


def test_tensor_shared_between_layers_is_offloaded_once(device, no_leaks, copy_delay):
    model, x = Toy(layers=4, shared=True).to(device), _input(device=device)
    want = _reference(model, x)
    model.zero_grad(set_to_none=True)
    with _ctx(model, device=device, scope="Block") as ctx:
        loss = model(x)
    loss.backward()
    _assert_same_grads(_grads(model), want)
    stats = ctx.stats()
    # Every layer saves `shared` (the mul's other operand); it moves once.
    assert stats["deduplicated"] >= 3
    assert stats["bytes_offloaded"] > 0


class ViewsOfOneStorage(nn.Module):
    """A layer that saves a transpose, a strided slice and an alias of one storage."""

    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(D, 2 * D)

    def forward(self, x):
        y = self.attn(x)  # (8, 64), one storage
        a = y.t().sin()  # saves y.t()
        b = y[:, ::2].cos()  # saves a strided view
        c = y.view(-1).sin()  # saves a flat alias
        return a.t()[:, :D].sum() + b.sum() + c.sum()


def test_views_and_aliases_share_one_host_copy(no_leaks):
    model = nn.Sequential(ViewsOfOneStorage())
    model[0].attn.weight.data.mul_(0.1)
    x = _input()
    model(x).backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    with _ctx(model, scope="ViewsOfOneStorage") as ctx:
        loss = model(x)
    loss.backward()
    _assert_same_grads(_grads(model), want)
    stats = ctx.stats()
    y_bytes = 8 * 2 * D * 4
    assert stats["deduplicated"] >= 2
    assert stats["bytes_offloaded"] >= y_bytes


class ViewGradBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(D, 2 * D)

    def forward(self, x):
        wide = torch.relu(self.attn(x))
        return SyntheticGrad.apply(x, wide) * 2


def test_backward_returning_a_view_of_a_reloaded_tensor(device, no_leaks, copy_delay):
    model = nn.Sequential(ViewGradBlock(), ViewGradBlock(), ViewGradBlock()).to(device)
    x = _input(device=device).requires_grad_()

    def run(ctx):
        model.zero_grad(set_to_none=True)
        x.grad = None
        for i in range(2):  # accumulation adds into a grad that may alias the view
            if ctx is None:
                loss = model(x + i).sum()
            else:
                with ctx:
                    loss = model(x + i).sum()
            loss.backward()
        return _grads(model), x.grad.clone()

    want, want_x = run(None)
    ctx = _ctx(model, device=device, scope="ViewGradBlock", lag=0)
    got, got_x = run(ctx)
    _assert_same_grads(got, want)
    assert torch.equal(got_x, want_x)
    assert ctx.stats()["bytes_reloaded"] > 0


# ---- what is never offloaded ------------------------------------------------


class ParamViewBlock(nn.Module):
    """Saves a view of its weight (mm's other operand) and one activation."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) * 0.1)
        self.register_buffer("scale", torch.full((8, D), 0.5))

    def forward(self, x):
        h = x @ self.w.t()  # saves x and w.t()
        return (h * self.scale).sin()  # saves scale (a buffer) and h*scale


def test_parameters_buffers_and_their_views_stay(no_leaks):
    model = nn.Sequential(ParamViewBlock())
    x = _input().requires_grad_()  # so mm saves w.t() too
    model(x).sum().backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    with _ctx(model, scope="ParamViewBlock") as ctx:
        loss = model(x).sum()
    loss.backward()
    _assert_same_grads(_grads(model), want)
    stats = ctx.stats()
    assert stats["skipped"]["parameter"] == 2  # w.t() and the buffer
    assert stats["bytes_offloaded"] == 2 * 8 * D * 4  # x and h * scale


def test_small_storages_stay():
    model, x = Toy(), _input()
    with _ctx(model, min_bytes=1 << 20) as ctx:
        loss = model(x)
    loss.backward()
    stats = ctx.stats()
    assert stats["bytes_offloaded"] == 0 and stats["skipped"]["small"] > 0


# ---- scope ------------------------------------------------------------------


def test_scope_none_means_the_layer_list_and_the_modules_with_parameters_outside_it(no_leaks):
    model, x = Toy(layers=3), _input()
    want = _reference(model, x)
    model.zero_grad(set_to_none=True)
    with _ctx(model, scope=None) as ctx:
        loss = model(x)
    loss.backward()
    _assert_same_grads(_grads(model), want)
    assert ctx.stats()["layers"] == 4  # layers.0-2, then head
    assert [name for name, _ in _scope_modules(model, "*")] == [
        "layers.0", "layers.1", "layers.2", "head"]
    # layers=[3] is the head alone: only its saved input moves.
    model.zero_grad(set_to_none=True)
    with _ctx(model, scope="*", layers=[3]) as ctx:
        loss = model(x)
    loss.backward()
    _assert_same_grads(_grads(model), want)
    assert ctx.stats()["storages_offloaded"] == 1


def test_scope_list_and_nested_scope_modules(no_leaks):
    model, x = Toy(layers=3), _input()
    want = _reference(model, x)
    model.zero_grad(set_to_none=True)
    with _ctx(model, scope=["attn", "mlp"]) as ctx:
        loss = model(x)
    loss.backward()
    _assert_same_grads(_grads(model), want)
    assert ctx.stats()["layers"] == 6
    # A scope module inside another one belongs to the outer one's layer.
    with _ctx(model, scope=["Block", "attn"]) as ctx:
        loss = model(x)
    loss.backward()
    assert ctx.stats()["layers"] == 3


def test_two_contexts_on_one_model_is_an_error():
    model = Toy()
    with _ctx(model):
        with pytest.raises(RuntimeError, match="already active"):
            with _ctx(model):
                pass
