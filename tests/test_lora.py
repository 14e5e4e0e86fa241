"""Style LoRAs: diffusers' `load_lora_weights` on both video pipelines, `--lora` on the commands.

The reference is the same pipeline with each LoRA merged into the weights by hand (W + scale * B @ A): the cached,
chunked path with adapters must make its latents over 3 chunks (text K/V, window, context pass all through them).
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import save_file
from test_long_sana_pipeline import tiny_sana_pipeline
from tiny_components import interrupted_run, tiny_pipeline

from rolldiff import KreaRealtimeVideoPipeline
from rolldiff.cli import main
from rolldiff.cli.loading import load_from_flags
from rolldiff.pipelines.io.resume import ResumeError
from rolldiff.pipelines.lora import loaded_adapters, lora_fingerprint

PROMPT = "a red circle moving left"
CALL = dict(num_frames=12, height=16, width=16, output_type="latent")  # 3 chunks of the tiny Krea-like pipeline
TARGETS = ("attn1.to_q", "attn1.to_v", "attn2.to_k")  # self-attention (cached window) and text K (cached per prompt)
# diffusers' module name -> the original Wan name (`diffusion_model.blocks.0.self_attn.q`)
WAN_NAMES = {"attn1.to_q": "self_attn.q", "attn1.to_v": "self_attn.v", "attn2.to_k": "cross_attn.k"}


def random_lora(transformer: torch.nn.Module, seed: int = 0, rank: int = 2) -> dict[str, torch.Tensor]:
    """A LoRA in diffusers' keys (`blocks.0.attn1.to_q.lora_A.weight`) on every `TARGETS` layer."""
    generator = torch.Generator().manual_seed(seed)
    lora = {}
    for name, module in transformer.named_modules():
        if name.endswith(TARGETS):
            lora[f"{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=generator) * 0.3
            lora[f"{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=generator) * 0.3
    return lora


@torch.no_grad()
def merged_by_hand(pipe, lora: dict[str, torch.Tensor], scale: float = 1.0):
    """`pipe` with `lora` added into its weights: W + scale * B @ A (rank = alpha, so no other factor)."""
    for name, module in pipe.transformer.named_modules():
        if f"{name}.lora_A.weight" in lora:
            module.weight += scale * lora[f"{name}.lora_B.weight"] @ lora[f"{name}.lora_A.weight"]
    return pipe


def latents(pipe, **extra) -> torch.Tensor:
    return pipe(PROMPT, generator=torch.Generator().manual_seed(0), **{**CALL, **extra}).frames


@pytest.fixture
def lora_file(tmp_path):
    """diffusers' pipeline LoRA file (`save_lora_weights`: keys `transformer.blocks.0.attn1.to_q.lora_A.weight`)."""
    lora = random_lora(tiny_pipeline().transformer)
    KreaRealtimeVideoPipeline.save_lora_weights(
        tmp_path, transformer_lora_layers=lora, weight_name="style.safetensors"
    )
    return tmp_path / "style.safetensors"


def test_a_loaded_lora_makes_the_hand_merged_weights_latents_over_3_chunks(tmp_path):
    pipe, lora = tiny_pipeline(), random_lora(tiny_pipeline().transformer)
    KreaRealtimeVideoPipeline.save_lora_weights(tmp_path, transformer_lora_layers=lora)
    base = latents(pipe)
    pipe.load_lora_weights(tmp_path, adapter_name="style")
    styled = latents(pipe)
    assert (styled - base).abs().max() > 1e-2  # it does change the video
    torch.testing.assert_close(styled, latents(merged_by_hand(tiny_pipeline(), lora)), atol=1e-5, rtol=1e-5)

    pipe.set_adapters(["style"], [0.5])
    half = latents(merged_by_hand(tiny_pipeline(), lora, scale=0.5))
    torch.testing.assert_close(latents(pipe), half, atol=1e-5, rtol=1e-5)
    pipe.set_adapters(["style"], [0.0])
    assert torch.equal(latents(pipe), base)
    pipe.set_adapters(["style"], [1.0])
    pipe.fuse_lora()
    torch.testing.assert_close(latents(pipe), styled, atol=1e-5, rtol=1e-5)
    pipe.unfuse_lora()
    pipe.unload_lora_weights()
    assert loaded_adapters(pipe.transformer) == []
    torch.testing.assert_close(latents(pipe), base, atol=1e-5, rtol=1e-5)


def test_an_original_wan_lora_file_loads_as_its_diffusers_twin(tmp_path):
    """Community Wan LoRAs keep the original module names (`diffusion_model.blocks.0.self_attn.q.lora_down`)."""
    lora = random_lora(tiny_pipeline().transformer)
    original = {}
    for key, tensor in lora.items():
        module, side = key.rsplit(".lora_", 1)
        block, rest = module.split(".", 2)[1], module.split(".", 2)[2]
        down_up = "lora_down" if side.startswith("A") else "lora_up"
        original[f"diffusion_model.blocks.{block}.{WAN_NAMES[rest]}.{down_up}.weight"] = tensor
    save_file(original, str(tmp_path / "wan_style.safetensors"))
    pipe = tiny_pipeline()
    pipe.load_lora_weights(tmp_path, weight_name="wan_style.safetensors")
    torch.testing.assert_close(latents(pipe), latents(merged_by_hand(tiny_pipeline(), lora)), atol=1e-5, rtol=1e-5)


def test_the_long_sana_pipeline_takes_a_lora_too(tmp_path):
    pipe = tiny_sana_pipeline()
    lora = random_lora(pipe.transformer)
    save_file({f"transformer.{key}": value for key, value in lora.items()}, str(tmp_path / "sana.safetensors"))
    pipe.load_lora_weights(tmp_path, weight_name="sana.safetensors")
    call = dict(num_frames=24, height=16, width=16, output_type="latent")  # 3 chunks of 2 latent frames
    styled = pipe(PROMPT, generator=torch.Generator().manual_seed(0), **call).frames
    expected = merged_by_hand(tiny_sana_pipeline(), lora)(PROMPT, generator=torch.Generator().manual_seed(0), **call)
    torch.testing.assert_close(styled, expected.frames, atol=1e-5, rtol=1e-5)


def test_save_pretrained_with_a_loose_adapter_is_refused_before_writing_and_fused_saves_plainly(tmp_path, lora_file):
    pipe = tiny_pipeline()
    pipe.load_lora_weights(lora_file.parent, weight_name=lora_file.name, adapter_name="style")
    styled = latents(pipe)
    target = tmp_path / "saved"
    with pytest.raises(ValueError, match=r"LoRA adapter\(s\) \['style'\] are loaded.*fuse_lora\(\)"):
        pipe.save_pretrained(target)
    assert not target.exists()
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    pipe.save_pretrained(target)
    torch.testing.assert_close(
        latents(KreaRealtimeVideoPipeline.from_pretrained(target)), styled, atol=1e-5, rtol=1e-5
    )


def test_the_resume_fingerprint_tells_adapters_and_their_scales_apart(lora_file):
    pipe = tiny_pipeline()
    plain = lora_fingerprint(pipe)
    pipe.load_lora_weights(lora_file.parent, weight_name=lora_file.name, adapter_name="style")
    loaded = lora_fingerprint(pipe)
    pipe.set_adapters(["style"], [0.5])
    halved = lora_fingerprint(pipe)
    assert (
        plain != loaded != halved and loaded["adapters"]["style"]["scaling"] > halved["adapters"]["style"]["scaling"]
    )


def test_a_resume_under_another_lora_is_refused_naming_it(tmp_path, lora_file):
    pipe, path = tiny_pipeline(), tmp_path / "video.mp4"
    run = interrupted_run(pipe, path, PROMPT)
    pipe.load_lora_weights(lora_file.parent, weight_name=lora_file.name, adapter_name="style")
    with pytest.raises(ResumeError, match="lora"):
        pipe.generate_to_file(str(path), PROMPT, resume=True, **run)


def _flags(*argv: str) -> argparse.Namespace:
    from rolldiff.cli import build_parser

    return build_parser().parse_args(["generate", "--prompt", PROMPT, *argv])


def test_lora_flags_fuse_the_weighted_loras_into_plain_weights(tmp_path, lora_file):
    folder = tmp_path / "pipeline"
    tiny_pipeline().save_pretrained(folder)
    second = tmp_path / "second.safetensors"
    lora, other = random_lora(tiny_pipeline().transformer), random_lora(tiny_pipeline().transformer, seed=1)
    save_file(other, str(second))  # PEFT's keys, no `transformer.` prefix (`save_lora_adapter`'s file)
    args = _flags("--model", str(folder), "--lora", str(lora_file), "--lora", str(second), "--lora-scale", "0.5",
                  "--lora-scale", "-1")  # fmt: skip
    pipe = load_from_flags(args, "cpu")
    assert loaded_adapters(pipe.transformer) == []  # fused: an ordinary transformer for --compile and the rest
    assert pipe.config.fused_loras == [
        {"source": str(lora_file), "scale": 0.5},
        {"source": str(second), "scale": -1.0},
    ]
    expected = merged_by_hand(merged_by_hand(tiny_pipeline(), lora, 0.5), other, -1.0)
    torch.testing.assert_close(latents(pipe), latents(expected), atol=1e-5, rtol=1e-5)
    saved = tmp_path / "fused"
    pipe.save_pretrained(saved)
    assert json.loads((saved / "model_index.json").read_text())["fused_loras"] == pipe.config.fused_loras


def test_the_command_writes_a_video_with_a_lora(tmp_path, lora_file, capsys):
    folder = tmp_path / "pipeline"
    tiny_pipeline().save_pretrained(folder)
    out = tmp_path / "styled.mp4"
    argv = ["generate", "--model", str(folder), "--prompt", PROMPT, "--lora", str(lora_file), "--seconds", "1"]
    assert main([*argv, "--fps", "8", "--height", "16", "--width", "16", "--out", str(out)]) == 0
    assert out.stat().st_size > 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--lora", "{lora}", "--lora-scale", "1", "--lora-scale", "2"], "--lora-scale: 2 given for 1 --lora"),
        (["--lora-scale", "0.5"], "--lora-scale: 1 given for 0 --lora"),
        (["--lora", "./no/such.safetensors"], "--lora: no such file or folder './no/such.safetensors'"),
        (["--lora", "style.safetensors"], "--lora: no such file or folder 'style.safetensors'"),
        (["--lora", "{pickle}"], "only .safetensors files are read"),
        (
            ["--lora", "{lora}", "--pipeline-parallel", "2"],
            "--pipeline-parallel runs the model as loaded, without --lora",
        ),
        (["--lora-scale", "nan"], "--lora-scale: expected a finite number"),
    ],
)
def test_bad_lora_flags_are_refused_before_the_model_loads(tmp_path, lora_file, monkeypatch, capsys, extra, message):
    pickle = tmp_path / "style.pt"
    pickle.write_bytes(b"not read")
    extra = [arg.format(lora=lora_file, pickle=pickle) for arg in extra]

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("rolldiff.cli.run_generate.load_from_flags", no_loading)
    assert main(["generate", "--prompt", PROMPT, "--out", str(tmp_path / "v.mp4"), *extra]) == 2
    assert message in capsys.readouterr().err


