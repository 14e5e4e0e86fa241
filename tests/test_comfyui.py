"""rolldiff's ComfyUI nodes, run as ComfyUI runs them: the class's `INPUT_TYPES` read, an instance made, its `FUNCTION`
called with the inputs by name. ComfyUI itself is not installed here (it is not on a package index), so its three
hooks the nodes use (`comfy.model_management`, `comfy.utils.ProgressBar`, `folder_paths`) are stand-ins that record
what they were asked. The reference for every video is the library called directly with the same arguments: the
frames must be equal, not close.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from test_lora import random_lora
from tiny_components import tiny_pipeline

from rolldiff import KreaRealtimeVideoPipeline
from rolldiff.cli import main
from rolldiff.comfyui import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
from rolldiff.comfyui.install import NODES_FOLDER, install_nodes
from rolldiff.comfyui.nodes import output_path
from rolldiff.pipelines.io.resume import state_path_for
from rolldiff.pipelines.io.subtitles import subtitle_overlay
from rolldiff.pipelines.io.video_writer import partial_path_for
from rolldiff.pipelines.lora import fuse_loras
from rolldiff.story import parse_story

PROMPT, OTHER = "a red circle moving left", "a blue square moving up"
# 12 frames of 16x16: 3 chunks of the tiny Krea-like pipeline
INPUTS = dict(prompt=PROMPT, seconds=1.5, fps=8, seed=0, recipe="auto", width=16, height=16)
LIBRARY = dict(num_frames=12, height=16, width=16)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("comfyui") / "tiny"
    tiny_pipeline().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def pipe(model_folder):
    (pipe,) = NODE_CLASS_MAPPINGS["RolldiffLoadPipeline"]().load(str(model_folder), "cpu", "auto", "none", False)
    return pipe


class ComfyStandIns:
    """`comfy.model_management`, `comfy.utils` and `folder_paths` as a running ComfyUI offers them."""

    def __init__(self, monkeypatch, output_folder, cancel_after_checks: int | None = None) -> None:
        self.progress: list[int] = []
        self.totals: list[int] = []
        self.checks = 0
        stand_ins = self

        class Interrupted(Exception):  # ComfyUI's InterruptProcessingException
            pass

        class ProgressBar:
            def __init__(self, total):
                stand_ins.totals.append(total)

            def update_absolute(self, value, total=None, preview=None):
                stand_ins.progress.append(value)

        def throw_exception_if_processing_interrupted():
            stand_ins.checks += 1
            if cancel_after_checks is not None and stand_ins.checks > cancel_after_checks:
                raise Interrupted

        self.Interrupted = Interrupted
        comfy = types.ModuleType("comfy")
        management = types.ModuleType("comfy.model_management")
        management.throw_exception_if_processing_interrupted = throw_exception_if_processing_interrupted
        management.get_torch_device = lambda: torch.device("cpu")
        utils = types.ModuleType("comfy.utils")
        utils.ProgressBar = ProgressBar
        comfy.model_management, comfy.utils = management, utils
        folder_paths = types.ModuleType("folder_paths")
        folder_paths.get_output_directory = lambda: str(output_folder)
        loras = output_folder / "models" / "loras"  # ComfyUI's models/loras
        folder_paths.get_full_path = lambda kind, name: str(loras / name) if (loras / name).is_file() else None
        self.loras = loras
        for name, module in [("comfy", comfy), ("comfy.model_management", management), ("comfy.utils", utils),
                             ("folder_paths", folder_paths)]:  # fmt: skip
            monkeypatch.setitem(sys.modules, name, module)


def library_frames(pipe, **call) -> np.ndarray:
    """The library's video for the same arguments: `(frames, height, width, 3)`."""
    generator = torch.Generator().manual_seed(0)
    return pipe(call.pop("prompt", PROMPT), generator=generator, **{**LIBRARY, **call}).frames[0]


