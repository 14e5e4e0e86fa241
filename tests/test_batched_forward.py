"""One forward over several streams' chunks, each batch row through its own cache (`kv_cache=[cache, ...]`): each row
equals its solo forward, with rows at different positions, window fill states, timesteps and prompts."""

import pytest
import torch
from tiny_components import tiny_transformer

from rolldiff.models import ChunkLayout

TOKENS_PER_FRAME = 4  # 4x4 latent, patch 2x2
LAYOUT = ChunkLayout(tokens_per_frame=TOKENS_PER_FRAME, chunk_frames=2, sink_frames=2, window_frames=6)


@pytest.fixture(scope="module")
def model():
    return tiny_transformer(num_layers=3)  # 3 blocks: an error a 2-block model hides shows


def _text(seed: int, tokens: int = 7) -> torch.Tensor:
    return torch.randn(1, tokens, 16, generator=torch.Generator().manual_seed(seed))


def _stream_at(model, layout: ChunkLayout, chunks: int, seed: int, text: torch.Tensor):
    """A cache that has committed `chunks` chunks of random clean latents (a stream part-way through its video)."""
    cache = model.make_cache(layout, batch_size=1)
    model.prepare_conditioning(cache, text)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(chunks):
        clean = torch.randn(1, 4, layout.chunk_frames, 4, 4, generator=generator)
        model(clean, torch.zeros(1), text, kv_cache=cache, layout=layout)
        cache.commit()
    return cache


@torch.no_grad()
@pytest.mark.parametrize("position_mode", ["relative", "absolute"])
@pytest.mark.parametrize("attention_bias", [1.0, 0.5])
@pytest.mark.parametrize(
    "committed",
    [
        [0, 1, 2, 7],  # the first chunk (empty cache), the window filling, just full, and wrapped several times
        [0, 1, 2, 1],  # every window filling, to different prefixes: the longest read, each row masked to its own
        [1, 1, 1, 1],  # sessions at the same point: their common prefix, unmasked
    ],
)
def test_each_row_equals_its_solo_forward(model, position_mode, attention_bias, committed):
    layout = ChunkLayout(TOKENS_PER_FRAME, 2, 2, 6, position_mode=position_mode)
    texts = [_text(10 + i) for i in range(len(committed))]
    solo_caches = [_stream_at(model, layout, n, seed=i, text=t) for i, (n, t) in enumerate(zip(committed, texts))]
    row_caches = [_stream_at(model, layout, n, seed=i, text=t) for i, (n, t) in enumerate(zip(committed, texts))]
    latents = torch.randn(len(committed), 4, 2, 4, 4, generator=torch.Generator().manual_seed(99))
    timesteps = torch.tensor([1000.0, 750.0, 0.0, 250.0])  # rows at different steps (a context pass among them)
    for step in range(2):  # a second step of the same chunk rewrites the same pending slots
        batched = model(
            latents, timesteps, torch.cat(texts), kv_cache=row_caches, layout=layout, attention_bias=attention_bias
        ).sample
        for i, cache in enumerate(solo_caches):
            solo = model(
                latents[i : i + 1], timesteps[i : i + 1], texts[i], kv_cache=cache, layout=layout,
                attention_bias=attention_bias,
            ).sample  # fmt: skip
            torch.testing.assert_close(batched[i : i + 1], solo, atol=1e-5, rtol=1e-5, msg=f"row {i}, step {step}")
        latents = latents * 0.5
    for solo_cache, row_cache in zip(solo_caches, row_caches):  # the caches hold the same pending K/V
        solo_cache.commit()
        row_cache.commit()
        for solo_layer, row_layer in zip(solo_cache, row_cache):
            assert solo_layer.committed_count == row_layer.committed_count
            torch.testing.assert_close(row_layer.get()[0], solo_layer.get()[0], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_rows_fill_their_text_key_values_from_their_own_prompt(model):
    """Caches whose cross-attention K/V are not filled yet fill them from their own row of the text (lazily)."""
    texts = [_text(1), _text(2)]
    solo = [model.make_cache(LAYOUT, batch_size=1) for _ in texts]
    rows = [model.make_cache(LAYOUT, batch_size=1) for _ in texts]
    latents = torch.randn(2, 4, 2, 4, 4, generator=torch.Generator().manual_seed(3))
    batched = model(latents, torch.tensor([500.0, 500.0]), torch.cat(texts), kv_cache=rows, layout=LAYOUT).sample
    for i in range(2):
        expected = model(latents[i : i + 1], torch.tensor([500.0]), texts[i], kv_cache=solo[i], layout=LAYOUT).sample
        torch.testing.assert_close(batched[i : i + 1], expected, atol=1e-5, rtol=1e-5)
        for row_layer, solo_layer in zip(rows[i].cross, solo[i].cross):  # each block's text K/V: its own prompt's
            assert row_layer.is_filled
            torch.testing.assert_close(row_layer.keys, solo_layer.keys, atol=1e-6, rtol=1e-6)


@torch.no_grad()
def test_rows_with_text_of_different_lengths(model):
    texts = [_text(1, tokens=7), _text(2, tokens=5)]
    solo = [_stream_at(model, LAYOUT, 1, seed=i, text=t) for i, t in enumerate(texts)]
    rows = [_stream_at(model, LAYOUT, 1, seed=i, text=t) for i, t in enumerate(texts)]
    latents = torch.randn(2, 4, 2, 4, 4, generator=torch.Generator().manual_seed(3))
    # the text states only feed the (already filled) cross-attention caches: pad to stack them
    padded = torch.cat([texts[0], torch.cat([texts[1], torch.zeros(1, 2, 16)], dim=1)])
    batched = model(latents, torch.tensor([500.0, 250.0]), padded, kv_cache=rows, layout=LAYOUT).sample
    for i, timestep in enumerate((500.0, 250.0)):
        expected = model(latents[i : i + 1], torch.tensor([timestep]), texts[i], kv_cache=solo[i], layout=LAYOUT)
        torch.testing.assert_close(batched[i : i + 1], expected.sample, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("caches", "message"),
    [
        (lambda model: [model.make_cache(LAYOUT)], "one RollingKVCache per batch row: expected 2"),
        (lambda model: [model.make_cache(LAYOUT), "cache"], "one RollingKVCache per batch row"),
        (lambda model: [cache := model.make_cache(LAYOUT), cache], "listed twice"),
    ],
)
def test_a_wrong_list_of_row_caches_is_refused_before_any_work(model, caches, message):
    with pytest.raises(ValueError, match=message):
        model(torch.randn(2, 4, 2, 4, 4), torch.zeros(2), torch.randn(2, 7, 16), kv_cache=caches(model), layout=LAYOUT)
