"""The Hugging Face models whose joint graphs ship in examples/graphs/, and T1's.

All weights are random, built from configs: nothing is downloaded. Small
models are real tensors (on the CPU unless a device is given); large ones are
FakeTensors built from a meta-device model, so tracing a Llama-3-8B allocates
no weight or activation memory. `t1` is workload T1 of BENCHMARKS.md built by
bench/torch/t1.py itself (real tensors, on CUDA by default), so its graph is
the benchmark's model; `t1-tiny` is the same construction at t1.py's --tiny
shape, small enough for CPU tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import pathlib
import sys
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode


@dataclasses.dataclass
class Preset:
    """What export_joint_graph needs to trace one named model."""

    model: torch.nn.Module
    fn: Callable[..., Any]  # the traced step: returns the loss
    args: tuple
    dynamic: tuple[tuple[int, int], ...]
    metadata: dict[str, str]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def fakeify(model: torch.nn.Module, fake_mode: FakeTensorMode, device: str = "cpu") -> None:
    """Replace every parameter and buffer by an uninitialised FakeTensor of the same
    shape, stride and dtype, keeping shared (tied) parameters shared."""
    replaced: dict[int, torch.Tensor] = {}
    with fake_mode:
        for module in model.modules():
            for key, p in list(module._parameters.items()):
                if p is None:
                    continue
                if id(p) not in replaced:
                    data = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=device)
                    replaced[id(p)] = torch.nn.Parameter(data, requires_grad=p.requires_grad)
                module._parameters[key] = replaced[id(p)]
            for key, b in list(module._buffers.items()):
                if b is None:
                    continue
                if id(b) not in replaced:
                    replaced[id(b)] = torch.empty_strided(b.shape, b.stride(), dtype=b.dtype, device=device)
                module._buffers[key] = replaced[id(b)]


def _causal_lm_step(model: torch.nn.Module) -> Callable[..., Any]:
    def step(input_ids):
        # Cross-entropy of the next token, as Hugging Face computes it from labels.
        return model(input_ids=input_ids, labels=input_ids).loss

    return step


def _config_summary(config: Any, keys: tuple[str, ...]) -> str:
    return json.dumps({k: getattr(config, k) for k in keys if hasattr(config, k)}, sort_keys=True)


_LLAMA_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
    "tie_word_embeddings",
)
_GPT2_KEYS = ("vocab_size", "n_embd", "n_layer", "n_head", "n_inner", "n_positions", "tie_word_embeddings")


def _llama(
    *, hidden: int, layers: int, heads: int, kv_heads: int, mlp: int, vocab: int,
    batch: int, seq: int, dtype: torch.dtype, fake: bool, dynamic: bool, tie: bool,
    device: str = "cpu",
) -> Preset:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max(seq, 2048), attn_implementation="sdpa",
        use_cache=False, tie_word_embeddings=tie,
    )
    return _causal_lm(LlamaForCausalLM, config, _LLAMA_KEYS, batch, seq, dtype, fake, dynamic, device)


def _causal_lm(cls, config, keys, batch, seq, dtype, fake, dynamic, device="cpu") -> Preset:
    """Fake tensors on `device` (from a meta-device model), or real ones built there."""
    torch.manual_seed(0)
    fake_mode = FakeTensorMode() if fake else None
    with _default_dtype(dtype), torch.device("meta" if fake else device):
        model = cls(config)
    if fake:
        fakeify(model, fake_mode, device)
        with fake_mode:
            input_ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    else:
        input_ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    model.train()
    metadata = _causal_lm_metadata(model, keys, batch, seq, dtype, fake, dynamic, device)
    return Preset(model, _causal_lm_step(model), (input_ids,), ((0, 1),) if dynamic else (), metadata)


def _causal_lm_metadata(model, keys, batch, seq, dtype, fake, dynamic, device) -> dict[str, str]:
    config = model.config
    if getattr(model, "loss_type", None) is None:
        # GPT2LMHeadModel's name does not reveal its loss; the lookup would log
        # a warning, which is a graph break under fullgraph=True.
        model.loss_type = "ForCausalLM"
    metadata = {
        "model": type(model).__name__,
        "config": _config_summary(config, keys),
        "attn_implementation": str(config._attn_implementation),
        "batch": str(batch),
        "seq": str(seq),
        "dtype": str(dtype).removeprefix("torch."),
        "fake_tensors": "true" if fake else "false",
        "device": device,
        "dynamic": "input_ids dim 1" if dynamic else "none",
        "loss": "cross_entropy(logits, labels=input_ids), Hugging Face shift",
    }
    if device.startswith("cuda"):
        # SDPA picks its kernel from the GPU's capabilities.
        metadata["gpu"] = torch.cuda.get_device_name(device)
    return metadata


def llama_tiny(*, seq: int = 256, batch: int = 2, dynamic: bool = False, device: str = "cpu") -> Preset:
    return _llama(hidden=256, layers=2, heads=4, kv_heads=2, mlp=704, vocab=2048, batch=batch,
                  seq=seq, dtype=torch.float32, fake=False, dynamic=dynamic, tie=False,
                  device=device)


def llama3_8b(*, seq: int = 8192, batch: int = 1, dynamic: bool = False, device: str = "cpu") -> Preset:
    """Fake tensors on `device`. "cuda" needs a CUDA build of torch and a visible GPU
    (dynamo's device guards call the CUDA runtime even for fake tensors)."""
    return _llama(hidden=4096, layers=32, heads=32, kv_heads=8, mlp=14336, vocab=128256,
                  batch=batch, seq=seq, dtype=torch.bfloat16, fake=True, dynamic=dynamic, tie=False,
                  device=device)


def gpt2_tiny(*, seq: int = 256, batch: int = 2, dynamic: bool = False, device: str = "cpu") -> Preset:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=2048, n_embd=256, n_layer=2, n_head=4, n_positions=max(seq, 1024),
        attn_implementation="sdpa", use_cache=False,
    )
    return _causal_lm(GPT2LMHeadModel, config, _GPT2_KEYS, batch, seq, torch.float32, False, dynamic,
                      device)


