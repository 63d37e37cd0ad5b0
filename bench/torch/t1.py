#!/usr/bin/env python3
"""Workload T1 of BENCHMARKS.md: training step (forward + backward, no
optimizer) of a Llama-style model with its saved activations managed by each
method, side by side in one run.

    python3 bench/torch/t1.py --method none --method spillway-eager ... \
        --json t1.json --markdown t1.md

Every method runs in its own subprocess (a fresh CUDA context and caching
allocator, so one method's peak cannot leak into another's), on the same
model shape and the same random input. Per method: median step time over
--steps measured steps after --warmup steps, and the peak memory allocated
during a measured step above what was allocated when it started (weights and
the accumulated gradients: the "activation memory above resident weights" of
BENCHMARKS.md). Methods:

  none                   eager, nothing
  ckpt-full              eager, every decoder layer under torch.utils.checkpoint
                         (non-reentrant), HF's gradient_checkpointing_enable
  ckpt:layers=0-3        eager, only the named decoder layers checkpointed
  ckpt:k=4               eager, the first k decoder layers checkpointed (k of 16; a
                         k or layer beyond the model's layers is an error)
  ckpt-selective         eager, every decoder layer under selective checkpointing:
                         matmul and attention outputs saved, the rest recomputed
  save-on-cpu            eager, torch.autograd.graph.save_on_cpu(pin_memory=True)
  torchtune-offload      eager, torchtune's OffloadActivations as its recipes apply it
                         (get_act_offloading_ctx_manager: use_streams=True, pinned
                         memory, a 5-tensor forward stash, tensors of 1 KiB and up;
                         the output head's activations stay on the GPU under NoOpManager,
                         here HF's lm_head); the context wraps the model's call, the loss
                         is computed after it. CUDA only. torchtune comes from
                         SPILLWAY_T1_TORCHTUNE_DIR (a `pip install --no-deps --target`
                         directory of its wheel; torchao is not needed) or the import
                         path; the results record its version.
  torchtune-offload-ckpt the same with every decoder layer checkpointed as in ckpt-full
                         (the combination torchtune's recipes require: they refuse
                         offloading without checkpointing)
  spillway-eager         eager, spillway.offload_activations; options
                         after a colon: spillway-eager:scope=*,layers=0-2,lag=8,prefetch=4
                         (0-2: a range, a+b: a list, none: None)
  spillway-trace:budget=B  eager, trace and replay (spillway.trace): step 1 plain, step 2
                         recorded and planned for B (a fraction of the recorded step's
                         simulated peak, e.g. 0.9, or 28GiB), replayed from step 3
                         (needs --warmup >= 3); min_bytes=N as for the planner
  spillway-eager-budget  eager, spillway.offload_activations(memory_budget=...): the
                         budget after the colon is activation memory above the
                         resident weights and gradients, as the table reports it
                         (spillway-eager-budget:19GiB; the planner gets weights +
                         gradients + 19 GiB), or a fraction of the no-offload peak
                         (spillway-eager-budget:0.5); more options after it
                         (spillway-eager-budget:7.1GiB,lag=2,prefetch=2;
                         by_position=0|1 sets Note [Parts by position] for the run;
                         0 also turns off Note [Recipes by position], which needs it;
                         windows=0|1 Note [Catching in a window]; lean=0|1 Note [A
                         leaner host path]; fast=0|1 Note [Kept saves in C++];
                         fast_offload=0|1 Note [Offloaded saves by position]
                         (with fast=1);
                         lane=0|1 Note [The host lane]; replan=0|1 Note [Replanning
                         on the host's speed]: planned again at the fifth step (the
                         third planned one) from the fourth's host times; --warmup >= 5
                         measures the plan it takes from its second step).
                         The first two warm-up steps profile, the plan applies from the
                         third (needs --warmup >= 3). The results carry the plan's
                         forecast beside the measurement (a table of its own).
  compiled               torch.compile (inductor), nothing; options after a colon set
                         torch._functorch.config flags for this method, e.g.
                         compiled:ban_recompute_materialized_backward=0
  compiled-ckpt-full     torch.compile over the checkpointed layers
  compiled-amb:budget=B  torch.compile with torch._functorch.config.activation_memory_budget = B
                         (the min-cut partitioner's own memory budget, 0..1)
  compiled-pt-offload    torch.compile with PyTorch's own activation offload
                         (torch._functorch.config.enable_activation_offloading,
                         separate stream, sink wait, reload prefetch)
  spillway-compiled      spillway.compile; options after a colon, e.g.
                         spillway-compiled:memory_budget=60%  (the budget planner; the
                         plan's forecast is recorded beside the measurement); a
                         budget in bytes is the whole step's, the gradients t1 keeps
                         from step to step included (grads_kept=True); with a
                         budget, offload_materialised=True unless given
                         (offload_materialised=0: bit-exact where nothing is
                         recomputed); recompute_far_apart=1: compile's option of
                         that name (closer to fp32, not bit-exact)

--flat-steps N (or the method option flat=N) runs N more steps for spillway
methods and records, per step,
the memory allocated at the step's start, its peak, and the pinned pool's
bytes, to show both stay flat.

--fp32-error runs one more step of each method, its gradients set to None
first, and compares its loss and gradients with the same weights in fp32 run
eagerly with nothing saved or recomputed (issue 10: a plan that recomputes is
judged by this error beside activation_memory_budget's at the same memory).
One batch's loss error is one draw of bf16 rounding, its sign as likely as
not, so --fp32-batches N (default 8) runs the method's step on N - 1 more
batches too and reports the mean absolute loss error over all N beside the
first batch's. The fp32 model and its activations take about twice the bf16
no-offload peak on T1, after the measured steps.

--profile DIR profiles one more step of each method with torch.profiler,
writes its Chrome trace to DIR/<method>.trace.json.gz and adds a summary to
the results: per CUDA stream the kernel and copy time, the compute stream's
busy and idle time over the step, and the kernels by name; the markdown then
compares each method's kernels with those of `compiled` (or `none`), so a
slowdown shows as extra or slower kernels (what fusion changed, copies
contending for memory bandwidth) or as idle compute time (waits).

--tiny runs a 2-layer toy shape (for a smoke test on any device, CPU included;
spillway then uses its fake backend, and peak memory is not measured on CPU).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time

T1 = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
          num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
          batch=4, seq=4096)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
            batch=2, seq=32)
GIB = 1 << 30


def _parse_method(spec: str) -> tuple[str, dict]:
    name, _, rest = spec.partition(":")
    options: dict = {}
    for i, item in enumerate(filter(None, rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq and i == 0 and name == "spillway-eager-budget":
            options["budget"] = item  # spillway-eager-budget:19GiB
            continue
        if not eq:
            raise SystemExit(f"[t1] bad option '{item}' in method '{spec}': expected key=value")
        options[key] = _option_value(value)
    return name, options


def _option_value(value: str):
    """'3' -> 3, '0-2' -> [0, 1, 2], 'a+b' -> ['a', 'b'], 'none' -> None, else the string."""
    if value.lower() == "none":
        return None
    if "+" in value:
        return [_option_value(v) for v in value.split("+")]
    lo, dash, hi = value.partition("-")
    if dash and lo.isdigit() and hi.isdigit():
        return list(range(int(lo), int(hi) + 1))
    try:
        return int(value)
    except ValueError:
        return value


def _build(shape: dict, device: str, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"], vocab_size=shape["vocab_size"],
        max_position_embeddings=shape["seq"], attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.train()
    return model, _ids(shape, device, seed=1)


def _ids(shape: dict, device: str, seed: int):
    """A batch of random token ids of T1's shape, drawn on the CPU from `seed`."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"]), generator=gen)
    return ids.to(device)


