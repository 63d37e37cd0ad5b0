"""spillway.compile(model, weights="offload"): the compiled piecewise executor (Note
[Piecewise executor] in python/spillway/weights/compiled.py).

On CPU, device='cpu' drives the runtime's fake copy backend. Outputs are compared with
torch.equal against the same model compiled the same way with every weight resident
(gpu_budget=1.0: the same pieces, nothing streamed), and, in fp32, against the eager
resident model; over many calls, with blocks skipped and reordered, after
mutate_weights() and detach(). The CUDA tests skip without a GPU and run in
scripts/device-check.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import spillway
from spillway import ops
from _models import deterministic_cuda, fresh_dynamo, tiny_llama  # noqa: F401
from test_weights import _dit, _dit_inputs

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "detached_after")


@pytest.fixture
def detached_after(monkeypatch):
    """Every handle a test attaches is detached after it (even when it failed), so no
    copy of the ring's handover stays pending into the next test."""
    from spillway.weights import layerwise
    made = []
    attach = layerwise._attach

    def tracked(*args, **kwargs):
        made.append(attach(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(layerwise, "_attach", tracked)
    yield
    for handle in made:
        if not handle._detached:
            handle.detach()


def _executors(compiled) -> int:
    return compiled.spillway_weights.stats().get("graphs", 0)


def test_llama_outputs_equal_the_resident_model_and_no_piece_recompiles():
    model, ids = tiny_llama(3, layers=4, hidden=128)
    model.eval()
    resident = copy.deepcopy(model)
    names = [n for n, _ in model.named_parameters()]
    compiled = spillway.compile(model, weights="offload", device="cpu", backend="eager")
    handle = compiled.spillway_weights
    assert handle.blocks == [f"model.layers.{i}" for i in range(4)]
    # Every offloaded parameter keeps its name, dtype and shape (what Dynamo traces).
    for (name, p), (_, q) in zip(model.named_parameters(), resident.named_parameters()):
        assert p.shape == q.shape and p.dtype == q.dtype, name
        if name.startswith("model.layers."):
            assert p.untyped_storage().nbytes() == p.element_size(), name  # one element
    assert [n for n, _ in model.named_parameters()] == names
    with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
        for k in range(6):
            batch = ids.roll(k, dims=1)
            assert torch.equal(compiled(batch, use_cache=False).logits,
                               resident(batch, use_cache=False).logits), k
    s = handle.stats()
    assert s["graphs"] == 1 and s["calls"] == 6 and s["order"] == [0, 1, 2, 3]
    # The embedding piece, one per block, the head: each compiled once in six calls.
    assert s["piece_compiles"] == 6
    # One copy per block per call and the ring's handover; only the first block of the
    # first call loads on demand.
    assert s["reloads"] == 6 * 4 + 2 and s["on_demand"] == 1 and s["in_flight"] == [0, 1]


def test_inductor_pieces_equal_the_same_pieces_resident_under_a_budget():
    """Inductor compiles the pieces; children groups; a budget that keeps some groups:
    bit-equal to the same compile with every weight resident; the second call is
    profiled and the plan made again from it; identical blocks share compiled code."""
    model, ids = tiny_llama(4, layers=3, hidden=64)
    model.eval()
    full_model = copy.deepcopy(model)
    compiled = spillway.compile(model, weights="offload", device="cpu", gpu_budget=0.6,
                                granularity="children")
    full = spillway.compile(full_model, weights="offload", device="cpu", gpu_budget=1.0,
                            granularity="children")
    with torch.inference_mode():
        for k in range(4):
            batch = ids.roll(k, dims=1)
            assert torch.equal(compiled(batch, use_cache=False).logits,
                               full(batch, use_cache=False).logits), k
    forecast = compiled.spillway_weights.forecast()
    assert forecast["profiled"] and 0 < len(forecast["resident"]) < 12, forecast
    assert full.spillway_weights.stats()["resident"] == list(range(12))
    assert full.spillway_weights.stats()["reloads"] == 12  # once, to stay
    s = compiled.spillway_weights.stats()
    assert s["order"] == [2, 0, 3, 1, 6, 4, 7, 5, 10, 8, 11, 9]  # norm, attention, norm, MLP
    assert s["on_demand"] <= 2


def test_dit_blocks_skipped_and_reordered_stay_exact():
    """Bit-equal to the same compile with every weight resident. Against plain
    torch.compile only close: on the CPU, F.multi_head_attention_forward's result depends
    on where its packed projection weight lies (a parameter of its own or a view into a
    slab: 1.2e-7 here, with the pieces run eagerly), so no weight offload that keeps
    slabs can be bit-equal there."""
    model = _dit(1, depth=4)
    plain = torch.compile(copy.deepcopy(model), backend="eager")
    resident = spillway.compile(copy.deepcopy(model), weights="offload", device="cpu",
                                backend="eager", gpu_budget=1.0)
    compiled = spillway.compile(model, weights="offload", device="cpu", backend="eager")
    orders = [None, [0, 2], [3, 1, 0, 2], None, [1, 1, 3]]
    # Three models of one class, four orders each: more graphs of one code object than
    # Dynamo's default limit, beyond which it would run the model eagerly.
    with torch.no_grad(), torch._dynamo.config.patch(cache_size_limit=64):
        for k in range(10):
            x, t = _dit_inputs(k)
            order = orders[k % len(orders)]
            got = compiled(x, t, order)
            assert torch.equal(got, resident(x, t, order)), k
            assert torch.allclose(got, plain(x, t, order), rtol=0, atol=1e-5), k
    # Dynamo specialises on the order: one graph each, no more.
    assert _executors(compiled) <= len(orders)
    assert compiled.spillway_weights.stats()["calls"] == 10


def test_mutate_weights_and_detach_keep_the_compiled_model_exact():
    model, ids = tiny_llama(5, layers=3, hidden=64)
    model.eval()
    resident = copy.deepcopy(model)
    compiled = spillway.compile(model, weights="offload", device="cpu", backend="eager")
    handle = compiled.spillway_weights
    with torch.inference_mode():
        assert torch.equal(compiled(ids, use_cache=False).logits,
                           resident(ids, use_cache=False).logits)
    with handle.mutate_weights(), torch.no_grad():
        for m in (model, resident):
            m.model.layers[1].mlp.up_proj.weight.mul_(0.5)
        # The weights are on the device: the model runs, compiled or not.
        assert torch.equal(model(ids, use_cache=False).logits,
                           resident(ids, use_cache=False).logits)
    with torch.inference_mode():
        for k in range(3):
            batch = ids.roll(k, 1)
            assert torch.equal(compiled(batch, use_cache=False).logits,
                               resident(batch, use_cache=False).logits), k
    state = handle.state_dict()
    for name, value in resident.state_dict().items():
        assert torch.equal(state[name], value), name
    handle.detach()
    for (name, p), (_, q) in zip(model.named_parameters(), resident.named_parameters()):
        assert torch.equal(p, q), name
    with torch.inference_mode():
        assert torch.equal(compiled(ids, use_cache=False).logits,
                           resident(ids, use_cache=False).logits)
        assert torch.equal(model(ids, use_cache=False).logits,
                           resident(ids, use_cache=False).logits)


def test_misuse_is_refused_with_the_values_kept():
    model, ids = tiny_llama(6, layers=2, hidden=64)
    model.eval()
    resident = copy.deepcopy(model)
    compiled = spillway.compile(model, weights="offload", device="cpu", backend="eager")
    # The model called without its compiled wrapper would compute on placeholders.
    with torch.inference_mode(), pytest.raises(
            RuntimeError, match=r"^\[weights\] model\.layers\.0 was called outside the "
                                r"compiled model"):
        model(ids, use_cache=False)
    # A copy of the model reads the placeholders safely (NaN, never a plausible value).
    clone = copy.deepcopy(model)
    assert torch.isnan(clone.model.layers[0].mlp.up_proj.weight).all()
    with torch.inference_mode():
        assert torch.equal(compiled(ids, use_cache=False).logits,
                           resident(ids, use_cache=False).logits)
    # An optimizer's step outside mutate_weights() would write into the placeholders.
    compiled(ids, labels=ids, use_cache=False).loss.backward()
    with pytest.raises(RuntimeError, match=r"SGD\.step\(\) would update model\.layers\.0\."
                                           r".*spillway_weights.*Nothing was changed"):
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert torch.isnan(model.model.layers[0].mlp.up_proj.weight).all()
    assert torch.equal(model.lm_head.weight, resident.lm_head.weight)
    # The same model offloaded twice.
    with pytest.raises(ValueError, match=r"offloaded already"):
        spillway.compile(model, weights="offload", device="cpu")
    with pytest.raises(ValueError, match=r"offloaded already"):
        spillway.offload_weights(model, device="cpu")


class _Broken(torch.nn.Module):
    """Blocks of two linears in an nn.ModuleList, with Dynamo graph breaks between two
    blocks (`between`) or inside every block (`inside`)."""

    class Block(torch.nn.Module):
        def __init__(self, inside: bool):
            super().__init__()
            self.a, self.b, self.inside = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32), inside

        def forward(self, x):
            y = self.a(x).relu()
            if self.inside:
                torch._dynamo.graph_break()
            return x + self.b(y)

    def __init__(self, inside: bool, between: bool):
        super().__init__()
        self.blocks = torch.nn.ModuleList(self.Block(inside) for _ in range(4))
        self.head, self.between = torch.nn.Linear(32, 8), between

    def forward(self, x, n: int = 4):
        for k, block in enumerate(self.blocks[:n]):
            x = block(x)
            if self.between and k == 1:
                torch._dynamo.graph_break()
        return self.head(x)


@pytest.mark.parametrize("inside, between", [(False, True), (True, False)],
                         ids=["between-blocks", "inside-blocks"])
def test_graph_breaks_stay_exact_and_one_call_prefetches_across_its_graphs(inside, between):
    """A call of the compiled model is one call of the handle however many graphs Dynamo
    made of it: the order spans the graphs, so the next call prefetches every block; a
    block cut by a break keeps its weights from its first graph to its second."""
    torch.manual_seed(13)
    model = _Broken(inside, between).eval()
    resident = copy.deepcopy(model)
    compiled = spillway.compile(model, weights="offload", device="cpu", backend="eager")
    handle = compiled.spillway_weights
    seen = []
    with torch.no_grad():
        for k in range(6):
            x = torch.randn(4, 32)
            assert torch.equal(compiled(x), resident(x)), k
            seen.append(handle.stats())
    s = seen[-1]
    assert s["calls"] == 6 and (s["graphs"] >= 2 or not inside), s
    assert s["order"] == ([0, 0, 1, 1, 2, 2, 3, 3] if inside else [0, 1, 2, 3]), s
    # From the second call on, one copy per block per call, every one prefetched.
    for before, after in zip(seen[1:], seen[2:]):
        assert after["reloads"] - before["reloads"] == 4, (before, after)
        assert after["on_demand"] == before["on_demand"], (before, after)
        assert after["dropped_prefetches"] == before["dropped_prefetches"], (before, after)


@pytest.mark.parametrize("granularity", ["block", "children"])
def test_blocks_dynamo_runs_eagerly_inside_a_call_get_their_weights(granularity):
    """Past Dynamo's recompile limit the model's frame runs eagerly: each group's module
    then runs as offload_weights() runs it (its weights brought and bound for its
    forward), bit-equal to the resident model; called outside the compiled model it is
    still refused."""
    torch.manual_seed(17)
    model = _Broken(False, False).eval()
    resident = copy.deepcopy(model)
    compiled = spillway.compile(model, weights="offload", device="cpu", backend="eager",
                                granularity=granularity, gpu_budget=0.6)
    handle = compiled.spillway_weights
    with torch.no_grad(), torch._dynamo.config.patch(cache_size_limit=1):
        for k in range(8):
            x, n = torch.randn(4, 32), [4, 2, 3, 4][k % 4]  # n != 4: past the limit
            assert torch.equal(compiled(x, n), resident(x, n)), k
            assert not handle._bound and not handle._held and not handle._live, k
    assert handle.stats()["graphs"] == 1 and handle.stats()["calls"] == 8
    for block in handle._blocks:  # the placeholders are back
        assert all(p.untyped_storage().nbytes() == p.element_size() for p in block.params)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"called outside the compiled"):
        model.blocks[1](torch.randn(4, 32))
    # Training through a block run eagerly: the gradients are the resident model's.
    x = torch.randn(4, 32)
    with torch._dynamo.config.patch(cache_size_limit=1):
        compiled(x, 3).square().sum().backward()
    resident(x, 3).square().sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), resident.named_parameters()):
        assert (p.grad is None) == (q.grad is None) and (
            p.grad is None or torch.equal(p.grad, q.grad)), name
    assert model.blocks[0].a.weight.grad is not None and model.blocks[3].a.weight.grad is None
    assert handle._depth == 0 and not handle._bound


