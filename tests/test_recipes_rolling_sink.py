"""`recipe="rolling-sink"` against the authors' code, and `sink_mode="rolling"` (the option it needs) on its own.

The goldens (tests/goldens/rolling-sink/, tools/record_rolling_sink_goldens.py) are haodong2000/RollingSink@d7fc0d9's
`CausalInferencePipeline` on tiny random weights: `plain` (14 chunks: the roll walks back over the first 18 frames
and forward again) and `past_rope_table` (20 chunks, 60 latent frames, replayed on our model built with a RoPE
table of 24 positions: upstream's positions grow, ours are re-indexed inside the window). Each chunk's clean
latents must equal upstream's within 1e-4 (the fp32-vs-fp64 floor is printed).

The layer tests are scalar traces (1 head, head_dim 1, token p carries the value p + 1) against a naive reference
of Rolling Sink's rule (`wan/modules/causal_model.py:232-283`).
"""

from __future__ import annotations

import pytest
import torch
from recipe_goldens import (
    Golden,
    assert_switch_seen,
    call_errors,
    chunk_errors,
    inject_noise,
    load_golden,
    load_upstream_weights,
    switched_stream,
)
from test_recipes_pipeline import krea_golden_pipeline

from rolldiff import KreaRealtimeVideoPipeline
from rolldiff.caching import SlidingWindowLayer
from rolldiff.caching.layout import ChunkLayout
from rolldiff.caching.rolling_sink import source_frame
from rolldiff.models import KreaRealtimeTransformer3DModel, convert_original_wan_state_dict
from rolldiff.pipelines.request.fingerprint import request_fingerprint
from rolldiff.recipes import describe_recipe, get_recipe

TOLERANCE = 1e-4
RECIPE = "rolling-sink"


# ----------------------------------------------------------------------------------------- against upstream
def _pipeline(golden: Golden, rope_max_seq_len: int | None = None) -> KreaRealtimeVideoPipeline:
    config = dict(golden.meta["diffusers_config"])
    if rope_max_seq_len is not None:
        config["rope_max_seq_len"] = rope_max_seq_len
    transformer = KreaRealtimeTransformer3DModel(**config)
    transformer.load_state_dict(convert_original_wan_state_dict(load_upstream_weights(RECIPE)), strict=True)
    return krea_golden_pipeline(golden, transformer.eval().requires_grad_(False))


@torch.no_grad()
def test_rolling_sink_recipe_through_the_call_matches_upstream(monkeypatch):
    """`pipe(...)` with the recipe: every chunk of the 14-chunk run (7 rolls: 6 backward, 1 forward) as upstream's."""
    golden = load_golden(RECIPE, "plain")
    errors = call_errors(_pipeline(golden), golden, RECIPE, monkeypatch)
    assert max(errors) <= TOLERANCE, errors


@torch.no_grad()
def test_rolling_sink_recipe_past_the_rope_table_matches_upstream(monkeypatch):
    """60 latent frames on a model whose RoPE table has 24 positions: absolute positions are refused, the recipe's
    re-indexed ones stay inside the window and give upstream's latents (whose positions run to 59)."""
    golden = load_golden(RECIPE, "past_rope_table")
    table = golden.settings["rope_max_seq_len"]
    pipe = _pipeline(golden, rope_max_seq_len=table)
    chunks = len(golden.clean)
    num_frames = pipe.latent_to_frames(3 * chunks)
    assert 3 * chunks > table
    with pytest.raises(ValueError, match="more than the RoPE table"):
        pipe.stream(num_frames=num_frames, prompt_embeds=golden.text["a"], output_type="latent", recipe="self-forcing")
    noise = inject_noise(golden, monkeypatch)
    stream = pipe.stream(num_frames=num_frames, prompt_embeds=golden.text["a"], output_type="latent", recipe=RECIPE)
    layout = stream.request.layout
    assert (layout.sink_frames, layout.window_frames, layout.position_mode, layout.sink_mode) == (
        0, 21, "relative", "rolling",
    )  # fmt: skip
    assert list(stream.request.step_plan.timesteps) == pytest.approx(golden.settings["timesteps"], abs=1e-3)
    made = list(stream)
    errors = chunk_errors(golden, made)
    print(f"\nrolling-sink/past_rope_table through the stream: max {max(errors):.1e}, floor {golden.floor:.1e}")
    assert noise.noise.exhausted
    assert max(errors) <= TOLERANCE, errors


