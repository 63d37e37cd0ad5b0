#!/usr/bin/env python3
"""What Spillway's eager hooks cost the thread that launches a step: host time of the
forward per block and per saved tensor, on a model whose kernels take next to nothing.

    PYTHONPATH=python python3 bench/torch/eager_host_overhead.py [--device cpu|cuda]
        [--layers 16] [--steps 20] [--dtype float32|bfloat16] [--json OUT]

Why: on T1 an eager plan's forward is bound by that thread (v15, H100: in a profiled
step the launch lead stays at zero through the forward and the compute stream idles 4-5
ms of every 10; the same plans ran 25-54 ms slower on a machine whose host was slower,
bench/results/2026-12-07-t1-eager-budget-v15-h100.md). The kernels of one T1 block take
~5.2 ms on an H100; whatever the hooks add to the host's ~block time beyond that is
step time. This measures the hooks apart from the kernels: a Llama with T1's structure
(its layer count, as many key/value heads as heads, SDPA) and tiny tensors (hidden 128,
batch 1 x seq 16), so a forward's host time is Python and the dispatcher.

Ways of running the forward, each timed on the host (model call to loss, no sync;
median of --steps after warm-up), each the same work but for the hooks:

- none: no context;
- offload: offload_activations(model) moving every saved tensor (min_bytes=0);
- plan, <policy>: a memory_budget context whose every block call runs the policy:
  offload S_k with C_k and L_k kept apart (their blocks run under the Recorder), the
  same with C_k and L_k rebuilt (recipes), the block checkpointed, the first two
  again by position (Notes [Parts by position] and [Recipes by position], _recipes.py:
  no Recorder), and the rebuild by position with its extra inputs caught in the
  submodule calls that take them (Note [Catching in a window], _CATCH_IN_WINDOWS);
  the by-position keep and the windowed rebuild again with what the contexts find
  unchanged between calls kept (Note [A leaner host path], eager._LEAN_HOST), then
  with their kept saves packed in C++ too (Note [Kept saves in C++], _FAST_KEEP), then
  with their offloaded saves sent straight to the store too (Note [Offloaded saves by
  position], _FAST_OFFLOAD).

Printed: host ms per forward, the difference to `none` per block call and per saved
tensor the hooks saw (tensors_seen per step). Timings of this host, not of the GPU
machine's: compare ways within one run.

--ablate: two more ways, the by-position keep way with part of its hooks replaced by
a plain keep (each saved tensor held as it is, no copy): "copies stubbed" (what the
store would offload is kept: the custom ops, their waits and the entries go) and "pack
stubbed" (the pack hook keeps every save at once: what is left is the block-level
hooks). Not plans anyone runs (nothing is offloaded): the differences to the full way
say where a hooked block's host time goes, on the GPU machine's host too.

--profile N: after the table, N more forwards of each way whose name contains
--profile-way (default: the by-position rebuild) run under cProfile, and the functions
with the most own time are printed (cProfile's own cost inflates the Python rows; read
the shares, not the totals): where a hooked block's host time goes, on the GPU
machine's host too (device-check: SPILLWAY_T1_HOST_BENCH=1 passes --profile 5).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))


def _model(device: str, layers: int):
    import torch
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=352, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
        max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device).train()
    ids = torch.randint(0, 256, (1, 16), device=device)
    return model, ids


def _forward_host_ms(model, ids, ctx, steps: int, sync, profile=None
                     ) -> tuple[float, int, float | None]:
    """(median host ms of the forward, tensors the context saw per step, median host ms
    of the forward outside its block calls: the hooks around them, the embeddings and
    the head; None without planned block calls); with `profile` (a cProfile.Profile),
    each forward runs under it and backward outside it."""
    seen0 = ctx.stats()["tensors_seen"] if ctx is not None else 0
    times, between = [], []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        if profile is not None:
            profile.enable()
        if ctx is None:
            loss = model(ids, labels=ids, use_cache=False).loss
        else:
            with ctx:
                loss = model(ids, labels=ids, use_cache=False).loss
        if profile is not None:
            profile.disable()
        times.append(1e3 * (time.perf_counter() - t0))
        blocks = (ctx.stats().get("block_forward_host_ms") or []) if ctx is not None else []
        if blocks:
            between.append(times[-1] - sum(blocks))
        loss.backward()
        sync()
    seen = (ctx.stats()["tensors_seen"] - seen0) // steps if ctx is not None else 0
    return statistics.median(times), seen, statistics.median(between) if between else None


def _profiled(model, ids, ctx, steps: int, sync, top: int = 30) -> str:
    """The forwards' functions with the most own time, as pstats prints them."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    _forward_host_ms(model, ids, ctx, steps, sync, profile)
    out = io.StringIO()
    pstats.Stats(profile, stream=out).strip_dirs().sort_stats("tottime").print_stats(top)
    return out.getvalue().strip()