@pytest.mark.parametrize("backend, options", [
    ("eager", {}),
    ("eager", {"gpu_budget": 0.5, "granularity": "children"}),
    ("inductor", {"gpu_budget": 0.5, "granularity": "children"}),
], ids=["eager-streamed", "eager-budget-children", "inductor-budget-children"])
def test_training_through_compiled_offloaded_weights_is_bit_exact(backend, options):
    """Four steps with an AdamW step between (inside mutate_weights): loss, every gradient
    and, after the steps, every weight torch.equal to the same compile with every weight
    resident, and (the eager backend) to the eager model; nothing held after backward,
    the groups brought back in reverse order one ahead."""
    with deterministic_cuda():  # deterministic kernels: Inductor's embedding backward
        _train_and_compare(backend, options)


def _train_and_compare(backend, options):
    model, ids = tiny_llama(15, layers=3, hidden=64)
    plain = copy.deepcopy(model)
    full_model = copy.deepcopy(model)
    compiled = spillway.compile(model, weights="offload", device="cpu", backend=backend,
                                **options)
    full = spillway.compile(full_model, weights="offload", device="cpu", backend=backend,
                            **dict(options, gpu_budget=1.0))
    handle, full_handle = compiled.spillway_weights, full.spillway_weights
    runs = [(compiled, model, handle), (full, full_model, full_handle)]
    if backend == "eager":
        runs.append((plain, plain, None))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for _, m, _ in runs]
    for step in range(4):
        batch = ids.roll(step, 1)
        losses = [run(batch, labels=batch, use_cache=False).loss for run, _, _ in runs]
        assert not handle._live and not handle._held, step
        for loss in losses:
            loss.backward()
        assert all(torch.equal(loss, losses[0]) for loss in losses), (step, losses)
        for named in zip(*(m.named_parameters() for _, m, _ in runs)):
            name, p = named[0]
            assert p.grad is not None, (step, name)
            assert all(torch.equal(p.grad, q.grad) for _, q in named[1:]), (step, name)
        assert not handle._backward.back and not handle._backward.ahead
        for (_, m, h), opt in zip(runs, optimizers):
            with (h.mutate_weights() if h is not None else contextlib.nullcontext()):
                opt.step()
                opt.zero_grad(set_to_none=True)
    s = handle.stats()
    groups = len(handle.groups)
    assert s["backward_reloads"] > 0 and s["backward_on_demand"] <= 4 * (
        1 if options.get("granularity") != "children" else groups), s
    handle.detach()
    full_handle.detach()
    for (name, p), (_, q) in zip(model.named_parameters(), full_model.named_parameters()):
        assert torch.equal(p, q), name


