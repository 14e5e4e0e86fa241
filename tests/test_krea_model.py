"""KreaRealtimeTransformer3DModel: equals Wan on one chunk; cached chunks equal the dense block-causal reference."""

import pytest
import torch
from diffusers import WanTransformer3DModel
from tiny_components import TRANSFORMER_CONFIG, tiny_transformer

from rolldiff.models import ChunkLayout, KreaRealtimeTransformer3DModel, teacher_forcing_frame_mask
from rolldiff.models.krea_realtime import apply_rotary

TEXT = torch.randn(1, 7, 16, generator=torch.Generator().manual_seed(1))
TOKENS_PER_FRAME = 4  # 4x4 latent, patch 2x2


@pytest.fixture(scope="module")
def model() -> KreaRealtimeTransformer3DModel:
    return tiny_transformer()


def _chunk(model, latents, sigma, cache, layout, bias=1.0, bias_mode="past"):
    timestep = torch.tensor([sigma * 1000.0])
    return model(
        latents, timestep, TEXT, kv_cache=cache, layout=layout, attention_bias=bias, attention_bias_mode=bias_mode
    ).sample


@torch.no_grad()
def test_one_chunk_without_cache_equals_diffusers_wan():
    reference = WanTransformer3DModel(**TRANSFORMER_CONFIG).eval()
    ours = KreaRealtimeTransformer3DModel(**TRANSFORMER_CONFIG).eval()
    ours.load_state_dict(reference.state_dict())
    latents = torch.randn(2, 4, 3, 4, 4)
    timestep = torch.tensor([500.0, 250.0])
    text = torch.randn(2, 7, 16)
    expected = reference(latents, timestep, text).sample
    assert torch.allclose(ours(latents, timestep, text).sample, expected, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_is_wans_bit_for_bit(dtype):
    """`apply_rotary` against Wan's rotation written out (diffusers' `WanAttnProcessor`), on Wan's own tables."""
    rope = KreaRealtimeTransformer3DModel(**TRANSFORMER_CONFIG).rope
    cos, sin = rope.freqs_cos[None, :10, None], rope.freqs_sin[None, :10, None]  # (1, tokens, 1, head_dim)
    states = torch.randn(2, 10, 3, cos.shape[-1]).to(dtype)
    x1, x2 = states.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    expected = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2).type_as(states)
    assert torch.equal(apply_rotary(states, cos, sin), expected)


@torch.no_grad()
def test_first_chunk_through_the_cache_equals_diffusers_wan(model):
    reference = WanTransformer3DModel(**TRANSFORMER_CONFIG).eval()
    reference.load_state_dict(model.state_dict())
    layout = ChunkLayout(TOKENS_PER_FRAME, chunk_frames=2, sink_frames=2, window_frames=4)
    latents = torch.randn(1, 4, 2, 4, 4)
    cached = _chunk(model, latents, 0.5, model.make_cache(layout), layout)
    assert torch.allclose(cached, reference(latents, torch.tensor([500.0]), TEXT).sample, atol=1e-6)


@pytest.mark.parametrize("position_mode", ["absolute", "relative"])
@pytest.mark.parametrize(("bias", "bias_mode"), [(1.0, "past"), (0.3, "past"), (0.3, "scope")])
@torch.no_grad()
def test_cached_chunks_equal_the_dense_block_causal_reference(model, position_mode, bias, bias_mode):
    """Each chunk, at every denoising step, equals the whole sequence under the sink + window mask."""
    layout = ChunkLayout(TOKENS_PER_FRAME, chunk_frames=2, sink_frames=2, window_frames=6, position_mode=position_mode)
    num_frames = 16  # 8 chunks: the window wraps several times
    clean = torch.randn(1, 4, num_frames, 4, 4)
    cache = model.make_cache(layout)
    for start in range(0, num_frames, 2):
        for sigma in (1.0, 0.6, 0.2):  # repeated denoising steps overwrite the same pending slots
            noisy = torch.randn(1, 4, 2, 4, 4)
            cached = _chunk(model, noisy, sigma, cache, layout, bias, bias_mode)
            sequence = torch.cat([clean[:, :, :start], noisy], dim=2)
            timesteps = torch.cat([torch.zeros(1, start), torch.full((1, 2), sigma * 1000.0)], dim=1)
            dense = model(
                sequence, timesteps, TEXT, layout=layout, attention_bias=bias, attention_bias_mode=bias_mode
            ).sample[:, :, start:]
            assert torch.allclose(cached, dense, atol=1e-5), (start, sigma)
        _chunk(model, clean[:, :, start : start + 2], 0.0, cache, layout, bias, bias_mode)  # context pass
        cache.commit()
    assert cache.cross[0].num_computations == 1  # text K/V computed once for the whole video