def _step_fn(name: str, options: dict, model, device: str):
    """Returns (step(ids) -> loss, after_step() -> dict of method stats)."""
    import torch

    def plain(ids):
        # No KV cache in training: with one, a checkpoint's recompute appends each
        # layer's keys again (HF's gradient_checkpointing_enable turns it off too;
        # selective checkpointing refuses the extra ops).
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    if name in ("ckpt-full", "compiled-ckpt-full"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if name == "ckpt":  # checkpoint the decoder layers options["layers"] names, or the first k
        from torch.utils.checkpoint import checkpoint
        chosen = options.get("layers", list(range(options.get("k", 0))))
        chosen = [chosen] if isinstance(chosen, int) else chosen
        count = len(model.model.layers)
        outside = [i for i in chosen if not 0 <= i < count]
        if outside:
            asked = f"k={options['k']}" if "layers" not in options else "layers"
            named = (f"layer {outside[0]}" if len(outside) == 1
                     else f"layers {outside[0]}-{outside[-1]}" if "layers" not in options
                     else "layers " + "+".join(map(str, outside)))
            raise SystemExit(f"[t1] ckpt: the model has {count} decoder layers (0-{count - 1}); "
                             f"{asked} asks for {named}")
        for i in chosen:
            layer = model.model.layers[i]
            layer.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(
                layer.forward)
        return plain, dict
    if name == "ckpt-selective":
        return _selective_checkpointing(model, plain), dict
    if name in ("none", "ckpt-full"):
        return plain, dict
    if name == "spillway-eager-budget":
        return _eager_budget(model, device, options, plain)
    if name == "spillway-trace":
        return _trace_replay(model, options, plain)
    if name in ("torchtune-offload", "torchtune-offload-ckpt"):
        if not device.startswith("cuda"):
            raise SystemExit("[t1] torchtune's OffloadActivations needs CUDA (its streams, and "
                             "copies back to 'cuda'); torchtune's recipes refuse other devices")
        if name == "torchtune-offload-ckpt":
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        return _torchtune_offload(model)
    if name == "save-on-cpu":
        def step(ids):
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                return plain(ids)
        return step, dict
    if name == "spillway-eager":
        from spillway.activations import eager

        def step(ids):
            with eager.offload_activations(model, device=device, **options) as ctx:
                loss = plain(ids)
            step.last = ctx
            return loss
        step.last = None
        return step, lambda: (step.last.stats() if step.last is not None else {})
    if name in ("compiled", "compiled-ckpt-full", "compiled-pt-offload", "compiled-amb"):
        import torch._functorch.config as fconfig
        if name == "compiled-amb":
            fconfig.activation_memory_budget = float(options["budget"])
        for key, value in options.items():  # compiled:ban_recompute_reductions=0, ...
            if key == "budget":
                continue
            if not hasattr(fconfig, key):
                raise SystemExit(f"t1: {name}: {key!r} is no torch._functorch.config flag")
            kind = type(getattr(fconfig, key))
            setattr(fconfig, key, str(value).lower() not in ("0", "false") if kind is bool
                    else kind(value))
        if name == "compiled-pt-offload":
            fconfig.enable_activation_offloading = True
            fconfig.activation_offload_separate_stream = True
            fconfig.activation_offload_sink_wait = True
            fconfig.activation_reload_prefetch = True
        compiled = torch.compile(model)
        # use_cache=False as in plain(): with the cache, the compiled backward gets a
        # zero gradient for each returned key and value (32 x 64 MiB on T1) and
        # the joint graph peaks 1.9 GiB higher (the budget planner's floor: 4 GiB).
        return (lambda ids: compiled(input_ids=ids, labels=ids, use_cache=False).loss), dict
    if name == "spillway-compiled":
        from spillway.activations import compiled as sc
        from spillway._budget import parse_memory_budget
        if ("memory_budget" in options and "grads_kept" not in options and
                parse_memory_budget(options["memory_budget"])[0] == "bytes"):
            # t1 never zeroes the gradients: the previous step's are held through
            # every step beside the graph's memory; a byte budget is the whole step's.
            options["grads_kept"] = True
        if "memory_budget" in options:
            # The curve of the README: the fastest mode, not bit-exact (compile's docstring);
            # offload_materialised=0 gives the bit-exact one.
            options["offload_materialised"] = bool(options.get("offload_materialised", True))
        if "recompute_far_apart" in options:
            options["recompute_far_apart"] = bool(options["recompute_far_apart"])
        fn = sc.compile(model, **options)
        def plan_stats():
            plans = sc.last_plans()
            budgets = [p for p in plans if p.budget is not None]
            return {"graphs": len(plans),
                    "forecast": [p.forecast() for p in budgets],
                    "decisions": [{d: sum(c["decision"] == d for c in p.budget["choices"])
                                   for d in ("keep", "offload", "recompute")} for p in budgets],
                    "departures": [p.departures for p in budgets],
                    # What each forward saves for backward, largest first: where
                    # the measured peak departs from the forecast.
                    "saved_bytes": [sum(p.forward_output_bytes) for p in budgets],
                    "saved": [sorted(zip(p.forward_outputs, p.forward_output_bytes),
                                     key=lambda item: -item[1])[:200] for p in budgets],
                    "bytes_offloaded": sum(p.bytes_offloaded for p in plans),
                    "chosen": [name for p in plans for name in p.chosen][:64],
                    "forward_ops": [dict(p.forward_ops) for p in plans],
                    "backward_ops": [dict(p.backward_ops) for p in plans]}
        return (lambda ids: fn(input_ids=ids, labels=ids, use_cache=False).loss), plan_stats
    raise SystemExit(f"[t1] unknown method '{name}'")


def _trace_replay(model, options, plain):
    """spillway-trace: the first call plain, the second recorded (spillway.trace.record),
    planned for options["budget"] (a fraction of the recorded step's simulated peak, or
    bytes as text) and replayed from the third. The driver calls backward after step()
    returns, so a step's context stays open until the next call: each replayed (and
    the recorded) step is the forward, the backward and what the driver does between."""
    from spillway.trace import plan, replay
    from spillway.trace._recorder import Recorder

    state = {"calls": 0, "open": None, "recorder": None, "replay": None, "plan": None, "last": None}
    budget = options.get("budget", 0.9)
    try:
        budget = float(budget) if float(budget) <= 1 else budget  # a fraction
    except ValueError:
        pass  # bytes as text: 28GiB
    min_bytes = int(options.get("min_bytes", 1 << 20))

    def step(ids):
        if state["open"] is not None:
            state["open"].__exit__(None, None, None)
            state["open"] = None
        if state["recorder"] is not None:  # the recorded step ended with this call
            recorder, state["recorder"] = state["recorder"], None
            t0 = time.perf_counter()
            recorder.__exit__(None, None, None)
            t1 = time.perf_counter()
            state["plan"] = plan(recorder.trace, budget, min_bytes=min_bytes)
            t2 = time.perf_counter()
            state["replay"] = replay(recorder.trace, state["plan"])
            state["replay"].__enter__()
            print(f"[t1] trace: {len(recorder.trace.graph['nodes'])} nodes closed in {t1 - t0:.1f} s, "
                  f"planned in {t2 - t1:.1f} s ({len(state['plan']['gaps'])} gaps), replay "
                  f"ready in {time.perf_counter() - t2:.1f} s", file=sys.stderr, flush=True)
        state["calls"] += 1
        now = time.perf_counter()
        if state["last"] is not None:  # the previous call, its backward included
            print(f"[t1] trace: call {state['calls'] - 1} took {now - state['last']:.2f} s",
                  file=sys.stderr, flush=True)
        state["last"] = now
        if state["replay"] is not None:
            state["open"] = state["replay"].step()
            state["open"].__enter__()
        elif state["calls"] == 2:
            state["recorder"] = Recorder(model)
            state["recorder"].__enter__()
        return plain(ids)

    def stats():
        if state["plan"] is None:
            return {}
        f, u = state["plan"]["forecast"], state["plan"]["unplanned"]
        return {"replay": state["replay"].stats(), "budget_bytes": state["plan"]["budget_bytes"],
                "forecast_step_ms": f["step_ms"], "forecast_peak_gib": f["peak_bytes"] / GIB,
                "unplanned_step_ms": u["step_ms"], "unplanned_peak_gib": u["peak_bytes"] / GIB,
                "gaps": len(state["plan"]["gaps"]), "host_gib": f["host_bytes"] / GIB}
    return step, stats


def _selective_checkpointing(model, plain):
    """Every decoder layer checkpointed, saving the outputs of matmuls and attention."""
    import torch
    from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                        create_selective_checkpoint_contexts)

    aten = torch.ops.aten
    saved = {aten.mm.default, aten.addmm.default, aten.bmm.default,
             aten._scaled_dot_product_flash_attention.default,
             aten._scaled_dot_product_efficient_attention.default,
             aten._scaled_dot_product_cudnn_attention.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    for layer in model.model.layers:
        layer.forward = (lambda f: lambda *a, **k: checkpoint(
            f, *a, use_reentrant=False, context_fn=context_fn, **k))(layer.forward)
    return plain


@functools.cache
def _load_torchtune_offloading():
    """torchtune's training/_activation_offloading.py, loaded by its path, and where it
    came from: ({"torchtune": version, "torchtune_dir": dir}, module).

    torchtune comes from SPILLWAY_T1_TORCHTUNE_DIR (a directory its wheel was installed
    into with `pip install --no-deps --target DIR`) or else from the import path. The
    file is loaded by its path because `import torchtune` runs the package's
    __init__, which requires torchao and imports every model and dataset. The file
    itself needs only torchtune.modules.TiedLinear and torchtune.utils.get_logger,
    which are loaded from their own files into empty package modules, and torchao
    (its version and NF4Tensor, read only when offloading an NF4 tensor fails: t1 has
    none), which is stood in for when it is not installed.
    """
    import importlib.metadata
    import importlib.util
    import types

    import torch

    root = os.environ.get("SPILLWAY_T1_TORCHTUNE_DIR")
    if not root:
        spec = importlib.util.find_spec("torchtune")
        if spec is None or spec.origin is None:
            raise SystemExit("[t1] torchtune methods need torchtune 0.6.1: install its wheel "
                             "with `python3 -m pip install --no-deps --target DIR "
                             "torchtune-0.6.1-py3-none-any.whl` and set "
                             "SPILLWAY_T1_TORCHTUNE_DIR=DIR, or make torchtune importable")
        root = os.path.dirname(os.path.dirname(spec.origin))
    package = os.path.join(root, "torchtune")
    path = os.path.join(package, "training", "_activation_offloading.py")
    if not os.path.isfile(path):
        raise SystemExit(f"[t1] {root} holds no torchtune/training/_activation_offloading.py "
                         "(SPILLWAY_T1_TORCHTUNE_DIR names the directory given to "
                         "`pip install --no-deps --target`)")
    version = next((d.version for d in importlib.metadata.distributions(name="torchtune",
                                                                        path=[root])), "unknown")

    def empty_package(name: str) -> types.ModuleType:
        module = types.ModuleType(name)
        module.__path__ = [os.path.join(package, *name.split(".")[1:])]
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
        return module

    def from_file(name: str, file: str) -> types.ModuleType:
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    if importlib.util.find_spec("torchao") is None:
        torchao = types.ModuleType("torchao")
        torchao.__version__ = "0 (absent; t1 stands in)"
        nf4tensor = types.ModuleType("torchao.dtypes.nf4tensor")
        nf4tensor.NF4Tensor = type("NF4Tensor", (torch.Tensor,), {})  # no tensor of t1 is one
        torchao.dtypes = types.ModuleType("torchao.dtypes")
        torchao.dtypes.nf4tensor = nf4tensor
        sys.modules.update({"torchao": torchao, "torchao.dtypes": torchao.dtypes,
                            "torchao.dtypes.nf4tensor": nf4tensor})
    for name in ("torchtune", "torchtune.modules", "torchtune.utils", "torchtune.training"):
        empty_package(name)
    sys.modules["torchtune"].__version__ = version
    sys.modules["torchtune.modules"].TiedLinear = from_file(
        "torchtune.modules.tied_linear", os.path.join(package, "modules", "tied_linear.py")).TiedLinear
    sys.modules["torchtune.utils"].get_logger = from_file(
        "torchtune.utils._logging", os.path.join(package, "utils", "_logging.py")).get_logger
    module = from_file("torchtune.training._activation_offloading", path)
    return {"torchtune": version, "torchtune_dir": root}, module  # cached: loaded once


def _torchtune_offload(model):
    """torchtune's activation offloading as its recipes apply it (full_finetune_single_device,
    0.6.1): get_act_offloading_ctx_manager builds OffloadActivations() with its defaults
    (pinned memory, a second stream, up to 5 activations kept alive in forward, tensors
    of 1 KiB and up) and keeps the output head's activations on the GPU under NoOpManager;
    the context wraps the model's call, and the loss is computed outside it."""
    import types

    found, offloading = _load_torchtune_offloading()
    # The function finds the output head as `model.output` (torchtune's TransformerDecoder);
    # HF's LlamaForCausalLM calls it lm_head.
    ctx = offloading.get_act_offloading_ctx_manager(types.SimpleNamespace(output=model.lm_head),
                                                    enable_activation_offloading=True)
    found["offload"] = dict(use_streams=ctx.use_streams, use_pin_memory=ctx.use_pin_memory,
                            max_fwd_stash_size=ctx.max_fwd_stash_size,
                            min_offload_size=ctx.min_tensor_size_bytes)

    def step(ids):
        with ctx:
            logits = model(input_ids=ids, use_cache=False).logits
        # What LlamaForCausalLM.forward does with labels, outside the context as in the recipe.
        return model.loss_function(logits=logits, labels=ids, vocab_size=model.config.vocab_size)
    return step, lambda: dict(found)


def _budget_bytes(spec, model, device: str):
    """spillway-eager-budget's budget: a fraction as it is, or activation bytes above the
    resident weights and gradients turned into the planner's whole-step budget."""
    import torch

    from spillway.activations._eager_budget import parse_memory_budget

    text = str(spec)
    try:
        value = float(text) if "." in text and float(text) <= 1 else spec
    except ValueError:
        value = spec
    nbytes, fraction = parse_memory_budget(value)
    if fraction is not None:
        return fraction
    weights = (torch.cuda.memory_allocated() if device.startswith("cuda")
               else sum(p.nbytes for p in model.parameters()))
    grads = sum(p.nbytes for p in model.parameters() if p.requires_grad)  # t1 never zeroes them
    return weights + grads + nbytes


def _eager_budget(model, device: str, options: dict, plain):
    import torch

    from spillway.activations import _eager_budget, eager

    options = dict(options)
    if "budget" not in options:
        raise SystemExit("[t1] spillway-eager-budget needs a budget: "
                         "spillway-eager-budget:19GiB")
    budget = _budget_bytes(options.pop("budget"), model, device)
    # Options that set a module flag (this method's own subprocess: the flag is its alone).
    flags = {
        "by_position": (_eager_budget, "_PARTS_BY_POSITION"),  # Note [Parts by position]
        "windows": (_eager_budget, "_CATCH_IN_WINDOWS"),  # Note [Catching in a window]
        "lean": (eager, "_LEAN_HOST"),  # Note [A leaner host path]
        "fast": (_eager_budget, "_FAST_KEEP"),  # Note [Kept saves in C++]
        "fast_offload": (_eager_budget, "_FAST_OFFLOAD"),  # [Offloaded saves by position]
        "lane": (_eager_budget, "_HOST_LANE"),  # Note [The host lane], from the profile
        "replan": (_eager_budget, "_HOST_REPLAN"),  # [Replanning on the host's speed]
    }
    for option, (module, flag) in flags.items():
        if option in options:
            setattr(module, flag, bool(options.pop(option)))
    ctx = eager.offload_activations(model, memory_budget=budget, device=device, **options)

    def step(ids):
        if not step.warm:
            # The first warm-up step runs a plain step before the context's first
            # (profiling) step, so the profile times warm kernels and starts, like
            # every later step, with the gradients allocated: the steady state the
            # plan is for.
            plain(ids).backward()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            step.warm = True
        with ctx:
            return plain(ids)
    step.warm = False

    def stats():
        out = ctx.stats()
        out["budget"] = budget
        plan = ctx.plan
        if plan is not None:
            out["forecast"] = plan.forecast()
            out["calibration"] = plan.calibration
            out["prefetch"] = plan.prefetch
            # The measured profile the plan was made from, and the planner's input itself:
            # bench/torch/replay_eager_plan.py makes the plan again on a machine without
            # a GPU, exactly.
            out["profile"] = dataclasses.asdict(plan.profile)
            out["plan_graph"] = plan.graph
            out["planner_options"] = plan.planner_options
            out["planner_budget"] = plan.planner_budget_bytes
            calls = plan.profile.calls
            out["choices"] = [dict(block=c.block, saved=c.saved, cheap=c.cheap, linear=c.linear,
                                   input=c.input, lag=c.lag, saved_bytes=c.saved_bytes,
                                   cheap_bytes=c.cheap_bytes,
                                   cheap_ms=round(calls[c.call].cheap_ms, 3),
                                   linear_bytes=c.linear_bytes,
                                   linear_ms=round(calls[c.call].linear_ms, 3),
                                   forward_ms=round(c.forward_ms, 3),
                                   backward_ms=round(c.backward_ms, 3)) for c in plan.choices]
            mix = dict(collections.Counter(c.summary("-") for c in plan.choices))
            if plan.head == "offload":
                mix["head-offload"] = 1
            out["head"] = plan.head
            out["decision_mix"] = mix
        return out
    return step, stats


def _merged_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summarize_trace(path: str) -> dict:
    """Kernel and copy time per stream, the compute stream's idle time, kernels by name (us)."""
    import gzip

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy",
                                                                      "gpu_memset")]
    if not gpu:
        return {}
    streams: dict = {}
    for e in gpu:
        s = streams.setdefault(str(e.get("args", {}).get("stream", e.get("tid"))),
                               {"kernel_us": 0.0, "kernels": 0, "copy_us": 0.0, "copies": {},
                                "intervals": []})
        if e["cat"] == "kernel":
            s["kernel_us"] += e["dur"]
            s["kernels"] += 1
        else:
            kind = (e["name"].split(" ") + [""])[1] if e["cat"] == "gpu_memcpy" else "memset"
            s["copies"][kind] = s["copies"].get(kind, 0.0) + e["dur"]
            s["copy_us"] += e["dur"]
        s["intervals"].append((e["ts"], e["ts"] + e["dur"]))
    compute = max(streams, key=lambda k: streams[k]["kernel_us"])
    start = min(e["ts"] for e in gpu)
    span = max(e["ts"] + e["dur"] for e in gpu) - start
    busy = _merged_length(streams[compute]["intervals"])
    by_name: dict = {}
    for e in gpu:
        if e["cat"] == "kernel" and str(e.get("args", {}).get("stream", e.get("tid"))) == compute:
            entry = by_name.setdefault(e["name"][:90], [0, 0.0])
            entry[0] += 1
            entry[1] += e["dur"]
    for s in streams.values():
        del s["intervals"]
    return {"span_us": span, "compute_stream": compute, "compute_busy_us": busy,
            "compute_idle_us": span - busy, "streams": streams,
            "kernels_by_name": {k: [c, round(t, 1)] for k, (c, t) in
                                sorted(by_name.items(), key=lambda kv: -kv[1][1])}}


