#!/usr/bin/env python3
"""Workload T3 of BENCHMARKS.md: fine-tuning with weights, gradients and AdamW state
planned off the GPU by trace and replay, side by side.

    python3 bench/torch/t3.py [--method M ...] [--steps 5] [--json OUT] [--markdown OUT]
    python3 bench/torch/t3.py --tiny --device cpu --method none --method spillway:budget=0.5

A Llama-style model (hidden 3072, MLP 8192, 24 layers, 24 heads, vocab 32000: 2.9 B
parameters), fp32 parameters and AdamW(fused=True) state, forward under bf16 autocast,
batch 1 x seq 2048; a step is forward + backward + optimizer step + zero_grad. Methods
(each in its own process, so its peak and host RSS are its own):

    none                  everything on the GPU: the reference (runs first; its peak X,
                          losses and the checksums of every parameter and AdamW state
                          after each step go to --work)
    spillway:budget=F[:host][:threads=N]
                          step 1 plain (AdamW makes its state), step 2 recorded
                          (spillway.trace.record), step 3 replayed under a plan that moves
                          nothing, its host time per op measured (the forecast's host:
                          spillway.trace.with_host_times), planned for F * X
                          (spillway.trace.plan), steps 4.. replayed
                          (spillway.trace.replay). AdamW has one
                          parameter group per parameter, so its fused step is one op per
                          parameter the plan can move around (the same arithmetic per
                          element as one group: bitwise equal, checked against none);
                          :host lets the plan run AdamW on the host CPUs (their speed
                          measured first while the GPU copies both ways: the median
                          of spillway.optim.measure_host_adamw's samples) when
                          its forecast is faster (Note [Host updates in replay]);
                          :threads=N runs it on N threads (SPILLWAY_HOST_THREADS)
    spillway-hostadam     spillway.optim.HostAdamW(step_in_backward=True, free_grads=True):
                          the AdamW state on the host, each parameter updated on the CPU
                          as soon as its gradient is complete, during backward, in the
                          form probed to equal AdamW(fused=True) on this GPU bit for bit
    torchao-offload       torchao's CPUOffloadOptimizer(AdamW, fused=True): the AdamW
                          state and step on the CPU (a carried wheel, SPILLWAY_T3_TORCHAO_DIR)

DeepSpeed's ZeRO-Offload, the issue's third peer, is not here: the GPU machine has no
DeepSpeed, and the only peers it may receive are the carried wheels its README lists
(torchtune, diffusers, torchao), so it cannot run there.

Per method: the median step time over the steps after the first three (CUDA events;
for spillway after the first four: the fourth, its first step under the plan, makes its
pinned host buffers and is reported apart as "step 3" (the third step of the others)), the CPU's time to issue a step (near the step time: bound
by the CPU), the peak GPU memory allocated in every step after the first two, the host RSS, whether the loss of every step
and every parameter and AdamW state after the last step equal the reference's (two
checksums of the bits of each), and for spillway the plan's forecast (step, peak)
against the measurement. On a CPU (--tiny --device cpu: a smoke test) the reference's
peak is the residency model's own, simulated.
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
T3 = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=24,
          num_attention_heads=24, num_key_value_heads=24, vocab_size=32000, seq=2048)
TINY = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, vocab_size=512, seq=64)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _checksum(t) -> list[int]:
    """Two sums of the tensor's bits (plain and position-weighted), exact in int64."""
    import torch
    bits = t.detach().reshape(-1).view(torch.int32).to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64) % 65521
    return [int(bits.sum()), int((bits * weights).sum())]


def _state_of(optimizer, p) -> dict:
    """p's AdamW state: torch's optimizers key it by p; torchao's CPUOffloadOptimizer keeps
    one CPU optimizer per offloaded parameter (keyed by its host copy) and one for the rest."""
    per_param = getattr(optimizer, "optim_dict", None)
    if per_param is None:
        return optimizer.state.get(p, {})
    if p in per_param:
        return next(iter(per_param[p].state.values()), {})
    return optimizer.d_opt.state.get(p, {}) if optimizer.d_opt is not None else {}


def _state_sums(model, optimizer) -> dict:
    import torch
    out = {}
    for name, p in model.named_parameters():
        out[name] = _checksum(p)
        for key, value in _state_of(optimizer, p).items():
            if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                out[f"{name}.{key}"] = _checksum(value)
    return out


