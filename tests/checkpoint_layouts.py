"""Tiny synthetic checkpoints in every published layout, and tiny diffusers base folders, for `rolldiff convert`.

The transformers are the embedded tiny models' (so a converted pipeline can be compared with the embedded one),
written back into the authors' original key names by inverse tables written here, independently of the converters:
- Wan 2.1 `WanModel` keys (`blocks.0.self_attn.q.weight`, `head.modulation`), as Self-Forcing, LongLive, Causal
  Forcing, Rolling Forcing, StreamDiffusionV2 and Krea Realtime save them;
- SANA-Video `SanaMSVideo` keys (`blocks.0.attn.qkv.weight` fused, `x_embedder.proj.weight`), as LongSANA saves them.
Each layout wraps them as its authors' code writes and reads the file (see src/pipelines/conversion/layouts.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rolldiff.defaults import embedded_models

# diffusers name fragment -> original Wan name fragment.
WAN_DIFFUSERS_TO_ORIGINAL = (
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn1.", "self_attn."),
    ("attn2.", "cross_attn."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    (".to_out.0.", ".o."),
    (".norm2.", ".norm3."),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    (".scale_shift_table", ".modulation"),
    ("proj_out", "head.head"),
)
# diffusers SANA-Video name -> original SanaMSVideo name (block entries under `transformer_blocks.{i}.`).
SANA_TOP_TO_ORIGINAL = {
    "patch_embedding": "x_embedder.proj",
    "caption_projection.linear_1": "y_embedder.y_proj.fc1",
    "caption_projection.linear_2": "y_embedder.y_proj.fc2",
    "time_embed.emb.timestep_embedder.linear_1": "t_embedder.mlp.0",
    "time_embed.emb.timestep_embedder.linear_2": "t_embedder.mlp.2",
    "time_embed.linear": "t_block.1",
    "caption_norm": "attention_y_norm",
    "proj_out": "final_layer.linear",
}
SANA_BLOCK_TO_ORIGINAL = {
    "attn1.norm_q": "attn.q_norm",
    "attn1.norm_k": "attn.k_norm",
    "attn1.to_out.0": "attn.proj",
    "attn2.to_q": "cross_attn.q_linear",
    "attn2.norm_q": "cross_attn.q_norm",
    "attn2.norm_k": "cross_attn.k_norm",
    "attn2.to_out.0": "cross_attn.proj",
    "ff.conv_inverted": "mlp.inverted_conv.conv",
    "ff.conv_depth": "mlp.depth_conv.conv",
    "ff.conv_point": "mlp.point_conv.conv",
    "ff.conv_temp": "mlp.t_conv",
}
LORA_TARGETS = {  # LongLive adapts every Linear of each attention block (original name: diffusers name)
    "self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v",
    "self_attn.o": "attn1.to_out.0", "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k",
    "cross_attn.v": "attn2.to_v", "cross_attn.o": "attn2.to_out.0", "ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2",
}  # fmt: skip
WAN_MODEL, SANA_MODEL = "tiny-bouncing-shapes", "tiny-bouncing-shapes-sana"


def embedded_transformer_weights(model: str) -> dict[str, torch.Tensor]:
    return load_file(str(embedded_models()[model] / "transformer" / "diffusion_pytorch_model.safetensors"))


def wan_to_original(weights: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """diffusers Wan keys -> original `WanModel` keys, behind `prefix`."""
    original = {}
    for key, tensor in weights.items():
        new_key = "head.modulation" if key == "scale_shift_table" else key
        if key != "scale_shift_table":
            for diffusers_part, original_part in WAN_DIFFUSERS_TO_ORIGINAL:
                new_key = new_key.replace(diffusers_part, original_part)
        original[prefix + new_key] = tensor
    return original


def _sana_block_key(rest: str) -> str:
    module, _, suffix = rest.rpartition(".")
    if module in SANA_BLOCK_TO_ORIGINAL:
        return f"{SANA_BLOCK_TO_ORIGINAL[module]}.{suffix}"
    return rest  # scale_shift_table


def sana_to_original(weights: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """diffusers SANA-Video keys -> original `SanaMSVideo` keys (q|k|v and k|v fused back), behind `prefix`."""
    original: dict[str, torch.Tensor] = {}
    blocks = sorted({int(key.split(".")[1]) for key in weights if key.startswith("transformer_blocks.")})
    for key, tensor in weights.items():
        if key.startswith("transformer_blocks."):
            index, rest = key.split(".", 2)[1:]
            if rest.startswith(("attn1.to_q.", "attn1.to_k.", "attn1.to_v.", "attn2.to_k.", "attn2.to_v.")):
                continue  # fused below
            original[f"{prefix}blocks.{index}.{_sana_block_key(rest)}"] = tensor
        elif key == "scale_shift_table":
            original[f"{prefix}final_layer.scale_shift_table"] = tensor
        else:
            module, _, suffix = key.rpartition(".")
            original[f"{prefix}{SANA_TOP_TO_ORIGINAL[module]}.{suffix}"] = tensor
    for index in blocks:
        block = f"transformer_blocks.{index}."
        qkv = [weights[f"{block}attn1.to_{name}.weight"] for name in "qkv"]
        original[f"{prefix}blocks.{index}.attn.qkv.weight"] = torch.cat(qkv)
        for suffix in ("weight", "bias"):
            kv = [weights[f"{block}attn2.to_{name}.{suffix}"] for name in "kv"]
            original[f"{prefix}blocks.{index}.cross_attn.kv_linear.{suffix}"] = torch.cat(kv)
    return original


def perturbed(weights: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    """Other weights of the same shapes: the entry a recipe's loader must NOT take (EMA vs not)."""
    generator = torch.Generator().manual_seed(seed)
    return {key: tensor + torch.randn(tensor.shape, generator=generator) for key, tensor in weights.items()}


