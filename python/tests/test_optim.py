"""spillway.optim.HostAdamW: AdamW with its state on the host.

On CPU (CI) the pipeline runs with plain copies, and each step must equal the same host
update applied to a resident twin by hand: parameters, moments and gradients
torch.equal after every step, in every mode (step_in_backward, free_grads, parameter
groups, maximize, weight decay off). The bitwise promise against the GPU's
AdamW(fused=True) is the probe's and the CUDA tests' (scripts/device-check).
"""

from __future__ import annotations

import copy
import os
import statistics

import pytest
import torch

from spillway import ops
from spillway.optim import ARITHMETICS, HostAdamW, probe_adamw
from spillway.optim._probe import device_powers, host_update, powers
from _models import deterministic_cuda, tiny_llama

needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and ops.cuda_built()),
                                reason="needs CUDA (runs in scripts/device-check)")


def _groups(model, lrs=(3e-3, 1e-3), wds=(0.1, 0.0)):
    """Two groups: the embeddings and norms apart from the rest (as recipes do)."""
    first, second = [], []
    for name, p in model.named_parameters():
        (first if "embed" in name or "norm" in name else second).append(p)
    return [dict(params=first, lr=lrs[0], weight_decay=wds[0]),
            dict(params=second, lr=lrs[1], weight_decay=wds[1])]


class _Reference:
    """The host update applied by hand to a resident model after each backward."""

    def __init__(self, model, groups, arithmetic, betas=(0.9, 0.999), eps=1e-8,
                 maximize=False):
        self.model, self.arithmetic = model, arithmetic
        self.groups = groups
        self.betas, self.eps, self.maximize = betas, eps, maximize
        self.state = {p: (torch.zeros_like(p), torch.zeros_like(p))
                      for g in groups for p in g["params"]}
        self.steps = 0

    def step(self):
        self.steps += 1
        for g in self.groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                m, v = self.state[p]
                host_update(self.arithmetic, p.data, p.grad, m, v, lr=g["lr"], betas=self.betas,
                            eps=self.eps, weight_decay=g["weight_decay"],
                            maximize=self.maximize, step=float(self.steps),
                            device=torch.device("cpu"), threads=1)


def _one_group_pair(seed: int, arithmetic: str):
    """A tiny Llama with a HostAdamW of one group (1e-3, decay 1e-2), and its twin with
    the same update applied by hand."""
    model, ids = tiny_llama(seed)
    twin = copy.deepcopy(model)
    opt = HostAdamW(model.parameters(), arithmetic=arithmetic, threads=1)
    ref = _Reference(twin, [dict(params=list(twin.parameters()), lr=1e-3, weight_decay=1e-2)],
                     arithmetic)
    return model, ids, twin, opt, ref


def _step_both(model, twin, opt, ref, ids, backwards: int = 1):
    """`backwards` backward calls on each model, one step of each optimizer; then the
    parameters must be equal."""
    for _ in range(backwards):
        model(ids, labels=ids).loss.backward()
        twin(ids, labels=ids).loss.backward()
    opt.step()
    ref.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def _twin_groups(groups, model, twin):
    index = {id(p): n for n, p in model.named_parameters()}
    params = dict(twin.named_parameters())
    return [dict(g, params=[params[index[id(p)]] for p in g["params"]]) for g in groups]


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize("mode", ["at-step", "in-backward", "in-backward-free-grads",
                                  "free-grads", "maximize"])