def test_a_lora_that_fits_no_layer_is_refused_by_name_and_leaves_no_adapter(tmp_path):
    path = tmp_path / "other_model.safetensors"
    save_file({"diffusion_model.blocks.0.nothing.lora_down.weight": torch.zeros(2, 8),
               "diffusion_model.blocks.0.nothing.lora_up.weight": torch.zeros(8, 2)}, str(path))  # fmt: skip
    folder = tmp_path / "pipeline"
    tiny_pipeline().save_pretrained(folder)
    assert main(["generate", "--model", str(folder), "--prompt", PROMPT, "--lora", str(path),
                 "--out", str(tmp_path / "v.mp4")]) == 2  # fmt: skip
    pipe = tiny_pipeline()
    from rolldiff.pipelines.lora import fuse_loras

    with pytest.raises(ValueError, match="other_model.safetensors"):
        fuse_loras(pipe, [str(path)], [1.0])
    assert loaded_adapters(pipe.transformer) == [] and pipe.config.fused_loras == []


def test_serve_refuses_bad_lora_flags_before_the_model_loads(tmp_path, capsys):
    assert main(["serve", "--lora", str(tmp_path / "missing.safetensors"), "--port", "0"]) == 2
    assert "--lora: no such file or folder" in capsys.readouterr().err


