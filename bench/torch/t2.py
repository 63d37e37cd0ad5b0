#!/usr/bin/env python3
"""Workload T2 of BENCHMARKS.md: inference with the weights on the host, side by side.

    python3 bench/torch/t2.py [--method M ...] [--calls 10] [--json OUT] [--markdown OUT]
    python3 bench/torch/t2.py --tiny --device cpu --method resident --method spillway

A Llama-style model (hidden 4096, MLP 11008, 8 layers, 32 heads, vocab 32000, bf16:
3.5 GiB of weights) built on the CPU from a fixed seed (once: later methods' processes
load it from --cache), one prompt of 2048 tokens,
forward only (inference_mode, use_cache=False). Methods (each in its own process,
so its memory and host RSS are its own):

    resident                 every weight on the GPU
    spillway[:prefetch=N]    spillway.offload_weights(model, prefetch=N) (default 1)
    spillway:budget=F        spillway.offload_weights(model, gpu_budget=F): the fraction F
                             of the weights stays on the GPU at most (the resident-set
                             scheduler's plan, made again after the second call)
    spillway:...,granularity=children   the same with a group per child of a block
                             (attention, MLP, norms) instead of per block
    accelerate-cpu-offload   accelerate.cpu_offload(model, execution_device)
    diffusers-leaf           diffusers' apply_group_offloading(offload_type="leaf_level",
                             use_stream=True) on the model
    diffusers-block          the same with offload_type="block_level",
                             num_blocks_per_group=1, on the decoder (model.model; the
                             LM head resident)
    resident-compiled        every weight on the GPU, torch.compile(model) (Inductor)
    spillway-compiled[:budget=F,granularity=G,prefetch=N]
                             spillway.compile(model, weights="offload", ...): the compiled
                             piecewise executor (Inductor pieces); budget=1.0 keeps every
                             weight resident (the same pieces: its logits are the
                             reference the others are compared with bit for bit)

diffusers comes from a carried wheel (SPILLWAY_T2_DIFFUSERS_DIR: a directory that
`pip install --target` made from .whl/diffusers-*.whl and .whl/importlib_metadata-*.whl;
scripts/device-check does it). Per method: the median forward time over --calls
after --warmup calls (CUDA events), the link floor (the bytes a call moves, the
offloaded weights, over the H2D rate measured here with one pinned 1 GiB copy), the
peak GPU memory allocated during a call, the process's host RSS, the pinned bytes
spillway's slabs hold, and whether the logits are torch.equal to the resident
model's (the resident method runs first and leaves them in --work). With a budget,
also the scheduler's forecast of a call and its plan, and the weights the calls held
on the GPU: the peak allocated during the calls less the activations the resident
model's calls needed (its peak less its weights); the bound then is max(the resident
model's time, the bytes moved per call over the H2D rate). --batch N makes the
compute-heavy case (N prompts of 2048 tokens).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
GIB = 1 << 30
T2 = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=8,
          num_attention_heads=32, num_key_value_heads=32, vocab_size=32000, seq=2048)
TINY = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, vocab_size=512, seq=64)
METHODS = ("resident", "spillway", "accelerate-cpu-offload", "diffusers-leaf", "diffusers-block",
           "resident-compiled", "spillway-compiled")
# The logits each method is compared with besides the resident model's: the compiled
# methods also with plain torch.compile's, and with the same pieces all resident.
REFERENCES = {"resident": "resident", "resident-compiled": "resident-compiled",
              "spillway-compiled:budget=1.0": "spillway-compiled-resident",
              "spillway-compiled:budget=1.0,granularity=children":
                  "spillway-compiled-children-resident"}


def _parse(spec: str) -> tuple[str, dict]:
    name, _, rest = spec.partition(":")
    if name not in METHODS:
        raise SystemExit(f"[t2] unknown method {name!r}: one of {', '.join(METHODS)}")
    options = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"[t2] bad option {item!r} in {spec!r}: expected key=value")
        try:
            options[key] = int(value) if value.isdigit() else float(value)
        except ValueError:
            options[key] = value
    return name, options


def _build(shape: dict, dtype, cache: str | None = None):
    """The model and the prompt. With `cache` (a directory), the first process to build a
    shape saves the whole built module there and later ones load it: the random
    initialisation of 1.75 G parameters on the CPU took ~45 s of each method's process."""
    import hashlib

    import torch
    import transformers

    path = None
    if cache:
        model_shape = {k: v for k, v in shape.items() if k != "batch"}
        key = hashlib.sha1(repr((sorted(model_shape.items()), str(dtype),
                                 transformers.__version__)).encode()).hexdigest()[:16]
        path = pathlib.Path(cache) / f"t2-model-{key}.pt"
    if path is not None and path.exists():
        model = torch.load(path, weights_only=False)
    else:
        config = transformers.LlamaConfig(
            hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
            num_hidden_layers=shape["num_hidden_layers"],
            num_attention_heads=shape["num_attention_heads"],
            num_key_value_heads=shape["num_key_value_heads"], vocab_size=shape["vocab_size"],
            max_position_embeddings=max(4096, shape["seq"]), attn_implementation="sdpa")
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).to(dtype).eval()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.partial")  # then one atomic rename
            torch.save(model, partial)
            partial.replace(path)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab_size"], (shape.get("batch", 1), shape["seq"]),
                        generator=gen)
    return model, ids