def training_checkpoint(weights: dict[str, torch.Tensor], take: str) -> dict:
    """`{"generator": ..., "generator_ema": ...}` as Self-Forcing-style trainers save it: `take` holds `weights`,
    the other entry other weights; keys behind `model.` (WanDiffusionWrapper), the EMA's with FSDP segments."""
    other = "generator" if take == "generator_ema" else "generator_ema"
    fsdp = {key.replace("blocks.", "_fsdp_wrapped_module.blocks.", 1): tensor for key, tensor in weights.items()}
    return {
        take: fsdp if take == "generator_ema" else weights,
        other: perturbed(weights),
        "critic": {"head.weight": torch.zeros(1)},
    }


def longlive_lora(weights: dict[str, torch.Tensor], rank: int = 4, seed: int = 0) -> dict:
    """LongLive's lora.pt: {"generator_lora": PEFT keys of the wrapped WanModel} for `weights`' shapes (diffusers)."""
    generator = torch.Generator().manual_seed(seed)
    blocks = sorted({int(key.split(".")[1]) for key in weights if key.startswith("blocks.")})
    adapter = {}
    for block in blocks:
        for original, diffusers_name in LORA_TARGETS.items():
            out_features, in_features = weights[f"blocks.{block}.{diffusers_name}.weight"].shape
            prefix = f"base_model.model.blocks.{block}.{original}"
            adapter[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.1
            adapter[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.1
    return {"generator_lora": adapter, "critic_lora": {}}


def merged_by_hand(weights: dict[str, torch.Tensor], lora: dict) -> dict[str, torch.Tensor]:
    """`weights` (diffusers names) with LongLive's adapter added: W + B A (rank = alpha: scale 1)."""
    merged = dict(weights)
    for key, down in lora["generator_lora"].items():
        if ".lora_A." not in key:
            continue
        module = key[len("base_model.model.") : -len(".lora_A.weight")]
        block, original = module.split(".", 2)[1], module.split(".", 2)[2]
        target = f"blocks.{block}.{LORA_TARGETS[original]}.weight"
        merged[target] = merged[target] + lora["generator_lora"][key.replace("lora_A", "lora_B")] @ down
    return merged


def write_published(folder: Path, recipe: str) -> Path:
    """The embedded model's transformer saved as `recipe`'s authors publish it, at its published path."""
    wan = wan_to_original(embedded_transformer_weights(WAN_MODEL), prefix="model.")
    layouts = {
        "self-forcing": ("checkpoints/self_forcing_dmd.pt", lambda: training_checkpoint(wan, "generator_ema")),
        "causal-forcing": ("chunkwise/causal_forcing.pt", lambda: training_checkpoint(wan, "generator")),
        "causal-forcing-framewise": ("framewise/causal_forcing.pt", lambda: training_checkpoint(wan, "generator_ema")),
        "causal-forcing-2step": ("causal-forcing++/framewise-2step.pt", lambda: training_checkpoint(wan, "generator_ema")),
        "causal-forcing-1step": ("causal-forcing++/framewise-1step.pt", lambda: training_checkpoint(wan, "generator_ema")),
        "rolling-forcing": ("chunkwise/longvideo.pt", lambda: training_checkpoint(wan, "generator_ema")),
        # StreamDiffusionV2's model.pt: {"generator": ...} whose keys may lack `model.` (inference_common.py:94-110)
        "streamdiffusionv2": (
            "wan_causal_dmd_v2v/model.pt",
            lambda: {"generator": wan_to_original(embedded_transformer_weights(WAN_MODEL))},
        ),
        "longlive": ("models/longlive_base.pt", lambda: training_checkpoint(wan, "generator")),
        # Reward Forcing's rewardforcing.pt: the generator's own state dict, `model.` keys (inference.py:70-73)
        "reward-forcing": ("Reward-Forcing-T2V-1.3B/rewardforcing.pt", lambda: dict(wan)),
        "longsana": (
            "checkpoints/LongSANA_2B_480p_self_forcing.pt",
            lambda: {"generator": sana_to_original(embedded_transformer_weights(SANA_MODEL), prefix="model.")},
        ),
    }  # fmt: skip
    if recipe == "krea-realtime":  # one flat safetensors of `model.`-prefixed keys (release_server.py:160-169)
        path = folder / "krea-realtime-video-14b.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({key: tensor.contiguous() for key, tensor in wan.items()}, str(path))
        return path
    relative, build = layouts[recipe]
    path = folder / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(build(), path)
    return path


def write_lora(folder: Path) -> tuple[Path, dict]:
    lora = longlive_lora(embedded_transformer_weights(WAN_MODEL))
    path = folder / "models" / "lora.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(lora, path)
    return path, lora


def base_folder(folder: Path, family: str = "wan") -> Path:
    """A tiny diffusers base: `WanPipeline` or `SanaVideoPipeline` with the embedded model's tokenizer, text encoder
    and VAE, diffusers' own transformer class in its config.json, and no transformer weights (the Hub download
    leaves them out too)."""
    embedded = embedded_models()[WAN_MODEL if family == "wan" else SANA_MODEL]
    index = json.loads((embedded / "model_index.json").read_text())
    pipeline, transformer = (
        ("WanPipeline", "WanTransformer3DModel")
        if family == "wan"
        else ("SanaVideoPipeline", "SanaVideoTransformer3DModel")
    )
    folder.mkdir(parents=True)
    for name in ("tokenizer", "text_encoder", "vae", "scheduler"):
        shutil.copytree(embedded / name, folder / name)
    config = json.loads((embedded / "transformer" / "config.json").read_text())
    (folder / "transformer").mkdir()
    (folder / "transformer" / "config.json").write_text(json.dumps({**config, "_class_name": transformer}))
    entries = {name: index[name] for name in ("tokenizer", "text_encoder", "vae", "scheduler")}
    entries["transformer"] = ["diffusers", transformer]
    (folder / "model_index.json").write_text(json.dumps({"_class_name": pipeline, **entries}))
    return folder
