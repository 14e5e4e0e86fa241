"""Convert original-format Wan 2.1 causal checkpoints to diffusers' `WanTransformer3DModel` layout.

Self-Forcing, CausVid, LongLive and Krea Realtime all train the original Wan 2.1 `WanModel` code (keys such as
`blocks.0.self_attn.q.weight`, `head.modulation`) inside a `WanDiffusionWrapper` that holds it as `self.model`, so
their weights arrive with wrappers around them:

- Self-Forcing / LongLive `.pt`: `{"generator": {...}, "generator_ema": {...}, ...}` (some forks use `{"model": ...}`);
  each inner key starts with `model.` and EMA copies saved under FSDP carry `_fsdp_wrapped_module.` segments.
- Krea Realtime `.safetensors`: a flat dict whose keys start with `model.`.
- `torch.compile` adds `_orig_mod.`, activation checkpointing `_checkpoint_wrapped_module.`, DDP `module.`,
  ComfyUI-style single files `model.diffusion_model.`.

`convert_original_wan_state_dict` strips all of these, renames every key through one explicit table and refuses
anything it cannot map. The renames match diffusers' `convert_wan_transformer_to_diffusers` (the test oracle) for
text-to-video checkpoints; image-to-video keys (`img_emb`, `k_img`) are rejected. (The checks that a diffusers-format
folder's weights fit its config, for every family, live in `weights.py`.)
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping

from torch import Tensor

from ..checks import check_flag, check_int
from .weights import (
    GENERATOR_ENTRIES,
    preview_keys,
    read_checkpoint_file,
    rename_by_tables,
    select_generator_weights,
    strip_wrappers,
    unwrapped_tensors,
)

__all__ = [
    "convert_original_wan_state_dict",
    "infer_wan_config",
    "load_original_wan_checkpoint",
]

# Module paths outside the blocks: original name -> diffusers name. Each has `.weight` and `.bias`.
_TOP_LEVEL_MODULES = {
    "patch_embedding": "patch_embedding",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "head.head": "proj_out",
}
# Bare parameters outside the blocks (no `.weight` suffix).
_TOP_LEVEL_PARAMETERS = {"head.modulation": "scale_shift_table"}

# Module paths inside `blocks.{i}.`: original name -> diffusers name.
_BLOCK_MODULES = {
    "self_attn.q": "attn1.to_q",
    "self_attn.k": "attn1.to_k",
    "self_attn.v": "attn1.to_v",
    "self_attn.o": "attn1.to_out.0",
    "self_attn.norm_q": "attn1.norm_q",
    "self_attn.norm_k": "attn1.norm_k",
    "cross_attn.q": "attn2.to_q",
    "cross_attn.k": "attn2.to_k",
    "cross_attn.v": "attn2.to_v",
    "cross_attn.o": "attn2.to_out.0",
    "cross_attn.norm_q": "attn2.norm_q",
    "cross_attn.norm_k": "attn2.norm_k",
    # The original calls the affine pre-cross-attention norm `norm3` and the (affine-free) pre-FFN norm `norm2`;
    # diffusers numbers them in block order, so the only norm with weights is `norm2` there.
    "norm3": "norm2",
    "ffn.0": "ffn.net.0.proj",
    "ffn.2": "ffn.net.2",
}
_BLOCK_PARAMETERS = {"modulation": "scale_shift_table"}

_TENSOR_SUFFIXES = ("weight", "bias")
_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.(.+)$")

# First path component of every original Wan key; anything in front of it is a wrapper prefix.
_WAN_ROOTS = ("blocks", "patch_embedding", "text_embedding", "time_embedding", "time_projection", "head")
# Leading prefixes added by training wrappers, stripped repeatedly (`module.model.blocks...` under DDP).
_LEADING_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.", "module.")
# Keys that prove a dict is a Wan transformer (the same pair diffusers uses to detect the format).
_REQUIRED_ORIGINAL_KEYS = ("patch_embedding.weight", "head.modulation")


def _rename_key(key: str) -> str | None:
    """Return the diffusers name of one original Wan key (wrappers already stripped), or None if it has none."""
    return rename_by_tables(
        key,
        _BLOCK_KEY,
        "blocks.{}.",
        (_BLOCK_MODULES, _BLOCK_PARAMETERS),
        (_TOP_LEVEL_MODULES, _TOP_LEVEL_PARAMETERS),
        _TENSOR_SUFFIXES,
    )


def _strip_wrappers(key: str) -> str:
    """One Wan key without training-wrapper prefixes and segments (`strip_wrappers` with Wan's roots)."""
    return strip_wrappers(key, _WAN_ROOTS, _LEADING_PREFIXES)


def _select_generator(checkpoint: Mapping, use_ema: bool) -> Mapping:
    """The generator's weights (`select_generator_weights`); a LoRA-only checkpoint is refused by name."""
    if isinstance(checkpoint.get("generator_lora"), Mapping) and not any(
        isinstance(checkpoint.get(name), Mapping) for name in GENERATOR_ENTRIES
    ):
        raise ValueError(
            "This checkpoint holds only LoRA adapter weights ('generator_lora', e.g. LongLive's lora.pt), not a "
            "Wan transformer. Convert the base checkpoint (e.g. longlive_base.pt) and merge the adapter into it."
        )
    return select_generator_weights(checkpoint, use_ema)


def convert_original_wan_state_dict(state_dict: Mapping[str, Tensor], use_ema: bool = True) -> dict[str, Tensor]:
    """Convert an original-format Wan 2.1 transformer state dict to diffusers' `WanTransformer3DModel` layout.

    Args:
        state_dict: Either a flat state dict (`blocks.0.self_attn.q.weight`, optionally behind `model.`,
            `_fsdp_wrapped_module.`, `_orig_mod.`, `module.` or `model.diffusion_model.`), or a training checkpoint
            holding one under `generator_ema` / `generator` (Self-Forcing, LongLive), `model` or `state_dict`
            (other top-level entries, such as a critic or optimizer state, are ignored).
        use_ema: Take `generator_ema` when the checkpoint has both; falls back to `generator` when it has no EMA
            copy. With False, `generator` is required.

    Returns:
        A new dict with diffusers key names and the same tensor objects (nothing is copied); the input is left
        untouched. Load it with `WanTransformer3DModel(**infer_wan_config(converted)).load_state_dict(converted)`.

    Raises:
        ValueError: if the input is not a Wan text-to-video transformer state dict, holds LoRA adapter weights, or
            has keys that do not map onto the diffusers layout (the message names a few of them).
    """
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"`state_dict` must be a mapping of names to tensors, got {type(state_dict).__name__}.")
    check_flag("use_ema", use_ema)
    weights = _select_generator(state_dict, use_ema)

    lora_keys = [key for key in weights if "lora_A" in key or "lora_B" in key or ".base_layer." in key]
    if lora_keys:
        raise ValueError(
            f"The state dict holds LoRA adapter weights ({preview_keys(lora_keys)}); merge the adapter into the base "
            "weights before converting."
        )
    stripped = unwrapped_tensors(weights, _WAN_ROOTS, _LEADING_PREFIXES, _REQUIRED_ORIGINAL_KEYS, "Wan 2.1")

    converted: dict[str, Tensor] = {}
    unexpected: list[str] = []
    for name, tensor in stripped.items():
        new_name = _rename_key(name)
        if new_name is None:
            unexpected.append(name)
        else:
            converted[new_name] = tensor
    if unexpected:
        raise ValueError(
            f"Cannot map {len(unexpected)} key(s) of the Wan state dict onto WanTransformer3DModel: "
            f"{preview_keys(unexpected)}. Only text-to-video Wan 2.1 transformer weights are supported."
        )
    return converted