def _profile_step(one_step, out_dir: str, spec: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "".join(c if c.isalnum() or c in "-_." else "_" for c in spec)
                        + ".trace.json.gz")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        one_step()
    prof.export_chrome_trace(path)
    summary = summarize_trace(path)
    summary["trace"] = os.path.basename(path)
    return summary


def _pool_bytes(device: str) -> dict:
    try:
        from spillway import _C
    except ImportError:
        return {}
    key = "cuda:0" if device.startswith("cuda") else "cpu"
    return _C.pool_stats(key)


def _fp32_error(model, step, ids, shape: dict, device: str, sync, batches: int = 1) -> dict:
    """One more step of the method (its gradients set to None first) against the same
    weights in fp32, run eagerly with nothing saved or recomputed: the loss's absolute
    error, and the gradients' error norm over their norm, all parameters together
    (global) and the worst parameter (max). Then batches - 1 more steps on other
    batches (seeds 2, 3, ...), losses only: the mean absolute loss error over all."""
    import torch

    reference, _ = _build(shape, device, torch.float32)
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    # The buffers too, non-persistent ones included: model.to(bf16) rounded the
    # rotary embedding's inv_freq, and at T1's 4096 positions that alone moves the
    # angles by radians: against fp32 frequencies every bf16 method measured a
    # gradient error of 0.63, the same for all, which hid the methods' own rounding.
    with torch.no_grad():
        mine = dict(reference.named_buffers())
        for name, buffer in model.named_buffers():
            if buffer.is_floating_point():
                mine[name].copy_(buffer.float())
    want = reference(input_ids=ids, labels=ids, use_cache=False).loss
    want.backward()
    model.zero_grad(set_to_none=True)
    sync()
    got = step(ids)
    got.backward()
    sync()
    err2 = ref2 = 0.0
    worst = 0.0
    params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is None or params[name].grad is None:
            continue
        g, r = p.grad.float(), params[name].grad
        diff, norm = float((g - r).norm()) ** 2, float(r.norm()) ** 2
        err2, ref2 = err2 + diff, ref2 + norm
        if norm > 0:
            worst = max(worst, (diff / norm) ** 0.5)
    loss, loss_fp32 = float(got.detach().float()), float(want.detach())
    del params
    reference.zero_grad(set_to_none=True)
    signed = [loss - loss_fp32]
    for seed in range(2, batches + 1):
        other = _ids(shape, device, seed)
        with torch.no_grad():
            want = float(reference(input_ids=other, labels=other, use_cache=False).loss)
        model.zero_grad(set_to_none=True)
        got = step(other)
        got.backward()
        sync()
        signed.append(float(got.detach().float()) - want)
    out = dict(loss=loss, loss_fp32=loss_fp32, loss_abs_error=abs(loss - loss_fp32),
               grad_rel_error_global=(err2 / ref2) ** 0.5 if ref2 > 0 else 0.0,
               grad_rel_error_max=worst, batches=len(signed),
               loss_abs_error_mean=statistics.fmean(abs(e) for e in signed),
               loss_error_signed=signed)
    del reference
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def _dispatch_us() -> float:
    """The host's speed at what an eager step's launching thread does: microseconds per
    small torch op dispatched from Python on the CPU (median of 5 runs of 2000). Two
    H100 machines of one kind differed here by how long a warm-up took (v15: 2.8 against
    4.0 s for `none`), and an eager plan bound by its launching thread with them."""
    import torch

    a, b = torch.ones(8), torch.ones(8)
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(2000):
            torch.add(a, b)
        runs.append((time.perf_counter() - t0) / 2000 * 1e6)
    return statistics.median(runs)