def test_five_hundred_compiled_calls_keep_pinned_memory_and_buffers_flat():
    """Over 500 calls under a budget (planned again from the second call's profile)
    nothing the executor holds grows: the pool's pinned bytes and allocations, the copies
    in flight, the resident groups, the groups held; every 50th call is checked against
    the same compile with every weight resident."""
    from test_weights import _settled_pinned_bytes
    model, ids = tiny_llama(8, layers=4, hidden=64, intermediate=128, heads=4, kv_heads=2,
                            vocab=128, batch=1, seq=16)
    model.eval()
    full = spillway.compile(copy.deepcopy(model), weights="offload", device="cpu",
                            backend="eager", gpu_budget=1.0, granularity="children")
    _settled_pinned_bytes()
    compiled = spillway.compile(model, weights="offload", device="cpu", backend="eager",
                                gpu_budget=0.7, granularity="children")
    handle, seen = compiled.spillway_weights, []
    with torch.inference_mode():
        for k in range(500):
            out = compiled(ids, use_cache=False).logits
            if k % 50 == 0:
                assert torch.equal(out, full(ids, use_cache=False).logits), k
            if k >= 3:
                s, pool = handle.stats(), ops.pool_stats("cpu")
                seen.append((pool["bytes_pinned"], pool["pinned_allocations"],
                             len(s["in_flight"]), tuple(s["resident"]), len(handle._held),
                             len(handle._live), s["graphs"], s["piece_compiles"]))
    assert len(set(seen)) == 1, set(seen)
    assert handle.stats()["calls"] == 500 and 0 < len(seen[0][3]) < len(handle.groups)


