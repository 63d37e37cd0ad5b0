"""The Hugging Face models whose joint graphs ship in examples/graphs/.

All weights are random, built from configs: nothing is downloaded. Small
models are real CPU tensors; large ones are FakeTensors built from a meta-device
model, so tracing a Llama-3-8B allocates no weight or activation memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
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
    if device != "cpu" and not fake:
        raise ValueError(f"[fx_export] device '{device}' needs a fake-tensor preset")
    torch.manual_seed(0)
    fake_mode = FakeTensorMode() if fake else None
    with _default_dtype(dtype), (torch.device("meta") if fake else contextlib.nullcontext()):
        model = cls(config)
    if fake:
        fakeify(model, fake_mode, device)
        with fake_mode:
            input_ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    else:
        input_ids = torch.randint(0, config.vocab_size, (batch, seq))
    model.train()
    if getattr(model, "loss_type", None) is None:
        # GPT2LMHeadModel's name does not reveal its loss; the lookup would log
        # a warning, which is a graph break under fullgraph=True.
        model.loss_type = "ForCausalLM"
    metadata = {
        "model": cls.__name__,
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
        metadata["gpu"] = torch.cuda.get_device_name()
    return Preset(model, _causal_lm_step(model), (input_ids,), ((0, 1),) if dynamic else (), metadata)


def llama_tiny(*, seq: int = 256, batch: int = 2, dynamic: bool = False) -> Preset:
    return _llama(hidden=256, layers=2, heads=4, kv_heads=2, mlp=704, vocab=2048, batch=batch,
                  seq=seq, dtype=torch.float32, fake=False, dynamic=dynamic, tie=False)


def llama3_8b(*, seq: int = 8192, batch: int = 1, dynamic: bool = False, device: str = "cpu") -> Preset:
    """Fake tensors on `device`. "cuda" needs a CUDA build of torch and a visible GPU
    (dynamo's device guards call the CUDA runtime even for fake tensors)."""
    return _llama(hidden=4096, layers=32, heads=32, kv_heads=8, mlp=14336, vocab=128256,
                  batch=batch, seq=seq, dtype=torch.bfloat16, fake=True, dynamic=dynamic, tie=False,
                  device=device)


def gpt2_tiny(*, seq: int = 256, batch: int = 2, dynamic: bool = False) -> Preset:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=2048, n_embd=256, n_layer=2, n_head=4, n_positions=max(seq, 1024),
        attn_implementation="sdpa", use_cache=False,
    )
    return _causal_lm(GPT2LMHeadModel, config, _GPT2_KEYS, batch, seq, torch.float32, False, dynamic)


PRESETS: dict[str, Callable[..., Preset]] = {
    "llama-tiny": llama_tiny,
    "llama-tiny-dynamic": lambda **kw: llama_tiny(dynamic=True, **kw),
    "gpt2-tiny": gpt2_tiny,
    "llama3-8b": llama3_8b,
}
