"""spillway.offload_weights: layer-wise weight offload (Note [Layer-wise weights] in
python/spillway/weights/layerwise.py).

On CPU, device='cpu' drives the real runtime through its fake copy backend: CPU tensors
play device memory, the slabs are the pool's host blocks, the reloads run on the fake
copy stream's worker thread. Every output is compared with torch.equal against the same
model resident, over many calls, with blocks skipped, reordered and repeated, after
mutate_weights() and after detach(). The CUDA tests skip without a GPU and run in
scripts/device-check.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

import spillway
from spillway import ops
from _models import deterministic_cuda, tiny_llama


class DiTBlock(nn.Module):
    """Attention and MLP modulated by the timestep embedding (adaLN), as in DiT/Wan."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.ada = nn.Linear(dim, 6 * dim)

    def forward(self, x, c):
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(c).unsqueeze(1).chunk(6, -1)
        h = self.norm1(x) * (1 + scale1) + shift1
        x = x + gate1 * self.attn(h, h, h, need_weights=False)[0]
        h = self.norm2(x) * (1 + scale2) + shift2
        return x + gate2 * self.mlp(h)


class TinyDiT(nn.Module):
    """Patch embedding, timestep embedding, a ModuleList of blocks, a projection out. The
    blocks run in `order` (default: all, in order), so a caller can skip, reorder and
    repeat them as caching samplers do."""

    def __init__(self, dim=64, heads=4, depth=6, channels=8, seq=16):
        super().__init__()
        self.embed = nn.Linear(channels, dim)
        self.t_embed = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(DiTBlock(dim, heads) for _ in range(depth))
        self.out = nn.Linear(dim, channels)
        self.register_buffer("pos", torch.randn(1, seq, dim))

    def forward(self, x, t, order=None):
        c = self.t_embed(t[:, None])
        h = self.embed(x) + self.pos
        for i in (range(len(self.blocks)) if order is None else order):
            h = self.blocks[i](h, c)
        return self.out(h)


def _dit(seed=0, **kw):
    torch.manual_seed(seed)
    return TinyDiT(**kw).eval()


def _dit_inputs(seed, device="cpu", batch=2, seq=16, channels=8):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, seq, channels, generator=gen).to(device),
            torch.rand(batch, generator=gen).to(device))


def _settled_pinned_bytes(device="cpu") -> int:
    """The pool's pinned bytes once every dropped host copy (earlier tests' handles) is
    freed and nothing cached is left."""
    import gc

    from spillway import _C
    gc.collect()
    ops.synchronize()
    _C.trim_pool(device)
    return ops.pool_stats(device)["bytes_pinned"]


def _offloaded(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if p.numel() == 0]


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_llama_outputs_equal_the_resident_model_over_many_calls(prefetch):
    model, ids = tiny_llama(3, layers=4, hidden=128)
    model.eval()
    resident = copy.deepcopy(model)
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict())
    handle = spillway.offload_weights(model, prefetch=prefetch, device="cpu")
    assert handle.blocks == [f"model.layers.{i}" for i in range(4)]
    # Every block parameter is a placeholder of its dtype and rank; names and keys stay.
    for (name, p), (_, q) in zip(model.named_parameters(), resident.named_parameters()):
        if name.startswith("model.layers."):
            assert p.numel() == 0 and p.dtype == q.dtype and p.dim() == q.dim(), name
        else:
            assert torch.equal(p, q), name
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == keys
    with torch.inference_mode():
        for k in range(6):
            batch = ids.roll(k, dims=1)
            assert torch.equal(model(batch).logits, resident(batch).logits), k
            # After each call no block holds device weights.
            assert len(_offloaded(model.model.layers)) == len(list(resident.model.layers.parameters()))
    s = handle.stats()
    assert s["calls"] == 6 and s["order"] == [0, 1, 2, 3]
    # One H2D per block per call, and the ring's handover: after the last block ran, the
    # first prefetch + 1 blocks of the next call copy (the slots).
    assert s["reloads"] == 6 * 4 + prefetch + 1
    assert s["in_flight"] == list(range(prefetch + 1))
    # Only the first block of the first call loads on demand: even with one slot the next
    # block's copy starts when a block has run.
    assert s["on_demand"] == 1
    assert s["dropped_prefetches"] == 0