@pytest.mark.parametrize("kwargs, match", [
    (dict(weights="host"), r"weights must be 'offload' or None, got 'host'"),
    (dict(weights="offload", memory_budget="1GiB"), r"does not combine with activation"),
    (dict(weights="offload", scope="mlp"), r"does not combine with activation"),
    (dict(gpu_budget=0.5), r"gpu_budget applies with weights='offload' only"),
    (dict(granularity="children"), r"granularity applies with weights='offload' only"),
    (dict(weights="offload", gpu_budget=-1), r"gpu_budget"),
    (dict(weights="offload", prefetch=-1), r"prefetch must be an int >= 0"),
    (dict(weights="offload", blocks="model.nothing"), r"no submodule of that path"),
])
def test_bad_arguments_are_named_and_change_nothing(kwargs, match):
    model, ids = tiny_llama(7, layers=2, hidden=64)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    if kwargs.get("weights"):
        kwargs.setdefault("device", "cpu")
    with pytest.raises(ValueError, match=match):
        spillway.compile(model, **kwargs)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and ops.cuda_built()),
                                reason="needs a CUDA device and a spillway._C with CUDA kernels")


@needs_cuda
def test_cuda_compiled_offload_is_exact_and_holds_few_blocks():
    """bf16 Llama built on the CPU, compiled with Inductor and every block streamed:
    bit-equal to the same compile with every weight resident; the GPU holds the blocks
    in flight only; against plain torch.compile of the whole graph the difference is
    reported (pieces fuse less), and fp32 is bit-equal to it."""
    with deterministic_cuda():
        model, ids = tiny_llama(11, layers=8, hidden=1024, intermediate=2816, heads=8,
                                kv_heads=4, vocab=1024, batch=2, seq=256, dtype=torch.bfloat16)
        model.eval()
        full_model = copy.deepcopy(model)
        ids = ids.cuda()
        full = spillway.compile(full_model, weights="offload", gpu_budget=1.0)
        with torch.inference_mode():
            want = [full(ids.roll(k, 1), use_cache=False).logits for k in range(4)]
        full.spillway_weights.detach()
        del full, full_model
        compiled, handle, block, base, rest = _compile_streamed(model, blocks=8)
        with torch.inference_mode():
            # Compiles. Its input made under inference_mode as the calls' below are: Dynamo
            # guards on it, and an ordinary tensor here compiled a second graph (H100).
            compiled(ids.roll(0, 1), use_cache=False)
            torch.cuda.synchronize()
            compiled_once = handle.stats()
            torch.cuda.reset_peak_memory_stats()
            for k in range(4):
                assert torch.equal(compiled(ids.roll(k, 1), use_cache=False).logits, want[k]), k
        peak = torch.cuda.max_memory_allocated() - base - rest
        assert peak < 4 * block + 64 * 2**20, (peak, block)
        s = handle.stats()
        # Nothing compiled again after the first call (its graphs: one, or more when
        # Dynamo saw this model's class before, as here); no block loaded on demand since.
        for key in ("graphs", "piece_compiles", "on_demand"):
            assert s[key] == compiled_once[key], (key, s, compiled_once)
        assert s["on_demand"] == 1, s
        handle.detach()


