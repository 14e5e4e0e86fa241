"""`rolldiff convert` / `from_original`: every published checkpoint layout -> a pipeline that runs its recipe.

The checkpoints are the embedded tiny models written back into each authors' layout (tests/checkpoint_layouts.py),
with the entry the authors' loader must not take filled with other weights; the bases are tiny diffusers
`WanPipeline` / `SanaVideoPipeline` folders. So a right conversion is the embedded model exactly, and a converted
folder generates, with no argument, what the embedded model generates with the recipe named.
"""

from __future__ import annotations

import json

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from checkpoint_layouts import (
    SANA_MODEL,
    WAN_MODEL,
    base_folder,
    embedded_transformer_weights,
    merged_by_hand,
    training_checkpoint,
    wan_to_original,
    write_lora,
    write_published,
)

from rolldiff import KreaRealtimeVideoPipeline, LongSanaVideoPipeline
from rolldiff.cli import main
from rolldiff.defaults import embedded_models
from rolldiff.pipelines.conversion import CHECKPOINT_LAYOUTS, convert_checkpoint, plan_conversion

PUBLISHED = [name for name, layout in CHECKPOINT_LAYOUTS.items() if layout.published and not layout.needs_lora]
PROMPT = "a red circle moving left"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    return {"wan": base_folder(root / "wan-base"), "sana": base_folder(root / "sana-base", "sana"), "root": root}


def _same(actual: dict, expected: dict) -> bool:
    return actual.keys() == expected.keys() and all(torch.equal(actual[key], expected[key]) for key in expected)


def _embedded_frames(model: str, recipe: str, num_frames: int, max_sequence_length: int) -> np.ndarray:
    pipe_class = KreaRealtimeVideoPipeline if model == WAN_MODEL else LongSanaVideoPipeline
    pipe = pipe_class.from_pretrained(embedded_models()[model])
    generator = torch.Generator().manual_seed(3)
    return pipe(
        PROMPT, num_frames=num_frames, recipe=recipe, max_sequence_length=max_sequence_length, generator=generator
    ).frames


# ---------------------------------------------------------------------------------------- every layout
@pytest.mark.parametrize("recipe", PUBLISHED)
def test_each_published_file_is_detected_and_converts_to_the_exact_weights(folders, tmp_path, recipe):
    family = CHECKPOINT_LAYOUTS[recipe].family
    path = write_published(tmp_path, recipe)
    plan = plan_conversion(path, folders[family])
    assert (plan.recipe, plan.decided) == (recipe, f"from the published file name {path.name!r}")
    # the other entry holds other weights: taking the wrong one (EMA or not) would fail here
    assert _same(plan.weights, embedded_transformer_weights(WAN_MODEL if family == "wan" else SANA_MODEL))


def test_layouts_cover_every_recipe():
    from rolldiff.recipes import RECIPES

    assert set(CHECKPOINT_LAYOUTS) == set(RECIPES)


def test_rolling_sink_runs_on_self_forcing_weights_when_named(folders, tmp_path):
    path = write_published(tmp_path, "self-forcing")
    plan = plan_conversion(path, folders["wan"], recipe="rolling-sink")
    assert (plan.recipe, plan.decided) == ("rolling-sink", "named")
    assert _same(plan.weights, embedded_transformer_weights(WAN_MODEL))  # the EMA weights, as RollingSink loads


def test_use_ema_overrides_the_authors_choice(folders, tmp_path):
    path = write_published(tmp_path, "self-forcing")
    plan = plan_conversion(path, folders["wan"], use_ema=False)
    assert not _same(plan.weights, embedded_transformer_weights(WAN_MODEL))  # `generator`: the other weights