def test_dit_blocks_skipped_reordered_and_repeated_stay_exact():
    model = _dit(1)
    resident = copy.deepcopy(model)
    # Other tests' handles hold their handovers until they are collected: collect them now, or
    # one collected during this test would change the count below.
    gc.collect()
    pending = ops.pending_waits()
    handle = spillway.offload_weights(model, prefetch=2, device="cpu")
    assert handle.blocks == [f"blocks.{i}" for i in range(6)]
    orders = [None, [0, 2, 4], [1, 3, 5], None, [5, 4, 3, 2, 1, 0], [0, 0, 1, 1], [3], None,
              [2, 4, 1], [2, 4, 1]]
    with torch.no_grad():
        for k, order in enumerate(orders):
            x, t = _dit_inputs(k)
            assert torch.equal(model(x, t, order), resident(x, t, order)), (k, order)
    s = handle.stats()
    assert s["order"] == [2, 4, 1]  # re-learned from the last call
    assert s["dropped_prefetches"] > 0  # mispredictions cost copies, never correctness
    assert s["prefetched"] > s["on_demand"]
    # Every reload started was waited for but the handover's, pending for the next call.
    assert s["in_flight"] and ops.pending_waits() - pending == len(s["in_flight"])
    # The last two calls ran the same order: the second found every block prefetched.
    before = handle.stats()
    with torch.no_grad():
        model(*_dit_inputs(0), [2, 4, 1])
    after = handle.stats()
    assert after["on_demand"] == before["on_demand"]


def test_generate_with_a_kv_cache_gives_the_resident_tokens():
    """Hugging Face generate(): one call per token, the cache growing; each call's blocks
    come and go, and the greedy tokens and their scores match the resident model's."""
    model, ids = tiny_llama(4, layers=3)
    model.eval()
    resident = copy.deepcopy(model)
    handle = spillway.offload_weights(model, device="cpu")
    kwargs = dict(max_new_tokens=6, do_sample=False, output_scores=True,
                  return_dict_in_generate=True, pad_token_id=0)
    with torch.inference_mode():
        got = model.generate(ids[:, :8], **kwargs)
        want = resident.generate(ids[:, :8], **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, want.scores))
    assert handle.stats()["calls"] == 6


def test_state_dict_reads_the_host_slabs():
    model = _dit(2)
    resident = copy.deepcopy(model)
    handle = spillway.offload_weights(model, device="cpu")
    got, want = handle.state_dict(), resident.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert model.blocks[0].ada.weight.numel() == 0  # the model itself still has placeholders


def test_mutate_weights_sees_every_weight_and_the_next_calls_use_the_change():
    model = _dit(3)
    resident = copy.deepcopy(model)
    handle = spillway.offload_weights(model, device="cpu")
    x, t = _dit_inputs(0)
    with torch.no_grad():
        model(x, t)
    with handle.mutate_weights():
        # Every weight is on the device with its value: merge a "LoRA", swap a Parameter.
        assert torch.equal(model.blocks[4].mlp[0].weight, resident.blocks[4].mlp[0].weight)
        for m in (model, resident):
            with torch.no_grad():
                m.blocks[1].mlp[2].weight.add_(0.5)
            m.blocks[2].ada.weight = nn.Parameter(torch.full_like(m.blocks[2].ada.weight, 0.01))
        with torch.no_grad():
            assert torch.equal(model(x, t), resident(x, t))  # runs without moving anything
    assert model.blocks[1].mlp[2].weight.numel() == 0
    assert model.blocks[2].ada.weight.numel() == 0  # the new Parameter was offloaded too
    with torch.no_grad():
        for k in range(3):
            x, t = _dit_inputs(10 + k)
            assert torch.equal(model(x, t), resident(x, t)), k


def test_detach_restores_an_ordinary_model_and_frees_the_pinned_slabs():
    model = _dit(4)
    resident = copy.deepcopy(model)
    before = _settled_pinned_bytes()
    handle = spillway.offload_weights(model, device="cpu")
    s = handle.stats()
    assert ops.pool_stats("cpu")["bytes_pinned"] - before == s["bytes_pinned"]
    with torch.no_grad():
        model(*_dit_inputs(0))
    assert handle.detach() is model
    assert _settled_pinned_bytes() == before
    for (name, p), (_, q) in zip(model.named_parameters(), resident.named_parameters()):
        assert torch.equal(p, q), name
    reloads = handle.stats()["reloads"]
    with torch.no_grad():
        x, t = _dit_inputs(1)
        assert torch.equal(model(x, t), resident(x, t))
    assert handle.stats()["reloads"] == reloads  # no hooks left
    with pytest.raises(RuntimeError, match=r"^\[weights\] mutate_weights\(\) after detach\(\)"):
        with handle.mutate_weights():
            pass
    spillway.offload_weights(model, device="cpu").detach()  # may be offloaded again