def test_each_step_equals_the_update_applied_by_hand(arithmetic, mode):
    model, ids = tiny_llama(3)
    twin = copy.deepcopy(model)
    groups = _groups(model)
    maximize = mode == "maximize"
    opt = HostAdamW(groups, arithmetic=arithmetic, threads=2, maximize=maximize,
                    step_in_backward="in-backward" in mode, free_grads="free-grads" in mode)
    ref = _Reference(twin, _twin_groups(groups, model, twin), arithmetic, maximize=maximize)
    for step in range(3):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        ref_loss = twin(ids, labels=ids).loss
        ref_loss.backward()
        ref.step()
        assert torch.equal(loss, ref_loss), step
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p, q), (step, name)
            assert torch.equal(opt.host_grad(p), q.grad), (step, name)
            assert (p.grad is None) == ("free-grads" in mode), (step, name)
            m, v = ref.state[q]
            assert torch.equal(opt.state[p]["exp_avg"], m), (step, name)
            assert torch.equal(opt.state[p]["exp_avg_sq"], v), (step, name)
            assert float(opt.state[p]["step"]) == step + 1
        opt.zero_grad()
        twin.zero_grad()
    opt.close()


def test_a_parameter_changed_by_the_user_is_taken_again_from_the_device():
    model, ids, twin, opt, ref = _one_group_pair(4, "cuda-fused-float")
    for step in range(3):
        if step == 1:  # the user halves a weight, and loads another, between steps
            with torch.no_grad():
                model.model.layers[0].mlp.up_proj.weight.mul_(0.5)
                twin.model.layers[0].mlp.up_proj.weight.mul_(0.5)
            state = {k: v * 0.25 for k, v in model.lm_head.state_dict().items()}
            model.lm_head.load_state_dict(state)
            twin.lm_head.load_state_dict(state)
        _step_both(model, twin, opt, ref, ids)
        opt.zero_grad()
        twin.zero_grad()


def test_gradients_accumulate_across_backward_calls_unless_consumed_early():
    model, ids, twin, opt, ref = _one_group_pair(5, "cuda-fused-double")
    _step_both(model, twin, opt, ref, ids, backwards=2)  # two micro-batches per step

    eager = HostAdamW(model.parameters(), arithmetic="cuda-fused-double", threads=1,
                      step_in_backward=True)
    opt.close()
    model(ids, labels=ids).loss.backward()
    with pytest.raises(RuntimeError, match="second backward"):
        model(ids, labels=ids).loss.backward()
    eager.close()


def test_a_torch_adamw_state_dict_loads_onto_the_host_and_training_continues():
    model, ids = tiny_llama(6)
    twin = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    model(ids, labels=ids).loss.backward()
    torch_opt.step()
    twin.load_state_dict(model.state_dict())
    saved = torch_opt.state_dict()
    model.zero_grad()

    opt = HostAdamW(model.parameters(), arithmetic="cuda-fused-float", threads=1)
    opt.load_state_dict(saved)
    ref = _Reference(twin, [dict(params=list(twin.parameters()), lr=1e-3, weight_decay=1e-2)],
                     "cuda-fused-float")
    for q, p in zip(twin.parameters(), model.parameters()):
        ref.state[q] = (torch_opt.state[p]["exp_avg"].clone(),
                        torch_opt.state[p]["exp_avg_sq"].clone())
    ref.steps = 1
    _step_both(model, twin, opt, ref, ids)
    for p in model.parameters():
        assert opt.state[p]["exp_avg"].device.type == "cpu"
        assert float(opt.state[p]["step"]) == 2


def test_under_spillway_trace_it_refuses_to_update_behind_the_traces_back():
    import spillway.trace
    model, ids = tiny_llama(10)
    opt = HostAdamW(model.parameters(), arithmetic="cuda-fused-float", threads=1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"HostAdamW ran under spillway.trace \(Recorder\)"):
        with spillway.trace.record(model, opt):
            model(ids, labels=ids).loss.backward()
    for p, q in zip(model.parameters(), before):  # nothing was updated
        assert torch.equal(p, q)
    opt.close()


def test_a_dropped_optimizer_leaves_no_hook_behind():
    import gc
    import weakref
    model, ids = tiny_llama(11)
    opt = HostAdamW(model.parameters(), arithmetic="cuda-fused-float", threads=1)
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert gone() is None  # the hooks did not keep it alive
    model(ids, labels=ids).loss.backward()  # and nothing fires on its behalf
    again = HostAdamW(model.parameters(), arithmetic="cuda-fused-float", threads=1)
    model(ids, labels=ids).loss.backward()
    again.step()
    assert all(float(again.state[p]["step"]) == 1 for p in model.parameters())
    again.close()


