"""`denoising="pipelined"` with StreamDiffusionV2's adaptive sink (rolldiff's: upstream pipelines by its stream batch).

The spec, on the layer: a pipelined `AdaptiveSinkLayer` (`in_flight_frames`) is a sequential one whose every write pops
(`forwards_per_chunk=1`), fed each committed chunk ONCE, plus the in-flight chunks: every forward sees exactly that
sequential layer's written slots followed by the window, and after every commit its slots, queue, fill and refreshes
are that layer's. Checked over random walks of window forwards (1 to S chunks in flight), commits of the leaving chunk
(`context_policy="last_step"`) and context passes (`"rolling"`), on random keys, so refreshes are frequent.

On the model: with a threshold that never refreshes the adaptive sink is a fixed sink plus a FIFO ring, so a pipelined
stream under the recipe equals the sliding-window pipelined stream with the same visible frames (sink 3, the latest 3
committed frames, the window); with refreshes it does not (the control).
"""

from __future__ import annotations

import random

import pytest
import torch
from recipe_goldens import load_golden
from test_recipes_streamdiffusionv2 import RECIPE, _pipeline

from rolldiff.caching import AdaptiveSinkLayer, AdaptiveSinkPolicy, RollingKVCache

SINK, WINDOW, FRAME = 3, 3, 2  # frames of the recipe's geometry, 2 tokens a frame


def _layers(threshold: float, in_flight: int) -> tuple[AdaptiveSinkLayer, AdaptiveSinkLayer]:
    pipelined = AdaptiveSinkLayer(
        SINK * FRAME, WINDOW * FRAME, 2 * FRAME, frame_tokens=FRAME,
        policy=AdaptiveSinkPolicy(threshold, 1, in_flight_frames=in_flight),
    )  # fmt: skip
    sequential = AdaptiveSinkLayer(
        SINK * FRAME, WINDOW * FRAME, 2 * FRAME, frame_tokens=FRAME, policy=AdaptiveSinkPolicy(threshold, 1)
    )
    return pipelined, sequential


def _written(layer: AdaptiveSinkLayer) -> tuple[torch.Tensor, torch.Tensor]:
    if layer.keys is None:  # nothing written yet
        return torch.zeros(1, 0, 1, 4), torch.zeros(1, 0, 1, 4)
    return layer.keys[:, : layer.filled], layer.values[:, : layer.filled]


@pytest.mark.parametrize("policy", ["last_step", "rolling"])
@pytest.mark.parametrize("seed", range(3))
def test_a_pipelined_layer_is_a_sequential_one_plus_the_window(policy, seed):
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    steps = 4
    pipelined, sequential = _layers(threshold=0.2, in_flight=steps + 1)
    cache = RollingKVCache([pipelined])
    first = True
    for _ in range(40):  # enough commits to fill the buffer and wrap its ring several times
        chunk = 2 if first else 1  # StreamDiffusionV2's first chunk of two latent frames
        frames = chunk + rng.randint(0, steps - 1)  # the leaving chunk and those still in flight behind it
        for _ in range(rng.randint(1, 2)):  # a forward, or an aborted one and the next at the same place
            key = torch.randn(1, frames * FRAME, 1, 4, generator=generator)
            value = torch.randn(1, frames * FRAME, 1, 4, generator=generator)
            keys, values = pipelined.update(key, value)
            visible = pipelined.visible_prefix(key.shape[1])
            slots = torch.arange(pipelined.buffer_tokens)
            assert torch.equal(pipelined.attention_mask, slots < visible)  # what a compiled step reads instead
            held_keys, held_values = _written(sequential)
            torch.testing.assert_close(keys[:, :visible], torch.cat([held_keys, key], 1), rtol=0, atol=0)
            torch.testing.assert_close(values[:, :visible], torch.cat([held_values, value], 1), rtol=0, atol=0)
        leaving = slice(0, chunk * FRAME)
        if policy == "last_step":
            cache.commit(chunk * FRAME)  # the leaving chunk's writes of the forward it left in
        else:
            key, value = torch.randn(2, 1, chunk * FRAME, 1, 4, generator=generator)  # its clean pass
            with cache.context_pass():
                pipelined.update(key, value)
            cache.commit()
        sequential.update(key[:, leaving], value[:, leaving])
        sequential.commit()
        first = False
        assert (pipelined.queue, pipelined.filled, pipelined.refreshes) == (
            sequential.queue, sequential.filled, sequential.refreshes,
        )  # fmt: skip
        assert pipelined.committed_count == sequential.committed_count
        for mine, theirs in zip(_written(pipelined), _written(sequential)):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert sequential.refreshes > 0  # the walk exercised the decisions