def _h2d_gbs(device) -> float:
    """One pinned 1 GiB host-to-device copy, timed with CUDA events (median of 3)."""
    import torch

    host = torch.empty(GIB, dtype=torch.uint8).pin_memory()
    dev = torch.empty(GIB, dtype=torch.uint8, device=device)
    times = []
    for _ in range(4):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    del host, dev
    torch.cuda.empty_cache()
    return GIB / (statistics.median(times[1:]) * 1e-3) / 1e9


def _apply(name: str, options: dict, model, device: str) -> tuple[object, int]:
    """Applies the method to the CPU model; returns (its handle, the bytes it offloads)."""
    import torch

    everything = sum(p.numel() * p.element_size() for p in model.parameters())
    if name == "resident":
        model.to(device)
        return None, 0
    if name == "spillway":
        import spillway
        handle = spillway.offload_weights(model, prefetch=options.get("prefetch"),
                                          gpu_budget=options.get("budget"), device=device,
                                          granularity=options.get("granularity", "block"))
        return handle, handle.stats()["bytes_offloaded"]
    if name == "resident-compiled":
        model.to(device)
        return torch.compile(model), 0
    if name == "spillway-compiled":
        import spillway
        compiled = spillway.compile(model, weights="offload", prefetch=options.get("prefetch"),
                                    gpu_budget=options.get("budget"), device=device,
                                    granularity=options.get("granularity", "block"))
        return compiled, compiled.spillway_weights.stats()["bytes_offloaded"]
    if name == "accelerate-cpu-offload":
        import accelerate
        accelerate.cpu_offload(model, execution_device=torch.device(device))
        return None, everything
    sys.path.insert(0, os.environ.get("SPILLWAY_T2_DIFFUSERS_DIR", "/tmp/df"))
    from diffusers.hooks import apply_group_offloading
    if name == "diffusers-leaf":
        apply_group_offloading(model, onload_device=torch.device(device),
                               offload_type="leaf_level", use_stream=True)
        return None, everything
    # diffusers-block: the decoder's blocks one group each; the LM head resident.
    model.lm_head.to(device)
    apply_group_offloading(model.model, onload_device=torch.device(device),
                           offload_type="block_level", num_blocks_per_group=1, use_stream=True)
    head = model.lm_head.weight
    return None, everything - head.numel() * head.element_size()


