"""`convert_original_sana_video_state_dict`: LongSANA's original `SanaMSVideo` weights -> our model, exactly.

The weights are a tiny upstream model's random state dict (`tests/goldens/longsana/transformer.safetensors`,
written by tools/record_longsana_goldens.py from meefs/Sana 5498e5b, buffers included); the reference output is
upstream's own `forward_long` on one chunk with an empty state (recorded beside it), so no upstream code runs here.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from recipe_goldens import load_golden, load_meta, load_transformer, load_upstream_weights
from safetensors.torch import save_file

from rolldiff.models import (
    LongSanaTransformer3DModel,
    convert_original_sana_video_state_dict,
    infer_sana_video_config,
    load_original_sana_video_checkpoint,
)

RECIPE = "longsana"


@pytest.fixture(scope="module")
def upstream_weights() -> dict[str, torch.Tensor]:
    return load_upstream_weights(RECIPE)


@pytest.fixture(scope="module")
def converted(upstream_weights) -> dict[str, torch.Tensor]:
    return convert_original_sana_video_state_dict(upstream_weights)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_converted_keys_and_shapes_are_our_models(converted):
    model = LongSanaTransformer3DModel(**load_meta(RECIPE)["diffusers_config"])
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert {name: tuple(t.shape) for name, t in converted.items()} == expected
    model.load_state_dict(converted, strict=True)


def test_fused_projections_are_split_in_order(upstream_weights, converted):
    q, k, v = upstream_weights["blocks.1.attn.qkv.weight"].chunk(3)
    assert torch.equal(converted["transformer_blocks.1.attn1.to_k.weight"], k)
    assert torch.equal(converted["transformer_blocks.1.attn1.to_v.weight"], v)
    k_bias, v_bias = upstream_weights["blocks.2.cross_attn.kv_linear.bias"].chunk(2)
    assert torch.equal(converted["transformer_blocks.2.attn2.to_v.bias"], v_bias)
    assert torch.equal(converted["transformer_blocks.2.attn2.to_k.bias"], k_bias)


@torch.no_grad()
def test_converted_model_matches_upstream_forward():
    """Our model without a cache on one chunk == upstream `forward_long` on an empty state (frames 0..4, t = 500).

    Upstream's cross-attention q/k RMSNorm uses eps 1e-6 (`sana_blocks.py:63-64`), diffusers' 1e-5: set here as the
    LongSANA recipe does. Measured: 8.3e-7 with it, 8.0e-6 without (floor: upstream fp32 vs fp64, 1.3e-6).
    """
    model = load_transformer(RECIPE)
    for block in model.transformer_blocks:
        block.attn2.norm_q.eps = block.attn2.norm_k.eps = 1e-6
    golden = load_golden(RECIPE, "plain")
    forward = golden.meta["forward"]
    timestep = torch.tensor([float(forward["timestep"])])
    text, mask = golden.text[forward["text"]], golden.text_mask[forward["text"]]
    ours = model(golden.tensor("forward.input"), text, timestep, encoder_attention_mask=mask).sample
    error = float((ours - golden.tensor("forward.output")).abs().max())
    print(f"\nmax |ours - upstream forward_long| = {error:.1e}, floor {forward['floor']:.1e}")
    assert error <= 1e-5


def test_training_checkpoint_wrappers_are_removed(upstream_weights, converted):
    """LongSANA `.pt`: `generator` / `generator_ema` under `SanaModelWrapper` (`model.`), FSDP segments in the EMA."""
    parameters = {k: v for k, v in upstream_weights.items() if k not in ("pos_embed", "y_embedder.y_embedding")}
    ema = {f"model._fsdp_wrapped_module.{k}": v + 1 for k, v in parameters.items()}  # EMA shadow: parameters only
    checkpoint = {"generator": {f"model.{k}": v for k, v in upstream_weights.items()}, "generator_ema": ema}
    checkpoint |= {"critic": {"model.blocks.0.attn.qkv.weight": torch.zeros(1)}, "step": 7}
    assert _same(convert_original_sana_video_state_dict(checkpoint, use_ema=False), converted)
    from_ema = convert_original_sana_video_state_dict(checkpoint)
    assert torch.equal(from_ema["proj_out.bias"], converted["proj_out.bias"] + 1)
    assert _same(convert_original_sana_video_state_dict({"state_dict": dict(upstream_weights)}), converted)


def test_use_ema_false_without_generator_is_refused(upstream_weights):
    with pytest.raises(ValueError, match="holds only 'generator_ema'; pass use_ema=True"):
        convert_original_sana_video_state_dict({"generator_ema": dict(upstream_weights)}, use_ema=False)


def test_unknown_key_is_named(upstream_weights):
    weights = dict(upstream_weights) | {"blocks.0.attn.extra_gate.weight": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"Cannot map 1 key\(s\).*'blocks\.0\.attn\.extra_gate\.weight'"):
        convert_original_sana_video_state_dict(weights)


def test_other_formats_are_refused():
    with pytest.raises(ValueError, match="missing .*'x_embedder.proj.weight'"):
        convert_original_sana_video_state_dict(
            {"patch_embedding.weight": torch.zeros(1), "head.modulation": torch.zeros(1)}
        )
    with pytest.raises(ValueError, match="`state_dict` must be a mapping"):
        convert_original_sana_video_state_dict([("x_embedder.proj.weight", torch.zeros(1))])


def test_inferred_config_is_the_diffusers_config(converted):
    config = infer_sana_video_config(converted, attention_head_dim=16, cross_attention_head_dim=8)
    expected = load_meta(RECIPE)["diffusers_config"]
    assert config == {key: expected[key] for key in config}
    with pytest.raises(ValueError, match="`attention_head_dim`=12 does not divide the model width 32"):
        infer_sana_video_config(converted, attention_head_dim=12)


def test_loader_reads_safetensors_and_weights_only_pickles(tmp_path, upstream_weights, converted):
    save_file(dict(upstream_weights), tmp_path / "longsana.safetensors")
    assert _same(load_original_sana_video_checkpoint(tmp_path / "longsana.safetensors"), converted)
    torch.save({"generator": {f"model.{k}": v for k, v in upstream_weights.items()}, "step": 3}, tmp_path / "model.pt")
    assert _same(load_original_sana_video_checkpoint(tmp_path / "model.pt"), converted)


class _NotAWeight:
    pass


def test_loader_refuses_pickled_objects_and_unknown_suffixes(tmp_path):
    torch.save({"generator": {}, "optimizer": _NotAWeight()}, tmp_path / "trainer.pth")
    with open(tmp_path / "legacy.pth", "wb") as handle:  # a pre-zip pickle: loaded without mmap, still weights-only
        pickle.dump({"generator": {}, "optimizer": _NotAWeight()}, handle, protocol=2)
    for name in ("trainer.pth", "legacy.pth"):
        with pytest.raises(ValueError, match="only weights_only loading is allowed"):
            load_original_sana_video_checkpoint(tmp_path / name)
    with pytest.raises(ValueError, match="Unsupported checkpoint suffix '.ckpt'"):
        load_original_sana_video_checkpoint(tmp_path / "model.ckpt")
    with pytest.raises(ValueError, match="is not a file"):
        load_original_sana_video_checkpoint(tmp_path / "missing.safetensors")