def run_one(method: str, args) -> dict:
    import torch
    import transformers

    shape = TINY if args.tiny else T3
    device = torch.device(args.device)
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    config = transformers.LlamaConfig(
        hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"], vocab_size=shape["vocab_size"],
        max_position_embeddings=shape["seq"], attn_implementation="sdpa")
    torch.manual_seed(0)
    # Made on the device: the 2.9 B parameters' initialisation takes seconds there, not
    # most of a minute on the CPU, and leaves no freed CPU copies in the host RSS.
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(1)
    profiled = bool(args.profile) and device.type == "cuda"
    kind, _, option = method.partition(":")
    # After the timed steps, untimed: one watched step under a replay (its allocated bytes
    # before every op, read through the allocator's statistics at some 150 us per op),
    # then the profiled one.
    watched = kind == "spillway"
    batches = [torch.randint(0, shape["vocab_size"], (1, shape["seq"]), generator=generator)
               .to(device) for _ in range(args.steps + watched + profiled)]
    fused = device.type == "cuda" or args.tiny
    if kind == "torchao-offload":
        sys.path.insert(0, os.environ["SPILLWAY_T3_TORCHAO_DIR"])
        from torchao.optim import CPUOffloadOptimizer
        import torchao
        optimizer = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, fused=True)
        version = torchao.__version__
    elif kind == "spillway":
        optimizer = torch.optim.AdamW([{"params": [p]} for p in model.parameters()],
                                      lr=1e-4, fused=fused)
    elif kind == "spillway-hostadam":
        from spillway.optim import HostAdamW
        # On a CPU the probe finds torch's CPU AdamW unlike either CUDA form: the smoke
        # test names one (and its checksums then differ from the reference's).
        optimizer = HostAdamW(model.parameters(), lr=1e-4, step_in_backward=True,
                              free_grads=True,
                              arithmetic="probe" if device.type == "cuda" else "cuda-fused-float")
        result_extra = {"arithmetic": optimizer._arithmetic[0]}
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)

    def step(ids):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def timed(fn):
        if device.type == "cuda":
            before = torch.cuda.memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            began = time.perf_counter()
            out = fn()
            end.record()
            # ms the CPU took to issue the step (its Python, dispatch and the replay's
            # bookkeeping, waits for the host included): close to step ms, the CPU never
            # ran ahead (bound by the CPU, or blocked by a full launch queue: a profile
            # tells which)
            result["issue_ms"].append((time.perf_counter() - began) * 1e3)
            torch.cuda.synchronize()
            # What the caching allocator did in the step: a retry frees its cache
            # (cudaFree, a device-wide synchronize); new segments are cudaMallocs.
            after = torch.cuda.memory_stats()
            result["allocator"].append({key: after.get(key, 0) - before.get(key, 0) for key in (
                "num_alloc_retries", "num_device_alloc", "num_device_free",
                "num_sync_all_streams")})
            return out, start.elapsed_time(end)
        began = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - began) * 1e3

    result = {"method": method, "losses": [], "sums": [], "times_ms": [], "issue_ms": [],
              "peaks": [], "allocator": []}
    if kind == "spillway-hostadam":
        result.update(result_extra)
    if kind == "torchao-offload":
        result["torchao"] = version
    plan = replay = None
    for k, ids in enumerate(batches):
        if k == args.steps:  # the untimed steps, after the checksums (the reference took
            # as many steps as were timed); the replay's counts are the timed steps' (the
            # checksums' reads bring everything back, on demand)
            if replay is not None:
                result["replay"] = replay.stats()
            result["sums"] = _state_sums(model, optimizer)
        if k == args.steps and watched and replay is not None:
            replay.watch_memory()
            with replay.step():
                step(ids)
            replay.watch_memory(False)
            result["on_demand_watched"] = replay.on_demand_copies()
            continue
        if k >= args.steps:  # the profiled step
            def profiled_step(ids=ids):
                if replay is None:
                    return step(ids)
                with replay.step():
                    return step(ids)
            _profile_step(profiled_step, method, args)
            break
        if device.type == "cuda" and k >= 2:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if kind == "none" and k == 1 and device.type != "cuda":
            # No measured peak on a CPU (the smoke test): the residency model's stands in.
            import spillway.trace
            with spillway.trace.record(model, optimizer) as recording:
                loss, ms = timed(lambda: step(ids))
            result["simulated_peak_bytes"] = spillway.trace.plan(
                recording.trace, 1.0, min_bytes=args.min_bytes)["unplanned"]["peak_bytes"]
        elif kind == "spillway" and k == 1:
            import spillway.trace
            with spillway.trace.record(model, optimizer) as recording:
                loss, ms = timed(lambda: step(ids))
            fraction, *flags = option.removeprefix("budget=").split(":")
            budget = float(fraction) * args.reference_peak
            for flag in flags:  # threads=N: the host AdamW's threads (planned and run so)
                if flag.startswith("threads="):
                    os.environ["SPILLWAY_HOST_THREADS"] = flag.removeprefix("threads=")
                    result["host_threads"] = int(flag.removeprefix("threads="))
            # Step 3 under a plan that moves nothing: the host's time per op as a replay
            # spends it (the recorder's own Python work is in its times).
            probe = spillway.trace.replay(recording.trace, {"gaps": [], "storages": {}})
            probe.__enter__()
            planned = (recording.trace, budget, flags)
        elif kind == "spillway" and k == 2:
            def probed(ids=ids):
                with probe.step():
                    return step(ids)
            loss, ms = timed(probed)
            host_times = probe.host_times_ms()
            probe.__exit__(None, None, None)
            trace, budget, flags = planned
            if host_times is not None:
                trace = spillway.trace.with_host_times(trace, host_times)
                result["host_times_ms"] = sum(host_times)
            gbs = None
            if "host" in flags:  # AdamW may run on the host: at the speed measured here
                from spillway.optim import measure_host_adamw
                # While copying: the updates run beside the step's copies.
                copying = measure_host_adamw(while_copying=device.type == "cuda")
                alone = measure_host_adamw()
                gbs = result["host_adamw_gbs"] = copying["gbs"]
                result["host_adamw_gbs_alone"] = alone["gbs"]
                result["host_adamw_samples"] = {"copying": copying, "alone": alone}
            if args.save_trace:  # for planning it elsewhere: spillway simulate, plan()
                out = pathlib.Path(args.save_trace)
                out.mkdir(parents=True, exist_ok=True)
                spillway.trace.save(trace, out / "t3-trace.json.zst")
            began = time.perf_counter()
            plan = spillway.trace.plan(trace, int(budget), min_bytes=args.min_bytes,
                                       host_adamw_gbs=gbs, live_bytes=True,
                                       device_profile=args.device_profile)
            result["plan_s"] = time.perf_counter() - began
            result["host_updates"] = len(plan["host_updates"])
            replay = spillway.trace.replay(trace, plan)
            replay.__enter__()
        elif replay is not None:
            def replayed(ids=ids):
                with replay.step():
                    return step(ids)
            loss, ms = timed(replayed)
        else:
            loss, ms = timed(lambda: step(ids))
        result["losses"].append(loss.float().item())
        result["times_ms"].append(ms)
        if replay is not None and k >= 2:  # each replayed step's own counts
            result.setdefault("replay_steps", []).append(replay.stats())
            result.setdefault("on_demand_steps", []).append(replay.on_demand_copies())
        if device.type == "cuda" and k >= (3 if kind == "spillway" else 2):
            # Every step after the first two; for spillway every step under the plan
            # (step 3 ran under the empty plan that measures the host, at full memory).
            result["peaks"].append(torch.cuda.max_memory_allocated())
    if device.type == "cuda":
        result["peak_bytes"] = max(result["peaks"])
    if replay is not None:
        result.setdefault("replay", replay.stats())
        result["memory"] = _memory_against_forecast(replay, plan)
        replay.__exit__(None, None, None)  # everything back on the device
        if plan["forecast"]["host_busy_ms"] > 0:
            # The host updates' speed in each step under the plan (the fourth step on): the
            # bytes the plan gave them (its busy time at the speed it was made for) over the
            # time the updates that step submitted took, however far into the next step
            # they ran (all have finished once the replay is left).
            planned = plan["forecast"]["host_busy_ms"] * result["host_adamw_gbs"]
            busy = replay.host_busy_ms_by_step()
            result["host_adamw_gbs_in_step"] = [
                planned / busy[i] if busy.get(i, 0) > 0 else None
                for i in range(len(result["times_ms"]) - 3)]
        f = plan["forecast"]
        result["forecast"] = {"step_ms": f["step_ms"], "peak_bytes": f["peak_bytes"],
                              "budget_bytes": plan["budget_bytes"], "gaps": len(plan["gaps"]),
                              "host_bytes": f["host_bytes"], "bytes_d2h": f["bytes_d2h"],
                              "bytes_h2d": f["bytes_h2d"], "stall_ms": f["stall_ms"],
                              "host_busy_ms": f["host_busy_ms"],
                              # the host thread (Note [The host in residency replay])
                              "host_issue_ms": f["host_issue_ms"],
                              "host_blocked_ms": f["host_blocked_ms"],
                              "host_late_ms": f["host_late_ms"],
                              "replay_op_us": plan["replay_op_us"],
                              "replay_copy_us": plan["replay_copy_us"]}
    if not result["sums"]:
        result["sums"] = _state_sums(model, optimizer)  # after the last timed step
    result["rss_bytes"] = _rss_bytes()
    # Steady state: the median over the steps after the first three (plain, recorded,
    # first replayed: that one makes the pinned host buffers); the third is reported apart.
    times = result["times_ms"]
    first = 4 if kind == "spillway" else 3  # the first step under the plan, or the third
    steady = slice(first, None) if len(times) >= first + 2 else slice(first - 1, None)
    result["step_ms"] = statistics.median(times[steady] or times)
    if result["issue_ms"]:
        result["issue_step_ms"] = statistics.median(result["issue_ms"][steady] or
                                                    result["issue_ms"])
    if len(times) >= 3:
        result["third_step_ms"] = times[first - 1] if len(times) >= first else times[2]
    # The host updates' speed over the same steps (their list starts at the fourth step).
    ran = [g for g in ([None] * 3 + result.get("host_adamw_gbs_in_step", []))[steady] if g]
    if ran:
        result["host_adamw_gbs_ran"] = statistics.median(ran)
    return result