@torch.no_grad()
def test_a_prompt_switch_before_the_roll_matches_upstream_switched_alike(monkeypatch):
    """`switch_prompt` before chunk 4, then on past the roll: the source frames the roll walks were re-cached under
    the new prompt. The tree has no switch: its loop was switched as `switch_prompt` defines it (text K/V reset,
    every committed block's clean pass re-run under the new prompt; `tools/_wan_upstream.py` `SwitchingGenerator`).
    Control: after the switch the chunks differ from the unswitched run's."""
    golden = load_golden(RECIPE, "prompt_switch")
    switch = golden.settings["switch_before_block"]
    pipe = _pipeline(golden)
    noise = inject_noise(golden, monkeypatch)
    made = switched_stream(pipe, golden, RECIPE, 3 * len(golden.clean), switch)
    errors = chunk_errors(golden, made)
    print(f"\nrolling-sink/prompt_switch through the stream: max {max(errors):.1e}, floor {golden.floor:.1e}")
    assert noise.noise.exhausted
    assert max(errors) <= TOLERANCE, errors
    assert_switch_seen(golden, load_golden(RECIPE, "plain"), switch, TOLERANCE)


@torch.no_grad()
def test_the_plain_self_forcing_window_differs_from_upstream_once_it_rolls(monkeypatch):
    """The goldens see the roll: the same window without it (`sink_mode="fixed"`) matches the 7 chunks before the
    first roll and misses every chunk after it."""
    golden = load_golden(RECIPE, "plain")
    pipe = _pipeline(golden)
    inject_noise(golden, monkeypatch)
    stream = pipe.stream(
        num_frames=pipe.latent_to_frames(3 * len(golden.clean)), prompt_embeds=golden.text["a"],
        output_type="latent", recipe=RECIPE, sink_mode="fixed",
    )  # fmt: skip
    assert stream.request.options.sink_mode == "fixed"  # the explicit argument wins over the recipe
    errors = chunk_errors(golden, list(stream))
    assert max(errors[:8]) <= TOLERANCE, errors  # chunk 7's context pass still sees real frames
    assert min(errors[8:]) > 100 * TOLERANCE, errors


def test_the_recipe_names_its_upstream_and_settings():
    recipe = get_recipe(RECIPE, "KreaRealtimeVideoPipeline")
    assert "haodong2000/RollingSink@d7fc0d9" in recipe.upstream
    assert recipe.settings["sink_mode"] == "rolling" and recipe.settings["position_mode"] == "relative"
    assert "sink_mode = 'rolling'" in describe_recipe(RECIPE)


# ----------------------------------------------------------------------------------------- stream: resume, memory
@torch.no_grad()
def test_a_rolling_stream_resumes_exactly_and_keeps_its_memory():
    golden = load_golden(RECIPE, "plain")
    pipe = _pipeline(golden)
    call = dict(num_frames=pipe.latent_to_frames(30), prompt_embeds=golden.text["a"], output_type="latent")

    def stream(seed=0, **extra):
        return pipe.stream(**call, recipe=RECIPE, generator=torch.Generator().manual_seed(seed), **extra)

    whole = list(stream())
    first = stream()
    head = [next(first) for _ in range(8)]  # past the first roll (chunk 7)
    cache = first._caches[0]  # noqa: SLF001 (the memory of the stream's own cache)
    memory, pointer = cache.memory_bytes(), cache[0].keys.data_ptr()
    state = first.state_dict()
    resumed = stream(seed=99)  # the generator's state comes from `state`
    resumed.load_state_dict(state)
    tail = list(resumed)
    for made, expected in zip(head + tail, whole, strict=True):
        torch.testing.assert_close(made, expected, rtol=0, atol=0)
    rest = list(first)
    assert cache.memory_bytes() == memory and cache[0].keys.data_ptr() == pointer
    torch.testing.assert_close(torch.cat(rest, 2), torch.cat(tail, 2), rtol=0, atol=0)