def test_pinned_bytes_are_the_offloaded_bytes_within_two_percent():
    model, _ = tiny_llama(5, layers=2, hidden=256, intermediate=688)
    _settled_pinned_bytes()
    before = ops.pool_stats("cpu")
    handle = spillway.offload_weights(model, device="cpu")
    after = ops.pool_stats("cpu")
    s = handle.stats()
    pinned = after["bytes_pinned"] - before["bytes_pinned"]
    assert pinned == s["bytes_pinned"]
    assert s["bytes_offloaded"] <= pinned <= 1.02 * s["bytes_offloaded"], s
    # One slab per block: one pinned allocation each, not one per parameter.
    assert after["pinned_allocations"] - before["pinned_allocations"] == 2
    handle.detach()


def test_a_block_compiled_with_torch_compile_is_never_recompiled_by_the_offload():
    import torch._dynamo

    torch._dynamo.reset()
    model = _dit(5, depth=3)
    resident = copy.deepcopy(model)
    for block in [*model.blocks, *resident.blocks]:
        block.compile(backend="eager")
    spillway.offload_weights(model, prefetch=1, device="cpu")
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for k in range(4):
            x, t = _dit_inputs(k)
            assert torch.equal(model(x, t), resident(x, t)), k
    torch._dynamo.reset()


def handle_live(model) -> list:
    """The groups whose weights the model's handle holds on the device right now."""
    from spillway.weights.layerwise import _HANDLES
    return list(_HANDLES[model]()._live)


def test_a_block_called_alone_with_gradients_is_refused_and_changes_nothing():
    """Only a call of the model brings weights back for backward (Note [Weights in
    backward]): a block called on its own with autograd recording is refused, before it
    runs when its weights require grad, after it ran (its weights let go) when only its
    input does."""
    model = _dit(6)
    resident = copy.deepcopy(model)
    spillway.offload_weights(model, device="cpu")
    x, t = _dit_inputs(0)
    h, c = torch.randn(2, 16, 64), torch.randn(2, 64)
    with pytest.raises(RuntimeError, match=r"^\[weights\] blocks\.0 runs with gradients enabled "
                                           r"outside a call of the model"):
        model.blocks[0](h, c)
    assert _offloaded(model.blocks[0])  # still placeholders
    model.requires_grad_(False)
    resident.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"^\[weights\] blocks\.0 ran with autograd recording "
                                           r"outside a call of the model"):
        model.blocks[0](h.requires_grad_(True), c)
    assert _offloaded(model.blocks[0]) and not handle_live(model)
    with torch.no_grad():
        assert torch.equal(model(x, t), resident(x, t))


def _sgd_inside(handle, models, lr=0.1):
    """One SGD step of every model's parameters, the offloaded one inside mutate_weights."""
    with handle.mutate_weights(), torch.no_grad():
        for m in models:
            for p in m.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-lr)
                    p.grad = None


@pytest.mark.parametrize("options", [{}, {"prefetch": 0}, {"granularity": "children"},
                                     {"gpu_budget": 0.6}])
def test_training_gradients_equal_the_resident_models_bit_for_bit(options):
    """Loss and every gradient torch.equal to the resident model's on every step, the
    first included, with an SGD step between (inside mutate_weights); the weights come
    back in backward in reverse order, one group ahead."""
    model, ids = tiny_llama(13, layers=4)
    resident = copy.deepcopy(model)
    handle = spillway.offload_weights(model, device="cpu", **options)
    for step in range(4):
        got, want = model(ids, labels=ids), resident(ids, labels=ids)
        assert torch.equal(got.loss, want.loss), step
        # What autograd saved of the streamed weights are references: no buffer stays.
        assert not handle_live(model)
        got.loss.backward()
        want.loss.backward()
        for (name, p), (_, q) in zip(model.named_parameters(), resident.named_parameters()):
            assert p.grad is not None and torch.equal(p.grad, q.grad), (step, name)
            assert p.grad.shape == q.shape
        # After backward every streamed weight is a placeholder again, nothing held.
        b = handle._backward
        assert not b.back and not b.ahead
        streamed = [g for g in range(len(handle.groups)) if g not in handle.stats()["resident"]]
        assert all(p.numel() == 0 for g in streamed for p in handle._blocks[g].params)
        _sgd_inside(handle, (model, resident))
    s = handle.stats()
    assert s["backward_reloads"] > 0
    # In reverse order one group ahead: only the first group of each backward on demand.
    assert s["backward_on_demand"] <= 4 * (1 if options.get("granularity") != "children" else 4)
    handle.detach()
    for (name, p), (_, q) in zip(model.named_parameters(), resident.named_parameters()):
        assert torch.equal(p, q), name