def _stub(ctx, stub: str | None) -> None:
    """--ablate: the context's copies ("copies"), or its whole pack hook ("pack"), replaced
    by a plain keep (instance attributes, set before the context is entered: its hooks
    bind them then); None: nothing."""
    from spillway.activations._eager_store import _Kept

    if stub == "copies":
        ctx._pack_offloaded = lambda t, storage, key: _Kept(ctx, t, ctx._current)
    elif stub == "pack":
        ctx._pack = lambda t: _Kept(ctx, t, None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the model's (T1's is bfloat16: its norms' float copies are "
                             "then rebuilt from the bf16 hidden state, an extra input)")
    parser.add_argument("--json")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="N forwards of the --profile-way ways under cProfile (0: none)")
    parser.add_argument("--ablate", action="store_true",
                        help="also time the by-position keep way with its copies, then its "
                             "whole pack hook, replaced by a plain keep")
    parser.add_argument("--profile-way", default="rebuild C_k and L_k (by position)",
                        help="profile the ways whose name contains this")
    args = parser.parse_args()

    import torch

    from spillway.activations._eager_budget import _CallPolicy
    from spillway.activations import eager
    from spillway.activations.eager import offload_activations

    cuda = args.device.startswith("cuda")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    model, ids = _model(args.device, args.layers)
    model = model.to(getattr(torch, args.dtype))
    warm = max(3, args.steps // 4)
    rows = []

    profiles = []  # (way, pstats text)

    def measure(name, ctx):
        _forward_host_ms(model, ids, ctx, warm, sync)
        ms, seen, between = _forward_host_ms(model, ids, ctx, args.steps, sync)
        rows.append(dict(way=name, forward_host_ms=round(ms, 3), tensors_seen=seen,
                         outside_blocks_ms=None if between is None else round(between, 3)))
        if args.profile > 0 and args.profile_way in name:
            profiles.append((name, _profiled(model, ids, ctx, args.profile, sync)))

    measure("none", None)
    measure("offload", offload_activations(model, min_bytes=0, device=args.device))
    from spillway.activations import _eager_budget

    keep_apart = dict(checkpoint=False, offload_saved=True, offload_input=False, lag=0,
                      cheap="keep", linear="keep")
    rebuild = dict(keep_apart, cheap="recompute", linear="recompute")
    keep_by_position = "plan, offload S_k, keep C_k and L_k (by position)"
    rebuild_by_position = "plan, offload S_k, rebuild C_k and L_k (by position)"
    windows = rebuild_by_position.replace(")", ", caught in windows)")

    def way(name, policy, parts=False, recipes=False, windows=False, lean=False, fast=False,
            offload=False, stub=None):
        """A way: the policy of every block call, Notes [Parts by position], [Recipes by
        position], [Catching in a window], [A leaner host path], [Kept saves in C++] and
        [Offloaded saves by position] on or off, --ablate's stub or None."""
        return dict(name=name, policy=policy, parts=parts, recipes=recipes, windows=windows,
                    lean=lean, fast=fast, offload=offload, stub=stub)

    by_position = dict(parts=True, recipes=True)
    ways = [
        way("plan, offload S_k, keep C_k and L_k (recorded)", keep_apart),
        way("plan, offload S_k, rebuild C_k and L_k (recorded)", rebuild),
        way("plan, checkpoint", dict(checkpoint=True, offload_saved=False, offload_input=False)),
        way(keep_by_position, keep_apart, parts=True),
        way(rebuild_by_position, rebuild, **by_position),
        way(windows, rebuild, **by_position, windows=True),
        way(keep_by_position.replace(")", ", lean host)"), keep_apart, parts=True, lean=True),
        way(windows.replace(")", ", lean host)"), rebuild, **by_position, windows=True,
            lean=True),
        way(keep_by_position.replace(")", ", lean host, kept in C++)"), keep_apart, parts=True,
            lean=True, fast=True),
        way(windows.replace(")", ", lean host, kept in C++)"), rebuild, **by_position,
            windows=True, lean=True, fast=True),
        way(keep_by_position.replace(")", ", lean host, kept and offloaded in C++)"),
            keep_apart, parts=True, lean=True, fast=True, offload=True),
        way(windows.replace(")", ", lean host, kept and offloaded in C++)"), rebuild,
            **by_position, windows=True, lean=True, fast=True, offload=True),
    ]
    if args.ablate:
        ways += [way(keep_by_position.replace(")", f", {stub} stubbed)"), keep_apart,
                     parts=True, stub=stub) for stub in ("copies", "pack")]
    for w in ways:
        name, policy, stub = w["name"], w["policy"], w["stub"]
        _eager_budget._PARTS_BY_POSITION = w["parts"]
        _eager_budget._RECIPES_BY_POSITION = w["recipes"]
        _eager_budget._CATCH_IN_WINDOWS = w["windows"]
        eager._LEAN_HOST = w["lean"]
        _eager_budget._FAST_KEEP = w["fast"]
        _eager_budget._FAST_OFFLOAD = w["offload"]
        ctx = offload_activations(model, memory_budget=1.0, min_bytes=0, profile_steps=1,
                                  device=args.device)
        _forward_host_ms(model, ids, ctx, 2, sync)  # the profiling step, then a plan
        ctx._policies = [_CallPolicy(**policy) for _ in ctx._policies]
        _stub(ctx, stub)
        measure(name, ctx)

    none = rows[0]["forward_host_ms"]
    print(f"# eager hooks on the host: {args.layers} layers, {args.device}, {args.dtype}, "
          f"torch {torch.__version__}, median of {args.steps} forwards\n")
    print("| way | forward host ms | over none, per block us | saved tensors seen | "
          "over none, per tensor us | outside block calls ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        over = r["forward_host_ms"] - none
        per_block = 1e3 * over / args.layers
        per_tensor = f"{1e3 * over / r['tensors_seen']:.1f}" if r["tensors_seen"] else "-"
        r.update(over_none_per_block_us=round(per_block, 1))
        outside = r["outside_blocks_ms"]
        print(f"| {r['way']} | {r['forward_host_ms']:.2f} | {per_block:.0f} | "
              f"{r['tensors_seen'] or '-'} | {per_tensor} | "
              f"{'-' if outside is None else f'{outside:.2f}'} |")
    for name, text in profiles:
        print(f"\n## {name}: {args.profile} forwards under cProfile, by own time\n")
        print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(device=args.device, layers=args.layers, dtype=args.dtype,
                           torch=torch.__version__,
                           rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