def _memory_against_forecast(replay, plan) -> dict:
    """The watched step's allocated bytes before each op against the simulator's live
    bytes at that op: where the measured peak is, where the forecast's is, the ops where
    measured exceeds forecast most, and both every 100 ops (GiB)."""
    watched = replay.memory_by_op()
    forecast = plan["forecast"].get("live_bytes")
    if not watched or not forecast:
        return {}
    rows = [(k, pos, target, got, forecast[pos]) for k, pos, target, got in watched]
    top = max(rows, key=lambda r: r[3])
    top_forecast = max(rows, key=lambda r: r[4])
    worst = sorted(rows, key=lambda r: r[4] - r[3])[:10]

    def row(r):
        return {"op": r[0], "position": r[1], "target": r[2], "measured_gib": r[3] / GIB,
                "forecast_gib": r[4] / GIB}
    return {"measured_peak": row(top), "forecast_peak": row(top_forecast),
            "most_over": [row(r) for r in worst],
            "every_100_ops": [[r[0], round(r[3] / GIB, 3), round(r[4] / GIB, 3)]
                              for r in rows[::100]]}


def _profile_step(fn, method: str, args) -> None:
    """One more step under torch.profiler: its Chrome trace, gzipped, in --profile."""
    import gzip
    import shutil
    import torch
    out = pathlib.Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    raw = out / f"{method.replace(':', '_').replace('=', '')}.trace.json"
    prof.export_chrome_trace(str(raw))
    # And one under cProfile: where the issuing thread's time goes, by Python function
    # (the replay's bookkeeping, its waits), which the Chrome trace shows only as gaps.
    import cProfile
    import io
    import pstats
    python_profile = cProfile.Profile()
    python_profile.enable()
    fn()
    torch.cuda.synchronize()
    python_profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(python_profile, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
    raw.with_suffix(".cprofile.txt").write_text(text.getvalue())
    with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", action="append", default=[])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--min-bytes", type=int, default=1 << 20)
    parser.add_argument("--device-profile", help="the device-profile JSON the plans are made "
                        "with (python -m spillway.calibrate on this GPU); default: the shipped "
                        "H200 profile")
    parser.add_argument("--work", default="/tmp/spillway-t3")
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--profile", help="a directory: one more step of each method under "
                        "torch.profiler, its Chrome trace gzipped there (CUDA only)")
    parser.add_argument("--profile-method", action="append", default=[],
                        help="with --profile: only these methods (default: all)")
    parser.add_argument("--save-trace", help="a directory: the recorded step of the first "
                        "spillway method lands there as t3-trace.json.zst")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--reference-peak", type=float, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    work = pathlib.Path(args.work)
    if args.run:
        out = run_one(args.run, args)
        (work / f"{args.run.replace(':', '_')}.json").write_text(json.dumps(out))
        return 0
    work.mkdir(parents=True, exist_ok=True)
    methods = args.method or ["none", "none", "spillway:budget=0.75", "spillway:budget=0.5",
                              "spillway:budget=0.35", "spillway:budget=0.2"]
    if methods[0] != "none":
        methods = ["none", *methods]
    results, reference, saved = [], None, False
    for method in methods:
        command = [sys.executable, __file__, "--run", method, "--steps", str(args.steps),
                   "--device", args.device, "--work", str(work), "--min-bytes",
                   str(args.min_bytes)]
        if args.profile and (not args.profile_method or method in args.profile_method):
            command += ["--profile", args.profile]
        if args.tiny:
            command.append("--tiny")
        if args.device_profile:
            command += ["--device-profile", args.device_profile]
        if args.save_trace and method.startswith("spillway:") and not saved:
            command += ["--save-trace", args.save_trace]
            saved = True
        if reference is not None:
            command += ["--reference-peak", str(reference.get("peak_bytes") or
                                                 reference["simulated_peak_bytes"])]
        began = time.time()
        try:
            run = subprocess.run(command, timeout=args.timeout, capture_output=True, text=True)
            ok = run.returncode == 0
            error = run.stderr[-2000:]
        except subprocess.TimeoutExpired:
            ok, error = False, f"timed out after {args.timeout} s"
        if not ok:
            print(f"[t3] {method}: FAILED\n{error}", file=sys.stderr)
            results.append({"method": method, "error": error})
            continue
        r = json.loads((work / f"{method.replace(':', '_')}.json").read_text())
        r["wall_s"] = round(time.time() - began, 1)
        if reference is None and method == "none":
            reference = r
        else:  # a second `none` is the control: the reference reproduces itself
            r["losses_equal"] = r["losses"] == reference["losses"]
            r["state_equal"] = r["sums"] == reference["sums"]
            r["vs_none"] = r["step_ms"] / reference["step_ms"]
        results.append(r)
        _report(results, args, quiet=True)  # what ran so far survives a run cut short
    _report(results, args)
    # torchao's CPUOffloadOptimizer runs torch's CPU AdamW, whose arithmetic is not the
    # GPU's: it is not expected to match (its row says so).
    return 0 if all("error" not in r and (r["method"].startswith("torchao") or
                                          (r.get("state_equal", True) and
                                           r.get("losses_equal", True)))
                    for r in results) else 1