def _cpu_now() -> int | None:
    """The core this process last ran on (/proc/self/stat's field 39; Linux), or None."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def _cpu_mhz(cpu: int | None) -> float | None:
    """That core's clock as /proc/cpuinfo reports it now, or None."""
    if cpu is None:
        return None
    try:
        with open("/proc/cpuinfo", encoding="ascii") as f:
            blocks = f.read().split("\n\n")
    except OSError:
        return None
    for block in blocks:
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        if fields.get("processor", "").strip() == str(cpu) and "cpu MHz" in fields:
            return round(float(fields["cpu MHz"]), 0)
    return None


def _cpu_list(text: str) -> set[int]:
    """--cpus: "0-3,8" -> {0, 1, 2, 3, 8}."""
    cpus = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _host_bound(forwards: list) -> dict:
    """How the measured steps' forward went on the host against the GPU: the host's
    time to issue it (model call to loss, no sync) and the GPU's time from the step's
    start to the end of the last kernel issued then (CUDA events). A forward whose host
    time is near its GPU time kept the GPU waiting on the thread that launches it (the
    GPU cannot finish before the host has issued); a host far ahead does not. Medians;
    dispatch_us: _dispatch_us() in this method's process."""
    host = statistics.median(h for h, _ in forwards)
    gpu = [g for _, g in forwards if g is not None]
    cpu = _cpu_now()
    return dict(forward_host_ms=round(host, 2),
                forward_gpu_ms=round(statistics.median(gpu), 2) if gpu else None,
                dispatch_us=round(_dispatch_us(), 3), cpu=cpu, cpu_mhz=_cpu_mhz(cpu),
                cpus_allowed=sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                else None)


