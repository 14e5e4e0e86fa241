"""Convert original-format SANA-Video / LongSANA checkpoints to diffusers' `SanaVideoTransformer3DModel` layout.

NVlabs/Sana trains `SanaMSVideo` (diffusion/model/nets/sana_multi_scale_video.py); LongSANA runs the same module tree
with `attn_type="cachedcausal"` and `ffn_type="CachedGLUMBConvTemp"`, which add no weights. Its keys:

    x_embedder.proj, t_embedder.mlp.{0,2}, t_block.1, y_embedder.y_proj.fc{1,2}, attention_y_norm,
    blocks.{i}.attn.qkv (fused q|k|v), attn.{q,k}_norm, attn.proj, cross_attn.q_linear, cross_attn.kv_linear
    (fused k|v), cross_attn.{q,k}_norm, cross_attn.proj, mlp.{inverted,depth,point}_conv.conv, mlp.t_conv,
    blocks.{i}.scale_shift_table, final_layer.linear, final_layer.scale_shift_table

The renames and the two splits are those of diffusers' scripts/convert_sana_video_to_diffusers.py. Checkpoints arrive
wrapped: SANA-Video `.pth` as `{"state_dict": {...}}`; LongSANA training `.pt` as `{"generator": ..., "critic": ...,
"generator_ema": ...}` whose keys start with `model.` (`SanaModelWrapper` holds the net as `self.model`), FSDP EMA
copies with `_fsdp_wrapped_module.` segments. Buffers that diffusers has no place for are dropped: `pos_embed` (a
fixed sin-cos table, unused with RoPE), `y_embedder.y_embedding` (the CFG-dropout caption) and `logvar_linear`
(a training head). Anything else that does not map is refused by name.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping

import torch
from torch import Tensor

from ..checks import check_flag, check_int
from .weights import (
    preview_keys,
    read_checkpoint_file,
    rename_by_tables,
    select_generator_weights,
    unwrapped_tensors,
)

__all__ = ["convert_original_sana_video_state_dict", "infer_sana_video_config", "load_original_sana_video_checkpoint"]

# Modules outside the blocks: original name -> diffusers name (each has `.weight`, most `.bias`).
_TOP_LEVEL_MODULES = {
    "x_embedder.proj": "patch_embedding",
    "y_embedder.y_proj.fc1": "caption_projection.linear_1",
    "y_embedder.y_proj.fc2": "caption_projection.linear_2",
    "t_embedder.mlp.0": "time_embed.emb.timestep_embedder.linear_1",
    "t_embedder.mlp.2": "time_embed.emb.timestep_embedder.linear_2",
    "t_block.1": "time_embed.linear",
    "attention_y_norm": "caption_norm",
    "final_layer.linear": "proj_out",
}
_TOP_LEVEL_PARAMETERS = {"final_layer.scale_shift_table": "scale_shift_table"}
# Modules inside `blocks.{i}.`: original name -> name under `transformer_blocks.{i}.`.
_BLOCK_MODULES = {
    "attn.q_norm": "attn1.norm_q",
    "attn.k_norm": "attn1.norm_k",
    "attn.proj": "attn1.to_out.0",
    "cross_attn.q_linear": "attn2.to_q",
    "cross_attn.q_norm": "attn2.norm_q",
    "cross_attn.k_norm": "attn2.norm_k",
    "cross_attn.proj": "attn2.to_out.0",
    "mlp.inverted_conv.conv": "ff.conv_inverted",
    "mlp.depth_conv.conv": "ff.conv_depth",
    "mlp.point_conv.conv": "ff.conv_point",
    "mlp.t_conv": "ff.conv_temp",
}
_BLOCK_PARAMETERS = {"scale_shift_table": "scale_shift_table"}
# Fused projections split along the output axis, in order.
_BLOCK_FUSED = {
    "attn.qkv": ("attn1.to_q", "attn1.to_k", "attn1.to_v"),
    "cross_attn.kv_linear": ("attn2.to_k", "attn2.to_v"),
}
# Entries with no diffusers counterpart (see the module docstring).
_DROPPED = re.compile(r"^(pos_embed|y_embedder\.y_embedding|logvar_linear\.(weight|bias))$")

_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.(.+)$")
_SUFFIXES = ("weight", "bias")
_SANA_ROOTS = ("blocks.", "x_embedder.", "t_embedder.", "t_block.", "y_embedder.", "attention_y_norm.", "final_layer.")
_SANA_ROOTS += ("pos_embed", "logvar_linear.")
_LEADING_PREFIXES = ("model.", "module.")  # SanaModelWrapper, DDP; stripped repeatedly
_REQUIRED_KEYS = ("x_embedder.proj.weight", "final_layer.scale_shift_table")


def _rename(name: str) -> str | None:
    """The diffusers name of one unfused original key (wrappers stripped), or None."""
    return rename_by_tables(
        name,
        _BLOCK_KEY,
        "transformer_blocks.{}.",
        (_BLOCK_MODULES, _BLOCK_PARAMETERS),
        (_TOP_LEVEL_MODULES, _TOP_LEVEL_PARAMETERS),
        _SUFFIXES,
    )


def _split_fused(name: str, tensor: Tensor) -> dict[str, Tensor] | None:
    """`blocks.{i}.attn.qkv.weight` -> to_q/to_k/to_v (and k|v of the cross-attention); None if not fused."""
    match = _BLOCK_KEY.match(name)
    if match is None:
        return None
    index, rest = match.groups()
    module, _, suffix = rest.rpartition(".")
    targets = _BLOCK_FUSED.get(module)
    if targets is None or suffix not in _SUFFIXES:
        return None
    if tensor.shape[0] % len(targets):
        raise ValueError(f"{name!r} has {tensor.shape[0]} rows, not divisible into {len(targets)} projections.")
    parts = torch.chunk(tensor, len(targets), dim=0)
    return {f"transformer_blocks.{index}.{target}.{suffix}": part for target, part in zip(targets, parts)}


def _convert_keys(stripped: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
    """Rename (and split) every key that maps; drop the known unused buffers; return the rest as unexpected."""
    converted: dict[str, Tensor] = {}
    unexpected: list[str] = []
    for name, tensor in stripped.items():
        if _DROPPED.match(name):
            continue
        split = _split_fused(name, tensor)
        renamed = _rename(name)
        if split is not None:
            converted.update(split)
        elif renamed is not None:
            converted[renamed] = tensor
        else:
            unexpected.append(name)
    return converted, unexpected


def convert_original_sana_video_state_dict(
    state_dict: Mapping[str, Tensor], use_ema: bool = True
) -> dict[str, Tensor]:
    """Convert an original-format SANA-Video / LongSANA state dict to diffusers' `SanaVideoTransformer3DModel` keys.

    Args:
        state_dict: a flat `SanaMSVideo` state dict (optionally behind `model.`, `module.`, `_fsdp_wrapped_module.`,
            `_orig_mod.`), or a checkpoint holding one under `generator_ema` / `generator` (LongSANA training),
            `model` or `state_dict` (SANA-Video releases); other entries (critic, optimizer, step) are ignored.
        use_ema: take `generator_ema` when present (falling back to `generator`); False requires `generator`.

    Returns:
        A new dict in the diffusers layout; the fused `qkv` / `kv_linear` projections are split (views of the
        inputs), every other tensor is the input's object. Load it strictly into `LongSanaTransformer3DModel(
        **infer_sana_video_config(converted))` (or `SanaVideoTransformer3DModel`).

    Raises:
        ValueError: the input is not a SANA-Video transformer state dict, or has keys that do not map (named).
    """
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"`state_dict` must be a mapping of names to tensors, got {type(state_dict).__name__}.")
    check_flag("use_ema", use_ema)
    weights = select_generator_weights(state_dict, use_ema)
    stripped = unwrapped_tensors(weights, _SANA_ROOTS, _LEADING_PREFIXES, _REQUIRED_KEYS, "SANA-Video")
    converted, unexpected = _convert_keys(stripped)
    if unexpected:
        raise ValueError(
            f"Cannot map {len(unexpected)} key(s) of the SANA-Video state dict onto SanaVideoTransformer3DModel: "
            f"{preview_keys(unexpected)}. Only text-to-video SanaMSVideo weights are supported."
        )
    return converted


def load_original_sana_video_checkpoint(path: str | os.PathLike, use_ema: bool = True) -> dict[str, Tensor]:
    """Load an original-format SANA-Video / LongSANA checkpoint and convert it to the diffusers layout
    (`read_checkpoint_file`: safetensors, or a torch pickle with `weights_only=True` only)."""
    return convert_original_sana_video_state_dict(read_checkpoint_file(path), use_ema=use_ema)


def infer_sana_video_config(
    state_dict: Mapping[str, Tensor], attention_head_dim: int = 112, cross_attention_head_dim: int | None = None
) -> dict:
    """`SanaVideoTransformer3DModel` init arguments read from the tensor shapes of a (converted) state dict.

    Head counts leave no trace in the weights, so they are `width // head_dim`: upstream's self-attention uses
    `linear_head_dim` (112 in every release) and its cross-attention `hidden_size // num_heads` (also 112);
    `cross_attention_head_dim=None` means the same as `attention_head_dim`. Settings without a trace in the weights
    (`norm_eps`, `rope_max_seq_len`, `sample_size`) keep diffusers' defaults.
    """
    if "scale_shift_table" not in state_dict:
        state_dict = convert_original_sana_video_state_dict(state_dict)
    cross_attention_head_dim = attention_head_dim if cross_attention_head_dim is None else cross_attention_head_dim
    for name, value in (
        ("attention_head_dim", attention_head_dim),
        ("cross_attention_head_dim", cross_attention_head_dim),
    ):
        check_int(name, value, 1)
    patch_weight = state_dict["patch_embedding.weight"]  # (width, in_channels, p_t, p_h, p_w)
    width, in_channels = patch_weight.shape[:2]
    patch_size = list(patch_weight.shape[2:])
    for name, value in (
        ("attention_head_dim", attention_head_dim),
        ("cross_attention_head_dim", cross_attention_head_dim),
    ):
        if width % value:
            raise ValueError(f"`{name}`={value} does not divide the model width {width}.")
    blocks = {int(m.group(1)) for key in state_dict if (m := re.match(r"^transformer_blocks\.(\d+)\.", key))}
    if not blocks or blocks != set(range(len(blocks))):
        raise ValueError(f"Transformer blocks are not numbered 0..n-1: found {sorted(blocks)}.")
    hidden_channels = state_dict["transformer_blocks.0.ff.conv_point.weight"].shape[1]
    return {
        "in_channels": in_channels,
        "out_channels": state_dict["proj_out.weight"].shape[0] // math.prod(patch_size),
        "num_attention_heads": width // attention_head_dim,
        "attention_head_dim": attention_head_dim,
        "num_layers": len(blocks),
        "num_cross_attention_heads": width // cross_attention_head_dim,
        "cross_attention_head_dim": cross_attention_head_dim,
        "cross_attention_dim": state_dict["transformer_blocks.0.attn2.to_k.weight"].shape[1],
        "caption_channels": state_dict["caption_projection.linear_1.weight"].shape[1],
        "mlp_ratio": hidden_channels / width,
        "attention_bias": "transformer_blocks.0.attn1.to_q.bias" in state_dict,
        "patch_size": patch_size,
        "norm_elementwise_affine": "transformer_blocks.0.norm2.weight" in state_dict,
        "qk_norm": "rms_norm_across_heads" if "transformer_blocks.0.attn1.norm_q.weight" in state_dict else None,
    }