@needs_cuda
def test_cuda_compiled_fp32_is_close_to_plain_torch_compile():
    """Pieces fuse less than the whole graph (Note [Piecewise executor]): in fp32 the
    logits stay within 1e-5 of plain torch.compile's; the largest difference is printed
    for the record."""
    with deterministic_cuda():
        model, ids = tiny_llama(12, layers=4, hidden=256, heads=4, kv_heads=2, vocab=512,
                                batch=2, seq=128)
        model.eval()
        plain = torch.compile(copy.deepcopy(model).cuda())
        ids = ids.cuda()
        compiled = spillway.compile(model, weights="offload")
        with torch.inference_mode():
            for k in range(3):
                batch = ids.roll(k, 1)
                got = compiled(batch, use_cache=False).logits
                want = plain(batch, use_cache=False).logits
                print(f"fp32 compiled offload vs plain torch.compile, call {k}: "
                      f"max |difference| {(got - want).abs().max().item():.3g}")
                assert torch.allclose(got, want, rtol=0, atol=1e-5), k
        compiled.spillway_weights.detach()


@needs_cuda
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cuda_five_hundred_calls_hold_gpu_and_pinned_memory_flat(compiled):
    """500 calls of a bf16 Llama under a 50 % budget (children), through offload_weights
    or spillway.compile (its pieces run by the eager backend: the executor's memory is
    what is measured, not Inductor's): the GPU peak of every 50 calls, the bytes
    allocated between calls and the pool's pinned bytes are the same from the fourth
    call on; every 50th call is bit-equal to the same model with every weight resident."""
    from test_weights import _settled_pinned_bytes
    model, ids = tiny_llama(14, layers=4, hidden=512, intermediate=1024, heads=8, kv_heads=4,
                            vocab=512, batch=1, seq=128, dtype=torch.bfloat16)
    model.eval()
    ids = ids.cuda()
    options = dict(granularity="children")

    def offload(m, budget):
        if compiled:
            c = spillway.compile(m, weights="offload", backend="eager", gpu_budget=budget,
                                 **options)
            return c, c.spillway_weights
        return m, spillway.offload_weights(m, gpu_budget=budget, **options)

    full, full_handle = offload(copy.deepcopy(model), 1.0)
    with torch.inference_mode():
        want = full(ids, use_cache=False).logits
    full_handle.detach()
    del full, full_handle
    _settled_pinned_bytes("cuda:0")
    run, handle = offload(model, 0.5)
    windows, between = [], set()
    with torch.inference_mode():
        for k in range(503):
            out = run(ids, use_cache=False).logits
            if k % 50 == 0:
                assert torch.equal(out, want), k
            del out
            torch.cuda.synchronize()
            if k == 2:
                torch.cuda.reset_peak_memory_stats()
            elif k > 2:
                pool = ops.pool_stats("cuda:0")
                between.add((torch.cuda.memory_allocated(), pool["bytes_pinned"],
                             pool["pinned_allocations"], tuple(handle.stats()["resident"])))
                if (k - 2) % 50 == 0:
                    windows.append(torch.cuda.max_memory_allocated())
                    torch.cuda.reset_peak_memory_stats()
    assert len(between) == 1, between
    assert len(windows) == 10 and len(set(windows)) == 1, windows
    f = handle.forecast()
    print(f"500 {'compiled' if compiled else 'eager'} calls: peak {windows[0] / 2**20:.1f} MiB "
          f"every 50 calls, {between.pop()[1] / 2**20:.1f} MiB pinned; budget "
          f"{f['budget_bytes'] / 2**20:.1f} MiB of weights, resident groups {f['resident']}")
    handle.detach()


