"""Backward peak of spillway.compile under CPU Inductor, by tracing the generated code.

The configuration of test_cuda_offload_lowers_peak_memory (python/tests/
test_compiled.py): HF Llama, hidden 512, intermediate 2048, 4 layers, vocab 128,
ids [4, 2048], scope "mlp", default min_bytes, on CPU.

Method: sys.settrace on the call() frames of Inductor's generated modules.
Before each line of the backward's call() (the module whose code names a
`tangents_` input), the live bytes are the distinct storages of the tensor
locals, less the model's parameters and less the host copies the backward
reloads from (the first argument of each spillway.reload line, and its
aliases): what a device would hold. On CPU the runtime's fake backend moves
the bytes, so host and "device" tensors share the CPU; the reload arguments
are how the two are told apart. The first call compiles; the second is
measured.

    PYTHONPATH=python python3 bench/torch/compiled_backward_peak.py \
        [--dtype bf16|fp32] [--configs none,p0,p1-start,p1-end] [--replay-pointwise on|off]
"""

from __future__ import annotations

import argparse
import copy
import linecache
import re
import sys
import time

import torch
import transformers

from spillway import _C
from spillway.activations import compiled

_RELOAD_ARG = re.compile(r"\s*buf\d+ = torch\.ops\.spillway\.reload\.default\((\w+)")
_ALIAS = re.compile(r"\s*(\w+) = (?:reinterpret_tensor\()?(\w+)\b")


class BackwardPeak:
    """Peak live bytes of the backward call() frame, line by line (see above)."""

    def __init__(self, excluded_ptrs: set[int]):
        self.excluded_ptrs = excluded_ptrs
        self.peak = 0
        self.frames = 0

    @staticmethod
    def _host_names(lines: list[str]) -> set[str]:
        names = {m.group(1) for line in lines if (m := _RELOAD_ARG.match(line))}
        for line in lines:
            if (m := _ALIAS.match(line)) and m.group(2) in names:
                names.add(m.group(1))
        return names

    def __call__(self, frame, event, _arg):
        code = frame.f_code
        if event != "call" or code.co_name != "call" or "torchinductor" not in code.co_filename:
            return None
        lines = linecache.getlines(code.co_filename)
        if not any("tangents_" in line for line in lines):
            return None
        host = self._host_names(lines)
        self.frames += 1

        def on_line(frame, event, _arg):
            live = {}
            for name, value in frame.f_locals.items():
                if name in host or not isinstance(value, torch.Tensor):
                    continue
                storage = value.untyped_storage()
                ptr = storage.data_ptr()
                if ptr and ptr not in self.excluded_ptrs:
                    live[ptr] = storage.nbytes()
            self.peak = max(self.peak, sum(live.values()))
            return on_line

        return on_line


def tiny_llama(dtype):
    config = transformers.LlamaConfig(
        hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train().to(dtype)


def measure(base, ids, config: str, replay_pointwise: bool) -> tuple[float, dict]:
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    info = {}
    if config == "none":
        run = torch.compile(model)
    else:
        prefetch = 0 if config == "p0" else 1
        anchor = "end" if config.endswith("end") else "start"
        run = compiled.compile(model, scope="mlp", prefetch=prefetch, prefetch_anchor=anchor,
                               replay_pointwise=replay_pointwise)
    run(ids, labels=ids).loss.backward()  # compiles
    _C.synchronize()
    if config != "none":
        (plan,) = compiled.last_plans()
        info = {"bytes_offloaded": plan.bytes_offloaded,
                "reloads_prefetched": plan.plan["reloads_prefetched"],
                "chosen": len(plan.chosen),
                "replayed": len(plan.plan.get("replays", []))}
    model.zero_grad(set_to_none=True)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    meter = BackwardPeak(params)
    loss = run(ids, labels=ids).loss
    sys.settrace(meter)
    try:
        loss.backward()
    finally:
        sys.settrace(None)
    _C.synchronize()
    assert meter.frames == 1, meter.frames
    return meter.peak / 2**20, info


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--configs", default="none,p0,p1-start,p1-end")
    parser.add_argument("--replay-pointwise", choices=["on", "off"], default="on",
                        help="spillway.compile's replay_pointwise (default on, as compile's)")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    base = tiny_llama(dtype)
    ids = torch.randint(0, 128, (4, 2048), generator=torch.Generator().manual_seed(1))
    print(f"torch {torch.__version__}, {args.dtype}, threads {torch.get_num_threads()}, "
          f"replay_pointwise {args.replay_pointwise}")
    for config in args.configs.split(","):
        start = time.time()
        peak, info = measure(base, ids, config, args.replay_pointwise == "on")
        print(f"{config:9s} backward peak {peak:8.1f} MiB  {info}  ({time.time() - start:.0f} s)",
              flush=True)


if __name__ == "__main__":
    main()