def test_frozen_offloaded_weights_pass_gradients_to_the_input_and_an_adapter():
    """LoRA-style fine-tuning: the blocks' weights frozen and offloaded, a trainable
    adapter outside them; the input's and the adapter's gradients are the resident
    model's."""
    model = _dit(14)
    model.requires_grad_(False)
    model.out.requires_grad_(True)  # the adapter: resident, trainable
    resident = copy.deepcopy(model)
    handle = spillway.offload_weights(model, device="cpu")
    for k in range(3):
        x, t = _dit_inputs(k)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        model(xa, t).square().mean().backward()
        resident(xb, t).square().mean().backward()
        assert torch.equal(xa.grad, xb.grad), k
        assert torch.equal(model.out.weight.grad, resident.out.weight.grad), k
        model.out.weight.grad = resident.out.weight.grad = None
    assert handle.stats()["backward_reloads"] > 0


@pytest.mark.parametrize("options", [{}, {"gpu_budget": 0.5}], ids=["streamed", "budget"])
def test_an_optimizer_step_outside_mutate_weights_is_refused_and_changes_nothing(options):
    """optimizer.step() over offloaded weights outside mutate_weights() would update
    placeholders (or a resident group's buffer behind its host slab): refused by name
    before anything changes, the resident parameters and the optimizer's state included;
    the same step inside mutate_weights() then gives the resident model's weights. An
    optimizer over other parameters only (an adapter) is not refused; after detach()
    nothing is."""
    model = _dit(21)
    resident = copy.deepcopy(model)
    handle = spillway.offload_weights(model, device="cpu", **options)
    x, t = _dit_inputs(3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(resident.parameters(), lr=1e-2)
    model(x, t).square().mean().backward()
    resident(x, t).square().mean().backward()
    before = handle.state_dict()  # the offloaded values read from their slabs
    with pytest.raises(RuntimeError, match=r"AdamW.step\(\) would update blocks\.0\..*"
                                           r"outside mutate_weights\(\).*Nothing was changed"):
        opt.step()
    assert not opt.state
    for name, value in handle.state_dict().items():
        assert torch.equal(value, before[name]), name
    with handle.mutate_weights():
        opt.step()
    ref_opt.step()
    want = resident.state_dict()
    for name, value in handle.state_dict().items():
        assert torch.equal(value, want[name]), name
    with torch.no_grad():
        assert torch.equal(model(x, t), resident(x, t))
    adapter = torch.optim.SGD(model.out.parameters(), lr=1e-2)
    adapter.step()  # not an offloaded weight: runs
    handle.detach()
    opt.step()  # an ordinary model again


def test_exhausted_pinned_memory_names_the_block_and_leaves_the_model_as_it_was():
    model = _dit(7)
    resident = copy.deepcopy(model)
    before = _settled_pinned_bytes()
    from spillway import _C
    _C.fail_next_fake_pinned_allocations(1)
    with pytest.raises(torch.OutOfMemoryError,
                       match=r"^\[weights\] block blocks\.0 \(.* MiB\): no memory .* the model "
                             r"is unchanged"):
        spillway.offload_weights(model, device="cpu")
    for (name, p), (_, q) in zip(model.named_parameters(), resident.named_parameters()):
        assert torch.equal(p, q), name
    assert _settled_pinned_bytes() == before
    handle = spillway.offload_weights(model, device="cpu")  # nothing is left attached
    with torch.no_grad():
        x, t = _dit_inputs(0)
        assert torch.equal(model(x, t), resident(x, t))
    handle.detach()


class _NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("kwargs, error, match", [
    ({}, ValueError, r"^\[weights\] _NoBlocks has no nn\.ModuleList of blocks to offload; "
                     r"pass blocks="),
    ({"blocks": "c"}, ValueError, r"^\[weights\] blocks='c': the model has no submodule"),
    ({"blocks": "a"}, ValueError, r"^\[weights\] blocks='a' is a Linear.*must be a non-empty "
                                  r"nn\.ModuleList or nn\.Sequential"),
    ({"blocks": 3}, ValueError, r"^\[weights\] blocks must be the path"),
    ({"prefetch": -1}, ValueError, r"^\[weights\] prefetch must be an int >= 0"),
    ({"prefetch": True}, ValueError, r"^\[weights\] prefetch must be an int >= 0"),
    ({"gpu_budget": -1}, ValueError, r"^\[weights\] gpu_budget=-1: it must be > 0"),
    ({"gpu_budget": 1.5}, ValueError, r"^\[weights\] gpu_budget=1.5: a float is a fraction "
                                      r"of the model's weight bytes"),
    ({"device_profile": {}}, ValueError, r"^\[weights\] device_profile is for the "
                                         r"gpu_budget's scheduler"),
    ({"device": "tpu"}, ValueError, r"^\[weights\] device must be cpu, cuda or cuda:N"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    model = _NoBlocks()
    want = copy.deepcopy(model)
    with pytest.raises(error, match=match):
        spillway.offload_weights(model, **{"device": "cpu", **kwargs})
    for p, q in zip(model.parameters(), want.parameters()):
        assert torch.equal(p, q)


def test_a_model_offloaded_twice_and_blocks_without_parameters_are_refused():
    model = _dit(8)
    handle = spillway.offload_weights(model, device="cpu")
    with pytest.raises(ValueError, match=r"^\[weights\] the model's weights are offloaded "
                                         r"already"):
        spillway.offload_weights(model, device="cpu")
    handle.detach()
    with pytest.raises(ValueError, match=r"^\[weights\] model must be an nn\.Module"):
        spillway.offload_weights("model", device="cpu")

    class Empty(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.ReLU() for _ in range(3))
    with pytest.raises(ValueError, match=r"^\[weights\] the blocks of blocks \(3 modules\) have "
                                         r"no parameters of their own"):
        spillway.offload_weights(Empty(), device="cpu")


def test_a_parameter_shared_with_the_outside_stays_resident():
    model = _dit(9)
    model.blocks[0].ada.weight = model.blocks[3].ada.weight  # shared by two blocks
    resident = copy.deepcopy(model)
    handle = spillway.offload_weights(model, device="cpu")
    assert model.blocks[3].ada.weight.numel() > 0
    with torch.no_grad():
        x, t = _dit_inputs(0)
        assert torch.equal(model(x, t), resident(x, t))
    handle.detach()


def test_the_t2_benchmark_runs_and_checks_its_logits(tmp_path):
    """bench/torch/t2.py on a tiny model on CPU: each method in its own process, the
    offloaded logits torch.equal to the resident ones (the GPU run's check). The resident
    method runs first and builds the model; the other loads it from the cache, so the
    equal logits also show the cached model is the built one."""
    import json
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    out = tmp_path / "t2.json"
    done = subprocess.run(
        [sys.executable, str(root / "bench/torch/t2.py"), "--tiny", "--device", "cpu",
         "--method", "spillway:prefetch=2", "--method", "resident", "--calls", "2",
         "--warmup", "1", "--work", str(tmp_path), "--cache", str(tmp_path / "models"),
         "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert results["spillway:prefetch=2"]["logits_equal_resident"] is True
    assert results["spillway:prefetch=2"]["spillway"]["blocks"] == 4
    assert len(list((tmp_path / "models").glob("t2-model-*.pt"))) == 1


needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and ops.cuda_built()),
                                reason="needs a CUDA device and a spillway._C with CUDA kernels")


@needs_cuda
def test_cuda_a_cpu_llama_runs_on_the_gpu_block_by_block_bit_exactly():
    """bf16 Llama built on the CPU: offload_weights moves only what is outside the blocks
    to the GPU; each call is bit-equal to the resident model, the GPU holds at most the
    blocks in flight, and the pinned slabs are the offloaded bytes within 2 %."""
    with deterministic_cuda():
        model, ids = tiny_llama(11, layers=8, hidden=1024, intermediate=2816, heads=8,
                                kv_heads=4, vocab=1024, batch=2, seq=256, dtype=torch.bfloat16)
        model.eval()
        resident = copy.deepcopy(model).cuda()
        ids = ids.cuda()
        with torch.inference_mode():
            want = [resident(ids.roll(k, 1)).logits for k in range(4)]
        del resident
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        pinned_before = ops.pool_stats("cuda:0")["bytes_pinned"]
        handle = spillway.offload_weights(model, prefetch=1)
        s = handle.stats()
        assert ops.pool_stats("cuda:0")["bytes_pinned"] - pinned_before == s["bytes_pinned"]
        assert s["bytes_pinned"] <= 1.02 * s["bytes_offloaded"]
        block = s["bytes_host"] / 8
        resident_rest = torch.cuda.memory_allocated() - base
        assert resident_rest < s["bytes_offloaded"] / 2  # the blocks did not come along
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            for k in range(4):
                assert torch.equal(model(ids.roll(k, 1)).logits, want[k]), k
        peak = torch.cuda.max_memory_allocated() - base - resident_rest
        # The call's activations are small here; the weights in flight are the running
        # block and the prefetched one (and the ring's handover): well under 4 blocks.
        assert peak < 4 * block + 64 * 2**20, (peak, block)
        assert handle.stats()["on_demand"] == 1
        handle.detach()


@needs_cuda
def test_cuda_training_through_offloaded_weights_is_bit_exact_and_holds_few_blocks():
    """A CPU-built fp32 Llama trained on the GPU with its blocks offloaded: loss and every
    gradient torch.equal to the resident model's on every step (an SGD step between, inside
    mutate_weights), and the step's peak above the resident step's (whose weights were
    already allocated) is a few blocks of weights, not all eight."""
    with deterministic_cuda():
        model, ids = tiny_llama(15, layers=8, hidden=512, intermediate=1408, heads=8,
                                kv_heads=4, vocab=1024, batch=2, seq=128)
        resident = copy.deepcopy(model).cuda()
        ids = ids.cuda()
        block_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
        handle = spillway.offload_weights(model)

        def step_peak(m, batch):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = m(batch, labels=ids)
            out.loss.backward()
            torch.cuda.synchronize()
            return out.loss, torch.cuda.max_memory_allocated() - base

        for step in range(3):
            batch = ids.roll(step, 1)
            want, resident_peak = step_peak(resident, batch)  # its weights are in its base
            got, peak = step_peak(model, batch)
            assert torch.equal(got, want), step
            for (name, p), (_, q) in zip(model.named_parameters(), resident.named_parameters()):
                assert torch.equal(p.grad, q.grad), (step, name)
            # Above what the resident step needs besides its weights: a few blocks.
            assert peak < resident_peak + 4 * block_bytes + 16 * 2**20, (
                step, peak, resident_peak, block_bytes)
            _sgd_inside(handle, (model, resident))
        s = handle.stats()
        assert s["backward_reloads"] >= 3 * 8 and s["backward_on_demand"] <= 3
        handle.detach()
        for (name, p), (_, q) in zip(model.named_parameters(), resident.named_parameters()):
            assert torch.equal(p, q), name


# ---- gpu_budget: the resident-set scheduler (include/spillway/weights.h) ----------------

def test_gpu_budget_keeps_the_planned_blocks_resident_and_stays_exact():
    model, ids = tiny_llama(3, layers=6)
    model.eval()
    resident = copy.deepcopy(model)
    weights = sum(-(-t.numel() * t.element_size() // 512) * 512
                  for t in [*model.parameters(), *model.buffers()])
    handle = spillway.offload_weights(model, gpu_budget=0.6, device="cpu")
    first = handle.forecast()
    assert abs(first["budget_bytes"] - 0.6 * weights) < 0.01 * weights  # slabs: aligned
    assert not first["profiled"]
    assert first["peak_bytes"] <= first["budget_bytes"]
    assert 0 < len(first["resident"]) < 6  # some blocks fit, not all
    assert handle.stats()["resident"] == first["resident"]
    with torch.inference_mode():
        for k in range(6):
            batch = ids.roll(k, dims=1)
            assert torch.equal(model(batch).logits, resident(batch).logits), k
            if k == 1:  # the second call was profiled and the plan made again from it
                planned = handle.forecast()
                assert planned["profiled"] and planned["compute_ms"] > 0
                assert planned["peak_bytes"] <= planned["budget_bytes"]
                assert set(planned["candidates"]) >= {"nothing", "greedy", "exact"}
                fastest = min(c["call_ms"] for c in planned["candidates"].values())
                assert planned["call_ms"] <= fastest + 1e-9
                assert handle.stats()["resident"] == planned["resident"]
                reloads = handle.stats()["reloads"]
    # From then on only the streamed blocks move, one copy each per call.
    s = handle.stats()
    streamed = 6 - len(s["resident"])
    assert s["reloads"] - reloads == 4 * streamed
    # A resident block's parameters are real device tensors; a streamed one's placeholders.
    for i, layer in enumerate(model.model.layers):
        sizes = {p.numel() > 0 for p in layer.parameters()}
        assert sizes == {i in s["resident"]}, i
    assert "resident" in repr(handle)
    handle.detach()
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, resident(ids).logits)


def test_gpu_budget_for_every_weight_keeps_every_block_and_moves_nothing():
    model, ids = tiny_llama(4, layers=4)
    model.eval()
    resident = copy.deepcopy(model)
    handle = spillway.offload_weights(model, gpu_budget=1.0, device="cpu")
    assert handle.forecast()["resident"] == [0, 1, 2, 3]
    reloads = handle.stats()["reloads"]
    with torch.inference_mode():
        for k in range(4):
            assert torch.equal(model(ids.roll(k, 1)).logits, resident(ids.roll(k, 1)).logits)
    s = handle.stats()
    assert s["reloads"] == reloads and s["in_flight"] == []
    assert handle.forecast()["bytes_moved"] == 0


def _smallest_budget(model) -> int:
    """The smallest gpu_budget, read from the error a budget of one byte gets."""
    with pytest.raises(ValueError) as e:
        spillway.offload_weights(model, gpu_budget=1, device="cpu")
    return int(str(e.value).split("any plan fits is ")[1].split(" bytes")[0])


def test_gpu_budget_below_the_smallest_names_it_and_leaves_the_model_unchanged():
    model, ids = tiny_llama(5, layers=4)
    model.eval()
    want = copy.deepcopy(model)
    pinned = _settled_pinned_bytes()
    with pytest.raises(ValueError, match=r"^\[weights\] gpu_budget \(4096 bytes\): \[plan\] "
                       r"resident set: no plan fits .* the smallest budget any plan fits is "
                       r"\d+ bytes .*; the model is unchanged$"):
        spillway.offload_weights(model, gpu_budget=4096, device="cpu")
    for (name, p), (_, q) in zip(model.named_parameters(), want.named_parameters()):
        assert torch.equal(p, q), name
    assert _settled_pinned_bytes() == pinned
    # The smallest budget itself is accepted: nothing resident, one slot.
    smallest = _smallest_budget(model)
    handle = spillway.offload_weights(model, gpu_budget=smallest, device="cpu")
    f = handle.forecast()
    assert f["resident"] == [] and f["slots"] == 1 and f["peak_bytes"] <= smallest
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, want(ids).logits)
    handle.detach()


def test_gpu_budget_with_a_fixed_prefetch_and_mutate_weights_replans_and_stays_exact():
    model = _dit(2)
    resident = copy.deepcopy(model)
    handle = spillway.offload_weights(model, gpu_budget="55%", prefetch=0, device="cpu")
    assert handle.forecast()["slots"] == 1  # prefetch given: the slot count is fixed
    orders = [None, None, [0, 2, 4], None, [5, 4, 3, 2, 1, 0]]
    with torch.no_grad():
        for k, order in enumerate(orders):
            x, t = _dit_inputs(k)
            assert torch.equal(model(x, t, order), resident(x, t, order)), (k, order)
        with handle.mutate_weights():
            for m in (model, resident):
                m.blocks[3].mlp[0].weight.mul_(0.5)
        for k, order in enumerate(orders):
            x, t = _dit_inputs(k + 10)
            assert torch.equal(model(x, t, order), resident(x, t, order)), (k, order)
    f = handle.forecast()
    assert f["profiled"] and f["slots"] == 1 and f["peak_bytes"] <= f["budget_bytes"]
    assert handle.stats()["resident"] == f["resident"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs in scripts/device-check)")
def test_cuda_gpu_budget_holds_the_measured_weights_and_stays_exact():
    """Budgets of 30 %, 55 % and 80 % of the weights on a bf16 Llama: logits torch.equal to
    the resident model's on every call, and the device memory the calls hold above their
    activations (measured on the resident model) within the budget."""
    with deterministic_cuda():
        model, ids = tiny_llama(12, layers=8, hidden=1024, intermediate=2816, heads=8,
                                kv_heads=4, vocab=1024, batch=2, seq=256, dtype=torch.bfloat16)
        model.eval()
        ids = ids.cuda()
        reference = copy.deepcopy(model).cuda()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            want = [reference(ids.roll(k, 1)).logits for k in range(5)]
        kept = sum(w.numel() * w.element_size() for w in want)
        activations = torch.cuda.max_memory_allocated() - base - kept  # base: the weights
        del reference
        for fraction in (0.3, 0.55, 0.8):
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            handle = spillway.offload_weights(model, gpu_budget=fraction)
            budget = handle.forecast()["budget_bytes"]
            torch.cuda.reset_peak_memory_stats()
            with torch.inference_mode():
                for k in range(5):
                    got = model(ids.roll(k, 1)).logits
                    assert torch.equal(got, want[k]), (fraction, k)
                    del got
            held = torch.cuda.max_memory_allocated() - base - activations
            f = handle.forecast()
            assert f["profiled"] and f["peak_bytes"] <= budget
            assert held <= budget + 4 * 2**20, (fraction, held, budget, f)
            handle.detach()
            model.cpu()


@pytest.mark.parametrize("make", ["llama", "dit"])
def test_children_granularity_streams_each_child_and_stays_exact(make):
    """granularity='children': a group per direct child with parameters (and the block's
    own), each with its slab, copy and hooks; exact over calls with blocks skipped and
    reordered, under a budget whose plan streams groups through two slots."""
    if make == "llama":
        model, ids = tiny_llama(6, layers=4)
        model.eval()
        inputs = [((ids.roll(k, 1),), None) for k in range(5)]
        run = lambda m, x, order: m(*x).logits  # noqa: E731
    else:
        model = _dit(6)
        inputs = [(_dit_inputs(k), order) for k, order in
                  enumerate([None, [0, 2, 4], None, [5, 4, 3, 2, 1, 0], None])]
        run = lambda m, x, order: m(*x, order)  # noqa: E731
    resident = copy.deepcopy(model)
    handle = spillway.offload_weights(model, granularity="children", device="cpu")
    groups = handle.groups
    assert len(groups) > len(handle.blocks) and all(
        any(g == b or g.startswith(b + ".") for b in handle.blocks) for g in groups)
    if make == "llama":
        assert "model.layers.0.self_attn" in groups and "model.layers.0.mlp" in groups
    with torch.inference_mode():
        for x, order in inputs:
            assert torch.equal(run(model, x, order), run(resident, x, order))
    assert handle.stats()["groups"] == len(groups)
    assert list(model.state_dict()) == list(resident.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(handle.state_dict().values(),
                                                   resident.state_dict().values()))
    handle.detach()
    # The smallest budget: one group's buffer beside the rest; the plan still exact.
    smallest_blocks = _smallest_budget(model)
    with pytest.raises(ValueError) as e:
        spillway.offload_weights(model, gpu_budget=1, granularity="children", device="cpu")
    smallest = int(str(e.value).split("any plan fits is ")[1].split(" bytes")[0])
    assert smallest < smallest_blocks
    handle = spillway.offload_weights(model, gpu_budget=smallest + (smallest_blocks - smallest) // 2,
                                      granularity="children", device="cpu")
    with torch.inference_mode():
        for x, order in inputs:
            assert torch.equal(run(model, x, order), run(resident, x, order))
    f = handle.forecast()
    assert f["profiled"] and f["peak_bytes"] <= f["budget_bytes"]
    handle.detach()


def test_five_hundred_calls_keep_pinned_memory_and_buffers_flat():
    """Over 500 calls under a budget (the plan made again after the second) nothing
    grows: the pool's pinned bytes and allocations, the copies in flight, the groups
    resident; every 50th call is checked against the resident model."""
    model, ids = tiny_llama(8, layers=4, hidden=64, intermediate=128, heads=4, kv_heads=2,
                            vocab=128, batch=1, seq=16)
    model.eval()
    resident = copy.deepcopy(model)
    _settled_pinned_bytes()  # earlier tests' dropped handles freed before counting starts
    handle = spillway.offload_weights(model, gpu_budget=0.7, granularity="children",
                                      device="cpu")
    seen = []
    with torch.inference_mode():
        for k in range(500):
            out = model(ids).logits
            if k % 50 == 0:
                assert torch.equal(out, resident(ids).logits), k
            if k >= 3:
                s, pool = handle.stats(), ops.pool_stats("cpu")
                seen.append((pool["bytes_pinned"], pool["pinned_allocations"],
                             len(s["in_flight"]), tuple(s["resident"])))
    assert len(set(seen)) == 1, set(seen)
    assert handle.stats()["calls"] == 500
    handle.detach()
