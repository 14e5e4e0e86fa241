"""Which diffusers attention backend a cached attention call may use (the model side of the backend choice).

A mask-free kernel (flash-attn 2/3, torch's flash) raises on an attention mask, and a cached step passes one
while the window fills under `torch.compile`, or with an attention bias; such a call goes to torch's SDPA.
`rolldiff.pipelines.acceleration` chooses and sets the backend; the processors ask `attention_backend_for`.
"""

from __future__ import annotations

from typing import Any

from diffusers.models.attention_dispatch import AttentionBackendName

MASK_FREE_BACKENDS = frozenset({"_flash_3", "flash", "_native_flash"})  # raise on an attention mask


def attention_backend_for(backend: Any, masked: bool) -> Any:
    """The backend a processor should call: `backend` itself, or torch's SDPA for a masked call that a
    mask-free kernel (flash-attn 2/3, torch's flash) would refuse. `backend` is a name, an
    `AttentionBackendName` or None (the active one)."""
    value = getattr(backend, "value", backend)
    if masked and value in MASK_FREE_BACKENDS:
        return AttentionBackendName.NATIVE
    return backend