def _report(results, args, quiet: bool = False) -> None:
    rows = ["| method | step ms | × none | step 3 ms | CPU issue ms | peak GiB | "
            "forecast step / peak | host RSS GiB | RSS over none's / host bytes | "
            "loss, state == none |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    # The host memory the offload costs: the RSS above a plain process's (the reference's:
    # CUDA's and torch's own), against the bytes the plan keeps on the host.
    base_rss = next((r["rss_bytes"] for r in results if r["method"] == "none"
                     and "error" not in r), None)
    for r in results:
        if "error" in r:
            rows.append(f"| {r['method']} | failed | | | | | | | | |")
            continue
        f = r.get("forecast")
        forecast = (f"{f['step_ms']:.1f} ms / {f['peak_bytes'] / GIB:.2f} GiB" if f else "")
        if f and f.get("host_issue_ms"):
            forecast += (f" (host {f['host_issue_ms']:.0f} ms issuing, "
                         f"{f['host_blocked_ms']:.0f} blocked; the replay's own "
                         f"{f['replay_op_us']:.1f} us an op, {f['replay_copy_us']:.0f} a copy)")
        if r.get("host_updates"):
            forecast += (f" (AdamW on the host: {r['host_updates']} ops, planned at "
                         f"{r['host_adamw_gbs']:.0f} GB/s" +
                         (f", ran at {r['host_adamw_gbs_ran']:.0f}"
                          if "host_adamw_gbs_ran" in r else "") + ")")
        elif r.get("host_adamw_gbs"):
            forecast += f" (AdamW on the device; the host measured {r['host_adamw_gbs']:.0f} GB/s)"
        rss_ratio = (f"{(r['rss_bytes'] - base_rss) / f['host_bytes']:.3f}"
                     if f and f.get("host_bytes") and base_rss is not None else "")
        name = r["method"] + (" (control)" if r["method"] == "none" and "vs_none" in r else "")
        rows.append(f"| {name} | {r['step_ms']:.1f} | {r.get('vs_none', 1.0):.2f} | "
                    f"{r.get('third_step_ms', 0):.1f} | {r.get('issue_step_ms', 0):.1f} | "
                    f"{r.get('peak_bytes', 0) / GIB:.2f} | {forecast} | "
                    f"{r['rss_bytes'] / GIB:.2f} | {rss_ratio} | "
                    f"{r.get('losses_equal', True)}, {r.get('state_equal', True)} |")
    table = "\n".join(rows)
    if not quiet:
        print(table)
    if args.markdown:
        pathlib.Path(args.markdown).write_text(table + "\n")
    if args.json:
        shown = [{k: v for k, v in r.items() if k != "sums"} for r in results]
        pathlib.Path(args.json).write_text(json.dumps(shown, indent=1))


if __name__ == "__main__":
    sys.exit(main())