def file_frames(path) -> np.ndarray:
    return iio.imread(path, plugin="FFMPEG", index=None)  # (frames, height, width, 3) uint8


# ---------------------------------------------------------------------------------------- what ComfyUI reads
@pytest.mark.parametrize("name", sorted(NODE_CLASS_MAPPINGS))
def test_every_node_declares_what_comfyui_reads_and_its_function_takes_every_input(name):
    node = NODE_CLASS_MAPPINGS[name]
    assert NODE_DISPLAY_NAME_MAPPINGS[name]
    assert isinstance(node.CATEGORY, str) and isinstance(node.DESCRIPTION, str)
    assert isinstance(node.RETURN_TYPES, tuple) and len(node.RETURN_NAMES) == len(node.RETURN_TYPES)
    inputs = node.INPUT_TYPES()
    assert set(inputs) <= {"required", "optional"}
    function = inspect.signature(getattr(node(), node.FUNCTION))
    takes_any = any(p.kind is p.VAR_KEYWORD for p in function.parameters.values())
    for group, specs in inputs.items():
        for input_name, spec in specs.items():
            assert takes_any or input_name in function.parameters, input_name
            kind, options = spec[0], (spec[1] if len(spec) > 1 else {})
            if isinstance(kind, list):  # a combo: its default is one of its values
                assert all(isinstance(value, str) for value in kind) and options.get("default", kind[0]) in kind
            elif kind in ("INT", "FLOAT"):  # ComfyUI refuses a default outside [min, max]
                assert options["min"] <= options["default"] <= options["max"], input_name
            else:
                assert isinstance(kind, str) and kind.isupper(), input_name
            if group == "required" and kind in ("STRING", "BOOLEAN", "INT", "FLOAT"):
                assert "default" in options, input_name


