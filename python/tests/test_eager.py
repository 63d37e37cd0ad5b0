"""spillway.offload_activations (activations/eager.py) on tiny Hugging Face models.

Properties: the loss and every gradient are bit-equal to the run without
offload, on every iteration (the first too), with and without random copy
delays; bytes really move (the runtime's copy counters agree with the
context's statistics); nothing leaks (no pending wait, the pinned pool's live
bytes back to their value before the step). On CPU the fake backend moves CPU
tensors, so this runs in CI; the CUDA variants run where there is a GPU.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

if os.environ.get("SPILLWAY_REQUIRE_EXTENSION") == "1":
    from spillway import ops  # scripts/test built it: failing to import is a failure
else:
    ops = pytest.importorskip(
        "spillway.ops", reason="spillway._C is not built (cmake --preset python && "
        "cmake --build --preset python)", exc_type=ImportError)

from spillway import _C  # noqa: E402
from spillway.activations.eager import offload_activations  # noqa: E402

from _models import deterministic_cuda, tiny_gpt2, tiny_llama  # noqa: E402

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and ops.cuda_built()),
    reason="needs a CUDA device and spillway._C built with CUDA")

MODELS = [
    pytest.param(tiny_llama, "self_attn", id="llama-self_attn"),
    pytest.param(tiny_llama, "LlamaDecoderLayer", id="llama-layers"),
    pytest.param(tiny_gpt2, "attn", id="gpt2-attn"),
]


@pytest.fixture
def copy_delay(request):
    """Random fake-backend copy delays in [0, 2 ms] (param True), reset afterwards."""
    if request.param:
        _C.set_fake_copy_delay(0, 2000, 7)
    yield request.param
    _C.set_fake_copy_delay(0, 0, 0)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference_step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), _grads(model)


def _assert_same(loss, grads, ref_loss, ref_grads):
    assert torch.equal(loss, ref_loss), f"loss {loss.item()} != {ref_loss.item()}"
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), f"gradient of {name} differs"


def _sgd(model, lr=1e-2):
    """Moves the weights so the next iteration sees a different model."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(lr * p.grad)


def _offload_step(model, ids, pool_device, **kwargs):
    """One step under the context; checks traffic and leaks; returns loss, grads, stats."""
    gc.collect()
    ops.synchronize()
    live_before = ops.pool_stats(pool_device)["bytes_live"]
    copies_before = ops.copy_stats(pool_device)
    model.zero_grad(set_to_none=True)
    with offload_activations(model, **kwargs) as ctx:
        loss = model(ids, labels=ids).loss
    assert ops.pending_waits() == 0, "forward waits left pending after the context"
    stats = ctx.stats()
    assert stats["bytes_offloaded"] > 0, stats
    assert ops.pool_stats(pool_device)["bytes_live"] > live_before, "no host copy is alive"
    loss.backward()
    loss = loss.detach()
    grads = _grads(model)
    gc.collect()
    ops.synchronize()
    assert ops.pending_waits() == 0
    assert ops.pool_stats(pool_device)["bytes_live"] == live_before, "host copies leaked"
    stats = ctx.stats()
    copies = ops.copy_stats(pool_device)
    assert copies["bytes_d2h"] - copies_before["bytes_d2h"] == stats["bytes_offloaded"]
    assert copies["bytes_h2d"] - copies_before["bytes_h2d"] == stats["bytes_reloaded"]
    assert stats["bytes_reloaded"] > 0, stats
    return loss, grads, stats


@pytest.mark.parametrize("copy_delay", [False, True], ids=["no-delay", "delay"], indirect=True)
@pytest.mark.parametrize("factory, scope", MODELS)
def test_loss_and_every_gradient_bit_equal_over_iterations(factory, scope, copy_delay):
    model, ids = factory(0)
    for _ in range(3):
        ref_loss, ref_grads = _reference_step(model, ids)
        loss, grads, stats = _offload_step(model, ids, "cpu", scope=scope, min_bytes=256,
                                           device="cpu")
        _assert_same(loss, grads, ref_loss, ref_grads)
        assert stats["skipped"]["outside_scope"] > 0  # embeddings, norms, loss stay put
        _sgd(model)


def test_min_bytes_zero_moves_every_scope_tensor():
    model, ids = tiny_llama(1)
    ref_loss, ref_grads = _reference_step(model, ids)
    loss, grads, stats = _offload_step(model, ids, "cpu", scope="self_attn", min_bytes=0,
                                       device="cpu")
    _assert_same(loss, grads, ref_loss, ref_grads)
    assert stats["skipped"]["small"] == 0
    # q, k, v views, the rotary tables every layer saves: one copy per storage.
    assert stats["deduplicated"] > 0
    assert stats["tensors_offloaded"] == stats["storages_offloaded"] + stats["deduplicated"]


@pytest.mark.parametrize("copy_delay", [True], ids=["delay"], indirect=True)
def test_backward_prefetches_earlier_layers(copy_delay):
    model, ids = tiny_llama(2, layers=4)
    ref_loss, ref_grads = _reference_step(model, ids)
    loss, grads, stats = _offload_step(model, ids, "cpu", scope="LlamaDecoderLayer",
                                       min_bytes=256, device="cpu", prefetch=1)
    _assert_same(loss, grads, ref_loss, ref_grads)
    # Layer 3 stays resident (lag 1); its backward prefetches layer 2, and so on.
    assert stats["layers"] == 4
    assert stats["kept_resident"] > 0
    assert stats["reloads_prefetched"] > 0
    assert stats["reloads_prefetched"] > stats["reloads_on_demand"], stats