def test_bad_arguments_are_refused_with_their_name():
    model, _ = tiny_llama(7)
    params = list(model.parameters())
    for kwargs, match in [(dict(lr=-1), "lr"), (dict(lr=float("nan")), "lr"),
                          (dict(betas=(0.9, 1.0)), "betas"), (dict(eps=-1e-8), "eps"),
                          (dict(weight_decay=-0.1), "weight_decay"),
                          (dict(threads=0), "threads"), (dict(arithmetic="exact"), "arithmetic")]:
        with pytest.raises(ValueError, match=match):
            HostAdamW(params, **{"arithmetic": "cuda-fused-float", **kwargs})
    with pytest.raises(ValueError, match="float32"):
        HostAdamW([torch.zeros(3, dtype=torch.float16, requires_grad=True)],
                  arithmetic="cuda-fused-float")
    with pytest.raises(ValueError, match="does not require grad"):
        HostAdamW([torch.zeros(3)], arithmetic="cuda-fused-float")
    with pytest.raises(ValueError, match="no parameters|empty parameter list"):
        HostAdamW([], arithmetic="cuda-fused-float")
    with pytest.raises(ValueError, match="float32"):
        torch.ops.spillway.adamw_update_(torch.zeros(4, dtype=torch.float64), torch.zeros(4),
                                         torch.zeros(4), torch.zeros(4), 1e-3, 0.9, 0.999, 1e-8,
                                         0.0, False, 0.9, 0.999, 0, 1)


def test_the_host_thread_count_follows_spillway_host_threads(monkeypatch):
    from spillway.optim._probe import host_threads
    monkeypatch.setenv("SPILLWAY_HOST_THREADS", "3")
    assert host_threads() == 3
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv("SPILLWAY_HOST_THREADS", bad)
        with pytest.raises(ValueError, match="SPILLWAY_HOST_THREADS"):
            host_threads()
    monkeypatch.delenv("SPILLWAY_HOST_THREADS")
    assert host_threads() >= 1


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
def test_powers_made_a_block_of_steps_at_a_time_are_those_of_each_step(arithmetic):
    """device_powers makes 1024 steps' bias-correction powers per round trip to the
    device (a lone one waited 200 ms behind T3's offloads): the same bits as one step's,
    across block boundaries, far steps and a step that is not whole."""
    for step in (0, 1, 2, 1023, 1024, 1025, 2 ** 20 + 5, 7.5):
        assert device_powers(arithmetic, 0.9, 0.999, step, torch.device("cpu")) == \
            powers(arithmetic, 0.9, 0.999, step, torch.device("cpu")), step


def test_the_probe_names_where_each_form_differs_from_the_devices_optimizer():
    found = probe_adamw("cpu")
    assert set(found) == {"arithmetic", "mismatch"}
    assert set(found["mismatch"]) | {found["arithmetic"]} >= set(ARITHMETICS)
    if found["arithmetic"] is None:
        # torch's CPU AdamW(fused=True) is neither of the CUDA kernel's forms: the
        # default refuses with the mismatch named, rather than promise equality.
        model, _ = tiny_llama(8)
        with pytest.raises(ValueError, match="no host form reproduces"):
            HostAdamW(model.parameters())
    with pytest.raises(ValueError, match="lr"):
        probe_adamw("cpu", lr=-1)