def test_the_fingerprint_tells_a_rolling_sink_from_a_fixed_one():
    golden = load_golden(RECIPE, "plain")
    pipe = _pipeline(golden)
    call = dict(num_frames=pipe.latent_to_frames(30), prompt_embeds=golden.text["a"], output_type="latent")
    rolling = request_fingerprint(pipe.stream(**call, recipe=RECIPE).request)
    fixed = request_fingerprint(pipe.stream(**call, recipe=RECIPE, sink_mode="fixed").request)
    assert rolling["options"]["sink_mode"] == "rolling" and fixed["options"]["sink_mode"] == "fixed"


# ----------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"sink_mode": "sliding"}, r"`sink_mode` must be one of \('fixed', 'rolling', 'ema'\)"),
        ({"sink_mode": "rolling", "position_mode": "absolute"}, "needs position_mode='relative'"),
        ({"sink_mode": "rolling", "window_frames": "all"}, "an integer `window_frames`"),
        ({"sink_mode": "rolling", "position_mode": "relative", "kv_quantization": "int8"}, "kv_quantization=None"),
        ({"sink_mode": "rolling", "position_mode": "relative", "kv_offload": True}, "kv_offload=False"),
    ],
    ids=["unknown", "absolute", "unbounded", "int8", "offload"],
)
def test_bad_sink_modes_are_refused_naming_the_argument(extra, match):
    golden = load_golden(RECIPE, "plain")
    pipe = _pipeline(golden)
    with pytest.raises(ValueError, match=match):
        pipe.stream(num_frames=pipe.latent_to_frames(30), prompt_embeds=golden.text["a"], **extra)


def test_the_layer_refuses_a_rolling_sink_it_cannot_keep():
    with pytest.raises(ValueError, match="`sink_mode` must be one of"):
        SlidingWindowLayer(0, 6, 2, sink_mode="slide", frame_tokens=1)
    with pytest.raises(ValueError, match="frame_tokens=None"):
        SlidingWindowLayer(0, 6, 2, sink_mode="rolling")
    with pytest.raises(ValueError, match="quantization='int8'"):
        SlidingWindowLayer(0, 6, 2, sink_mode="rolling", frame_tokens=1, quantization="int8")
    with pytest.raises(ValueError, match="whole frames"):
        SlidingWindowLayer(0, 7, 2, sink_mode="rolling", frame_tokens=2)  # a source of 5 tokens: 2.5 frames
    with pytest.raises(ValueError, match="needs position_mode='relative'"):
        ChunkLayout(tokens_per_frame=1, sink_frames=0, window_frames=6, sink_mode="rolling")


# ----------------------------------------------------------------------------------------- the layer, scalar traces
def reference_rolling(positions: list[int], start: int, sink: int, window: int, chunk: int, frame: int) -> list[int]:
    """Rolling Sink by hand: the value (token + 1) each visible committed position holds after committing the chunk
    that starts at `start`. Positions after the source and before that chunk hold source token m(frame), same
    offset in the frame; everything else holds itself."""
    source = window - chunk
    held = []
    for p in positions:
        if sink + source <= p < start:
            within = (p - sink) % frame
            p = sink + source_frame((p - sink) // frame, source // frame) * frame + within
        held.append(p + 1)
    return held


GEOMETRIES = {  # sink, window, chunk, frame (tokens)
    "one_token_frames": (0, 7, 1, 1),
    "upstream_shape": (0, 21, 3, 1),  # 21-frame buffer, 3-frame chunks, 18-frame source
    "two_token_frames": (0, 10, 4, 2),  # a reversed lap keeps each frame's tokens in order
    "with_a_fixed_sink": (2, 8, 2, 2),
}


def _trace(layer: SlidingWindowLayer, chunk: int, chunks: int, after_commit=None) -> None:
    for index in range(chunks):
        start = index * chunk
        values = torch.arange(start + 1, start + chunk + 1, dtype=torch.float32).view(1, chunk, 1, 1)
        layer.update(values, -values)
        layer.commit()
        if after_commit is not None:
            after_commit(start)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRIES)
def test_the_rolling_sink_holds_the_source_walked_back_and_forth(geometry):
    sink, window, chunk, frame = GEOMETRIES[geometry]
    layer = SlidingWindowLayer(sink, window, chunk, sink_mode="rolling", frame_tokens=frame)
    laps = 3 * (window - chunk) // chunk + 4  # the walk goes back, forward and back again

    def check(start):
        positions = layer._visible_committed_positions()  # noqa: SLF001 (the host view of the slot map)
        keys, values = layer.get()
        expected = reference_rolling(positions, start, sink, window, chunk, frame)
        assert keys.flatten().tolist() == expected, (start, positions)
        assert values.flatten().tolist() == [-v for v in expected]
        # the roll changes content only: each slot keeps its own absolute position, re-indexed inside the window
        slots = layer.key_positions().tolist()
        assert [slots[layer._slot_of(p)] for p in positions] == positions  # noqa: SLF001
        assert int(layer.key_positions(reindexed=True).max()) < sink + window

    _trace(layer, chunk, laps, check)


