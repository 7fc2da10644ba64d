"""A short text sample from the model at the end of training (outside the compiled step)."""

from __future__ import annotations

import torch

from xtrain.model.gpt import GPT


def host_copy(model):
    """The model on the CPU: token-by-token shapes would recompile an XLA graph per token."""
    if next(model.parameters()).device.type != "xla":
        return model
    cpu_model = GPT(model.config)
    cpu_model.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    return cpu_model


def sample_text(model, tokenizer, n_tokens: int, seed: int, prompt: str = "#include <") -> str:
    model = host_copy(model)
    model.eval()
    device = next(model.parameters()).device
    idx = torch.tensor([[tokenizer.bos_id] + tokenizer.encode(prompt)], device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(idx, n_tokens, temperature=0.8, generator=gen)
    return tokenizer.decode(out[0, 1:].tolist())