@pytest.mark.parametrize("bias_mode", ["past", "scope"])
@torch.no_grad()
def test_the_bias_mask_is_built_once_per_step_for_every_block_of_one_geometry(model, bias_mode, monkeypatch):
    from rolldiff.models import krea_realtime

    built = []
    original = krea_realtime._bias_mask
    monkeypatch.setattr(krea_realtime, "_bias_mask", lambda *args: built.append(1) or original(*args))
    layout = ChunkLayout(TOKENS_PER_FRAME, chunk_frames=2, sink_frames=2, window_frames=4)
    cache = model.make_cache(layout)
    for _ in range(3):  # window filling, then full
        _chunk(model, torch.randn(1, 4, 2, 4, 4), 0.5, cache, layout, 0.3, bias_mode)
        built.clear()
        _chunk(model, torch.randn(1, 4, 2, 4, 4), 0.0, cache, layout, 0.3, bias_mode)
        assert len(built) == 1 < len(cache)  # one mask per step, shared by both blocks
        cache.commit()


@pytest.mark.parametrize("position_mode", ["absolute", "relative"])
@torch.no_grad()
def test_a_window_per_block_equals_the_dense_reference_with_a_layout_per_block(model, position_mode):
    """`make_cache(window_frames_per_block=...)` (local/global blocks) against `forward(layout=[one per block])`."""
    layout = ChunkLayout(TOKENS_PER_FRAME, chunk_frames=2, sink_frames=2, window_frames=4, position_mode=position_mode)
    windows = [4, 8]
    per_block = model.block_layouts(layout, windows)
    cache = model.make_cache(layout, window_frames_per_block=windows)
    assert [cache[i].window_tokens for i in range(2)] == [w * TOKENS_PER_FRAME for w in windows]
    clean = torch.randn(1, 4, 12, 4, 4)
    for start in range(0, 12, 2):
        noisy = torch.randn(1, 4, 2, 4, 4)
        cached = _chunk(model, noisy, 0.6, cache, layout)
        timesteps = torch.cat([torch.zeros(1, start), torch.full((1, 2), 600.0)], dim=1)
        sequence = torch.cat([clean[:, :, :start], noisy], dim=2)
        dense = model(sequence, timesteps, TEXT, layout=per_block).sample[:, :, start:]
        assert torch.allclose(cached, dense, atol=1e-5), start
        _chunk(model, clean[:, :, start : start + 2], 0.0, cache, layout)
        cache.commit()


@pytest.mark.parametrize(
    "windows, message",
    [([4], "has 1 entries, expected one per block \\(2\\)"), ([4, 1], r"`window_frames_per_block\[1\]`=1")],
)
def test_bad_windows_per_block_are_refused_naming_the_argument(model, windows, message):
    layout = ChunkLayout(TOKENS_PER_FRAME, chunk_frames=2, sink_frames=2, window_frames=4)
    with pytest.raises(ValueError, match=message):
        model.make_cache(layout, window_frames_per_block=windows)


@pytest.mark.parametrize("position_mode", ["absolute", "relative"])
@torch.no_grad()
def test_teacher_forcing_sequence_equals_generation_from_a_clean_cache(model, position_mode):
    layout = ChunkLayout(TOKENS_PER_FRAME, chunk_frames=2, sink_frames=2, window_frames=4, position_mode=position_mode)
    num_frames, sigma = 10, 0.6
    clean, noisy = torch.randn(1, 4, num_frames, 4, 4), torch.randn(1, 4, num_frames, 4, 4)
    indices, mask = teacher_forcing_frame_mask(num_frames, layout)
    timesteps = torch.cat([torch.zeros(1, num_frames), torch.full((1, num_frames), sigma * 1000.0)], dim=1)
    sequence = torch.cat([clean, noisy], dim=2)
    forced = model(sequence, timesteps, TEXT, layout=layout, frame_indices=indices, frame_mask=mask).sample
    cache, chunks = model.make_cache(layout), []
    for start in range(0, num_frames, 2):
        chunks.append(_chunk(model, noisy[:, :, start : start + 2], sigma, cache, layout))
        _chunk(model, clean[:, :, start : start + 2], 0.0, cache, layout)
        cache.commit()
    assert torch.allclose(torch.cat(chunks, dim=2), forced[:, :, num_frames:], atol=1e-5)


