"""The main job with a GPU: one real offloaded training step, checked and measured.

    python3 -m spillway.demo [--layers 8] [--hidden 2048] [--seq 4096] [--batch 2]
                             [--scope LlamaDecoderLayer]

Builds a Llama-style model with random weights (bf16, SDPA attention) on the
GPU, runs forward + backward once without offload and once under
spillway.offload_activations, and prints: whether the loss and every
gradient are bitwise equal, the step times, the peak memory above the weights
of each run and the bytes that went to pinned host memory. Exits 1 when the
results differ.

Without a GPU it runs the same steps on CPU with a smaller model (2 layers,
hidden 128, batch 2 x seq 64, float32, min_bytes 4096) whose saved tensors
move through the runtime's fake copy backend. That checks exactness and the
runtime's bookkeeping and counts the bytes moved; it does not measure peak
memory (torch keeps no allocator statistics for CPU tensors), and CPU step
times say nothing about a GPU.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

GIB = 1 << 30
MIB = 1 << 20
# The model's shape with and without a GPU; flags override each field.
GPU_SHAPE = {"layers": 8, "hidden": 2048, "seq": 4096, "batch": 2}
CPU_SHAPE = {"layers": 2, "hidden": 128, "seq": 64, "batch": 2}
CPU_MIN_BYTES = 4096  # the CPU model's saved tensors are small


def _model(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128 or 1,
                         num_key_value_heads=args.hidden // 128 or 1, vocab_size=32000,
                         max_position_embeddings=args.seq, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16 if device == "cuda" else torch.float32)
    model.train()
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(1)).to(device)
    return model, ids


def _step(model, ids, device, offload=None):
    from spillway import _C

    model.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    stats = None
    if offload is None:
        loss = model(input_ids=ids, labels=ids).loss
    else:
        with offload(model) as ctx:
            loss = model(input_ids=ids, labels=ids).loss
        stats = ctx
    loss.backward()
    _C.synchronize()
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - base) if device == "cuda" else 0
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, dt, peak, (stats.stats() if stats is not None else {})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for field in GPU_SHAPE:
        parser.add_argument(f"--{field}", type=int, default=None,
                            help=f"default {GPU_SHAPE[field]} with a GPU, {CPU_SHAPE[field]} on CPU")
    parser.add_argument("--scope", default="LlamaDecoderLayer",
                        help="modules whose saved tensors move (default: %(default)s)")
    parser.add_argument("--min-bytes", type=int, default=1 << 20,
                        help=f"smallest tensor that moves (default %(default)s; at most "
                             f"{CPU_MIN_BYTES} on CPU)")
    parser.add_argument("--prefetch", type=int, default=1,
                        help="layers ahead that backward reloads (default %(default)s)")
    args = parser.parse_args(argv)
    from spillway.activations import eager

    device = "cuda" if torch.cuda.is_available() else "cpu"
    big = device == "cuda"
    for field, default in (GPU_SHAPE if big else CPU_SHAPE).items():
        setattr(args, field, getattr(args, field) or default)
    if not big:
        args.min_bytes = min(args.min_bytes, CPU_MIN_BYTES)
    shape = (f"Llama-style, {args.layers} layers, hidden {args.hidden}, batch {args.batch} x "
             f"seq {args.seq}, {'bfloat16' if big else 'float32'}, scope {args.scope}")
    if big:
        print(f"[demo] {torch.cuda.get_device_name()}, torch {torch.__version__}: {shape}")
    else:
        gpu = GPU_SHAPE
        print(f"[demo] no GPU: a smaller model on CPU (with a GPU: {gpu['layers']} layers, hidden "
              f"{gpu['hidden']}, batch {gpu['batch']} x seq {gpu['seq']}, bfloat16)")
        print(f"[demo] cpu, torch {torch.__version__}: {shape}, min_bytes {args.min_bytes}")
        print("[demo] saved tensors move through the runtime's fake copy backend (threads standing "
              "in for copy streams):\n"
              "       it checks exactness and bookkeeping; no peak memory on CPU, and CPU times "
              "say nothing about a GPU")
    model, ids = _model(args, device)

    def offload(m):
        return eager.offload_activations(m, scope=args.scope, min_bytes=args.min_bytes,
                                         prefetch=args.prefetch, device=device)

    # One warm-up of each, then the measured pair.
    _step(model, ids, device)
    _step(model, ids, device, offload)
    ref_loss, ref_grads, ref_dt, ref_peak, _ = _step(model, ids, device)
    loss, grads, dt, peak, stats = _step(model, ids, device, offload)
    same = torch.equal(loss, ref_loss) and all(torch.equal(grads[n], g) for n, g in ref_grads.items())
    moved = stats.get("bytes_offloaded", 0)
    print(f"[demo] loss and all {len(ref_grads)} gradients bitwise equal to no offload: {same}")
    print(f"[demo] step{'' if big else ' on CPU'}: {1e3 * ref_dt:.1f} ms without offload, "
          f"{1e3 * dt:.1f} ms with ({dt / ref_dt:.2f}x)")
    if big:
        print(f"[demo] peak memory above weights: {ref_peak / GIB:.2f} GiB without, "
              f"{peak / GIB:.2f} GiB with (-{(ref_peak - peak) / GIB:.2f} GiB); "
              f"moved to pinned host memory: {moved / GIB:.2f} GiB")
    else:
        print(f"[demo] moved through the fake copy backend: {moved / MIB:.2f} MiB in "
              f"{stats.get('storages_offloaded', 0)} storages; backward reloaded "
              f"{stats.get('bytes_reloaded', 0) / MIB:.2f} MiB and read "
              f"{stats.get('bytes_kept_resident', 0) / MIB:.2f} MiB still resident")
    print(f"[demo] offload stats: {stats}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