def test_the_pipelined_layer_refuses_what_it_cannot_commit():
    pipelined, sequential = _layers(threshold=0.2, in_flight=5)
    pipelined.update(torch.randn(1, 5 * FRAME, 1, 4), torch.randn(1, 5 * FRAME, 1, 4))
    with pytest.raises(ValueError, match="whole frames"):
        pipelined.commit(FRAME + 1)
    with pytest.raises(ValueError, match="at most the window's"):
        RollingKVCache([pipelined]).commit(4 * FRAME)
    sequential.update(torch.randn(1, FRAME, 1, 4), torch.randn(1, FRAME, 1, 4))
    with pytest.raises(TypeError, match="commits whole chunks"):
        sequential.commit(FRAME)
    with pytest.raises(ValueError, match="`in_flight_frames`"):
        AdaptiveSinkPolicy(0.2, 1, in_flight_frames=-1)


# ----------------------------------------------------------------------------------------- the model
def _stream_latents(pipe, golden, **extra) -> list[torch.Tensor]:
    call = dict(num_frames=1 + 4 * 12, prompt_embeds=golden.text["a"], output_type="latent", recipe=RECIPE)
    stream = pipe.stream(**call, generator=torch.Generator().manual_seed(0), denoising="pipelined", **extra)
    return [chunk.float() for chunk in stream], stream


@torch.no_grad()
def test_without_refreshes_a_pipelined_adaptive_sink_is_the_sliding_window():
    """Threshold -1, the recipe's `context_policy="last_step"`: the sink keeps frames 0-2 and the ring holds the
    latest 3 committed frames, exactly what a sliding window of 3 + the 4 in-flight frames shows a pipelined window;
    the streams agree chunk by chunk. (Under "rolling" they part on purpose: the adaptive sink's context pass writes
    its chunk into the ring, over the oldest of the 3, as a sequential one does; the layer walk above covers it.)"""
    golden = load_golden(RECIPE, "plain")
    pipe = _pipeline(golden)
    common = dict(first_chunk="whole")
    adaptive, stream = _stream_latents(pipe, golden, adaptive_sink_threshold=-1.0, **common)
    assert stream.caches[0][0].buffer_tokens > stream.caches[0][0].capacity  # the in-flight region
    sliding, _ = _stream_latents(pipe, golden, adaptive_sink=False, window_frames=3 + 4, **common)
    errors = [float((a - b).abs().max()) for a, b in zip(adaptive, sliding, strict=True)]
    assert max(errors) <= 1e-5, errors
    refreshing, stream = _stream_latents(pipe, golden, adaptive_sink_threshold=0.99, **common)
    assert sum(layer.refreshes for layer in stream.caches[0]) > 0
    assert max(float((a - b).abs().max()) for a, b in zip(refreshing, sliding)) > 1e-3  # the control