def test_a_server_with_a_lora_serves_the_fused_models_frames_and_names_it(tmp_path):
    """`rolldiff serve --lora`, a real process: /v1/model lists the LoRA, and a session's frames are those of the
    library on a folder saved from the same fusion."""
    from serve_helpers import FRAMES, RED, Server, reference_chunks

    from rolldiff.defaults import load_pipeline
    from rolldiff.pipelines.lora import fuse_loras
    from rolldiff.serving import connect

    pipe = load_pipeline(None, device="cpu", dtype="float32")
    path = tmp_path / "style.safetensors"
    save_file(random_lora(pipe.transformer), str(path))
    plain_weight = pipe.transformer.blocks[0].attn1.to_q.weight.clone()
    fuse_loras(pipe, [str(path)], [0.7])
    assert (pipe.transformer.blocks[0].attn1.to_q.weight - plain_weight).abs().max() > 1e-3  # not the plain model
    pipe.save_pretrained(tmp_path / "fused")
    server = Server("--lora", str(path), "--lora-scale", "0.7")
    try:
        assert server.http("/v1/model")["loras"] == [{"source": str(path), "scale": 0.7}]
        with connect(server.url, prompt=RED, seed=3, num_frames=FRAMES) as live:
            chunks = list(live)
    finally:
        server.stop()
    expected = reference_chunks(
        tmp_path / "refs", model=str(tmp_path / "fused"), prompt=RED, seed=3, num_frames=FRAMES
    )
    assert len(chunks) == len(expected) and all((got == want).all() for got, want in zip(chunks, expected))


def test_the_demo_serves_the_model_with_its_loras_fused(tmp_path, lora_file, monkeypatch):
    import gradio as gr

    import rolldiff.demo

    folder = tmp_path / "pipeline"
    tiny_pipeline().save_pretrained(folder)
    built = {}

    def build_demo(**kwargs):
        built.update(kwargs)
        return gr.Blocks()

    monkeypatch.setattr(rolldiff.demo, "build_demo", build_demo)
    monkeypatch.setattr(gr.Blocks, "launch", lambda self, **kwargs: None)
    assert (
        main(["demo", "--model", str(folder), "--lora", str(lora_file), "--lora-scale", "0.5", "--port", "7862"]) == 0
    )
    (label, load), *others = built["models"].items()
    assert others == [] and label == f"{folder} + LoRA"
    assert load().config.fused_loras == [{"source": str(lora_file), "scale": 0.5}]


def test_the_demo_refuses_a_missing_lora_before_the_model_loads(capsys):
    assert main(["demo", "--lora", "./no/such.safetensors", "--port", "7862"]) == 2
    assert "--lora: no such file or folder" in capsys.readouterr().err
