"""How each published checkpoint is laid out, and which recipe a checkpoint file is for.

Every Wan 2.1 causal checkpoint of the field (Self-Forcing, Causal Forcing, Rolling Forcing, StreamDiffusionV2,
LongLive, Krea Realtime) holds the same original `WanModel` keys, so its keys tell the family (Wan 2.1 or
SANA-Video) but not the recipe. The authors' loaders differ only in which entry of the file they read (their
`--use_ema` choice) and in whether a LoRA comes with it; the published file names tell the rest. So detection is:
the family from the keys, then the recipe from the file's published name, else the one recipe of its family (SANA),
else the caller names it. Each entry cites the authors' loading code it follows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ...checks import check_choice
from ...recipes import list_recipes

__all__ = ["CHECKPOINT_LAYOUTS", "CheckpointLayout", "checkpoint_family", "detect_recipe"]

WAN = "wan"  # original Wan 2.1 `WanModel` keys (`blocks.0.self_attn.q.weight`, `head.modulation`)
SANA = "sana"  # original SANA-Video `SanaMSVideo` keys (`blocks.0.attn.qkv.weight`, `x_embedder.proj.weight`)
FAMILY_NAMES = {WAN: "Wan 2.1", SANA: "SANA-Video"}
FAMILY_PIPELINES = {WAN: "KreaRealtimeVideoPipeline", SANA: "LongSanaVideoPipeline"}


@dataclass(frozen=True)
class CheckpointLayout:
    """One recipe's published checkpoint: the file names its authors release, which weights their loader takes,
    and whether a LoRA adapter comes with it."""

    recipe: str
    family: str
    published: tuple[str, ...]  # tails of the released file paths, lower case ("chunkwise/causal_forcing.pt")
    use_ema: bool  # the authors' loader reads `generator_ema` (True) or `generator` (False)
    needs_lora: bool  # the recipe is the base weights plus a LoRA adapter (LongLive)
    source: str  # the authors' loading code


CHECKPOINT_LAYOUTS: dict[str, CheckpointLayout] = {
    layout.recipe: layout
    for layout in (
        CheckpointLayout(
            "self-forcing", WAN, ("self_forcing_dmd.pt",), True, False,
            "guandeh17/Self-Forcing inference.py:70-71 (README runs --use_ema)",
        ),
        CheckpointLayout(
            "rolling-sink", WAN, (), True, False,
            "haodong2000/RollingSink inference.py:74-75 on Self-Forcing's self_forcing_dmd.pt (shell_scripts/cuda_0.sh "
            "--use_ema); the file is Self-Forcing's, so this recipe is always named",
        ),
        CheckpointLayout(
            "infinity-rope", WAN, (), True, False,
            "yesiltepe-hidir/infinity-rope@63d7b84 inference.py:168-181 with inference.sh's --use_ema on "
            "SOTAMak1r/Infinite-Forcing's checkpoints/ema_model.pt (setup_env.sh; or Causal Forcing's chunk-wise "
            "file, inference_causal_forcing.sh, without --use_ema); a Self-Forcing-layout file, so this recipe is "
            "always named",
        ),
        CheckpointLayout(
            "reward-forcing", WAN, ("rewardforcing.pt",), False, False,
            "JaydenLyh/Reward-Forcing@4317f5a inference.py:70-73 (the file is the generator's state dict, loaded "
            "whole; README: checkpoints/Reward-Forcing-T2V-1.3B/rewardforcing.pt)",
        ),
        CheckpointLayout(
            "causal-forcing", WAN, ("chunkwise/causal_forcing.pt",), False, False,
            "thu-ml/Causal-Forcing inference.py:70-71 (README: chunk-wise runs without --use_ema)",
        ),
        CheckpointLayout(
            "causal-forcing-framewise", WAN, ("framewise/causal_forcing.pt",), True, False,
            "thu-ml/Causal-Forcing inference.py:70-71 (README: frame-wise runs --use_ema)",
        ),
        CheckpointLayout(
            "causal-forcing-2step", WAN, ("framewise-2step.pt",), True, False,
            "thu-ml/Causal-Forcing inference.py:70-71, causal-forcing++/framewise-2step.pt with --use_ema",
        ),
        CheckpointLayout(
            "causal-forcing-1step", WAN, ("framewise-1step.pt",), True, False,
            "thu-ml/Causal-Forcing inference.py:70-71, causal-forcing++/framewise-1step.pt with --use_ema",
        ),
        CheckpointLayout(
            "rolling-forcing", WAN, ("chunkwise/longvideo.pt", "rolling_forcing_dmd.pt"), True, False,
            "thu-ml/Causal-Forcing long_video/inference.py:67-69 (README runs --use_ema); TencentARC/RollingForcing",
        ),
        CheckpointLayout(
            "streamdiffusionv2", WAN, ("wan_causal_dmd_v2v/model.pt", "wan_causal_dmd_v2v_14b/model.pt"), False, False,
            "chenfengxu714/StreamDiffusionV2 streamv2v/inference_common.py:94-110 (generator, then generator_ema, "
            "then state_dict; keys with or without model.)",
        ),
        CheckpointLayout(
            "longlive", WAN, ("longlive_base.pt",), False, True,
            "NVlabs/LongLive@2462895 inference.py:74-76 and configs/longlive_inference.yaml (use_ema: false, "
            "generator_ckpt longlive_base.pt + lora_ckpt lora.pt, rank 256, alpha 256)",
        ),
        CheckpointLayout(
            "krea-realtime", WAN, ("krea-realtime-video-14b.safetensors",), False, False,
            "krea-ai/realtime-video release_server.py:160-169 (a flat safetensors of model.-prefixed keys)",
        ),
        CheckpointLayout(
            "longsana", SANA, ("longsana_2b_480p_self_forcing.pt",), False, False,
            "NVlabs/Sana diffusion/longsana/model/dmd_sana.py:108 (state_dict.get('generator', state_dict)); "
            "configs/sana_video_config/longsana/480ms/longsana.yaml",
        ),
    )
}  # fmt: skip


def checkpoint_family(weights: Mapping) -> str | None:
    """`WAN` or `SANA` from a checkpoint's keys (looking inside `generator_ema` / `generator` / `model` /
    `state_dict` entries and past wrapper prefixes), or None when it is neither."""
    inner = next((weights[name] for name in _ENTRIES if isinstance(weights.get(name), Mapping)), weights)
    keys = [key for key in inner if isinstance(key, str)]
    if any(key.endswith("x_embedder.proj.weight") for key in keys):
        return SANA
    if any(key.endswith("head.modulation") for key in keys) and any(
        key.endswith("patch_embedding.weight") for key in keys
    ):
        return WAN
    return None


_ENTRIES = ("generator_ema", "generator", "model", "state_dict")


def _published_recipe(path: Path) -> str | None:
    tail = path.as_posix().lower()
    for layout in CHECKPOINT_LAYOUTS.values():
        if any(tail == name or tail.endswith("/" + name) for name in layout.published):
            return layout.recipe
    return None


def detect_recipe(path: Path, family: str, recipe: str | None, has_lora: bool) -> tuple[str, str]:
    """The recipe a checkpoint of `family` at `path` is converted for, and how it was decided (for messages).

    `recipe` given: it must be a recipe of the family's pipeline. Else the published file name decides, else the
    family's only recipe (SANA), else a LoRA means LongLive; otherwise the caller must name one.
    """
    pipeline = FAMILY_PIPELINES[family]
    if recipe is not None:
        check_choice("recipe", recipe, list_recipes(pipeline), hint=f"for a {FAMILY_NAMES[family]} checkpoint")
        return recipe, "named"
    published = _published_recipe(path)
    if published is not None and CHECKPOINT_LAYOUTS[published].family == family:
        return published, f"from the published file name {path.name!r}"
    candidates = [name for name, layout in CHECKPOINT_LAYOUTS.items() if layout.family == family]
    if len(candidates) == 1:
        return candidates[0], f"the one {FAMILY_NAMES[family]} recipe"
    if has_lora:
        return "longlive", "a LoRA adapter comes with it"
    raise ValueError(
        f"Cannot tell the recipe of {str(path)!r} from its keys: every {FAMILY_NAMES[family]} causal checkpoint "
        f"(Self-Forcing, Causal Forcing, Rolling Forcing, StreamDiffusionV2, Krea Realtime, ...) has the same ones, "
        f"and its file name is none of the published ones. Name it: `recipe` one of {candidates}."
    )