@torch.no_grad()
def test_relative_positions_stay_inside_the_window_past_the_rope_table():
    model = tiny_transformer(rope_max_seq_len=8)
    layout = ChunkLayout(TOKENS_PER_FRAME, chunk_frames=2, sink_frames=2, window_frames=4, position_mode="relative")
    cache = model.make_cache(layout)
    for _ in range(10):  # 20 latent frames, far past the 8-entry table
        out = _chunk(model, torch.randn(1, 4, 2, 4, 4), 0.5, cache, layout)
        _chunk(model, out, 0.0, cache, layout)
        cache.commit()
    assert torch.isfinite(out).all()
    assert int(cache[0].key_positions(reindexed=True).max()) // TOKENS_PER_FRAME < layout.context_frames


@torch.no_grad()
def test_absolute_positions_past_the_rope_table_are_refused():
    model = tiny_transformer(rope_max_seq_len=4)
    layout = ChunkLayout(TOKENS_PER_FRAME, chunk_frames=2, sink_frames=2, window_frames=4)
    cache = model.make_cache(layout)
    for _ in range(2):
        _chunk(model, torch.randn(1, 4, 2, 4, 4), 0.0, cache, layout)
        cache.commit()
    with pytest.raises(ValueError, match="RoPE table"):
        _chunk(model, torch.randn(1, 4, 2, 4, 4), 0.5, cache, layout)


def test_make_cache_converts_frames_to_tokens(model):
    layout = ChunkLayout(TOKENS_PER_FRAME, chunk_frames=2, sink_frames=1, window_frames=6)
    cache = model.make_cache(layout, batch_size=1)
    assert len(cache) == TRANSFORMER_CONFIG["num_layers"]
    layer = cache[0]
    assert (layer.sink_tokens, layer.window_tokens, layer.chunk_tokens) == (4, 24, 8)
    assert layer.keys.shape == (1, 28, 2, 12)
    assert cache.memory_bytes() > 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(chunk_frames=3, window_frames=3), "window_frames"),
        (dict(chunk_frames=0), "chunk_frames"),
        (dict(sink_frames=-1), "sink_frames"),
        (dict(position_mode="rope"), "position_mode"),
    ],
)
def test_bad_layouts_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ChunkLayout(TOKENS_PER_FRAME, **kwargs)


def test_forward_checks_the_layout_against_the_input(model):
    layout = ChunkLayout(9, chunk_frames=2, sink_frames=2, window_frames=4)
    with pytest.raises(ValueError, match="tokens_per_frame"):
        model(torch.randn(1, 4, 2, 4, 4), torch.tensor([0.0]), TEXT, kv_cache=model.make_cache(layout), layout=layout)
    good = ChunkLayout(TOKENS_PER_FRAME, chunk_frames=2, sink_frames=2, window_frames=4)
    with pytest.raises(ValueError, match="chunk_frames"):
        model(torch.randn(1, 4, 3, 4, 4), torch.tensor([0.0]), TEXT, kv_cache=model.make_cache(good), layout=good)


@torch.no_grad()
def test_scopes_bias_leaves_the_first_frame_unbiased(model):
    """With only the first frame committed, Scope's bias changes nothing; the past mode does."""
    layout = ChunkLayout(TOKENS_PER_FRAME, chunk_frames=1, sink_frames=1, window_frames=3)
    first, chunk = torch.randn(1, 4, 1, 4, 4), torch.randn(1, 4, 1, 4, 4)
    outputs = {}
    for bias, mode in [(1.0, "past"), (0.3, "scope"), (0.3, "past")]:
        cache = model.make_cache(layout)
        _chunk(model, first, 0.0, cache, layout, bias, mode)
        cache.commit()
        outputs[(bias, mode)] = _chunk(model, chunk, 0.5, cache, layout, bias, mode)
    torch.testing.assert_close(outputs[(0.3, "scope")], outputs[(1.0, "past")], atol=1e-6, rtol=0)
    assert (outputs[(0.3, "past")] - outputs[(1.0, "past")]).abs().max() > 1e-4