# ---------------------------------------------------------------------------------------- end to end
def test_converted_folder_runs_the_recipe_with_no_argument(folders, tmp_path):
    out = tmp_path / "self-forcing"
    convert_checkpoint(write_published(tmp_path, "self-forcing"), folders["wan"], out, height=32, width=32)
    index = json.loads((out / "model_index.json").read_text())
    assert (index["_class_name"], index["recipe"], index["window_frames"]) == (
        "KreaRealtimeVideoPipeline",
        "self-forcing",
        21,
    )
    pipe = KreaRealtimeVideoPipeline.from_pretrained(out)
    frames = pipe(PROMPT, num_frames=9, generator=torch.Generator().manual_seed(3)).frames
    expected = _embedded_frames(WAN_MODEL, "self-forcing", 9, max_sequence_length=512)  # UMT5's 512, as Wan's base
    assert frames.shape == expected.shape == (1, 9, 32, 32, 3)
    assert np.array_equal(frames, expected)


def test_converted_longsana_folder_runs_the_longsana_recipe(folders, tmp_path):
    out = tmp_path / "longsana"
    convert_checkpoint(write_published(tmp_path, "longsana"), folders["sana"], out, height=32, width=32)
    pipe = LongSanaVideoPipeline.from_pretrained(out)
    assert pipe.config.recipe == "longsana"
    frames = pipe(PROMPT, num_frames=41, generator=torch.Generator().manual_seed(3)).frames
    assert np.array_equal(frames, _embedded_frames(SANA_MODEL, "longsana", 41, max_sequence_length=300))


def test_longlive_lora_is_fused_into_the_base_weights(folders, tmp_path):
    lora_path, lora = write_lora(tmp_path)
    pipe = KreaRealtimeVideoPipeline.from_original(
        write_published(tmp_path, "longlive"), folders["wan"], lora=lora_path
    )
    assert pipe.config.recipe == "longlive" and pipe.config.lora_adapter is None
    expected = merged_by_hand(embedded_transformer_weights(WAN_MODEL), lora)
    actual = pipe.transformer.state_dict()
    assert actual.keys() == expected.keys()
    assert max((actual[key] - expected[key]).abs().max().item() for key in expected) < 1e-6


def test_kept_longlive_adapter_round_trips_and_equals_the_fused_weights(folders, tmp_path):
    lora_path, _ = write_lora(tmp_path)
    base = write_published(tmp_path, "longlive")
    fused = KreaRealtimeVideoPipeline.from_original(base, folders["wan"], lora=lora_path, height=32, width=32)
    out = tmp_path / "longlive-adapter"
    convert_checkpoint(base, folders["wan"], out, lora=lora_path, fuse_lora=False, height=32, width=32)
    assert (out / "transformer" / "pytorch_lora_weights.safetensors").is_file()
    kept = KreaRealtimeVideoPipeline.from_pretrained(out)
    assert kept.config.lora_adapter == "longlive" and "longlive" in kept.transformer.peft_config
    run = dict(num_frames=6, max_sequence_length=8)
    a = fused(PROMPT, generator=torch.Generator().manual_seed(1), **run).frames
    b = kept(PROMPT, generator=torch.Generator().manual_seed(1), **run).frames
    assert np.abs(a - b).max() < 1e-4
    resaved = tmp_path / "resaved"
    kept.save_pretrained(resaved)  # plain base weights + the adapter file again, and the adapter still on
    again = KreaRealtimeVideoPipeline.from_pretrained(resaved)
    assert np.array_equal(again(PROMPT, generator=torch.Generator().manual_seed(1), **run).frames, b)
    assert "longlive" in kept.transformer.peft_config


def test_a_style_lora_fused_onto_a_kept_adapter_keeps_the_adapter_in(folders, tmp_path):
    """`--lora` on a LongLive folder that keeps its adapter: both are fused (LongLive's at its own scale), as on the
    folder with LongLive fused at conversion."""
    from safetensors.torch import save_file
    from test_lora import random_lora

    from rolldiff.pipelines.lora import fuse_loras, loaded_adapters

    lora_path, _ = write_lora(tmp_path)
    base = write_published(tmp_path, "longlive")
    fused = KreaRealtimeVideoPipeline.from_original(base, folders["wan"], lora=lora_path, height=32, width=32)
    out = tmp_path / "longlive-adapter"
    convert_checkpoint(base, folders["wan"], out, lora=lora_path, fuse_lora=False, height=32, width=32)
    kept = KreaRealtimeVideoPipeline.from_pretrained(out)
    style = tmp_path / "style.safetensors"
    save_file(random_lora(fused.transformer), str(style))
    for pipe in (fused, kept):
        fuse_loras(pipe, [str(style)], [0.5])
    assert loaded_adapters(kept.transformer) == [] and kept.config.lora_adapter is None
    run = dict(num_frames=6, max_sequence_length=8)
    a = fused(PROMPT, generator=torch.Generator().manual_seed(1), **run).frames
    b = kept(PROMPT, generator=torch.Generator().manual_seed(1), **run).frames
    assert np.abs(a - b).max() < 1e-4


