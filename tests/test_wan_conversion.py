"""Original-format Wan 2.1 checkpoints convert to diffusers' layout exactly as diffusers' own converter does."""

import pytest
import torch
from checkpoint_layouts import wan_to_original
from diffusers import WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from safetensors.torch import save_file

from rolldiff.models.wan_conversion import (
    convert_original_wan_state_dict,
    infer_wan_config,
    load_original_wan_checkpoint,
)

TINY_CONFIG = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": 32,
    "freq_dim": 32,
    "ffn_dim": 64,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
}
WAN_1_3B_CONFIG = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 12,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 8960,
    "num_layers": 30,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
}


def to_original_format(diffusers_state_dict, prefix=""):
    """Invert the conversion: diffusers keys -> original Wan keys, optionally behind a wrapper prefix."""
    return wan_to_original(diffusers_state_dict, prefix)


def make_tiny_model(seed=0):
    torch.manual_seed(seed)
    model = WanTransformer3DModel(**TINY_CONFIG).eval()
    # Randomise every parameter (norms start at 1, biases at 0) so that any swapped key changes the output.
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)
    return model


def forward(model):
    generator = torch.Generator().manual_seed(1)
    hidden_states = torch.randn(1, 4, 2, 4, 4, generator=generator)  # (batch, channels, frames, height, width)
    encoder_hidden_states = torch.randn(1, 6, 32, generator=generator)  # (batch, text tokens, text_dim)
    with torch.no_grad():
        return model(hidden_states, torch.tensor([500]), encoder_hidden_states, return_dict=False)[0]


@pytest.fixture(scope="module")
def tiny_model():
    return make_tiny_model()


@pytest.fixture
def original_state_dict(tiny_model):
    return to_original_format(tiny_model.state_dict())


def assert_same_tensors(actual, expected):
    assert set(actual) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(actual[key], tensor), key


def test_matches_diffusers_converter_key_for_key(original_state_dict):
    ours = convert_original_wan_state_dict(original_state_dict)
    theirs = convert_wan_transformer_to_diffusers(dict(original_state_dict))  # it pops from its input
    assert set(ours) == set(theirs)
    assert_same_tensors(ours, theirs)


def test_converted_keys_are_exactly_the_models_keys(tiny_model, original_state_dict):
    assert set(convert_original_wan_state_dict(original_state_dict)) == set(tiny_model.state_dict())


def test_converted_state_dict_loads_strictly_and_reproduces_the_forward(tiny_model, original_state_dict):
    converted = convert_original_wan_state_dict(original_state_dict)
    model = WanTransformer3DModel(**infer_wan_config(converted, attention_head_dim=16)).eval()
    model.load_state_dict(converted, strict=True)
    torch.testing.assert_close(forward(model), forward(tiny_model), rtol=0, atol=0)


def test_conversion_neither_copies_tensors_nor_mutates_the_input(original_state_dict):
    before = dict(original_state_dict)
    converted = convert_original_wan_state_dict(original_state_dict)
    assert original_state_dict == before
    assert converted["blocks.0.attn1.to_q.weight"] is original_state_dict["blocks.0.self_attn.q.weight"]


def test_generator_ema_wrapper_with_model_prefix_is_unwrapped(tiny_model):
    ema = to_original_format(tiny_model.state_dict(), prefix="model.")
    raw = to_original_format(make_tiny_model(seed=1).state_dict(), prefix="model.")
    checkpoint = {"generator": raw, "generator_ema": ema, "critic": {"x": torch.zeros(1)}, "step": 7}
    assert_same_tensors(convert_original_wan_state_dict(checkpoint), tiny_model.state_dict())


def test_use_ema_false_picks_generator(tiny_model):
    ema = to_original_format(make_tiny_model(seed=1).state_dict(), prefix="model.")
    raw = to_original_format(tiny_model.state_dict(), prefix="model.")
    checkpoint = {"generator": raw, "generator_ema": ema}
    assert_same_tensors(convert_original_wan_state_dict(checkpoint, use_ema=False), tiny_model.state_dict())


def test_use_ema_falls_back_to_generator_when_there_is_no_ema_copy(tiny_model):
    checkpoint = {"generator": to_original_format(tiny_model.state_dict(), prefix="model.")}
    assert_same_tensors(convert_original_wan_state_dict(checkpoint, use_ema=True), tiny_model.state_dict())


def test_use_ema_false_without_generator_raises(tiny_model):
    checkpoint = {"generator_ema": to_original_format(tiny_model.state_dict(), prefix="model.")}
    with pytest.raises(ValueError, match="use_ema=False"):
        convert_original_wan_state_dict(checkpoint, use_ema=False)


@pytest.mark.parametrize(
    "prefix",
    [
        "model.",  # Krea Realtime .safetensors, Self-Forcing / LongLive generator dicts
        "model._fsdp_wrapped_module.",  # EMA copies saved under FSDP
        "_orig_mod.model.",  # torch.compile
        "module.model.",  # DDP
        "model.diffusion_model.",  # ComfyUI-style single files
    ],
)
def test_wrapper_prefixes_are_stripped(tiny_model, prefix):
    wrapped = to_original_format(tiny_model.state_dict(), prefix=prefix)
    assert_same_tensors(convert_original_wan_state_dict(wrapped), tiny_model.state_dict())


