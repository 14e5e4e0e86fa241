"""A model split across devices (`device_map`) gets each block's cache layers where that block runs.

No second accelerator here: "meta" stands in for the second device (the placement is what is tested; a block
on "meta" cannot run, so nothing is computed).
"""

from __future__ import annotations

import pytest
import torch
from test_long_sana_model import TINY_SANA
from tiny_components import tiny_pipeline, tiny_transformer

from rolldiff.caching import CrossAttentionLayer, RollingKVCache, SlidingWindowLayer
from rolldiff.caching.conv_state import ConvStateLayer
from rolldiff.caching.layout import ChunkLayout
from rolldiff.models.long_sana import LongSanaTransformer3DModel, sana_layout
from rolldiff.models.placement import block_devices


def device_types(layer) -> set[str]:
    return {tensor.device.type for tensor in layer.buffers()}


def test_one_device_per_block_places_every_kind_of_layer_with_its_block():
    cache = RollingKVCache(
        [SlidingWindowLayer(2, 4, 2) for _ in range(2)],
        [CrossAttentionLayer(), None],
        slots={"conv_state": [ConvStateLayer(2), ConvStateLayer(2)]},
    )
    cache.early_initialization(1, 2, 4, torch.float32, ["cpu", "meta"])
    assert device_types(cache.layers[0]) == device_types(cache.slots["conv_state"][0]) == {"cpu"}
    assert device_types(cache.layers[1]) == device_types(cache.slots["conv_state"][1]) == {"meta"}


@pytest.mark.parametrize("device", [["cpu"], ["cpu", "cpu", "cpu"], ["cpu", "not-a-device"], 3.5])
def test_a_device_list_of_the_wrong_length_or_a_bad_device_is_refused_naming_device(device):
    cache = RollingKVCache([SlidingWindowLayer(2, 4, 2) for _ in range(2)])
    with pytest.raises(ValueError, match="`device`"):
        cache.early_initialization(1, 2, 4, torch.float32, device)
    assert cache.layers[0].keys is None  # nothing was allocated


def test_krea_cache_follows_a_split_model_unless_a_device_is_given():
    model = tiny_transformer()
    model.blocks[1].to("meta")
    layout = ChunkLayout(4, chunk_frames=2, sink_frames=2, window_frames=4)
    assert block_devices(model.blocks) == [torch.device("cpu"), torch.device("meta")]
    split = model.make_cache(layout, batch_size=1)
    assert [device_types(layer) for layer in split.layers] == [{"cpu"}, {"meta"}]
    assert [device_types(layer) for layer in model.make_cache(layout, batch_size=1, device="cpu").layers] == [
        {"cpu"},
        {"cpu"},
    ]


def test_sana_cache_follows_a_split_model():
    model = LongSanaTransformer3DModel(**TINY_SANA)
    model.transformer_blocks[0].to("meta")
    cache = model.make_cache(sana_layout(4, chunk_frames=2), batch_size=1)
    assert [device_types(layer) for layer in cache.layers] == [{"meta"}, {"cpu"}]
    assert [device_types(layer) for layer in cache.slots["conv_state"]] == [{"meta"}, {"cpu"}]


def test_accelerate_execution_device_wins_over_where_offloaded_weights_wait():
    model = tiny_transformer()

    class Hook:  # what accelerate's AlignDevicesHook exposes: the weights wait elsewhere, the block runs here
        execution_device = "meta"

    model.blocks[0]._hf_hook = Hook()
    assert block_devices(model.blocks) == [torch.device("meta"), torch.device("cpu")]


def test_the_pipeline_leaves_placement_to_the_model_only_when_the_transformer_is_split():
    pipe = tiny_pipeline()
    device = torch.device("cpu")
    assert pipe.cache_device(device) == device
    pipe.transformer.hf_device_map = {"blocks.0": 0, "blocks.1": 0}
    assert pipe.cache_device(device) == device
    pipe.transformer.hf_device_map = {"blocks.0": 0, "blocks.1": 1}
    assert pipe.cache_device(device) is None