def test_bfloat16_keeps_diffusers_float32_modules(folders, tmp_path):
    pipe = KreaRealtimeVideoPipeline.from_original(
        write_published(tmp_path, "self-forcing"), folders["wan"], dtype=torch.bfloat16
    )
    assert pipe.transformer.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert pipe.transformer.blocks[0].scale_shift_table.dtype == torch.float32
    assert pipe.text_encoder.dtype == torch.bfloat16 and pipe.vae.dtype == torch.float32


def test_the_old_name_torch_dtype_is_taken_with_a_future_warning_and_a_conflict_is_refused(folders, tmp_path):
    """diffusers 0.42 and transformers take `dtype` and deprecate `torch_dtype`; `from_original` does the same."""
    checkpoint = write_published(tmp_path, "self-forcing")
    with pytest.warns(FutureWarning, match="`torch_dtype` is deprecated: pass `dtype`"):
        pipe = KreaRealtimeVideoPipeline.from_original(checkpoint, folders["wan"], torch_dtype=torch.bfloat16)
    assert pipe.text_encoder.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="Give `dtype` only"):
        KreaRealtimeVideoPipeline.from_original(
            checkpoint, folders["wan"], dtype=torch.float16, torch_dtype=torch.bfloat16
        )


def test_cli_convert_then_generate_with_no_other_flag(folders, tmp_path, capsys):
    out = tmp_path / "cli-model"
    checkpoint = write_published(tmp_path, "causal-forcing-framewise")
    arguments = ["convert", str(checkpoint), "--base", str(folders["wan"]), "--out", str(out)]
    assert main([*arguments, "--height", "32", "--width", "32"]) == 0
    assert "recipe causal-forcing-framewise" in capsys.readouterr().out
    video = tmp_path / "video.mp4"
    assert (
        main(
            [
                "generate",
                "--model",
                str(out),
                "--prompt",
                PROMPT,
                "--seconds",
                "0.5",
                "--fps",
                "8",
                "--out",
                str(video),
            ]
        )
        == 0
    )
    assert iio.imread(video).shape[1:] == (32, 32, 3)