def test_the_installed_folder_loads_the_way_comfyui_loads_custom_nodes(tmp_path):
    (tmp_path / "ComfyUI" / "custom_nodes").mkdir(parents=True)
    module_path = install_nodes(tmp_path / "ComfyUI")
    assert module_path == tmp_path / "ComfyUI" / "custom_nodes" / NODES_FOLDER / "__init__.py"
    assert install_nodes(tmp_path / "ComfyUI") == module_path  # again: rewritten, not refused

    # ComfyUI's nodes.load_custom_node: a module named after the folder, from its __init__.py
    spec = importlib.util.spec_from_file_location(NODES_FOLDER, module_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[NODES_FOLDER] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[NODES_FOLDER]
    assert module.NODE_CLASS_MAPPINGS is NODE_CLASS_MAPPINGS
    assert module.NODE_DISPLAY_NAME_MAPPINGS is NODE_DISPLAY_NAME_MAPPINGS


def test_install_refuses_a_folder_without_custom_nodes_and_leaves_a_foreign_module_alone(tmp_path):
    with pytest.raises(ValueError, match="`comfyui_folder`: .*\\(no custom_nodes folder"):
        install_nodes(tmp_path)
    foreign = tmp_path / "custom_nodes" / NODES_FOLDER / "__init__.py"
    foreign.parent.mkdir(parents=True)
    foreign.write_text("NODE_CLASS_MAPPINGS = {}\n")
    with pytest.raises(ValueError, match="not written by rolldiff"):
        install_nodes(tmp_path)
    assert foreign.read_text() == "NODE_CLASS_MAPPINGS = {}\n"


def test_the_install_command_writes_the_folder_and_names_its_argument_when_refused(tmp_path, capsys):
    (tmp_path / "custom_nodes").mkdir()
    assert main(["install-comfyui", str(tmp_path)]) == 0
    assert (tmp_path / "custom_nodes" / NODES_FOLDER / "__init__.py").is_file()
    assert "restart ComfyUI" in capsys.readouterr().out
    assert main(["install-comfyui", str(tmp_path / "nowhere")]) == 2
    assert "COMFYUI_FOLDER (`comfyui_folder`): " in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- the videos
def test_the_video_node_returns_the_librarys_frames_as_comfyui_images(pipe, monkeypatch, tmp_path):
    comfy = ComfyStandIns(monkeypatch, tmp_path)
    frames, fps = NODE_CLASS_MAPPINGS["RolldiffVideo"]().generate(pipe, **INPUTS)
    assert frames.dtype == torch.float32 and frames.shape == (12, 16, 16, 3) and fps == 8.0
    np.testing.assert_array_equal(frames.numpy(), library_frames(pipe))
    assert comfy.totals == [12] and comfy.progress == [2, 4, 6, 8, 10, 12]  # the bar moves at each of the 6 chunks
    assert comfy.checks == 6  # Cancel is looked at after each


def test_a_prompt_schedule_a_start_image_and_an_input_video_are_the_librarys(pipe):
    node = NODE_CLASS_MAPPINGS["RolldiffVideo"]()
    frames, _ = node.generate(pipe, **INPUTS, prompt_schedule=f"\n4: {OTHER}\n", denoising_steps="1000,500")
    expected = library_frames(pipe, prompt_schedule=[(4, OTHER)], denoising_steps=[1000, 500])
    np.testing.assert_array_equal(frames.numpy(), expected)

    picture = torch.rand(1, 16, 16, 3, generator=torch.Generator().manual_seed(1))  # ComfyUI's IMAGE batch of one
    frames, _ = node.generate(pipe, **INPUTS, image=picture)
    np.testing.assert_array_equal(frames.numpy(), library_frames(pipe, image=picture[0].numpy()))

    source = torch.rand(12, 16, 16, 3, generator=torch.Generator().manual_seed(2))
    frames, _ = node.generate(pipe, **INPUTS, video=source, strength=0.5)
    np.testing.assert_array_equal(frames.numpy(), library_frames(pipe, video=source.numpy(), strength=0.5))


def test_scene_cuts_are_the_librarys(pipe):
    """`scene_cuts` names schedule lines that are hard cuts (under a recipe with relative positions)."""
    inputs = {**INPUTS, "recipe": "infinity-rope", "prompt_schedule": f"6: {OTHER}"}
    frames, _ = NODE_CLASS_MAPPINGS["RolldiffVideo"]().generate(pipe, **inputs, scene_cuts=" 6 ")
    call = dict(recipe="infinity-rope", prompt_schedule=[(6, OTHER)])
    np.testing.assert_array_equal(frames.numpy(), library_frames(pipe, **call, scene_cuts=[6]))
    assert not np.array_equal(frames.numpy(), library_frames(pipe, **call))


def test_a_story_is_the_librarys_scenes_and_cuts_with_its_subtitles_drawn_in(pipe, monkeypatch, tmp_path):
    """`story` replaces the prompt inputs and the length: the frames are the library's for `parse_story(...)
    .arguments(...)`, except on the frames a subtitle covers, which carry it; the file node draws them the same."""
    ComfyStandIns(monkeypatch, tmp_path)
    inputs = {**INPUTS, "recipe": "infinity-rope"}  # chunks of 3, relative positions (a cut needs them)
    story = f"{PROMPT}[0.75s#] | {OTHER}[0.75s] ; Red"  # 1.5 s at 8 fps: 12 frames, the cut at frame 6
    frames, _ = NODE_CLASS_MAPPINGS["RolldiffVideo"]().generate(pipe, **inputs, story=story)
    call = parse_story(story).arguments(pipe, 8, recipe="infinity-rope")
    assert call["prompt_schedule"] == [(0, PROMPT), (6, OTHER)] and call["scene_cuts"] == [6]
    expected = library_frames(pipe, **call)
    assert frames.shape == expected.shape == (12, 16, 16, 3)
    np.testing.assert_array_equal(frames.numpy()[6:], expected[6:])  # "Red" covers the first scene only
    drawn = (frames.numpy()[:6] != expected[:6]).any(axis=(1, 2, 3))
    assert drawn.all()
    written = NODE_CLASS_MAPPINGS["RolldiffVideoToFile"]().write(
        pipe, filename_prefix="story", quality=10, resume=False, **inputs, story=story
    )["result"][0]
    reference = tmp_path / "reference.mp4"
    pipe.generate_to_file(str(reference), fps=8, quality=10, generator=torch.Generator().manual_seed(0), height=16,
                          width=16, overlay=subtitle_overlay(parse_story(story).subtitle_spans(8)), **call)  # fmt: skip
    np.testing.assert_array_equal(file_frames(written), file_frames(reference))


def test_without_a_width_and_height_the_embedded_model_makes_its_own_size():
    (pipe,) = NODE_CLASS_MAPPINGS["RolldiffLoadPipeline"]().load("tiny-bouncing-shapes", "cpu", "auto", "none", False)
    inputs = {**INPUTS, "width": 0, "height": 0, "seconds": 0.5, "fps": 16}
    frames, _ = NODE_CLASS_MAPPINGS["RolldiffVideo"]().generate(pipe, **inputs)
    assert frames.shape[1:] == (pipe.config.height, pipe.config.width, 3)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (dict(prompt_schedule="4: fine\nsoon: a blue square"), "`prompt_schedule` line 2: expected FRAME:TEXT"),
        (dict(denoising_steps="1000, half"), "`denoising_steps`: expected comma-separated integers"),
        (dict(prompt_schedule="6: a blue square", scene_cuts="6, x"), "`scene_cuts`: expected comma-separated"),
        (
            dict(prompt_schedule="6: a blue square", scene_cuts="5", recipe="infinity-rope"),
            "frames [5] are not prompt",
        ),
        (dict(image=torch.rand(2, 16, 16, 3)), "`image`: connect one picture"),
        (dict(width=20), "`width`"),
        (dict(recipe="longsana"), "`recipe`"),  # the SANA-like pipe's recipe
        (dict(seconds=0.0), "`seconds` must be a finite number > 0"),
        (dict(story="a red circle[1s] | "), "`story` scene 2 has no prompt"),
        (dict(story="a red circle[1s]", scene_cuts="4"), "`story` holds the prompts, their switches and cuts; drop "),
        (  # a scene past the video's end (no length: 14 chunks, beyond `seconds`), named by the input that set it
            dict(story="a red circle[0.5s] | a blue square | a red circle", recipe="infinity-rope"),
            "`story` (`prompt_schedule`) frame 45 is out of range",
        ),
    ],
)
def test_a_bad_input_is_refused_by_name_before_any_chunk(pipe, model_calls, inputs, message):
    with pytest.raises(ValueError) as refused:
        NODE_CLASS_MAPPINGS["RolldiffVideo"]().generate(pipe, **{**INPUTS, **inputs})
    assert message in str(refused.value)
    assert model_calls == []  # refused before the transformer ran


