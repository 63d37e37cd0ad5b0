"""The custom ops spillway::offload / reload / wait_tensor.

On CPU, CPU tensors play device memory and the runtime's fake backend moves
them on its copy threads, so these tests drive the real runtime: pinned pool,
copy engine, residency manager. Properties checked: bytes come back exactly,
spillway lets go of what it holds at the documented points, misuse raises a
clear error, and torch.compile traces, functionalizes and compiles graphs that
contain the ops without changing a bit of the result. CUDA tests run only where
torch has CUDA and the extension was built with it.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("SPILLWAY_REQUIRE_EXTENSION") == "1":
    from spillway import ops  # scripts/test built it: failing to import is a failure
else:
    ops = pytest.importorskip(
        "spillway.ops", reason="spillway._C is not built (cmake --preset python && "
        "cmake --build --preset python)", exc_type=ImportError)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
          torch.int8, torch.uint8, torch.bool, torch.complex64]
SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 4, 5), (1024, 1025)]


def _random(shape, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=gen).bool()
    elif dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(shape, generator=gen, dtype=dtype)
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(info.min, info.max, shape, generator=gen, dtype=dtype)
    return t.to(device)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).cpu()


def _round_trip(x: torch.Tensor):
    host = ops.wait_tensor(ops.offload(x), keepalive=x)
    y = ops.wait_tensor(ops.reload(host, x.device), keepalive=host)
    return host, y


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_is_bit_exact(shape, dtype):
    x = _random(shape, dtype)
    if dtype.is_floating_point and x.numel() > 2:
        x.view(-1)[0] = float("nan")  # NaN payloads survive too
    host, y = _round_trip(x)
    assert host.device.type == "cpu" and y.device == x.device
    assert host.shape == x.shape and y.shape == x.shape
    assert host.dtype == x.dtype and y.dtype == x.dtype
    assert torch.equal(_bytes(host), _bytes(x))
    assert torch.equal(_bytes(y), _bytes(x))
    assert y.data_ptr() != x.data_ptr()
    assert ops.pending_waits() == 0


def test_contiguous_slice_moves_only_its_bytes():
    big = _random((10, 64), torch.float32)
    part = big[2:5]  # contiguous, at an offset into a larger storage
    before = ops.copy_stats("cpu")["bytes_d2h"]
    host, y = _round_trip(part)
    assert ops.copy_stats("cpu")["bytes_d2h"] - before == part.nbytes
    assert torch.equal(host, part) and torch.equal(y, part)


def test_empty_tensor_moves_nothing():
    x = torch.empty(0, 3)
    host, y = _round_trip(x)
    assert host.shape == (0, 3) and y.shape == (0, 3)
    assert ops.pending_waits() == 0


def test_bytes_cross_the_copy_engine():
    x = _random((256, 1024), torch.float32)  # 1 MiB
    before = ops.copy_stats("cpu")
    _round_trip(x)
    after = ops.copy_stats("cpu")
    assert after["bytes_d2h"] - before["bytes_d2h"] == x.nbytes
    assert after["bytes_h2d"] - before["bytes_h2d"] == x.nbytes


def test_forward_wait_releases_spillways_hold_on_the_source():
    x = _random((64, 64), torch.float32)
    base = _use_count(x)
    host = ops.offload(x)
    assert _use_count(x) == base + 1, "the source stays alive while the D2H may read it"
    ops.wait_tensor(host, keepalive=x)
    assert _use_count(x) == base, "after the forward wait only the graph holds the source"


def test_reload_leaves_the_destination_to_its_tensor():
    x = _random((64, 64), torch.float32)
    host = ops.wait_tensor(ops.offload(x), keepalive=x)
    alone = _use_count(torch.empty(4))  # a storage held by one tensor only
    y = ops.reload(host, "cpu")
    assert _use_count(y) == alone + 1, "spillway holds the destination while the H2D writes it"
    waited = ops.wait_tensor(y, keepalive=host)
    assert waited.data_ptr() == y.data_ptr()
    del waited  # the wait's output is an alias of y
    assert _use_count(y) == alone, "after the backward wait only the tensor holds its memory"


def test_source_may_die_before_the_wait():
    x = _random((128, 128), torch.float32)
    expected = x.clone()
    host = ops.offload(x)
    del x  # spillway holds the storage until the forward wait
    host = ops.wait_tensor(host)
    assert torch.equal(host, expected)


def test_host_copy_returns_to_the_pool_when_its_tensor_dies():
    x = _random((300, 300), torch.float32)
    live_before = ops.pool_stats("cpu")["bytes_live"]
    host = ops.wait_tensor(ops.offload(x), keepalive=x)
    assert ops.pool_stats("cpu")["bytes_live"] > live_before
    del host
    assert ops.pool_stats("cpu")["bytes_live"] == live_before


def test_host_copy_dropped_before_its_wait_loses_nothing():
    x = _random((300, 300), torch.float32)
    base = _use_count(x)
    live_before = ops.pool_stats("cpu")["bytes_live"]
    ops.offload(x)  # result dropped at once: its wait runs when it dies
    assert ops.pending_waits() == 0
    assert _use_count(x) == base
    assert ops.pool_stats("cpu")["bytes_live"] == live_before


def test_host_copy_reloads_more_than_once():
    x = _random((33, 17), torch.float64)
    host = ops.wait_tensor(ops.offload(x), keepalive=x)
    first = ops.wait_tensor(ops.reload(host, "cpu"))
    second = ops.wait_tensor(ops.reload(host, "cpu"))  # retain_graph=True reads it twice
    assert torch.equal(first, x) and torch.equal(second, x)
    assert first.data_ptr() != second.data_ptr()


def test_many_transfers_in_flight_complete_in_any_wait_order():
    xs = [_random((64, 257), torch.float32, seed=i) for i in range(16)]
    hosts = [ops.offload(x) for x in xs]
    hosts = [ops.wait_tensor(h, keepalive=x) for h, x in reversed(list(zip(hosts, xs)))][::-1]
    ys = [ops.reload(h, "cpu") for h in hosts]
    ys = [ops.wait_tensor(y) for y in ys]
    for x, y in zip(xs, ys):
        assert torch.equal(y, x)
    assert ops.pending_waits() == 0


@pytest.fixture
def slow_copies():
    """The fake backend's copy streams sleep before every copy task, so a wait
    that did not really wait would read unfinished bytes."""
    ops._C.set_fake_copy_delay(200, 2000, 7)
    yield
    ops._C.set_fake_copy_delay(0, 0, 0)


def test_waits_order_delayed_copies(slow_copies):
    xs = [_random((128, 129), torch.float32, seed=i) for i in range(8)]
    hosts = [ops.offload(x) for x in xs]
    hosts = [ops.wait_tensor(h, keepalive=x) for h, x in zip(hosts, xs)]
    for h, x in zip(hosts, xs):
        assert torch.equal(h, x)  # read on the host right after the forward wait
    ys = [ops.wait_tensor(ops.reload(h, "cpu"), keepalive=h) for h in hosts]
    for y, x in zip(ys, xs):
        assert torch.equal(y, x)


def test_source_overwritten_after_the_forward_wait_leaves_the_copy_intact(slow_copies):
    x = _random((256, 256), torch.float32)
    expected = x.clone()
    host = ops.wait_tensor(ops.offload(x), keepalive=x)
    x.fill_(-1)  # the D2H is complete once the wait returned
    assert torch.equal(ops.wait_tensor(ops.reload(host, "cpu")), expected)


# ---- misuse ---------------------------------------------------------------------


def test_offload_of_a_non_contiguous_tensor_is_refused():
    x = torch.randn(4, 6).t()
    with pytest.raises(ValueError, match=r"^\[ops\] offload of a non-contiguous tensor "
                                         r"\(sizes \[6, 4\], strides \[1, 6\]\)"):
        ops.offload(x)
    assert ops.pending_waits() == 0


def test_reload_of_a_tensor_offload_did_not_make_is_refused():
    with pytest.raises(RuntimeError, match=r"^\[ops\] reload of the host tensor at .*"
                                           r"spillway::offload did not make it"):
        ops.reload(torch.randn(8), "cpu")


def test_reload_of_a_non_contiguous_host_tensor_is_refused():
    host = ops.wait_tensor(ops.offload(torch.randn(4, 6)))
    with pytest.raises(ValueError, match=r"^\[ops\] reload of a non-contiguous host tensor"):
        ops.reload(host.t(), "cpu")


def test_reload_to_an_unsupported_device_is_refused():
    host = ops.wait_tensor(ops.offload(torch.randn(4)))
    with pytest.raises(ValueError, match=r"^\[ops\] device meta is not supported"):
        ops.reload(host, "meta")


@pytest.mark.skipif(ops.cuda_built(), reason="this build has CUDA kernels")
def test_reload_to_cuda_without_cuda_says_so():
    host = ops.wait_tensor(ops.offload(torch.randn(4)))
    with pytest.raises(ValueError, match=r"^\[ops\] cuda.*built without CUDA"):
        ops.reload(host, "cuda")


def test_wait_with_nothing_in_flight_is_refused():
    with pytest.raises(RuntimeError, match=r"^\[ops\] wait_tensor on the tensor at .*: no "
                                           r"offload or reload into it is in flight"):
        ops.wait_tensor(torch.randn(4))


def test_second_wait_is_refused():
    x = torch.randn(16)
    host = ops.wait_tensor(ops.offload(x), keepalive=x)
    with pytest.raises(RuntimeError, match=r"no offload or reload into it is in flight"):
        ops.wait_tensor(host, keepalive=x)


# ---- torch.compile ----------------------------------------------------------------


def _with_offload(x):
    y = x * 2 + 1
    host = torch.ops.spillway.offload(y)
    host = torch.ops.spillway.wait_tensor(host, y)
    z = torch.ops.spillway.reload(host, y.device)
    z = torch.ops.spillway.wait_tensor(z, host)
    return torch.relu(z) * 0.5 - y


def _without_offload(x):
    y = x * 2 + 1
    return torch.relu(y) * 0.5 - y


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_graph_with_the_ops_is_bit_identical(backend, slow_copies):
    torch._dynamo.reset()
    x = _random((32, 48), torch.float32)
    compiled = torch.compile(_with_offload, backend=backend, fullgraph=True)
    for _ in range(3):
        out = compiled(x)
        assert torch.equal(out, _without_offload(x))
        assert torch.equal(out, _with_offload(x))
        assert ops.pending_waits() == 0


def _capture_backend(graphs):
    from torch._dynamo.backends.common import aot_autograd

    def compiler(gm, _example_inputs):
        graphs.append(gm)
        return gm.forward

    return aot_autograd(fw_compiler=compiler)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_functionalized_graph_keeps_each_op_in_order():
    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(_with_offload, backend=_capture_backend(graphs), fullgraph=True)
    x = _random((8, 8), torch.float32)
    assert torch.equal(compiled(x), _without_offload(x))
    (gm,) = graphs
    order = [t for t in _targets(gm) if getattr(t, "namespace", None) == "spillway"]
    sp = torch.ops.spillway
    assert order == [sp.offload.default, sp.wait_tensor.default, sp.reload.default,
                     sp.wait_tensor.default]


def test_unused_wait_survives_dead_code_elimination():
    def fn(x):
        y = x + 1
        host = torch.ops.spillway.offload(y)
        torch.ops.spillway.wait_tensor(host, y)  # output unused
        return y * 3

    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(fn, backend=_capture_backend(graphs), fullgraph=True)
    x = _random((8, 8), torch.float32)
    assert torch.equal(compiled(x), fn(x))
    assert torch.ops.spillway.wait_tensor.default in _targets(graphs[0])
    assert ops.pending_waits() == 0
    torch._dynamo.reset()
    assert torch.equal(torch.compile(fn, backend="inductor")(x), fn(x))
    assert ops.pending_waits() == 0


def test_dynamic_shapes_trace_without_specialising():
    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(_with_offload, backend=_capture_backend(graphs), dynamic=True)
    for rows in (8, 24, 40):
        x = _random((rows, 16), torch.float32, seed=rows)
        assert torch.equal(compiled(x), _without_offload(x))
    assert len(graphs) == 1, "one graph serves every size"


# ---- opcheck ----------------------------------------------------------------------


def test_opcheck_offload():
    # Not test_aot_dispatch_dynamic: it compares offload's output before any
    # wait, when the D2H may still be writing it (the op's contract: readable
    # after wait_tensor). The compile tests above cover aot_autograd.
    torch.library.opcheck(torch.ops.spillway.offload.default, (_random((4, 5), torch.float32),),
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))


# opcheck runs an op on copies of its sample inputs. A reload or a wait finds its
# transfer by the identity of the tensor it gets (as PyTorch's ao:: ops do), so
# on a copy it rightly refuses; for those two ops only the autograd
# registration check applies, and the fake-kernel and schema properties are
# checked on the real tensors below.


@pytest.mark.parametrize("op_name", ["reload", "wait_tensor"])
def test_opcheck_autograd_registration(op_name):
    x = _random((4, 5), torch.float32)
    host = ops.offload(x)
    if op_name == "reload":
        args = (ops.wait_tensor(host), torch.device("cpu"))
    else:
        args = (host, x)
    torch.library.opcheck(getattr(torch.ops.spillway, op_name).default, args,
                          test_utils="test_autograd_registration")


def _meta(t):
    return (t.shape, t.stride(), t.dtype, t.device, t.storage_offset())


@pytest.mark.parametrize("shape", [(), (5,), (3, 1, 7)], ids=str)
def test_fake_kernels_agree_with_the_real_ones(shape):
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = _random(shape, torch.bfloat16)
    host = ops.offload(x)
    waited_host = ops.wait_tensor(host, keepalive=x)
    y = ops.reload(waited_host, "cpu")
    waited_y = ops.wait_tensor(y, keepalive=waited_host)
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        fake_host = torch.ops.spillway.offload(fx)
        fake_waited_host = torch.ops.spillway.wait_tensor(fake_host, fx)
        fake_y = torch.ops.spillway.reload(fake_waited_host, torch.device("cpu"))
        fake_waited_y = torch.ops.spillway.wait_tensor(fake_y, fake_waited_host)
    for real, fake in [(host, fake_host), (waited_host, fake_waited_host), (y, fake_y),
                       (waited_y, fake_waited_y)]:
        assert _meta(real) == _meta(fake)
    # The schemas' aliasing is the real one: a wait's output shares its input's
    # storage, offload and reload outputs share nothing.
    assert waited_host.untyped_storage().data_ptr() == host.untyped_storage().data_ptr()
    assert waited_y.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    assert len({x.untyped_storage().data_ptr(), host.untyped_storage().data_ptr(),
                y.untyped_storage().data_ptr()}) == (3 if x.numel() else 1)


# ---- CUDA -------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and ops.cuda_built()),
    reason="needs a CUDA device and spillway._C built against a CUDA torch")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_cuda_round_trip_is_bit_exact(dtype):
    x = _random((1024, 1031), dtype, device="cuda")
    host, y = _round_trip(x)
    assert host.device.type == "cpu" and host.is_pinned()
    assert y.device == x.device
    assert torch.equal(_bytes(host), _bytes(x))
    assert torch.equal(y, x)


@needs_cuda
def test_cuda_ops_follow_the_current_stream():
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x = torch.randn(4096, 1024, device="cuda")
        x.mul_(3)  # still running when offload is called
        host, y = _round_trip(x)
        z = y + 0
    stream.synchronize()
    assert torch.equal(z, x)


@needs_cuda
def test_cuda_compiled_graph_is_bit_identical():
    torch._dynamo.reset()
    x = _random((64, 96), torch.float32, device="cuda")
    compiled = torch.compile(_with_offload, backend="inductor", fullgraph=True)
    assert torch.equal(compiled(x), _without_offload(x))