def test_no_prefetch_reloads_on_demand():
    model, ids = tiny_llama(3, layers=3)
    ref_loss, ref_grads = _reference_step(model, ids)
    loss, grads, stats = _offload_step(model, ids, "cpu", scope="LlamaDecoderLayer",
                                       min_bytes=256, device="cpu", prefetch=0)
    _assert_same(loss, grads, ref_loss, ref_grads)
    assert stats["reloads_prefetched"] == 0 and stats["reloads_on_demand"] > 0


@pytest.mark.parametrize("copy_delay", [True], ids=["delay"], indirect=True)
def test_lag_zero_releases_every_layer_and_keeps_none(copy_delay):
    model, ids = tiny_gpt2(4, layers=3)
    ref_loss, ref_grads = _reference_step(model, ids)
    loss, grads, stats = _offload_step(model, ids, "cpu", scope=None, min_bytes=256,
                                       device="cpu", lag=0)
    _assert_same(loss, grads, ref_loss, ref_grads)
    assert stats["kept_resident"] == 0
    assert stats["bytes_reloaded"] == stats["bytes_offloaded"]


@pytest.mark.parametrize("copy_delay", [True], ids=["delay"], indirect=True)
def test_chosen_layers_offload_and_kept_layers_drive_prefetch(copy_delay):
    model, ids = tiny_llama(5, layers=4)
    ref_loss, ref_grads = _reference_step(model, ids)
    # Only layers 0 and 1 move; each waits 2 layers later (at the end of layers
    # 2 and 3), so neither is in the resident tail.
    loss, grads, stats = _offload_step(model, ids, "cpu", scope="LlamaDecoderLayer",
                                       min_bytes=256, device="cpu", lag=2, layers=[0, 1],
                                       prefetch=2)
    _assert_same(loss, grads, ref_loss, ref_grads)
    assert stats["skipped"]["layer_not_selected"] > 0
    assert stats["kept_resident"] == 0
    assert stats["bytes_reloaded"] == stats["bytes_offloaded"]
    # Layers 2 and 3 kept everything; their unpacks started the reloads of 1 and 0.
    assert stats["reloads_on_demand"] == 0, stats
    assert stats["reloads_prefetched"] == stats["storages_offloaded"], stats


def test_layer_positions_out_of_range_are_refused():
    model, _ = tiny_llama(6, layers=2)
    with pytest.raises(ValueError, match=r"layer position 2 is out of range.*2 modules"):
        offload_activations(model, scope="LlamaDecoderLayer", device="cpu", layers=[0, 2])
    with pytest.raises(ValueError, match="layers must hold ints"):
        offload_activations(model, scope="LlamaDecoderLayer", device="cpu", layers=["0"])


# ---- CUDA -------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("factory, scope", MODELS)
def test_cuda_loss_and_every_gradient_bit_equal(factory, scope, dtype):
    with deterministic_cuda():
        model, ids = factory(0, device="cuda", dtype=dtype)
        for _ in range(3):
            ref_loss, ref_grads = _reference_step(model, ids)
            again_loss, again_grads = _reference_step(model, ids)
            _assert_same(again_loss, again_grads, ref_loss, ref_grads)  # the baseline is exact
            loss, grads, stats = _offload_step(model, ids, "cuda:0", scope=scope, min_bytes=256)
            _assert_same(loss, grads, ref_loss, ref_grads)
            _sgd(model)


@needs_cuda
def test_cuda_peak_memory_falls_by_about_the_bytes_offloaded():
    model, ids = tiny_llama(5, device="cuda", dtype=torch.bfloat16, layers=8, hidden=512,
                            intermediate=2048, heads=8, kv_heads=4, batch=4, seq=1024)

    def peak(ctx_factory):
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        ctx = ctx_factory()
        if ctx is None:
            loss = model(ids, labels=ids).loss
        else:
            with ctx:
                loss = model(ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
        del loss
        return torch.cuda.max_memory_allocated(), ctx

    peak(lambda: None)  # warm up the allocator and kernels
    base, _ = peak(lambda: None)
    off, ctx = peak(lambda: offload_activations(model, scope="LlamaDecoderLayer",
                                                min_bytes=1 << 20))
    stats = ctx.stats()
    moved = stats["bytes_offloaded"] - stats["bytes_kept_resident"]
    assert moved > 0, stats
    saved = base - off
    assert saved >= moved // 2, f"peak fell by {saved} bytes; {moved} left the device ({stats})"
    assert saved <= stats["bytes_offloaded"] + (64 << 20), (saved, stats)


@needs_cuda
def test_cuda_tensors_of_another_device_stay():
    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.Linear(64, 64)

        def forward(self, x, host):
            cpu_part = (host * 3).sin().sum()  # saved on the CPU, inside the scope
            return self.attn(x).tanh().sum() + cpu_part.to(x.device)

    model = torch.nn.Sequential()
    model.add_module("block", Mixed().cuda())  # scope "block": the CPU work is inside it
    x = torch.randn(16, 64, device="cuda")
    host = torch.randn(16, 64, requires_grad=True)
    model.block(x, host).backward()
    want = _grads(model)
    want_host = host.grad.clone()
    model.zero_grad(set_to_none=True)
    host.grad = None
    with offload_activations(model, scope="block", min_bytes=0) as ctx:
        loss = model.block(x, host)
    loss.backward()
    grads = _grads(model)
    assert grads.keys() == want.keys()
    assert all(torch.equal(grads[k], want[k]) for k in want)
    assert torch.equal(host.grad, want_host)
    stats = ctx.stats()
    assert stats["bytes_offloaded"] > 0
    assert stats["skipped"]["other_device"] > 0