T1_SCRIPT = pathlib.Path(__file__).resolve().parents[3] / "bench" / "torch" / "t1.py"


def t1_benchmark():
    """bench/torch/t1.py as a module (its T1 and TINY shapes, its _build)."""
    name = "spillway_bench_t1"
    if name not in sys.modules:
        if not T1_SCRIPT.is_file():
            raise FileNotFoundError(
                f"[fx_export] preset t1 builds its model with {T1_SCRIPT}, which is missing "
                "(the t1 presets need a source checkout)")
        spec = importlib.util.spec_from_file_location(name, T1_SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def _t1(shape_name: str, *, seq: int | None, batch: int | None, device: str, dtype: torch.dtype) -> Preset:
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"[fx_export] preset {'t1' if shape_name == 'T1' else 't1-tiny'} builds real tensors "
            f"on '{device}', and torch.cuda.is_available() is False; pass --device cpu (t1 then "
            "needs ~2.2 GiB of weights and a full-size forward pass on the CPU)")
    bench = t1_benchmark()
    shape = dict(getattr(bench, shape_name))
    shape.update({k: v for k, v in (("seq", seq), ("batch", batch)) if v is not None})
    model, input_ids = bench._build(shape, device, dtype)
    metadata = _causal_lm_metadata(model, _LLAMA_KEYS, shape["batch"], shape["seq"], dtype,
                                   False, False, device)
    metadata["construction"] = f"bench/torch/t1.py _build({shape_name} shape)"
    return Preset(model, _causal_lm_step(model), (input_ids,), (), metadata)


def t1(*, seq: int | None = None, batch: int | None = None, device: str = "cuda") -> Preset:
    """Workload T1 (BENCHMARKS.md): hidden 2048, 16 layers, 16 heads, 16 KV heads,
    MLP 5632, vocab 32000, untied, batch 4 x seq 4096, bf16, SDPA, real random
    weights on `device`. Its training step holds ~30 GiB of activations."""
    return _t1("T1", seq=seq, batch=batch, device=device, dtype=torch.bfloat16)


def t1_tiny(*, seq: int | None = None, batch: int | None = None, device: str = "cpu") -> Preset:
    """t1.py's --tiny shape (hidden 64, 2 layers, vocab 128, batch 2 x seq 32), bf16."""
    return _t1("TINY", seq=seq, batch=batch, device=device, dtype=torch.bfloat16)


PRESETS: dict[str, Callable[..., Preset]] = {
    "llama-tiny": llama_tiny,
    "llama-tiny-dynamic": lambda **kw: llama_tiny(dynamic=True, **kw),
    "gpt2-tiny": gpt2_tiny,
    "llama3-8b": llama3_8b,
    "t1": t1,
    "t1-tiny": t1_tiny,
}
