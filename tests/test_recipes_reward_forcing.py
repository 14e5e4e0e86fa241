"""`recipe="reward-forcing"` against the authors' code, and `sink_mode="ema"` (the option it needs) on its own.

The goldens (tests/goldens/reward-forcing/, tools/record_reward_forcing_goldens.py) are JaydenLyh/Reward-Forcing
@4317f5a's `CausalInferencePipeline` on tiny random weights, 10 chunks each (7 chunks blended into the sink):
`plain` at the released alpha 0.999, `alpha_half` with every block's `compression_alpha` at 0.5 (so the blends show
far above the tolerance; `EMA_SINK_ALPHA` is patched to match), and `prompt_switch` (alpha 0.5, to prompt b before
chunk 2, so the chunk re-cached under b is the one blended at chunk 3). Each chunk's clean latents must equal
upstream's within 1e-4 (the fp32-vs-fp64 floor is printed).

The layer tests are scalar traces against a naive reference of the rule (`wan/modules/causal_model.py:151-192`).
"""

from __future__ import annotations

import pytest
import torch
from recipe_goldens import assert_switch_seen, call_errors, chunk_errors, inject_noise, load_golden, switched_stream
from test_recipes_pipeline import krea_golden_pipeline

from rolldiff.caching import SlidingWindowLayer, ema_sink
from rolldiff.caching.layout import ChunkLayout
from rolldiff.recipes import describe_recipe, get_recipe

TOLERANCE = 1e-4
RECIPE = "reward-forcing"


def _use_alpha(golden, monkeypatch) -> None:
    monkeypatch.setattr(ema_sink, "EMA_SINK_ALPHA", golden.settings["alpha"])


# ----------------------------------------------------------------------------------------- against upstream
@pytest.mark.parametrize("scenario", ["plain", "alpha_half"])
@torch.no_grad()
def test_the_recipe_through_the_call_matches_upstream(scenario, monkeypatch):
    golden = load_golden(RECIPE, scenario)
    _use_alpha(golden, monkeypatch)
    errors = call_errors(krea_golden_pipeline(golden), golden, RECIPE, monkeypatch)
    assert max(errors) <= TOLERANCE, errors


@torch.no_grad()
def test_a_prompt_switch_before_the_first_blend_matches_upstream_switched_alike(monkeypatch):
    """`switch_prompt` before chunk 2: chunk 1 is re-cached under b, then blended into the sink at chunk 3. The tree has
    no switch: its loop was switched as `switch_prompt` defines it (`tools/_wan_upstream.py` `SwitchingGenerator`)."""
    golden = load_golden(RECIPE, "prompt_switch")
    _use_alpha(golden, monkeypatch)
    switch = golden.settings["switch_before_block"]
    noise = inject_noise(golden, monkeypatch)
    made = switched_stream(krea_golden_pipeline(golden), golden, RECIPE, 3 * len(golden.clean), switch)
    errors = chunk_errors(golden, made)
    print(f"\nreward-forcing/prompt_switch through the stream: max {max(errors):.1e}, floor {golden.floor:.1e}")
    assert noise.noise.exhausted
    assert max(errors) <= TOLERANCE, errors
    assert_switch_seen(golden, load_golden(RECIPE, "alpha_half"), switch, TOLERANCE)


@torch.no_grad()
def test_a_fixed_sink_matches_until_the_first_blend_and_misses_after_it(monkeypatch):
    """The goldens see the blend: the same window with a fixed sink equals the 3 chunks before the first eviction and
    misses every chunk after it (at alpha 0.5)."""
    golden = load_golden(RECIPE, "alpha_half")
    _use_alpha(golden, monkeypatch)
    pipe = krea_golden_pipeline(golden)
    inject_noise(golden, monkeypatch)
    stream = pipe.stream(
        num_frames=pipe.latent_to_frames(3 * len(golden.clean)), prompt_embeds=golden.text["a"],
        output_type="latent", recipe=RECIPE, sink_mode="fixed",
    )  # fmt: skip
    errors = chunk_errors(golden, list(stream))
    assert max(errors[:3]) <= TOLERANCE, errors
    assert min(errors[3:]) > 100 * TOLERANCE, errors


def test_the_recipe_names_its_upstream_and_settings():
    recipe = get_recipe(RECIPE, "KreaRealtimeVideoPipeline")
    assert "JaydenLyh/Reward-Forcing@4317f5a" in recipe.upstream
    settings = recipe.settings
    assert (settings["sink_frames"], settings["window_frames"], settings["sink_mode"]) == (3, 6, "ema")
    assert "sink_mode = 'ema'" in describe_recipe(RECIPE)
    assert ema_sink.EMA_SINK_ALPHA == 0.999