@torch.no_grad()
def test_the_recipe_runs_pipelined_with_its_first_chunk_of_two_and_resumes_exactly():
    """`recipe="streamdiffusionv2", denoising="pipelined"` keeps the recipe's first chunk of two latent frames; a
    stream saved mid-window and loaded into a fresh one continues bit for bit; the cache is allocated once."""
    golden = load_golden(RECIPE, "plain")
    pipe = _pipeline(golden)
    whole, stream = _stream_latents(pipe, golden, adaptive_sink_threshold=0.9)
    assert [chunk.shape[2] for chunk in whole[:2]] == [2, 1]
    assert stream.request.in_flight_frames == 5  # 4 chunks of 1, the first one frame larger
    first = pipe.stream(
        num_frames=1 + 4 * 12, prompt_embeds=golden.text["a"], output_type="latent", recipe=RECIPE,
        denoising="pipelined", adaptive_sink_threshold=0.9, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    head = [next(first).float() for _ in range(6)]
    resumed = pipe.stream(
        num_frames=1 + 4 * 12, prompt_embeds=golden.text["a"], output_type="latent", recipe=RECIPE,
        denoising="pipelined", adaptive_sink_threshold=0.9, generator=torch.Generator().manual_seed(5),
    )  # fmt: skip
    resumed.load_state_dict(first.state_dict())
    for made, expected in zip(head + [chunk.float() for chunk in resumed], whole, strict=True):
        torch.testing.assert_close(made, expected, rtol=0, atol=0)


def _compiled_cases(golden) -> dict[str, dict]:
    """Streams whose forwards are all in-flight writes (text), or also decide one context pass each (a start image;
    `context_policy="rolling"`: one per chunk), in one process (their layouts add graphs)."""
    image = load_golden(RECIPE, "i2v").tensor("image").numpy()
    text = dict(num_frames=1 + 4 * 8, prompt_embeds=golden.text["a"])
    guided = dict(negative_prompt_embeds=torch.zeros_like(golden.text["a"]), guidance_scale=3.0)
    return {
        "text": text,
        "guided": {**text, **guided},
        "image": {**text, "image": image},
        "rolling": {**text, "context_policy": "rolling"},
    }


@torch.no_grad()
def test_a_compiled_step_runs_the_pipelined_recipe_fullgraph_with_a_bounded_number_of_graphs():
    """`compile_cached_step` (fullgraph=True) under `denoising="pipelined"`: every in-flight forward runs the
    compiled graph, which reads the fill from the device (graphs: the window's sizes and one `window_full` bool, none
    added as the video grows); each forward that decides (a context pass) runs eager, counted. Every chunk equals the
    eager stream's (same noise) within 1e-5, through refreshes (threshold 0.9)."""
    from torch._dynamo.testing import CompileCounter

    from rolldiff.pipelines.acceleration import compile_cached_step

    golden = load_golden(RECIPE, "plain")
    pipe = _pipeline(golden)
    cases = _compiled_cases(golden)
    call = dict(output_type="latent", recipe=RECIPE, denoising="pipelined", adaptive_sink_threshold=0.9)

    def run(case: dict) -> tuple[list[torch.Tensor], int]:
        stream = pipe.stream(**case, **call, generator=torch.Generator().manual_seed(0))
        chunks = [chunk.float() for chunk in stream]
        return chunks, sum(layer.refreshes for cache in stream.caches for layer in cache)

    eager = {name: run(case) for name, case in cases.items()}
    counter = CompileCounter()
    torch.compiler.reset()
    try:
        step = compile_cached_step(pipe.transformer, backend=counter)
        graphs, eager_calls = {}, {}
        for name, case in cases.items():
            before = step.eager_calls
            compiled, refreshes = run(case)
            graphs[name], eager_calls[name] = counter.frame_count, step.eager_calls - before
            assert refreshes == eager[name][1] > 0
            for made, expected in zip(compiled, eager[name][0], strict=True):
                torch.testing.assert_close(made, expected, rtol=1e-5, atol=1e-5)
        longer, _ = run({**cases["text"], "num_frames": 1 + 4 * 24})  # the buffer wrapped several more times
    finally:
        torch.compiler.reset()
    assert len(longer) == 24 and counter.frame_count == graphs["rolling"]  # no graph added by the length
    assert graphs["guided"] == graphs["text"] == 5  # windows of 2 to 5 frames (the first chunk has 2), then 1
    assert graphs["image"] > 8  # past torch's default recompile limit: `compile_cached_step` raises it
    assert eager_calls == {"text": 0, "guided": 0, "image": 1, "rolling": 8}  # the context passes only


@pytest.mark.parametrize("how", ["module.compile", "sequential"])
def test_a_compiled_transformer_that_cannot_run_a_decided_write_eager_is_refused_before_any_work(how):
    """Sequentially every write decides on the host (upstream's `.item()`), and `module.compile()` has no eager
    forward for the decided ones: refused naming the option, where fullgraph tracing would fail mid-forward."""
    from rolldiff.pipelines.acceleration import compile_cached_step

    golden = load_golden(RECIPE, "plain")
    pipe = _pipeline(golden)
    if how == "module.compile":
        pipe.transformer.compile(fullgraph=True, backend="eager")
    else:
        compile_cached_step(pipe.transformer, backend="eager")
    denoising = "pipelined" if how == "module.compile" else "sequential"
    with pytest.raises(ValueError, match=r"`adaptive_sink=True` .* runs compiled only"):
        pipe.stream(num_frames=1 + 4 * 6, prompt_embeds=golden.text["a"], recipe=RECIPE, denoising=denoising)


@torch.no_grad()
def test_guidance_a_prompt_switch_an_image_and_a_video_run_pipelined_with_the_adaptive_sink():
    """The loop's other features under the recipe, pipelined: guidance (a cache per branch, each with its in-flight
    region), a switch at a chunk boundary (the text K/V only, as the recipe's switch), a start image (its chunk
    committed by its context pass, then in-flight chunks) and an input video under the strength mix."""
    golden = load_golden(RECIPE, "plain")
    pipe = _pipeline(golden)
    call = dict(prompt_embeds=golden.text["a"], output_type="latent", recipe=RECIPE, denoising="pipelined")
    guided = pipe.stream(
        num_frames=1 + 4 * 8, negative_prompt_embeds=torch.zeros_like(golden.text["a"]), guidance_scale=3.0, **call
    )
    made = [next(guided) for _ in range(4)]
    assert guided.switch_prompt(prompt_embeds=golden.text["a"] * 0.5) == 4
    made += list(guided)
    assert len(made) == guided.num_chunks and all(torch.isfinite(chunk).all() for chunk in made)
    assert all(layer.buffer_tokens > layer.capacity for cache in guided.caches for layer in cache)
    image = load_golden(RECIPE, "i2v").tensor("image").numpy()
    from_image = list(pipe.stream(num_frames=1 + 4 * 8, image=image, **call))
    assert [chunk.shape[2] for chunk in from_image[:2]] == [1, 1] and len(from_image) == 9
    video = ((golden.tensor("video")[0].permute(1, 2, 3, 0) + 1) / 2).clamp(0, 1).numpy()
    from_video = pipe.stream(num_frames=37, video=video, strength=0.7, video_noise_mix="strength", **call)
    assert from_video.request.in_flight_frames == 5  # every step runs under the strength mix: 4 in flight + 1
    assert len(list(from_video)) == 9  # a first chunk of two latent frames, then 8 of one