def test_the_upstream_walk_is_the_one_its_log_prints():
    """Frames 18-20 hold 17, 16, 15 ("Reversed sink: 18 --- 15"), ... 36-38 hold 0, 1, 2 ("Forward sink: 0 --- 3")."""
    walk = [source_frame(f, 18) for f in range(18, 60)]
    assert walk[:3] == [17, 16, 15] and walk[15:18] == [2, 1, 0] and walk[18:21] == [0, 1, 2]
    assert walk[36:39] == [17, 16, 15]


def test_an_aborted_chunk_leaves_the_rolled_cache_as_it_was():
    sink, window, chunk, frame = GEOMETRIES["upstream_shape"]
    layer = SlidingWindowLayer(sink, window, chunk, sink_mode="rolling", frame_tokens=frame)
    _trace(layer, chunk, 9)
    before = [t.clone() for t in layer.get()]
    layer.update(torch.full((1, chunk, 1, 1), 99.0), torch.full((1, chunk, 1, 1), 99.0))  # never committed
    assert all(torch.equal(a, b) for a, b in zip(layer.get(), before))
    start = 9 * chunk
    values = torch.arange(start + 1, start + chunk + 1, dtype=torch.float32).view(1, chunk, 1, 1)
    layer.update(values, -values)  # the same chunk again, as a retry writes it
    layer.commit()
    expected = reference_rolling(layer._visible_committed_positions(), start, sink, window, chunk, frame)  # noqa: SLF001
    assert layer.get()[0].flatten().tolist() == expected


def test_a_rolled_layer_saves_and_loads_its_source():
    sink, window, chunk, frame = GEOMETRIES["two_token_frames"]
    layer = SlidingWindowLayer(sink, window, chunk, sink_mode="rolling", frame_tokens=frame)
    _trace(layer, chunk, 5)
    state = layer.state_dict()
    assert "rolling_sink.source_keys" in state and "rolling_sink.source_values" in state
    loaded = SlidingWindowLayer(sink, window, chunk, sink_mode="rolling", frame_tokens=frame)
    loaded.load_state_dict(state)
    for each in (layer, loaded):  # both continue the walk
        for index in range(5, 12):
            start = index * chunk
            values = torch.arange(start + 1, start + chunk + 1, dtype=torch.float32).view(1, chunk, 1, 1)
            each.update(values, -values)
            each.commit()
    assert torch.equal(loaded.get()[0], layer.get()[0])
    fixed = SlidingWindowLayer(sink, window, chunk, frame_tokens=frame)
    with pytest.raises(ValueError, match="sink_mode"):
        fixed.load_state_dict(state)


def test_reset_keeps_the_source_buffers():
    layer = SlidingWindowLayer(0, 7, 1, sink_mode="rolling", frame_tokens=1)
    _trace(layer, 1, 9)
    pointer = layer.rolling_sink.source_keys.data_ptr()
    layer.reset()
    assert layer.rolling_sink.source_keys.data_ptr() == pointer and not layer.rolling_sink.source_keys.any()
    _trace(layer, 1, 9)
    expected = reference_rolling(layer._visible_committed_positions(), 8, 0, 7, 1, 1)  # noqa: SLF001
    assert layer.get()[0].flatten().tolist() == expected


def test_a_pipeline_folder_may_name_the_recipe_and_an_argument_still_wins():
    golden = load_golden(RECIPE, "plain")
    pipe = _pipeline(golden)
    pipe.register_to_config(recipe=RECIPE)  # what `"recipe": "rolling-sink"` in model_index.json does
    call = dict(num_frames=pipe.latent_to_frames(30), prompt_embeds=golden.text["a"], output_type="latent")
    assert pipe.stream(**call).request.layout.sink_mode == "rolling"
    assert pipe.stream(**call, window_frames=12).request.layout.window_frames == 12