@needs_cuda
@pytest.mark.parametrize("mode", ["at-step", "in-backward-free-grads"])
def test_cuda_host_adamw_equals_fused_adamw_on_the_gpu(mode):
    found = probe_adamw("cuda", lr=1e-3, weight_decay=1e-2)
    assert found["arithmetic"] is not None, found["mismatch"]
    with deterministic_cuda():
        model, ids = tiny_llama(9, device="cuda", layers=3)
        twin = copy.deepcopy(model)
        control = copy.deepcopy(model)
        opt = HostAdamW(model.parameters(), lr=1e-3, weight_decay=1e-2,
                        step_in_backward=mode != "at-step", free_grads=mode != "at-step")
        ref = torch.optim.AdamW(twin.parameters(), lr=1e-3, weight_decay=1e-2, fused=True)
        ctl = torch.optim.AdamW(control.parameters(), lr=1e-3, weight_decay=1e-2, fused=True)
        for step in range(3):
            losses = []
            for m, o in ((model, opt), (twin, ref), (control, ctl)):
                loss = m(ids, labels=ids).loss
                loss.backward()
                o.step()
                losses.append(loss)
            assert torch.equal(losses[1], losses[2]), "the reference does not reproduce itself"
            assert torch.equal(losses[0], losses[1]), step
            for (name, p), q in zip(model.named_parameters(), twin.parameters()):
                assert torch.equal(opt.host_grad(p), q.grad.cpu()), (step, name)
                assert torch.equal(p, q), (step, name)
                assert torch.equal(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"].cpu())
                assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"].cpu())
            for o in (opt, ref, ctl):
                o.zero_grad()
        opt.close()


def test_the_host_adamw_benchmark_runs_under_load(tmp_path):
    """bench/torch/host_adamw.py --load, small: every row a positive speed, the busy
    thread's rows there (the copies' only with CUDA), and the load reported."""
    import json
    import pathlib
    import subprocess
    import sys
    repo = pathlib.Path(__file__).resolve().parents[2]
    out = tmp_path / "host_adamw.json"
    run = subprocess.run([sys.executable, str(repo / "bench/torch/host_adamw.py"), "--elements",
                          "64K", "--repeat", "1", "--load", "--json", str(out)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(repo / "python")})
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert all(r["gb_per_s"] > 0 for r in rows)
    busy = [r for r in rows if r["method"].endswith("under busy thread")]
    assert busy and "k ops/s" in busy[-1]["load"]
    copies = [r for r in rows if "under copies" in r["method"]]
    assert bool(copies) == torch.cuda.is_available()


def test_the_host_update_speed_while_copying_needs_and_uses_the_gpu():
    """measure_host_adamw_gbs(while_copying=True): the update timed while the GPU copies
    both ways (as in a replayed step); without CUDA a clear error."""
    from spillway.optim import measure_host_adamw_gbs
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"^\[optim\] copies between host and GPU need CUDA"):
            measure_host_adamw_gbs(elements=1 << 16, while_copying=True)
        return
    assert measure_host_adamw_gbs(elements=1 << 22, while_copying=True) > 0


def test_the_host_update_speed_is_the_median_of_its_samples_over_fresh_arrays():
    """measure_host_adamw(): `repeat` timed updates in each of `rounds` rounds (Note
    [Sampling the host update's speed]), the median of them the speed a plan uses; bad
    counts are refused by name."""
    from spillway.optim import measure_host_adamw, measure_host_adamw_gbs
    out = measure_host_adamw(elements=1 << 16, rounds=3, repeat=2, threads=1)
    assert len(out["samples_gbs"]) == 6 and all(g > 0 for g in out["samples_gbs"])
    assert out["gbs"] == statistics.median(out["samples_gbs"])
    assert out["best_gbs"] == max(out["samples_gbs"])
    assert (out["elements"], out["threads"]) == (1 << 16, 1)
    assert "copied_gbs" not in out
    assert measure_host_adamw_gbs(elements=1 << 16, rounds=1, repeat=1) > 0
    for bad in ({"rounds": 0}, {"repeat": 0}, {"elements": 0}):
        with pytest.raises(ValueError, match=r"^\[optim\] elements, rounds and repeat must be >= 1"):
            measure_host_adamw(**bad)