def run_one(spec: str, args) -> dict:
    import torch

    name, options = _parse(spec)
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    shape = dict(TINY if args.tiny else T2, batch=args.batch)
    if cuda:
        torch.backends.cudnn.deterministic = True
        torch.use_deterministic_algorithms(True, warn_only=True)
    model, ids = _build(shape, dtype, args.cache)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    t0 = time.perf_counter()
    handle, moved = _apply(name, options, model, args.device)
    if name.endswith("-compiled"):  # the compiled module runs; the handle is its weights'
        model, handle = handle, getattr(handle, "spillway_weights", None)
    ids = ids.to(args.device)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def call():
        with torch.inference_mode():
            return model(input_ids=ids, use_cache=False).logits

    for _ in range(args.warmup):
        out = call()
    sync()
    setup_s = time.perf_counter() - t0  # the method applied and the warm-up calls (compiles)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(args.calls):
        if cuda:
            start, end = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
            start.record()
            out = call()
            end.record()
            sync()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            out = call()
            times.append(1e3 * (time.perf_counter() - t0))
    logits = out.float().cpu()
    work = pathlib.Path(args.work)
    if spec in REFERENCES:
        torch.save(logits, work / f"{REFERENCES[spec]}-logits.pt")
    compared = {}
    for ref in sorted(set(REFERENCES.values())):
        path = work / f"{ref}-logits.pt"
        if path.exists():
            want = torch.load(path)
            compared[ref] = {"equal": bool(torch.equal(logits, want)),
                             "max_abs_diff": float((logits - want).abs().max())}
    equal = compared.get("resident", {}).get("equal")
    result = dict(method=spec, device=torch.cuda.get_device_name() if cuda else "cpu",
                  torch=torch.__version__, shape=shape, dtype=args.dtype,
                  weights_gib=weights / GIB, moved_gib_per_call=moved / GIB,
                  forward_ms_median=statistics.median(times),
                  forward_ms_all=[round(t, 2) for t in times], logits_equal_resident=equal,
                  logits_against=compared, setup_s=setup_s)
    if cuda:
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        result["allocated_before_call_gib"] = base / GIB
    try:
        import psutil
        result["host_rss_gib"] = psutil.Process().memory_info().rss / GIB
    except ImportError:
        pass
    if handle is not None:
        result["spillway"] = handle.stats()
        result["pinned_gib"] = result["spillway"]["bytes_pinned"] / GIB
        forecast = handle.forecast()
        if forecast is not None:
            result["forecast"] = forecast
            result["moved_gib_per_call"] = forecast["bytes_moved"] / GIB
    return result