@needs_cuda
def test_cuda_compiled_training_through_offloaded_weights_is_bit_exact_and_holds_few_blocks():
    """bf16 Llama built on the CPU, Inductor, every block streamed, three steps with an
    SGD step inside mutate_weights: loss and every gradient torch.equal to the same
    compile with every weight resident; during forward and backward the GPU holds the
    blocks in flight only (what the pieces saved of the weights are references)."""
    with deterministic_cuda():
        model, ids = tiny_llama(16, layers=6, hidden=1024, intermediate=2816, heads=8,
                                kv_heads=4, vocab=1024, batch=1, seq=128, dtype=torch.bfloat16)
        full_model = copy.deepcopy(model)
        ids = ids.cuda()
        full = spillway.compile(full_model, weights="offload", gpu_budget=1.0)
        want = []
        for step in range(3):
            loss = full(ids.roll(step, 1), labels=ids.roll(step, 1), use_cache=False).loss
            loss.backward()
            want.append((loss.detach(), [p.grad.clone() for p in full_model.parameters()]))
            _sgd(full.spillway_weights, full_model)
        full.spillway_weights.detach()
        del full, full_model
        compiled, handle, block, base, rest = _compile_streamed(model, blocks=6)
        for step in range(3):
            torch.cuda.reset_peak_memory_stats()
            loss = compiled(ids.roll(step, 1), labels=ids.roll(step, 1), use_cache=False).loss
            loss.backward()
            held = torch.cuda.max_memory_allocated() - base - rest
            assert torch.equal(loss.detach(), want[step][0]), step
            for (name, p), g in zip(model.named_parameters(), want[step][1]):
                assert torch.equal(p.grad, g), (step, name)
            grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
            print(f"compiled training step {step}: peak beyond the resident part "
                  f"{held / 2**20:.0f} MiB, of which gradients {grads / 2**20:.0f} MiB; "
                  f"one block {block / 2**20:.0f} MiB")
            # Gradients, activations of a 128-token step, and a few blocks in flight.
            assert held - grads < 4 * block + 64 * 2**20, (held, grads, block)
            _sgd(handle, model)
        s = handle.stats()
        assert s["backward_on_demand"] <= 3, s
        handle.detach()


def _compile_streamed(model, blocks: int):
    """spillway.compile(model, weights="offload") with every block streamed, once the
    caller has let the all-resident reference go: (the compiled model, its handle, one
    block's bytes, the bytes allocated before, what the compile holds resident)."""
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    compiled = spillway.compile(model, weights="offload")
    handle = compiled.spillway_weights
    block = handle.stats()["bytes_host"] / blocks
    return compiled, handle, block, base, torch.cuda.memory_allocated() - base


def _sgd(handle, model, lr=1e-2):
    with handle.mutate_weights(), torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-lr)
            p.grad = None
