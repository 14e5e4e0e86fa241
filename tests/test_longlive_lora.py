"""LongLive's LoRA (original Wan names, PEFT keys) loads through diffusers' adapter API and equals a hand merge."""

import pytest
import torch
from checkpoint_layouts import LORA_TARGETS
from tiny_components import TRANSFORMER_CONFIG, tiny_transformer

from rolldiff import ChunkLayout
from rolldiff.models.lora_conversion import convert_longlive_lora_state_dict, load_longlive_lora

ORIGINAL_TARGETS = LORA_TARGETS  # LongLive adapts every Linear of each attention block


def _longlive_checkpoint(model, rank: int = 4, seed: int = 0) -> dict:
    """A LongLive-format adapter for `model`'s shapes: {"generator_lora": PEFT state dict of the wrapped WanModel}."""
    generator = torch.Generator().manual_seed(seed)
    adapter = {}
    for block in range(TRANSFORMER_CONFIG["num_layers"]):
        for original, diffusers_name in ORIGINAL_TARGETS.items():
            weight = model.get_submodule(f"blocks.{block}.{diffusers_name}").weight
            prefix = f"base_model.model.blocks.{block}.{original}"
            adapter[f"{prefix}.lora_A.weight"] = torch.randn(rank, weight.shape[1], generator=generator) * 0.1
            adapter[f"{prefix}.lora_B.weight"] = torch.randn(weight.shape[0], rank, generator=generator) * 0.1
    return {"generator_lora": adapter, "critic_lora": {}}


def _merge_by_hand(model, checkpoint, scale: float) -> None:
    adapter = checkpoint["generator_lora"]
    with torch.no_grad():
        for block in range(TRANSFORMER_CONFIG["num_layers"]):
            for original, diffusers_name in ORIGINAL_TARGETS.items():
                prefix = f"base_model.model.blocks.{block}.{original}"
                delta = adapter[f"{prefix}.lora_B.weight"] @ adapter[f"{prefix}.lora_A.weight"]
                model.get_submodule(f"blocks.{block}.{diffusers_name}").weight += scale * delta


@pytest.mark.parametrize("alpha", [None, 8.0])
@torch.no_grad()
def test_converted_longlive_lora_equals_merging_it_by_hand(tmp_path, alpha):
    base = tiny_transformer(seed=3)
    checkpoint = _longlive_checkpoint(base)
    path = tmp_path / "lora.pt"
    torch.save(checkpoint, path)

    adapted = tiny_transformer(seed=3)
    adapted.load_lora_adapter(load_longlive_lora(path, alpha=alpha), prefix=None, adapter_name="longlive")
    merged = tiny_transformer(seed=3)
    _merge_by_hand(merged, checkpoint, scale=1.0 if alpha is None else alpha / 4)

    layout = ChunkLayout(4, chunk_frames=2, sink_frames=2, window_frames=4)
    latents, text = torch.randn(1, 4, 4, 4, 4), torch.randn(1, 7, 16)
    outputs = []
    for model in (adapted, merged, base):
        cache = model.make_cache(layout)
        first = model(latents[:, :, :2], torch.tensor([500.0]), text, kv_cache=cache, layout=layout).sample
        model(latents[:, :, :2], torch.tensor([0.0]), text, kv_cache=cache, layout=layout)
        cache.commit()
        second = model(latents[:, :, 2:], torch.tensor([500.0]), text, kv_cache=cache, layout=layout).sample
        outputs.append(torch.cat([first, second], dim=2))
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-4)
    assert not torch.allclose(outputs[0], outputs[2], atol=1e-3)  # the adapter does change the model


def test_non_lora_keys_are_refused_with_their_names():
    with pytest.raises(ValueError, match="blocks.0.self_attn.q.weight"):
        convert_longlive_lora_state_dict({"blocks.0.self_attn.q.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="only one of"):
        convert_longlive_lora_state_dict({"base_model.model.blocks.0.self_attn.q.lora_A.weight": torch.zeros(2, 3)})