def _cell(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _against(r: dict) -> str:
    """'resident =, resident-compiled 3.1e-02' : = where torch.equal, else the largest
    difference."""
    out = [f"{ref} =" if c["equal"] else f"{ref} {c['max_abs_diff']:.1e}"
           for ref, c in r.get("logits_against", {}).items()]
    return "; ".join(out) or str(r.get("logits_equal_resident"))


def _markdown(results: list[dict], h2d: float | None, command: str) -> str:
    first = next((r for r in results if "error" not in r), {})
    lines = [f"# T2 on {first.get('device', '?')}, torch {first.get('torch', '?')}", "",
             f"Command: `{command}`  ",
             f"Shape: {first.get('shape')}, {first.get('dtype')}, forward only; median of the "
             f"measured calls; H2D {h2d:.1f} GB/s (one pinned 1 GiB copy); link floor = bytes "
             f"moved per call / that rate." if h2d else "", "",
             "| method | forward ms | x resident | moved GiB | link floor ms | x link floor | "
             "bound ms | x bound | forecast ms | budget GiB | weights held GiB | "
             "peak GiB | host RSS GiB | RSS - weights GiB | pinned GiB | logits against | "
             "setup s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = next((r for r in results if r.get("method") == "resident" and "error" not in r), {})
    resident = base.get("forward_ms_median")
    # The resident model's activations: its peak less its weights.
    activations = (base["peak_allocated_gib"] - base["weights_gib"]
                   if "peak_allocated_gib" in base else None)
    for r in results:
        if "error" in r:
            lines.append(f"| {r['method']} | error: {r['error'][-160:]} |" + " |" * 15)
            continue
        ms, moved = r["forward_ms_median"], r["moved_gib_per_call"]
        floor = moved * GIB / (h2d * 1e9) * 1e3 if h2d and moved else None
        bound = max(resident, floor or 0) if resident and floor else None
        forecast = r.get("forecast") or {}
        budget = forecast["budget_bytes"] / GIB if forecast else None
        rss = r.get("host_rss_gib")
        held = (r["peak_allocated_gib"] - activations
                if forecast and activations is not None and "peak_allocated_gib" in r else None)
        lines.append(
            f"| {r['method']} | {ms:.1f} | {_cell(ms / resident if resident else None, '.2f')} | "
            f"{moved:.2f} | {_cell(floor, '.1f')} | {_cell(ms / floor if floor else None, '.2f')} | "
            f"{_cell(bound, '.1f')} | {_cell(ms / bound if bound else None, '.2f')} | "
            f"{_cell(forecast.get('call_ms'), '.1f')} | {_cell(budget, '.2f')} | "
            f"{_cell(held, '.2f')} | "
            f"{_cell(r.get('peak_allocated_gib'), '.2f')} | {_cell(r.get('host_rss_gib'), '.2f')} | "
            f"{_cell(rss - r['weights_gib'] if rss is not None else None, '.2f')} | "
            f"{_cell(r.get('pinned_gib'), '.3f')} | {_against(r)} | "
            f"{_cell(r.get('setup_s'), '.0f')} |")
    if base.get("host_rss_gib") is not None and base.get("device") != "cpu":
        lines += ["", f"RSS - weights: the process's host memory beyond the model's size. The "
                      f"stated constant is the resident method's RSS, "
                      f"{base['host_rss_gib']:.2f} GiB: the same process with no weight on "
                      f"the host (torch, CUDA, transformers, the model's code). A method at or "
                      f"below it keeps no second host copy of the weights."]
    plans = [(r["method"], r["forecast"]) for r in results if r.get("forecast")]
    if plans:
        lines += ["", "Plans (resident blocks, slots, strategy; forecast of each strategy, ms):", ""]
        for method, f in plans:
            by = ", ".join(f"{k} {v['call_ms']:.1f}" for k, v in sorted(f["candidates"].items()))
            lines.append(f"- {method}: resident {f['resident']}, {f['slots']} slots, "
                         f"{f['strategy']}; {by}; forecast peak {f['peak_bytes'] / GIB:.2f} GiB")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", action="append", default=[])
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--tiny", action="store_true", help="a 4-layer hidden-128 model")
    parser.add_argument("--batch", type=int, default=1, help="prompts per call")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per method")
    parser.add_argument("--work", default="/tmp/spillway-t2")
    parser.add_argument("--cache", default="/tmp/spillway-t2-models",
                        help="where the built model is kept for the next method's process "
                             "(the same shape, dtype and transformers); '' builds each time")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # a child: one method, its result as the last line of stdout
        print(json.dumps(run_one(args.one, args)))
        return 0
    methods = args.method or ["resident", "spillway", "accelerate-cpu-offload",
                              "diffusers-leaf", "diffusers-block"]
    for spec in methods:
        _parse(spec)
    # The references first: the others compare their logits with theirs.
    refs = [m for m in REFERENCES if m in methods]
    methods = refs + [m for m in methods if m not in refs]
    pathlib.Path(args.work).mkdir(parents=True, exist_ok=True)
    for ref in set(REFERENCES.values()):
        (pathlib.Path(args.work) / f"{ref}-logits.pt").unlink(missing_ok=True)
    h2d = None
    if args.device.startswith("cuda"):
        import torch
        h2d = _h2d_gbs(args.device)
        del torch
    command = "python3 bench/torch/t2.py " + " ".join(sys.argv[1:])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT / "python"), os.environ.get("PYTHONPATH")]))}
    results = []
    for spec in methods:
        child = [sys.executable, __file__, "--one", spec, "--calls", str(args.calls),
                 "--warmup", str(args.warmup), "--device", args.device, "--dtype", args.dtype,
                 "--work", args.work, "--cache", args.cache, "--batch", str(args.batch)] + (["--tiny"] if args.tiny else [])
        t0 = time.perf_counter()
        try:
            done = subprocess.run(child, env=env, capture_output=True, text=True,
                                  timeout=args.timeout)
            if done.returncode == 0:
                results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            else:
                tail = " / ".join(done.stderr.strip().splitlines()[-3:])
                results.append(dict(method=spec, error=tail))
        except subprocess.TimeoutExpired:
            results.append(dict(method=spec, error=f"timed out after {args.timeout} s"))
        r = results[-1]
        print(f"[t2] {spec}: " + (f"{r['forward_ms_median']:.1f} ms, logits equal "
                                  f"{r['logits_equal_resident']}" if "error" not in r
                                  else f"error {r['error'][-200:]}")
              + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
        text = _markdown(results, h2d, command)  # after each method: a cut run keeps them
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(
                {"h2d_gbs": h2d, "command": command, "results": results}, indent=1))
        if args.markdown:
            pathlib.Path(args.markdown).write_text(text)
    print(text)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
