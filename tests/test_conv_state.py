"""ConvStateLayer: the last input frame of a temporal convolution, carried from chunk to chunk.

Scalar traces: frames are `(batch 1, channels 1, frames, tokens 1)` holding 1, 2, 3, ... so every
returned state names the frame it came from.
"""

import pytest
import torch

from rolldiff.caching import ConvStateLayer, CrossAttentionLayer, LinearAttentionLayer, RollingKVCache


def frames(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(1, 1, -1, 1)


def test_state_is_zero_before_the_first_commit():
    layer = ConvStateLayer()
    state, _ = layer.update(frames(1, 2, 3))
    assert state.flatten().tolist() == [0.0]
    assert layer.get() is None and layer.get_seq_length() == 0


def test_next_chunk_sees_the_last_frame_of_the_committed_chunk():
    layer = ConvStateLayer()
    layer.update(frames(1, 2, 3))
    layer.commit()
    state, _ = layer.update(frames(4, 5, 6))
    assert state.flatten().tolist() == [3.0]
    layer.commit()
    assert layer.update(frames(7, 8, 9))[0].flatten().tolist() == [6.0]


def test_repeated_updates_overwrite_the_pending_chunk():
    """Every denoising step writes the same pending slot; only the last one (the t = 0 pass) is committed."""
    layer = ConvStateLayer()
    for step_value in (10, 20, 30):
        layer.update(frames(step_value, step_value + 1))
    layer.commit()
    assert layer.get()[0].flatten().tolist() == [31.0]


def test_an_aborted_chunk_leaves_the_state_as_committed():
    layer = ConvStateLayer()
    layer.update(frames(1, 2))
    layer.commit()
    layer.update(frames(99, 98))  # never committed
    assert layer.update(frames(5, 6))[0].flatten().tolist() == [2.0]


def test_frame_count_is_a_device_counter_of_committed_frames():
    layer = ConvStateLayer()
    for _ in range(4):
        layer.update(frames(*range(3)))
        layer.commit()
    assert layer.frame_count.item() == 12 and layer.frame_count.dtype == torch.long
    assert layer.get_seq_length() == 12  # tokens: 12 frames x 1 token


def test_rewind_restores_the_previous_chunk_exactly_once():
    layer = ConvStateLayer()
    layer.update(frames(1, 2))
    layer.commit()
    layer.update(frames(3, 4))
    layer.commit()
    with pytest.raises(ValueError, match="exactly the last committed chunk"):
        layer.rewind(1)
    layer.rewind(2)
    assert layer.get()[0].flatten().tolist() == [2.0] and layer.frame_count.item() == 2
    with pytest.raises(ValueError, match="exactly the last committed chunk"):
        layer.rewind(2)  # two chunks back is not kept
    layer.update(frames(7, 8))  # the re-cache writes the chunk again
    layer.commit()
    assert layer.get()[0].flatten().tolist() == [8.0] and layer.frame_count.item() == 4


def test_reset_keeps_the_buffers():
    layer = ConvStateLayer()
    layer.update(frames(1, 2))
    layer.commit()
    address = layer.committed.data_ptr()
    layer.reset()
    assert layer.committed.data_ptr() == address
    assert layer.get() is None and layer.frame_count.item() == 0
    assert layer.update(frames(3, 4))[0].flatten().tolist() == [0.0]


def test_early_initialization_allocates_channels_heads_times_head_dim():
    layer = ConvStateLayer(tokens_per_frame=16)
    layer.early_initialization(2, 4, 8, torch.float32, "cpu")
    assert tuple(layer.committed.shape) == (2, 32, 1, 16)
    assert layer.memory_bytes() == 3 * 2 * 32 * 16 * 4 + 8  # committed, pending, previous + the counter
    with pytest.raises(ValueError, match="tokens_per_frame"):
        ConvStateLayer().early_initialization(1, 1, 1, torch.float32, "cpu")


@pytest.mark.parametrize(
    "bad, message",
    [(torch.zeros(1, 1, 3), "batch, channels, frames, tokens"), (torch.zeros(1, 2, 3, 1), "holds")],
)
def test_wrong_shapes_are_refused(bad, message):
    layer = ConvStateLayer()
    layer.update(frames(1, 2))
    with pytest.raises(ValueError, match=message):
        layer.update(bad)


def test_commit_with_nothing_pending_is_refused():
    with pytest.raises(RuntimeError, match="nothing pending"):
        ConvStateLayer().commit()


def test_container_fans_out_to_the_conv_state_slot():
    layers = [LinearAttentionLayer(), LinearAttentionLayer()]
    conv = [ConvStateLayer(), ConvStateLayer()]
    cache = RollingKVCache(layers, [CrossAttentionLayer(), None], slots={"conv_state": conv})
    key = torch.ones(1, 2, 1, 1)
    for index in range(2):
        layers[index].update(key, key)
        conv[index].update(frames(1, 2))
    cache.commit()
    assert [layer.get()[0].item() for layer in conv] == [2.0, 2.0]
    assert cache.memory_bytes() > 0
    cache.reset()
    assert all(layer.get() is None for layer in conv)
