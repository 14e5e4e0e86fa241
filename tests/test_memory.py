"""Fitting a smaller GPU: `enable_offload` (text encoder, whole components, the transformer's blocks) and
`enable_fp8_storage`, in the library and as `--offload` / `--fp8-storage` on the commands.

References: an offloaded pipeline makes the resident pipeline's latents bit for bit over 3 chunks and a prompt switch
(on a CPU the moves are no-ops, so only the hooks' calls can differ, and they must not); float8 storage makes the
latents of the same model whose cast weights were rounded to float8 by hand. 3 blocks, so a block left out of a
group cannot hide behind the last one.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from diffusers.hooks import apply_group_offloading
from test_long_sana_pipeline import tiny_sana_pipeline
from tiny_components import interrupted_run, tiny_pipeline, tiny_transformer

from rolldiff.cli import build_parser, main
from rolldiff.cli.loading import load_weights
from rolldiff.models.placement import execution_device, is_offloaded
from rolldiff.pipelines.acceleration import (
    AccelerationUnavailable,
    compile_cached_step,
    enable_fp8,
    transformer_device,
)
from rolldiff.pipelines.io.resume import ResumeError
from rolldiff.pipelines.memory import fp8_storage, offload_mode

PROMPT = "a red circle moving left"
SWITCH = [(4, "a blue square moving up")]  # a prompt switch at the second chunk: the text encoder runs again


def krea_pipeline():
    pipe = tiny_pipeline()
    pipe.register_modules(transformer=tiny_transformer(num_layers=3))
    return pipe


FAMILIES = {
    "krea": (krea_pipeline, dict(num_frames=12, height=16, width=16)),  # 3 chunks of 2 latent frames
    "sana": (lambda: tiny_sana_pipeline(num_layers=3), dict(num_frames=24, height=16, width=16)),  # 3 chunks of 2
}


def latents(family: str, pipe) -> torch.Tensor:
    call = FAMILIES[family][1]
    generator = torch.Generator().manual_seed(0)
    return pipe(prompt_schedule=[(0, PROMPT), *SWITCH], generator=generator, output_type="latent", **call).frames


@pytest.fixture(scope="module")
def resident() -> dict[str, torch.Tensor]:
    return {family: latents(family, make()) for family, (make, _) in FAMILIES.items()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["text-encoder", "model", "blocks"])
def test_an_offloaded_pipeline_makes_the_resident_ones_latents_bit_for_bit(family, mode, resident):
    pipe = FAMILIES[family][0]()
    pipe.enable_offload(mode, device="cpu")
    assert offload_mode(pipe) == mode
    assert is_offloaded(pipe.transformer) == (mode != "text-encoder")  # text-encoder: the transformer stays resident
    assert torch.equal(latents(family, pipe), resident[family])


def _layers_called_outside_the_forward(transformer: torch.nn.Module) -> list[str]:
    """Watch `transformer`: the names of its layers that run while its own forward is not running. Offload hooks
    bring the weights only inside that forward, so on a GPU such a layer would find its weights in CPU memory (on a
    CPU the moves are no-ops, so the latents alone cannot show it)."""
    depth, outside = [], []
    transformer.register_forward_pre_hook(lambda module, args: depth.append(1))
    transformer.register_forward_hook(lambda module, args, out: depth.pop() and None)  # None: the output stays
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda module, args, name=name: None if depth else outside.append(name))
    return outside


@pytest.mark.parametrize("mode", ["model", "blocks"])
@pytest.mark.parametrize(("family", "recache"), [("krea", "causal"), ("krea", "longlive"), ("sana", "causal")])
def test_offloaded_no_layer_of_the_transformer_runs_outside_its_forward(family, recache, mode):
    """The text K/V of a new prompt (and LongLive's re-cache) are filled from inside the first step, not ahead."""
    pipe = FAMILIES[family][0]()
    pipe.enable_offload(mode, device="cpu")
    outside = _layers_called_outside_the_forward(pipe.transformer)
    generator = torch.Generator().manual_seed(0)
    call = dict(prompt_schedule=[(0, PROMPT), *SWITCH], generator=generator, output_type="latent", recache=recache)
    pipe(**call, **FAMILIES[family][1])
    assert outside == []
    resident = FAMILIES[family][0]()
    watched = _layers_called_outside_the_forward(resident.transformer)
    resident(**{**call, "generator": torch.Generator().manual_seed(0)}, **FAMILIES[family][1])
    assert any(".attn2." in name for name in watched)  # resident, the text K/V are filled ahead: the watch sees it


def _cast_modules(transformer: torch.nn.Module) -> list[str]:
    """The modules whose own weights diffusers' layerwise casting stores in float8."""
    return [
        name
        for name, module in transformer.named_modules()
        if getattr(module, "_diffusers_hook", None) is not None
        and module._diffusers_hook.get_hook("layerwise_casting") is not None
    ]


@torch.no_grad()
def _rounded_to_float8(pipe, names: list[str]):
    for name in names:
        for parameter in pipe.transformer.get_submodule(name).parameters(recurse=False):
            parameter.copy_(parameter.to(torch.float8_e4m3fn).to(parameter.dtype))
    return pipe


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_storage_makes_the_latents_of_weights_rounded_to_float8_by_hand(family, resident):
    make = FAMILIES[family][0]
    pipe = make()
    bytes_before = sum(p.nbytes for p in pipe.transformer.parameters())
    pipe.enable_fp8_storage()
    cast = _cast_modules(pipe.transformer)
    assert len([name for name in cast if ".2." in name]) > 0  # the third block's layers too
    assert fp8_storage(pipe.transformer) and pipe.transformer.dtype == torch.float32  # computes in its dtype
    assert sum(p.nbytes for p in pipe.transformer.parameters()) < 0.5 * bytes_before
    stored = latents(family, pipe)
    assert stored.dtype == torch.float32
    assert (stored - resident[family]).abs().max() > 1e-3  # the rounding shows
    assert torch.equal(stored, latents(family, _rounded_to_float8(make(), cast)))


def test_fp8_storage_and_offloading_together_make_the_fp8_stored_latents(resident):
    stored = krea_pipeline()
    stored.enable_fp8_storage()
    both = krea_pipeline()
    both.enable_fp8_storage()
    both.enable_offload("blocks", device="cpu")
    assert torch.equal(latents("krea", both), latents("krea", stored))


def test_bad_memory_requests_are_refused_by_name_before_any_change():
    pipe = krea_pipeline()
    with pytest.raises(ValueError, match=r"`mode` must be one of 'text-encoder', 'model', 'blocks', got 'gpu'"):
        pipe.enable_offload("gpu", device="cpu")
    assert offload_mode(pipe) is None and not is_offloaded(pipe.transformer)
    pipe.enable_offload("blocks", device="cpu")
    with pytest.raises(ValueError, match="offloaded already"):
        pipe.enable_offload("model", device="cpu")
    with pytest.raises(ValueError, match="before offloading"):
        pipe.enable_fp8_storage()
    assert not fp8_storage(pipe.transformer)
    stored = krea_pipeline()
    stored.enable_fp8_storage()
    with pytest.raises(ValueError, match="float8 already"):
        stored.enable_fp8_storage()
    with pytest.raises(AccelerationUnavailable, match="--fp8-storage"):
        enable_fp8(stored.transformer)


@pytest.mark.parametrize("placed", ["model", "blocks", "fp8-storage"])
def test_compiling_weights_that_hooks_move_or_cast_is_refused_naming_why(placed):
    pipe = krea_pipeline()
    if placed == "fp8-storage":
        pipe.enable_fp8_storage()
    else:
        pipe.enable_offload(placed, device="cpu")
    forward = pipe.transformer.forward
    with pytest.raises(AccelerationUnavailable, match="--fp8-storage" if placed == "fp8-storage" else "--offload"):
        compile_cached_step(pipe.transformer, backend="eager")
    assert pipe.transformer.forward == forward  # nothing installed


def test_with_the_text_encoder_offloaded_the_resident_transformer_compiles_and_makes_the_same_latents(resident):
    pipe = krea_pipeline()
    pipe.enable_offload("text-encoder", device="cpu")
    compile_cached_step(pipe.transformer, backend="eager")
    torch.testing.assert_close(latents("krea", pipe), resident["krea"], atol=1e-5, rtol=1e-5)


def test_a_group_offloaded_module_reports_the_device_its_weights_visit_not_where_they_wait():
    """Named for a GPU this machine need not have: nothing moves until the first call, which never comes."""
    transformer = tiny_transformer(num_layers=3)
    apply_group_offloading(transformer, torch.device("cuda"), offload_type="block_level", num_blocks_per_group=1)
    assert next(transformer.parameters()).device.type == "cpu"  # waiting
    assert execution_device(transformer) == torch.device("cuda") == transformer_device(transformer)
    assert is_offloaded(transformer) and not is_offloaded(tiny_transformer())


def test_a_resume_with_other_weight_storage_is_refused_naming_it(tmp_path):
    pipe, path = tiny_pipeline(), tmp_path / "video.mp4"
    run = interrupted_run(pipe, path, PROMPT)
    stored = tiny_pipeline()
    stored.enable_fp8_storage()
    with pytest.raises(ResumeError, match="fp8_storage"):
        stored.generate_to_file(str(path), PROMPT, resume=True, **run)
    offloaded = tiny_pipeline()
    offloaded.enable_offload("blocks", device="cpu")  # the same video: resumes
    assert offloaded.generate_to_file(str(path), PROMPT, resume=True, **run) == 12  # every frame written


# ------------------------------------------------------------------------------------------- the commands
def _flags(command: str, *argv: str) -> argparse.Namespace:
    prompt = ["--prompt", PROMPT] if command == "generate" else []
    return build_parser().parse_args([command, *prompt, *argv])


@pytest.mark.parametrize("command", ["generate", "serve", "demo"])
def test_the_flags_load_the_weights_stored_and_placed_as_they_say(tmp_path, command):
    folder = tmp_path / "pipeline"
    tiny_pipeline().save_pretrained(folder)
    pipe = load_weights(_flags(command, "--model", str(folder), "--offload", "blocks", "--fp8-storage"), "cpu")
    assert offload_mode(pipe) == "blocks" and fp8_storage(pipe.transformer)
    plain = load_weights(_flags(command, "--model", str(folder)), "cpu")
    assert offload_mode(plain) is None and not fp8_storage(plain.transformer)


def test_the_command_writes_the_resident_video_with_the_weights_offloaded(tmp_path):
    import imageio.v3 as iio

    folder = tmp_path / "pipeline"
    tiny_pipeline().save_pretrained(folder)
    videos = {}
    for name, flags in (("resident", []), ("offloaded", ["--offload", "blocks"])):
        videos[name] = tmp_path / f"{name}.mp4"
        argv = ["generate", "--model", str(folder), "--prompt", PROMPT, "--seconds", "1", "--fps", "8"]
        assert main([*argv, "--height", "16", "--width", "16", "--out", str(videos[name]), *flags]) == 0
    assert (iio.imread(videos["offloaded"]) == iio.imread(videos["resident"])).all()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--offload", "blocks", "--compile"], "--offload blocks and --compile: hooks move the weights"),
        (["--offload", "model", "--cuda-graphs"], "--offload model and --cuda-graphs"),
        (["--fp8-storage", "--compile"], "--fp8-storage and --compile: hooks cast the weights"),
        (["--fp8-storage", "--fp8"], "--fp8-storage and --fp8: two ways to float8 weights"),
        (["--offload", "model", "--pipeline-parallel", "2"], "--pipeline-parallel runs the model as loaded, without"),
        (["--offload", "gpu"], "--offload: invalid choice: 'gpu' (choose from 'text-encoder', 'model', 'blocks')"),
    ],
)
def test_bad_memory_flags_are_refused_before_the_model_loads(tmp_path, monkeypatch, capsys, extra, message):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("rolldiff.cli.run_generate.load_from_flags", no_loading)
    assert main(["generate", "--prompt", PROMPT, "--out", str(tmp_path / "v.mp4"), *extra]) == 2
    assert message in capsys.readouterr().err


