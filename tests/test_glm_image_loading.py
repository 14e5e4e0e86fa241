"""`GlmImageCachedPipeline.from_pretrained` takes diffusers' loading arguments exactly as `GlmImagePipeline`'s does.

The oracle is diffusers' own pipeline loading the same diffusers-format folder with the same arguments: every
component must come up with the same dtype, the same errors must be raised, and the decoder's
`from_pretrained` must receive the very arguments diffusers' loader hands its own decoder class.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import GlmImagePipeline, GlmImageTransformer2DModel
from diffusers.models.modeling_utils import ModelMixin
from glm_tiny_components import DECODER_CONFIG, tiny_components

from rolldiff import GlmImageCachedPipeline, GlmImageCachedTransformer2DModel


@pytest.fixture(scope="module")
def diffusers_folder(tmp_path_factory):
    """A diffusers GLM-Image folder (`model_index.json` names diffusers' decoder class)."""
    components = tiny_components()
    decoder = GlmImageTransformer2DModel(**DECODER_CONFIG)
    decoder.load_state_dict(components["transformer"].state_dict())
    folder = tmp_path_factory.mktemp("glm") / "diffusers"
    GlmImagePipeline(**{**components, "transformer": decoder}).save_pretrained(folder)
    return folder


def component_dtypes(pipe) -> dict[str, torch.dtype]:
    return {name: module.dtype for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)}


@pytest.mark.parametrize(
    "dtype_kwargs",
    [
        {"dtype": torch.float16},
        {"torch_dtype": torch.bfloat16},
        {"dtype": {"transformer": torch.float16, "default": torch.bfloat16}},
        {"dtype": {"transformer": torch.bfloat16}},  # the rest falls back to fp32, as in diffusers
    ],
    ids=["dtype", "torch_dtype", "per-component", "per-component-no-default"],
)
def test_dtypes_are_diffusers(diffusers_folder, dtype_kwargs):
    ours = GlmImageCachedPipeline.from_pretrained(diffusers_folder, **dtype_kwargs)
    theirs = GlmImagePipeline.from_pretrained(diffusers_folder, **dtype_kwargs)
    assert type(ours.transformer) is GlmImageCachedTransformer2DModel
    assert component_dtypes(ours) == component_dtypes(theirs)
    assert ours.transformer.dtype != torch.float32


def test_missing_variant_raises_diffusers_error(diffusers_folder):
    with pytest.raises(ValueError) as theirs:
        GlmImagePipeline.from_pretrained(diffusers_folder, variant="fp16")
    with pytest.raises(ValueError) as ours:
        GlmImageCachedPipeline.from_pretrained(diffusers_folder, variant="fp16")
    assert str(ours.value) == str(theirs.value)


class Captured(Exception):
    """Stops a load at the decoder's `from_pretrained`, carrying the arguments it was called with."""


def capture_decoder_kwargs(monkeypatch, pipeline_class, folder, **kwargs) -> tuple[type, dict]:
    original = ModelMixin.from_pretrained.__func__

    def spy(cls, path, **load_kwargs):
        if issubclass(cls, GlmImageTransformer2DModel):
            raise Captured(cls, load_kwargs)
        return original(cls, path, **load_kwargs)

    monkeypatch.setattr(ModelMixin, "from_pretrained", classmethod(spy))
    with pytest.raises(Captured) as captured:
        pipeline_class.from_pretrained(folder, **kwargs)
    monkeypatch.undo()
    return captured.value.args


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(low_cpu_mem_usage=False, use_safetensors=True, disable_mmap=True),
        dict(device_map="cpu", max_memory={"cpu": "1GiB"}, offload_folder="offload", offload_state_dict=True),
        dict(dtype={"transformer": torch.float16, "default": torch.bfloat16}, local_files_only=True),
    ],
    ids=["memory", "device_map", "per-component-dtype"],
)
def test_decoder_gets_every_argument_diffusers_loader_passes(monkeypatch, diffusers_folder, kwargs):
    their_class, theirs = capture_decoder_kwargs(monkeypatch, GlmImagePipeline, diffusers_folder, **kwargs)
    our_class, ours = capture_decoder_kwargs(monkeypatch, GlmImageCachedPipeline, diffusers_folder, **kwargs)
    assert their_class is GlmImageTransformer2DModel and our_class is GlmImageCachedTransformer2DModel
    assert ours == theirs


def test_decoder_gets_the_pipeline_quantization_config(monkeypatch, diffusers_folder):
    from diffusers import GGUFQuantizationConfig, PipelineQuantizationConfig

    quantization = PipelineQuantizationConfig(
        quant_mapping={"transformer": GGUFQuantizationConfig(compute_dtype=torch.bfloat16)}
    )
    _, theirs = capture_decoder_kwargs(
        monkeypatch, GlmImagePipeline, diffusers_folder, quantization_config=quantization
    )
    _, ours = capture_decoder_kwargs(
        monkeypatch, GlmImageCachedPipeline, diffusers_folder, quantization_config=quantization
    )
    assert isinstance(theirs["quantization_config"], GGUFQuantizationConfig)
    assert ours == theirs


def test_a_passed_decoder_is_used_as_given(diffusers_folder):
    decoder = GlmImageCachedTransformer2DModel(**DECODER_CONFIG).to(torch.float16)
    pipe = GlmImageCachedPipeline.from_pretrained(diffusers_folder, transformer=decoder, dtype=torch.bfloat16)
    assert pipe.transformer is decoder and pipe.vae.dtype == torch.bfloat16
