"""UMT5 prompt encoding as Wan pipelines do it (shared by the pipeline and training).

Tokens past each prompt's length are zeroed, then every prompt is padded to `max_sequence_length`, so
a prompt's embedding does not depend on what else is in the batch.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def encode_prompts(
    tokenizer, text_encoder, prompts: list[str], max_sequence_length: int, device=None, dtype=None
) -> torch.Tensor:
    """`(len(prompts), max_sequence_length, text_dim)` embeddings, zero past each prompt's end."""
    device = device or text_encoder.device
    inputs = tokenizer(
        prompts,
        padding="max_length",
        max_length=max_sequence_length,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    ids, mask = inputs.input_ids.to(device), inputs.attention_mask.to(device)
    hidden = text_encoder(ids, mask).last_hidden_state
    hidden = hidden * mask.unsqueeze(-1).to(hidden.dtype)
    return hidden.to(dtype=dtype or hidden.dtype)
