"""Tiny Hugging Face models for tests: deterministic weights and inputs from a seed.

    model, input_ids = tiny_llama(seed, device="cpu", dtype=torch.float32)
    loss = model(input_ids, labels=input_ids).loss

Dropout is off, so two forward passes of one model give bit-equal results.
Keyword arguments size the model (defaults: 2 layers, hidden 64, vocab 128,
batch 2, sequence 32).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch


def _input_ids(seed: int, vocab: int, batch: int, seq: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, vocab, (batch, seq), generator=gen).to(device)


def tiny_llama(seed: int, device="cpu", dtype=torch.float32, *, layers: int = 2,
               hidden: int = 64, intermediate: int | None = None, heads: int = 4,
               kv_heads: int = 2, vocab: int = 128, batch: int = 2, seq: int = 32):
    """A LlamaForCausalLM (sdpa attention) and input ids, both on `device`."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        vocab_size=vocab, max_position_embeddings=max(64, seq), attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config)
    model.to(device=device, dtype=dtype).train()
    return model, _input_ids(seed, vocab, batch, seq, device)


def tiny_gpt2(seed: int, device="cpu", dtype=torch.float32, *, layers: int = 2,
              hidden: int = 64, heads: int = 4, vocab: int = 128, batch: int = 2,
              seq: int = 32, dropout: float = 0.0):
    """A GPT2LMHeadModel (sdpa attention; dropout off unless `dropout`, then every dropout
    has that probability and two forwards agree only from the same RNG state) and input
    ids, both on `device`."""
    import transformers

    config = transformers.GPT2Config(
        n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=vocab,
        n_positions=max(64, seq), resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.GPT2LMHeadModel(config)
    model.to(device=device, dtype=dtype).train()
    return model, _input_ids(seed, vocab, batch, seq, device)


# Hugging Face causal LMs beyond Llama and GPT-2, as tiny_causal_lm builds them:
# (config class, model class, architecture-specific config keywords).
_ARCHITECTURES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # GQA, biased q/k/v projections
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",  # fused qkv and gate_up projections
             {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "resid_pdrop": 0.0,
              "embd_pdrop": 0.0}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",  # fused qkv, partial rotary, GELU
                 {"hidden_dropout": 0.0, "attention_dropout": 0.0, "rotary_pct": 0.25}),
}
ARCHITECTURES = tuple(_ARCHITECTURES)


def tiny_causal_lm(arch: str, seed: int, device="cpu", dtype=torch.float32, *,
                   layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                   vocab: int = 128, batch: int = 2, seq: int = 32):
    """A tiny model of one of ARCHITECTURES (sdpa attention, no dropout) and input ids."""
    import transformers

    config_name, model_name, extra = _ARCHITECTURES[arch]
    sizes = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                 num_attention_heads=heads, vocab_size=vocab,
                 max_position_embeddings=max(64, seq), attn_implementation="sdpa")
    if arch != "gpt_neox":
        sizes["num_key_value_heads"] = kv_heads
    config = getattr(transformers, config_name)(**sizes, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_name)(config)
    model.to(device=device, dtype=dtype).train()
    return model, _input_ids(seed, vocab, batch, seq, device)


@contextlib.contextmanager
def deterministic_cuda():
    """Math SDPA and deterministic kernels, so two plain runs agree bit for bit."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was = (torch.are_deterministic_algorithms_enabled(),
           torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


class SyntheticGrad(torch.autograd.Function):
    """Identity forward; backward hands back a view of its saved tensor."""

    @staticmethod
    def forward(ctx, x, saved):
        ctx.save_for_backward(saved)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (saved,) = ctx.saved_tensors
        return saved[:, : grad.shape[1]], None


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches reset around a test, and the fake backend's copy delays off after it.

    Import it into a test module and apply it with
    `pytestmark = pytest.mark.usefixtures("fresh_dynamo")`.
    """
    from spillway import _C

    torch._dynamo.reset()
    yield
    _C.set_fake_copy_delay(0, 0)
    torch._dynamo.reset()