@torch.no_grad()
def test_an_ema_stream_resumes_exactly():
    """Saved past the first blends, the resumed stream blends what the uninterrupted one blends, and no chunk twice."""
    golden = load_golden(RECIPE, "plain")
    pipe = krea_golden_pipeline(golden)
    call = dict(num_frames=pipe.latent_to_frames(27), prompt_embeds=golden.text["a"], output_type="latent")

    def stream(seed=0):
        return pipe.stream(**call, recipe=RECIPE, generator=torch.Generator().manual_seed(seed))

    whole = list(stream())
    first = stream()
    head = [next(first) for _ in range(5)]
    # chunks 1-3 blended (chunk 5 sees the sink, chunk 4 and itself): every token before chunk 4's, 6 a frame
    assert first.caches[0][0].ema_sink.blended_until == 4 * 3 * 6
    resumed = stream(seed=99)
    resumed.load_state_dict(first.state_dict())
    for made, expected in zip(head + list(resumed), whole, strict=True):
        torch.testing.assert_close(made, expected, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"sink_mode": "ema", "position_mode": "absolute"}, r"`sink_mode='ema'`.*needs position_mode='relative'"),
        ({"sink_mode": "ema", "sink_frames": 2}, "needs sink_frames equal to chunk_frames"),
        ({"sink_mode": "ema", "window_frames": 7}, r"window_frames a multiple of it \(got .*window_frames=7"),
        ({"sink_mode": "ema", "kv_quantization": "int8"}, "kv_quantization=None"),
        ({"sink_mode": "ema", "kv_offload": True}, "kv_offload=False"),
    ],
    ids=["absolute", "sink_not_a_chunk", "window_not_whole_chunks", "int8", "offload"],
)
def test_an_ema_sink_it_cannot_keep_is_refused_naming_the_argument(extra, match):
    golden = load_golden(RECIPE, "plain")
    pipe = krea_golden_pipeline(golden)
    with pytest.raises(ValueError, match=match):
        pipe.stream(num_frames=pipe.latent_to_frames(27), prompt_embeds=golden.text["a"], recipe=RECIPE, **extra)


def test_the_layer_refuses_an_ema_sink_it_cannot_keep():
    with pytest.raises(ValueError, match="a sink of one chunk"):
        SlidingWindowLayer(2, 6, 3, sink_mode="ema")
    with pytest.raises(ValueError, match="a window of whole chunks"):
        SlidingWindowLayer(2, 5, 2, sink_mode="ema")
    with pytest.raises(ValueError, match="quantization='int8'"):
        SlidingWindowLayer(3, 6, 3, sink_mode="ema", quantization="int8")
    with pytest.raises(ValueError, match="sink_frames equal to chunk_frames"):
        ChunkLayout(tokens_per_frame=1, sink_frames=1, window_frames=6, position_mode="relative", sink_mode="ema")


# ----------------------------------------------------------------------------------------- the layer, scalar traces
def reference_ema(chunks: int, sink: int, window: int, alpha: float) -> list[float]:
    """Upstream's rule by hand on one scalar per token (token p carries p + 1): the sink after `chunks` chunks of
    `sink` tokens each, every chunk that leaves the window blended into it in order."""
    values = [float(p + 1) for p in range(sink)]
    leaving = max(0, chunks * sink - (window - sink) - sink)  # window tokens the next chunk no longer sees
    for start in range(sink, sink + leaving, sink):
        values = [alpha * v + (1 - alpha) * float(start + i + 1) for i, v in enumerate(values)]
    return values


@pytest.mark.parametrize(("sink", "window"), [(1, 3), (2, 6), (3, 6), (3, 12)])
def test_the_sink_holds_the_blend_of_every_chunk_that_left_and_a_rewind_blends_nothing_twice(sink, window):
    layer = SlidingWindowLayer(sink, window, sink, sink_mode="ema")
    for index in range(9):
        start = index * sink
        values = torch.arange(start + 1, start + sink + 1, dtype=torch.float64).view(1, sink, 1, 1)
        layer.update(values, -values)
        layer.commit()
        expected = reference_ema(index + 1, sink, window, ema_sink.EMA_SINK_ALPHA)
        keys, stored_values = layer.get()
        torch.testing.assert_close(keys[0, :sink, 0, 0].tolist(), expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(stored_values[0, :sink, 0, 0].tolist(), [-v for v in expected], rtol=0, atol=1e-12)
    before = layer.get()[0][0, :sink].clone()
    layer.rewind(window - sink)  # a re-cache: the visible window written again at the same positions
    committed = layer.committed_count
    values = torch.arange(committed + 1, committed + window - sink + 1, dtype=torch.float64).view(1, -1, 1, 1)
    for part in values.split(sink, dim=1):
        layer.update(part, -part)
        layer.commit()
    torch.testing.assert_close(layer.get()[0][0, :sink], before, rtol=0, atol=0)
    layer.reset()
    assert layer.ema_sink.blended_until == sink