def test_serve_and_the_demo_refuse_bad_memory_flags_before_the_model_loads(capsys):
    assert main(["serve", "--offload", "blocks", "--compile", "--port", "0"]) == 2
    assert "--offload blocks and --compile" in capsys.readouterr().err
    assert main(["demo", "--fp8-storage", "--offload", "nowhere", "--port", "7862"]) == 2
    assert "--offload: invalid choice" in capsys.readouterr().err


def test_the_demo_serves_the_one_model_loaded_as_the_flags_say(tmp_path, monkeypatch):
    import gradio as gr

    import rolldiff.demo

    folder = tmp_path / "pipeline"
    tiny_pipeline().save_pretrained(folder)
    built = {}
    monkeypatch.setattr(rolldiff.demo, "build_demo", lambda **kwargs: built.update(kwargs) or gr.Blocks())
    monkeypatch.setattr(gr.Blocks, "launch", lambda self, **kwargs: None)
    assert main(["demo", "--model", str(folder), "--offload", "text-encoder", "--port", "7862"]) == 0
    (label, load), *others = built["models"].items()
    assert others == [] and label == str(folder)
    assert offload_mode(load()) == "text-encoder"


def test_a_server_with_offloaded_fp8_weights_serves_their_frames_and_says_so(tmp_path):
    """`rolldiff serve --offload blocks --fp8-storage`, a real process: /v1/model says both, and a session's frames
    are the library's with float8 storage (resident), bit for bit."""
    from serve_helpers import FRAMES, RED, Server, reference_chunks

    from rolldiff.serving import connect

    server = Server("--offload", "blocks", "--fp8-storage")
    try:
        described = server.http("/v1/model")
        with connect(server.url, prompt=RED, seed=3, num_frames=FRAMES) as live:
            chunks = list(live)
    finally:
        server.stop()
    assert described["offload"] == "blocks" and described["fp8_storage"] is True
    expected = reference_chunks(tmp_path, prompt=RED, seed=3, num_frames=FRAMES, fp8_storage=True)
    plain = reference_chunks(tmp_path, prompt=RED, seed=3, num_frames=FRAMES)
    assert len(chunks) == len(expected) and all((got == want).all() for got, want in zip(chunks, expected))
    assert any((got != want).any() for got, want in zip(chunks, plain))  # float8 weights show in the frames