def load_original_wan_checkpoint(path: str | os.PathLike, use_ema: bool = True) -> dict[str, Tensor]:
    """Load an original-format Wan 2.1 checkpoint from disk and convert it to the diffusers layout
    (`read_checkpoint_file`: safetensors, or a torch pickle with `weights_only=True` only). See
    `convert_original_wan_state_dict` for `use_ema` and the accepted layouts."""
    return convert_original_wan_state_dict(read_checkpoint_file(path), use_ema=use_ema)


def infer_wan_config(state_dict: Mapping[str, Tensor], attention_head_dim: int = 128) -> dict:
    """Derive `WanTransformer3DModel` init arguments from the tensor shapes of a Wan 2.1 state dict.

    Accepts the diffusers layout (or an original-format dict, which is converted first). The head count cannot be
    read from the weights (q/k/v are `(dim, dim)`), so it is `dim // attention_head_dim`; every released Wan 2.1
    model uses 128. Settings that leave no trace in the weights (`eps`, `rope_max_seq_len`) keep diffusers' defaults.
    """
    if "scale_shift_table" not in state_dict:
        state_dict = convert_original_wan_state_dict(state_dict)

    check_int("attention_head_dim", attention_head_dim, 1)
    patch_weight = state_dict["patch_embedding.weight"]  # (dim, in_channels, p_t, p_h, p_w)
    dim, in_channels = patch_weight.shape[:2]
    patch_size = tuple(patch_weight.shape[2:])
    if dim % attention_head_dim != 0:
        raise ValueError(f"attention_head_dim={attention_head_dim} does not divide the model width {dim}.")

    block_indices = {int(match.group(1)) for key in state_dict if (match := _BLOCK_KEY.match(key)) is not None}
    if not block_indices or block_indices != set(range(len(block_indices))):
        raise ValueError(f"Transformer blocks are not numbered 0..n-1: found {sorted(block_indices)}.")

    return {
        "patch_size": patch_size,
        "num_attention_heads": dim // attention_head_dim,
        "attention_head_dim": attention_head_dim,
        "in_channels": in_channels,
        # proj_out maps dim -> out_channels * p_t * p_h * p_w.
        "out_channels": state_dict["proj_out.weight"].shape[0] // math.prod(patch_size),
        "text_dim": state_dict["condition_embedder.text_embedder.linear_1.weight"].shape[1],
        "freq_dim": state_dict["condition_embedder.time_embedder.linear_1.weight"].shape[1],
        "ffn_dim": state_dict["blocks.0.ffn.net.0.proj.weight"].shape[0],
        "num_layers": len(block_indices),
        "cross_attn_norm": "blocks.0.norm2.weight" in state_dict,
        "qk_norm": "rms_norm_across_heads" if "blocks.0.attn1.norm_q.weight" in state_dict else None,
    }