def run_one(spec: str, args) -> dict:
    import torch

    name, options = _parse_method(spec)
    if args.cpus:  # this method's process and every thread it starts
        os.sched_setaffinity(0, _cpu_list(args.cpus))
    flat_steps = options.pop("flat", args.flat_steps)  # per-method --flat-steps
    shape = TINY if args.tiny else T1
    device = args.device
    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model, ids = _build(shape, device, dtype)
    step, stats = _step_fn(name, options, model, device)

    def sync():
        if cuda:
            torch.cuda.synchronize()
        if name.startswith("spillway"):
            from spillway import _C
            _C.synchronize()

    forwards = []  # (host ms, GPU ms) of each step's forward: see _host_bound

    def one_step():
        sync()
        start_alloc = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            marks = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            marks[0].record()
        t0 = time.perf_counter()
        loss = step(ids)
        t_forward = time.perf_counter()
        if cuda:
            marks[1].record()
        loss.backward()
        sync()
        dt = time.perf_counter() - t0
        forwards.append((1e3 * (t_forward - t0), marks[0].elapsed_time(marks[1]) if cuda else None))
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        return dt, start_alloc, peak, float(loss.detach().float())

    # The pinned host allocations each step made (a spillway method's pool grows where
    # a step holds more host bytes than any before: cudaHostAlloc in the step's time).
    pinned = (lambda: _pool_bytes(device).get("pinned_allocations", 0)
              if name.startswith("spillway") else 0)
    t_build = time.perf_counter()
    warm_allocs = []
    for _ in range(args.warmup):
        before = pinned()
        one_step()
        warm_allocs.append(pinned() - before)
    warm_s = time.perf_counter() - t_build
    times, above, peaks, losses, allocs = [], [], [], [], []
    del forwards[:]
    for _ in range(args.steps):
        before = pinned()
        dt, start_alloc, peak, loss = one_step()
        allocs.append(pinned() - before)
        times.append(dt)
        above.append(peak - start_alloc)
        peaks.append(peak)
        losses.append(loss)
    result = dict(
        method=spec, device=torch.cuda.get_device_name() if cuda else "cpu",
        torch=torch.__version__, shape=shape, dtype=args.dtype,
        warmup_s=round(warm_s, 2), step_ms_median=1e3 * statistics.median(times),
        step_ms_all=[round(1e3 * t, 2) for t in times],
        activation_gib=max(above) / GIB if cuda else None,
        peak_allocated_gib=max(peaks) / GIB if cuda else None,
        weights_and_grads_gib=(torch.cuda.memory_allocated() / GIB) if cuda else None,
        loss_first=losses[0], method_stats=stats(), host=_host_bound(forwards))
    if name.startswith("spillway"):
        result["pinned_allocations_per_step"] = {"warmup": warm_allocs, "measured": allocs}
    if args.profile and cuda:
        result["profile"] = _profile_step(one_step, args.profile, spec)
    if args.fp32_error:
        result["fp32_error"] = _fp32_error(model, step, ids, shape, device, sync,
                                           args.fp32_batches)
    if name.startswith("spillway"):
        result["pool"] = _pool_bytes(device)
        if flat_steps:
            flat = []
            for _ in range(flat_steps):
                dt, start_alloc, peak, _loss = one_step()
                flat.append((start_alloc, peak, _pool_bytes(device).get("bytes_pinned", 0)))
            cols = list(zip(*flat))
            result["flat"] = {
                "steps": flat_steps,
                "start_alloc_min_max": [min(cols[0]), max(cols[0])],
                "peak_min_max": [min(cols[1]), max(cols[1])],
                "pinned_min_max": [min(cols[2]), max(cols[2])],
            }
    return result