def test_wrapper_segments_inside_keys_are_stripped(tiny_model, original_state_dict):
    wrapped = {
        key.replace("blocks.0.", "blocks.0._checkpoint_wrapped_module._fsdp_wrapped_module."): tensor
        for key, tensor in original_state_dict.items()
    }
    assert_same_tensors(convert_original_wan_state_dict(wrapped), tiny_model.state_dict())


def test_unknown_key_raises_and_names_it(original_state_dict):
    original_state_dict["blocks.0.self_attn.alpha"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"blocks\.0\.self_attn\.alpha"):
        convert_original_wan_state_dict(original_state_dict)


def test_image_to_video_keys_are_rejected(original_state_dict):
    original_state_dict["blocks.0.cross_attn.k_img.weight"] = torch.zeros(32, 32)
    with pytest.raises(ValueError, match="k_img"):
        convert_original_wan_state_dict(original_state_dict)


def test_non_wan_state_dict_raises():
    with pytest.raises(ValueError, match="Not an original-format Wan"):
        convert_original_wan_state_dict({"encoder.conv_in.weight": torch.zeros(1)})


def test_non_tensor_entries_raise():
    with pytest.raises(ValueError, match="not tensors"):
        convert_original_wan_state_dict({"lr": 1e-4})


def test_diffusers_layout_input_is_not_mistaken_for_original(tiny_model):
    with pytest.raises(ValueError, match="Not an original-format Wan"):
        convert_original_wan_state_dict(tiny_model.state_dict())


def test_lora_adapter_keys_raise(original_state_dict):
    original_state_dict["blocks.0.self_attn.q.lora_A.weight"] = torch.zeros(4, 32)
    with pytest.raises(ValueError, match="LoRA"):
        convert_original_wan_state_dict(original_state_dict)


def test_lora_only_checkpoint_raises():
    checkpoint = {"generator_lora": {"base_model.model.blocks.0.self_attn.q.lora_A.weight": torch.zeros(4, 32)}}
    with pytest.raises(ValueError, match="generator_lora"):
        convert_original_wan_state_dict(checkpoint)


def test_safetensors_file_round_trips(tmp_path, tiny_model):
    path = tmp_path / "krea.safetensors"
    save_file(
        {key: tensor.contiguous() for key, tensor in to_original_format(tiny_model.state_dict(), "model.").items()},
        path,
    )
    assert_same_tensors(load_original_wan_checkpoint(path), tiny_model.state_dict())


def test_weights_only_pt_file_round_trips(tmp_path, tiny_model):
    path = tmp_path / "self_forcing_dmd.pt"
    ema = to_original_format(tiny_model.state_dict(), prefix="model.")
    raw = to_original_format(make_tiny_model(seed=1).state_dict(), prefix="model.")
    torch.save({"generator": raw, "generator_ema": ema, "step": 600}, path)
    assert_same_tensors(load_original_wan_checkpoint(str(path)), tiny_model.state_dict())
    assert_same_tensors(load_original_wan_checkpoint(path, use_ema=False), make_tiny_model(seed=1).state_dict())


class _TrainerState:
    """Stands in for a non-tensor object pickled into a training checkpoint."""


def test_pt_file_with_arbitrary_objects_is_refused(tmp_path, original_state_dict):
    path = tmp_path / "unsafe.pt"
    torch.save({"generator": original_state_dict, "trainer": _TrainerState()}, path)
    with pytest.raises(ValueError, match="weights_only"):
        load_original_wan_checkpoint(path)


def test_unsupported_suffix_raises(tmp_path):
    with pytest.raises(ValueError, match=r"'\.ckpt'"):
        load_original_wan_checkpoint(tmp_path / "model.ckpt")


def test_infer_wan_config_recovers_the_tiny_config(original_state_dict):
    converted = convert_original_wan_state_dict(original_state_dict)
    assert infer_wan_config(converted, attention_head_dim=16) == TINY_CONFIG


def test_infer_wan_config_accepts_original_layout(original_state_dict):
    assert infer_wan_config(original_state_dict, attention_head_dim=16) == TINY_CONFIG


def test_infer_wan_config_recovers_wan_1_3b_with_the_default_head_dim():
    with torch.device("meta"):  # shapes only, no memory
        model = WanTransformer3DModel(**WAN_1_3B_CONFIG)
    original = to_original_format(model.state_dict(), prefix="model.")
    assert infer_wan_config(convert_original_wan_state_dict(original)) == WAN_1_3B_CONFIG


def test_infer_wan_config_rejects_a_head_dim_that_does_not_divide_the_width(original_state_dict):
    with pytest.raises(ValueError, match="attention_head_dim=24"):
        infer_wan_config(original_state_dict, attention_head_dim=24)