def test_hub_base_downloads_only_what_it_needs(folders, tmp_path, monkeypatch):
    import huggingface_hub

    asked = {}

    def snapshot_download(repo_id, allow_patterns):
        asked.update(repo_id=repo_id, allow_patterns=allow_patterns)
        return str(folders["wan"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    plan = plan_conversion(write_published(tmp_path, "self-forcing"), "Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    assert plan.base.folder == folders["wan"] and asked["repo_id"] == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    assert "transformer/config.json" in asked["allow_patterns"]
    assert not any(
        pattern.startswith("transformer/") and pattern != "transformer/config.json"
        for pattern in asked["allow_patterns"]
    )


# ---------------------------------------------------------------------------------------- refusals
def _refused(match: str, *args, **kwargs) -> None:
    with pytest.raises(ValueError, match=match):
        plan_conversion(*args, **kwargs)


def test_a_wan_file_of_no_published_name_needs_a_recipe(folders, tmp_path):
    path = write_published(tmp_path, "self-forcing").rename(tmp_path / "my_finetune.pt")
    _refused(r"Cannot tell the recipe.*`recipe` one of \[", path, folders["wan"])
    assert plan_conversion(path, folders["wan"], recipe="self-forcing").recipe == "self-forcing"


def test_a_recipe_of_the_other_family_is_refused(folders, tmp_path):
    _refused(
        r"`recipe` must be one of \('longsana',\) \(for a SANA-Video checkpoint\), got 'self-forcing'",
        write_published(tmp_path, "longsana"),
        folders["sana"],
        recipe="self-forcing",
    )
    _refused(
        r"`recipe` must be one of \(.*'self-forcing'.*\) \(for a Wan 2.1 checkpoint\), got 'longsana'",
        write_published(tmp_path, "self-forcing"),
        folders["wan"],
        recipe="longsana",
    )


def test_lora_only_file_and_lora_mismatches_are_refused(folders, tmp_path):
    lora_path, _ = write_lora(tmp_path)
    _refused(r"holds only a LoRA adapter .* pass it as `lora`", lora_path, folders["wan"])
    base = write_published(tmp_path, "longlive")
    _refused(r"recipe 'longlive' is the base weights plus LongLive's LoRA: pass `lora`", base, folders["wan"])
    _refused(
        r"`lora` is LongLive's adapter, for recipe 'longlive' only",
        write_published(tmp_path, "self-forcing"),
        folders["wan"],
        lora=lora_path,
    )


def test_a_base_of_the_other_family_is_refused(folders, tmp_path):
    _refused(
        r"is a 'SanaVideoPipeline' pipeline; a Wan 2.1 checkpoint needs one of",
        write_published(tmp_path, "self-forcing"),
        folders["sana"],
    )
    _refused(r"neither a folder nor a Hugging Face Hub id", write_published(tmp_path, "self-forcing"), "no such base!")


def test_a_base_of_another_size_is_refused_naming_the_keys(folders, tmp_path):
    small = base_folder(tmp_path / "small-base")
    config_path = small / "transformer" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "num_layers": 2}))
    _refused(
        r"does not fit `base`.*num_layers=2.*not in the base 54: 'blocks\.2\.",
        write_published(tmp_path, "self-forcing"),
        small,
    )


def test_missing_keys_are_refused_by_name(folders, tmp_path):
    weights = wan_to_original(embedded_transformer_weights(WAN_MODEL), prefix="model.")
    del weights["model.blocks.3.ffn.2.weight"]
    path = tmp_path / "checkpoints" / "self_forcing_dmd.pt"
    path.parent.mkdir()
    torch.save(training_checkpoint(weights, "generator_ema"), path)
    _refused(r"missing 1: 'blocks\.3\.ffn\.net\.2\.weight'", path, folders["wan"])


def test_a_file_that_is_no_transformer_is_refused(folders, tmp_path):
    path = tmp_path / "vae.pt"
    torch.save({"encoder.conv1.weight": torch.zeros(1)}, path)
    _refused(r"neither an original Wan 2.1 nor a SANA-Video transformer", path, folders["wan"])


def test_the_wrong_pipeline_class_is_refused(folders, tmp_path):
    with pytest.raises(ValueError, match=r"SANA-Video checkpoint: load it with LongSanaVideoPipeline.from_original"):
        KreaRealtimeVideoPipeline.from_original(write_published(tmp_path, "longsana"), folders["sana"])


def test_nothing_is_written_when_a_check_fails_and_an_existing_folder_is_kept(folders, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="Cannot tell the recipe"):
        convert_checkpoint(write_published(tmp_path, "self-forcing").rename(tmp_path / "x.pt"), folders["wan"], out)
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"`output` .* exists; pass overwrite=True"):
        convert_checkpoint(tmp_path / "x.pt", folders["wan"], out, recipe="self-forcing")
    assert (out / "keep.txt").read_text() == "mine"
    convert_checkpoint(tmp_path / "x.pt", folders["wan"], out, recipe="self-forcing", overwrite=True)
    assert (out / "model_index.json").is_file() and not (out / "keep.txt").exists()


def test_cli_errors_name_the_flags(folders, tmp_path, capsys):
    path = write_published(tmp_path, "self-forcing").rename(tmp_path / "mine.pt")
    assert main(["convert", str(path), "--base", str(folders["wan"]), "--out", str(tmp_path / "o")]) == 2
    assert "--recipe (`recipe`) one of" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