@pytest.mark.parametrize(
    ("model", "device", "message"),
    [("./no/such/folder", "cpu", "`model`"), ("tiny-bouncing-shapes", "gpu:0", "`device`: 'gpu:0' is not a device")],
)
def test_the_loader_names_a_bad_model_or_device(model, device, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        NODE_CLASS_MAPPINGS["RolldiffLoadPipeline"]().load(model, device, "auto", "none", False)


def test_auto_loads_on_comfyuis_device_and_a_missing_lora_is_named(model_folder, monkeypatch, tmp_path):
    ComfyStandIns(monkeypatch, tmp_path)
    (pipe,) = NODE_CLASS_MAPPINGS["RolldiffLoadPipeline"]().load(str(model_folder), "auto", "auto", "none", False)
    assert pipe.transformer.device == torch.device("cpu") and pipe.transformer.dtype == torch.float32
    with pytest.raises(ValueError, match="`lora`: no such file"):
        NODE_CLASS_MAPPINGS["RolldiffLoadPipeline"]().load(
            str(model_folder), "cpu", "auto", "none", False, lora="./style.safetensors"
        )


def test_a_lora_named_as_comfyui_lists_it_is_fused_as_the_library_fuses_it(model_folder, monkeypatch, tmp_path):
    comfy = ComfyStandIns(monkeypatch, tmp_path)
    lora = random_lora(tiny_pipeline().transformer)
    KreaRealtimeVideoPipeline.save_lora_weights(
        comfy.loras, transformer_lora_layers=lora, weight_name="style.safetensors"
    )
    load = NODE_CLASS_MAPPINGS["RolldiffLoadPipeline"]().load
    (styled,) = load(str(model_folder), "cpu", "auto", "none", False, lora="style.safetensors", lora_scale=0.5)
    expected = KreaRealtimeVideoPipeline.from_pretrained(model_folder)
    fuse_loras(expected, [str(comfy.loras / "style.safetensors")], [0.5])
    frames, _ = NODE_CLASS_MAPPINGS["RolldiffVideo"]().generate(styled, **INPUTS)
    np.testing.assert_array_equal(frames.numpy(), library_frames(expected))
    assert not np.array_equal(frames.numpy(), library_frames(load(str(model_folder), "cpu", "auto", "none", False)[0]))


# ---------------------------------------------------------------------------------------- to a file
def test_video_to_file_writes_numbered_mp4s_in_comfyuis_output_folder_with_the_librarys_frames(
    pipe, monkeypatch, tmp_path
):
    comfy = ComfyStandIns(monkeypatch, tmp_path / "output")
    node = NODE_CLASS_MAPPINGS["RolldiffVideoToFile"]()
    result = node.write(pipe, filename_prefix="rolldiff/video", quality=5, resume=True, **INPUTS)
    first = tmp_path / "output" / "rolldiff" / "video_00001.mp4"
    assert result["result"] == (str(first),)
    assert result["ui"]["images"] == [{"filename": first.name, "subfolder": "rolldiff", "type": "output"}]
    assert comfy.progress == [2, 4, 6, 8, 10, 12]
    reference = tmp_path / "library.mp4"
    pipe.generate_to_file(str(reference), PROMPT, fps=8, generator=torch.Generator().manual_seed(0), **LIBRARY)
    np.testing.assert_array_equal(file_frames(first), file_frames(reference))

    result = node.write(pipe, filename_prefix="rolldiff/video", quality=5, resume=True, **INPUTS)
    assert result["result"] == (str(first.with_name("video_00002.mp4")),)  # a finished video is never resumed


def test_cancel_keeps_the_frames_made_and_the_next_run_resumes_that_file_into_the_whole_video(
    pipe, monkeypatch, tmp_path
):
    ComfyStandIns(monkeypatch, tmp_path, cancel_after_checks=3)  # Cancel pressed during the fourth chunk
    node = NODE_CLASS_MAPPINGS["RolldiffVideoToFile"]()
    with pytest.raises(Exception) as cancelled:
        node.write(pipe, filename_prefix="long", quality=10, resume=True, **INPUTS)
    assert type(cancelled.value).__name__ == "Interrupted"
    target = tmp_path / "long_00001.mp4"
    assert not target.exists() and partial_path_for(target).is_file() and state_path_for(target).is_file()
    assert len(file_frames(partial_path_for(target))) == 8

    ComfyStandIns(monkeypatch, tmp_path)  # queued again, no Cancel
    result = node.write(pipe, filename_prefix="long", quality=10, resume=True, **INPUTS)
    assert result["result"] == (str(target),) and not partial_path_for(target).exists()
    reference = tmp_path / "library.mp4"
    pipe.generate_to_file(
        str(reference), PROMPT, fps=8, quality=10, generator=torch.Generator().manual_seed(0), **LIBRARY
    )
    np.testing.assert_array_equal(file_frames(target), file_frames(reference))  # lossless: the resume is exact
    assert output_path(tmp_path, "long", resume=True) == tmp_path / "long_00002.mp4"


def test_a_prefix_outside_the_output_folder_is_refused_before_any_work(pipe, model_calls, monkeypatch, tmp_path):
    ComfyStandIns(monkeypatch, tmp_path / "output")
    for prefix in ("../escape", "/etc/video", " "):
        with pytest.raises(ValueError, match="`filename_prefix` must name a file inside ComfyUI's output folder"):
            NODE_CLASS_MAPPINGS["RolldiffVideoToFile"]().write(
                pipe, filename_prefix=prefix, quality=5, resume=False, **INPUTS
            )
    assert model_calls == [] and not (tmp_path / "output").exists()


# ---------------------------------------------------------------------------------------- the example workflow
CORE_NODES = {  # ComfyUI's own nodes the example uses: input -> the type its link must carry, and their outputs
    "CreateVideo": ({"images": "IMAGE", "fps": "FLOAT"}, ("VIDEO",)),
    "SaveVideo": ({"video": "VIDEO"}, ()),
}


def run_api_workflow(workflow: dict, overrides: dict) -> dict:
    """ComfyUI's executor in short: nodes in dependency order, links `[node, output]` resolved, each of rolldiff's
    nodes run (its inputs checked against `INPUT_TYPES` first), each core node's links checked by type only."""
    outputs, types_of, pending = {}, {}, dict(workflow)
    while pending:
        ready = [key for key, node in pending.items() if all(
            not isinstance(value, list) or value[0] in outputs for value in node["inputs"].values())]  # fmt: skip
        assert ready, f"a cycle or a link to a missing node among {sorted(pending)}"
        for key in ready:
            node = pending.pop(key)
            inputs = {name: outputs[value[0]][value[1]] if isinstance(value, list) else value
                      for name, value in node["inputs"].items()}  # fmt: skip
            link_types = {name: types_of[value[0]][value[1]] for name, value in node["inputs"].items()
                          if isinstance(value, list)}  # fmt: skip
            if node["class_type"] in CORE_NODES:
                wanted, returns = CORE_NODES[node["class_type"]]
                assert {name: link_types[name] for name in wanted} == wanted
                outputs[key], types_of[key] = tuple(None for _ in returns), returns
                continue
            cls = NODE_CLASS_MAPPINGS[node["class_type"]]
            declared = cls.INPUT_TYPES()
            assert set(declared["required"]) <= set(inputs) <= {*declared["required"], *declared.get("optional", {})}
            for name, value in node["inputs"].items():
                kind = {**declared["required"], **declared.get("optional", {})}[name][0]
                assert value in kind if isinstance(kind, list) else link_types.get(name, kind) == kind, name
            result = getattr(cls(), cls.FUNCTION)(**{**inputs, **overrides.get(key, {})})
            outputs[key] = result["result"] if isinstance(result, dict) else result
            types_of[key] = cls.RETURN_TYPES
    return outputs


def test_the_example_workflow_runs_through_the_nodes(monkeypatch, tmp_path):
    import json
    from pathlib import Path

    workflow = json.loads((Path(__file__).parents[1] / "examples" / "comfyui_workflow_api.json").read_text())
    ComfyStandIns(monkeypatch, tmp_path)
    outputs = run_api_workflow(workflow, overrides={"5": {"seconds": 1.0}})  # its minute, shortened for CI
    frames, fps = outputs["2"]
    assert frames.shape == (48, 32, 32, 3) and fps == 16.0
    written = Path(outputs["5"][0])
    assert written == tmp_path / "rolldiff" / "minute_00001.mp4" and len(file_frames(written)) >= 16