def render(results: list[dict], command: str) -> str:
    base = {r["method"]: r for r in results}
    out = []
    first = next((r for r in results if "error" not in r), None)  # errors carry no shape
    if first is None:
        out.append("# T1: every method failed\n")
        out.append(f"Command: `{command}`\n")
    else:
        out.append(f"# T1 on {first['device']}, torch {first['torch']}\n")
        out.append(f"Command: `{command}`  ")
        out.append(f"Shape: {first['shape']}, {first['dtype']}; median step time over the "
                   "measured steps; activation = peak allocated during a step minus "
                   "allocated at its start.\n")
    out.append("| method | step ms | x none | x compiled | activation GiB | peak GiB | bytes offloaded |")
    out.append("|---|---|---|---|---|---|---|")
    none = base.get("none")
    comp = base.get("compiled")
    for r in results:
        if "error" in r:
            out.append(f"| {r['method']} | error: {r['error'][:120]} | | | | | |")
            continue
        ms = r["step_ms_median"]
        xn = f"{ms / none['step_ms_median']:.2f}" if none and "error" not in none else "-"
        xc = f"{ms / comp['step_ms_median']:.2f}" if comp and "error" not in comp else "-"
        act = f"{r['activation_gib']:.2f}" if r.get("activation_gib") is not None else "-"
        peak = f"{r['peak_allocated_gib']:.2f}" if r.get("peak_allocated_gib") is not None else "-"
        moved = r.get("method_stats", {}).get("bytes_offloaded")
        moved = f"{moved / GIB:.2f} GiB" if isinstance(moved, (int, float)) else "-"
        out.append(f"| {r['method']} | {ms:.1f} | {xn} | {xc} | {act} | {peak} | {moved} |")
    versions = {(r.get("method_stats") or {}).get("torchtune") for r in results
                if "error" not in r} - {None}
    if versions:
        out.append(f"\ntorchtune {', '.join(sorted(versions))}: "
                   "training/_activation_offloading.py as its recipes apply it.")
    flats = [r for r in results if "flat" in r]
    if flats:
        out.append("\nFlat over many steps (bytes: min / max over the steps):\n")
        out.append("| method | steps | allocated at step start | step peak | pinned |")
        out.append("|---|---|---|---|---|")
        for r in flats:
            f = r["flat"]
            cells = [f"{a} / {b}" for a, b in (f["start_alloc_min_max"], f["peak_min_max"],
                                                f["pinned_min_max"])]
            out.append(f"| {r['method']} | {f['steps']} | " + " | ".join(cells) + " |")
    forecasts = [r for r in results if "error" not in r
                 and (r.get("method_stats") or {}).get("forecast")]
    if forecasts:
        out.extend(_render_forecasts(forecasts))
    hosts = [r for r in results if "error" not in r and r.get("host")]
    if hosts:
        out.append("\nThe forward on the host and on the GPU (medians over the measured steps; "
                   "host = issuing it, model call to loss, no sync; GPU = step start to its "
                   "last kernel; a host near the GPU kept it waiting); dispatch = the host's "
                   "microseconds per small CPU torch op in that method's process; core = the "
                   "one it ran on at the end, at its clock then; over base = forward GPU ms "
                   "beyond `none`'s (`compiled`'s for compiled methods) in this run; step - "
                   "forecast = measured minus the planner's forecast (ms). A forward the host "
                   "kept waiting grows on the GPU by about what its step misses the device "
                   "forecast by (v17, v18):\n")
        out.append("| method | forward host ms | forward GPU ms | over base | step - forecast | "
                   "dispatch us | core (MHz) |")
        out.append("|---|---|---|---|---|---|---|")
        base_gpu = {r["method"]: r["host"].get("forward_gpu_ms") for r in hosts
                    if r["method"] in ("none", "compiled")}
        for r in hosts:
            h = r["host"]
            gpu = h.get("forward_gpu_ms")
            base = base_gpu.get("compiled" if "compiled" in r["method"] else "none")
            over = f"{gpu - base:+.1f}" if gpu is not None and base is not None else "-"
            stats = r.get("method_stats") or {}
            forecast = _shown_forecast(stats)[1] if stats.get("forecast") else {}
            miss = (f"{r['step_ms_median'] - forecast['step_ms']:+.1f}"
                    if forecast.get("step_ms") is not None and r.get("step_ms_median") else "-")
            core = "-" if h.get("cpu") is None else (
                f"{h['cpu']}" + (f" ({h['cpu_mhz']:.0f})" if h.get("cpu_mhz") else ""))
            out.append(f"| {r['method']} | {h['forward_host_ms']:.1f} | "
                       f"{'-' if gpu is None else f'{gpu:.1f}'} | {over} | {miss} | "
                       f"{h['dispatch_us']:.2f} | {core} |")
    errors = [r for r in results if r.get("fp32_error")]
    if errors:
        out.append("\nAgainst the same weights in fp32 (eager, nothing saved), one more step "
                   "(--fp32-error): gradient error = norm of the difference over the fp32 "
                   "norm, all parameters together and the worst one; mean loss error = mean "
                   "absolute loss error over that batch and --fp32-batches - 1 more:\n")
        out.append("| method | peak GiB | loss | fp32 loss | loss error | mean loss error "
                   "(batches) | gradient error (global) | gradient error (worst parameter) |")
        out.append("|---|---|---|---|---|---|---|---|")
        for r in errors:
            e = r["fp32_error"]
            peak = r.get("peak_allocated_gib")
            peak = f"{peak:.2f}" if peak is not None else "-"
            mean = (f"{e['loss_abs_error_mean']:.2e} ({e['batches']})"
                    if "loss_abs_error_mean" in e else "-")
            out.append(f"| {r['method']} | {peak} | {e['loss']:.6f} | "
                       f"{e['loss_fp32']:.6f} | {e['loss_abs_error']:.2e} | {mean} | "
                       f"{e['grad_rel_error_global']:.3e} | {e['grad_rel_error_max']:.3e} |")
    profiled = [r for r in results if r.get("profile")]
    if profiled:
        out.extend(_render_profiles(profiled, base))
    return "\n".join(out) + "\n"


def _shown_forecast(stats: dict) -> tuple[int | None, dict]:
    """(graph index, forecast) of a budget method's stats: spillway-eager-budget's one
    forecast (index None), or spillway-compiled's graph with the largest peak."""
    f = stats["forecast"]
    if not isinstance(f, list):
        return None, f
    i = max(range(len(f)), key=lambda k: f[k]["peak_bytes"])
    return i, f[i]


def _render_forecasts(results: list[dict]) -> list[str]:
    """The budget planner's forecast beside the measurement: spillway-eager-budget
    (one forecast per run) and spillway-compiled with memory_budget (one per
    compiled graph: the one with the largest peak is shown)."""
    out = ["\nThe budget planner's forecast (its simulation of its plan) against the "
           "measurement; peak = allocated at the step's peak, weights included:\n",
           "| method | decisions | predicted step ms | measured | error | predicted peak GiB "
           "| measured | error | departures |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        stats = r["method_stats"]
        i, f = _shown_forecast(stats)
        if i is not None:  # compiled: per graph
            mix = ", ".join(f"{k} {v}" for k, v in stats["decisions"][i].items())
            departures = str(len(stats["departures"][i]))
        else:
            mix = ", ".join(f"{k} {v}" for k, v in stats.get("decision_mix", {}).items())
            departures = "-"
        ms, peak = r["step_ms_median"], r.get("peak_allocated_gib")
        fpeak = f["peak_bytes"] / GIB
        step_err = f"{100 * (f['step_ms'] - ms) / ms:+.1f}%"
        peak_cell = f"{peak:.2f}" if peak is not None else "-"
        peak_err = f"{100 * (fpeak - peak) / peak:+.1f}%" if peak else "-"
        out.append(f"| {r['method']} | {mix} | {f['step_ms']:.1f} | {ms:.1f} | {step_err} | "
                   f"{fpeak:.2f} | {peak_cell} | {peak_err} | {departures} |")
    return out + _render_block_hosts(results) + _render_replans(results)


def _render_replans(results: list[dict]) -> list[str]:
    """spillway-eager-budget with replan=1: what the replan found (Note [Replanning on
    the host's speed], _eager_budget.py)."""
    rows = [(r["method"], r["method_stats"]["host_replan"]) for r in results
            if (r.get("method_stats") or {}).get("host_replan")]
    if not rows:
        return []
    out = ["\nThe replan on the host's measured speed: the host's speed over the cost model's "
           "(scale), its ms between block calls, the first plan's forecast without and with "
           "that host, the replan's forecast, and whether it was taken (the forecast above "
           "is then the new plan's):\n",
           "| method | at planned step | scale | between ms | first plan: device / with host "
           "ms | replanned ms | taken |",
           "|---|---|---|---|---|---|---|"]
    for method, h in rows:
        if "skipped" in h and "scale" not in h:
            out.append(f"| {method} | {h['planned_step']} | skipped: {h['skipped']} | | | | |")
            continue
        replanned = f"{h['replanned_ms']:.1f}" if "replanned_ms" in h else h.get("skipped", "-")
        out.append(f"| {method} | {h['planned_step']} | {h['scale']:.2f} | "
                   f"{h['between_ms']:.2f} | {h['running_device_ms']:.1f} / "
                   f"{h['running_ms']:.1f} | {replanned} | {'yes' if h['adopted'] else 'no'} |")
    return out


def _render_block_hosts(results: list[dict]) -> list[str]:
    """spillway-eager-budget: the blocks' forward on the launching thread against the
    device, summed over the block calls (Note [The host's share], _eager_budget.py)."""
    rows = []
    for r in results:
        stats = r["method_stats"]
        calls = (stats.get("profile") or {}).get("calls") or []
        planned = stats.get("block_forward_host_ms") or []
        if not calls or not planned or calls[0].get("forward_host_ms") is None:
            continue
        total = (lambda key: sum(c.get(key) or 0.0 for c in calls))
        rows.append(f"| {r['method']} | {total('forward_ms'):.1f} | "
                    f"{total('forward_host_ms'):.1f} | {total('recorded_host_ms'):.1f} | "
                    f"{sum(planned):.1f} |")
    if not rows:
        return []
    return ["\nThe blocks' forward, summed over the block calls (ms): on the device as "
            "profiled; on the host as profiled (checkpointed, no saves), as its recompute "
            "ran under the Recorder, and in the last planned step (the plan's hooks "
            "included):\n",
            "| method | device, profiled | host, profiled | host, under the Recorder | "
            "host, planned |",
            "|---|---|---|---|---|", *rows]


def _render_profiles(profiled: list[dict], base: dict) -> list[str]:
    out = ["\nOne profiled step per method (torch.profiler; ms of GPU time; compute = the "
           "stream with the most kernel time; idle = the step's GPU span minus the compute "
           "stream's busy time):\n",
           "| method | GPU span | compute busy | compute idle | kernels | kernel ms | "
           "other streams: kernel / copy ms |",
           "|---|---|---|---|---|---|---|"]
    for r in profiled:
        p = r["profile"]
        compute = p["streams"][p["compute_stream"]]
        others = [f"{k}: {v['kernel_us'] / 1e3:.1f} / {v['copy_us'] / 1e3:.1f}"
                  for k, v in p["streams"].items() if k != p["compute_stream"]]
        out.append(f"| {r['method']} | {p['span_us'] / 1e3:.1f} | {p['compute_busy_us'] / 1e3:.1f} "
                   f"| {p['compute_idle_us'] / 1e3:.1f} | {compute['kernels']} | "
                   f"{compute['kernel_us'] / 1e3:.1f} | {'; '.join(others) or '-'} |")
    reference = next((base[m] for m in ("compiled", "none") if base.get(m, {}).get("profile")),
                     None)
    if reference is None:
        return out
    want = reference["profile"]["kernels_by_name"]
    for r in profiled:
        if r is reference:
            continue
        got = r["profile"]["kernels_by_name"]
        rows = []
        for name in set(got) | set(want):
            (gc, gt), (wc, wt) = got.get(name, (0, 0.0)), want.get(name, (0, 0.0))
            if gc != wc or abs(gt - wt) > 200:
                rows.append((gt - wt, name, gc, wc, gt, wt))
        rows.sort(key=lambda row: -abs(row[0]))
        out.append(f"\nKernels of {r['method']} against {reference['method']} on the compute "
                   "stream (largest time differences first; count and ms):\n")
        out.append("| kernel | count | ms | reference count | reference ms | difference ms |")
        out.append("|---|---|---|---|---|---|")
        for diff, name, gc, wc, gt, wt in rows[:15]:
            out.append(f"| `{name}` | {gc} | {gt / 1e3:.2f} | {wc} | {wt / 1e3:.2f} | "
                       f"{diff / 1e3:+.2f} |")
    return out


def _write(results: list[dict], passthrough: list[str], args) -> str:
    command = "python3 bench/torch/t1.py " + " ".join(passthrough)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    table = render(results, command)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    return table


def _tail(text) -> str:
    """The last three lines a method printed, on one line: what an error row shows."""
    return " / ".join((text or "").strip().splitlines()[-3:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", action="append", default=[])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--flat-steps", type=int, default=0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per method")
    parser.add_argument("--profile", metavar="DIR",
                        help="profile one more step per method; traces go to DIR")
    parser.add_argument("--fp32-error", action="store_true",
                        help="after the measured steps, one more step of each method against "
                             "the same weights in fp32 (eager, nothing saved): loss and gradient "
                             "errors in the results")
    parser.add_argument("--fp32-batches", type=int, default=8,
                        help="with --fp32-error: batches whose loss errors are averaged")
    parser.add_argument("--cpus", metavar="LIST",
                        help="run each method's process on these cores only (\"0-3,8\"; "
                             "Linux): one T1 run on an H100 machine saw its processes at "
                             "two host speeds, 1.3-1.6 or 2.8-3.3 us per small op (v17)")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.flat_steps < 0:
        parser.error("--steps must be >= 1, --warmup and --flat-steps >= 0")
    if args.warmup < 3 and any(m.startswith(("spillway-eager-budget", "spillway-trace"))
                               for m in args.method):
        parser.error("spillway-eager-budget and spillway-trace profile or record their first "
                     "two steps and plan at the third: --warmup must be >= 3")
    if args.warmup < 5 and any(m.startswith("spillway-eager-budget") and "replan=1" in m
                               for m in args.method):
        parser.error("spillway-eager-budget's replan=1 plans again at the fifth step: "
                     "--warmup must be >= 5")
    if args.one:
        print("T1RESULT " + json.dumps(run_one(args.one, args)), flush=True)
        return 0
    methods = args.method or ["none", "spillway-eager"]
    passthrough = [a for a in sys.argv[1:]]
    results = []
    for spec in methods:
        _parse_method(spec)  # reject bad options before spending time
        cmd = [sys.executable, __file__, "--one", spec] + [
            a for i, a in enumerate(passthrough)
            if a != "--method" and (i == 0 or passthrough[i - 1] != "--method")]
        print(f"[t1] {spec} ...", flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            lines = [l for l in proc.stdout.splitlines() if l.startswith("T1RESULT ")]
            if proc.returncode != 0 or not lines:
                results.append(dict(method=spec, error=_tail(proc.stderr or proc.stdout)
                                    or f"rc={proc.returncode}"))
            else:
                results.append(json.loads(lines[-1][len("T1RESULT "):]))
        except subprocess.TimeoutExpired as e:
            # What the method printed before it was cut off says where its time went.
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
            tail = _tail(err)
            results.append(dict(method=spec, error=f"timed out after {args.timeout} s"
                                + (": " + tail if tail else "")))
        r = results[-1]
        print(f"[t1] {spec}: " + (f"error {r['error']}" if "error" in r else
              f"{r['step_ms_median']:.1f} ms, activation {r['activation_gib']} GiB")
              + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
        # Written after every method, so a run cut short keeps what it measured.
        table = _write(results, passthrough, args)
    print(table)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
