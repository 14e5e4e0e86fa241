"""`recipe="streamdiffusionv2"` against the authors' own code (tools/record_streamdiffusionv2_goldens.py).

The goldens are the authors' single-GPU driver (chenfengxu714/StreamDiffusionV2 c5a0f20,
`streamv2v/inference_wo_batch.py`, and the stream batch of `streamv2v/inference.py`) on the tiny random Wan, with every
noise draw, the input video, what the authors' VAE encoded, each block's clean latents and, per chunk and transformer
block, the adaptive sink's eviction queue. Here our pipeline runs `recipe="streamdiffusionv2"` on the golden's weights,
VAE and input pixels with upstream's noise injected in upstream's order, and every block's clean latents must equal
upstream's within 1e-4 (the floor, upstream fp32 against upstream fp64, is printed), our eviction queues must be
upstream's, chunk by chunk and block by block, and the sink must refresh in our run as it did in upstream's. The
stream batch's golden is matched twice: by a hand-written reference loop through our model and cache
(`_upstream_stream_batch`) and by the pipeline's `denoising="stream_batch"` (`rolldiff.pipelines.stream_batch`).

The weights upstream ran with are the stored ones rounded to bf16: the driver casts its pipeline to bf16 when it is
built (`inference_wo_batch.py:74`) and loads the checkpoint afterwards (`load_model`), and the recorder only then
moved it to fp32/fp64. The replay loads the same rounded values (`_transformer`); with the unrounded ones every block
differs by ~1e-2, which is that rounding, not the loop.

Our input reader rounds pixels to 8 bits (every video file's precision); the golden's input is float, so the tests hand
the stream upstream's exact pixels through `VideoInput.next_chunk` (`_exact_pixels`). The encoder itself is proven
against upstream's below.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers.schedulers import scheduling_flow_match_euler_discrete as scheduler_module
from recipe_goldens import Golden, load_golden, load_meta, load_transformer, load_vae
from test_recipes_pipeline import krea_golden_pipeline

from rolldiff import KreaRealtimeVideoPipeline
from rolldiff.caching import AdaptiveSinkLayer
from rolldiff.pipelines import stream as stream_module
from rolldiff.pipelines.codecs.streaming_encode import StreamingWanEncoder
from rolldiff.pipelines.io.video_input import VideoInput
from rolldiff.pipelines.request.steps import StepMapping, plan_steps
from rolldiff.pipelines.video_noise import VideoNoiseMix
from rolldiff.recipes import describe_recipe, get_recipe

RECIPE = "streamdiffusionv2"
TOLERANCE = 1e-4
NUM_FRAMES = 37  # the golden's input: 1 + 4 pixel frames (2 latent frames), then 8 chunks of 4 (1 latent frame each)


def _transformer():
    """The golden's tiny transformer with the weights upstream ran with: the stored ones rounded to bf16."""
    transformer = load_transformer(RECIPE)
    with torch.no_grad():
        for parameter in transformer.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).float())
    return transformer


def _pipeline(golden: Golden) -> KreaRealtimeVideoPipeline:
    return krea_golden_pipeline(golden, _transformer(), vae_recipe=RECIPE)


class UpstreamDraws:
    """Stands in for `randn_tensor` in the stream and the scheduler: upstream's draws in upstream's order, each put
    in diffusers' layout. Per chunk the stream draws its noise, then one re-noise per step; upstream draws none after
    the last step (its sigma is 0), so that draw gets zeros."""

    def __init__(self, golden: Golden, steps: int) -> None:
        count = len(golden.settings["draw_shapes"])
        self.draws = [golden.tensor(f"draw.{i}") for i in range(count)]
        self.per_chunk, self.calls, self.used = steps + 1, 0, 0

    def __call__(self, shape, generator=None, device=None, dtype=None, **kwargs) -> torch.Tensor:
        self.calls += 1
        if self.calls % self.per_chunk == 0:
            return torch.zeros(shape, device=device, dtype=dtype)
        draw = self.draws[self.used]  # (batch, frames, channels, h, w) or a re-noise's (frames, channels, h, w)
        self.used += 1
        draw = (draw if draw.ndim == 5 else draw.unsqueeze(0)).permute(0, 2, 1, 3, 4)
        assert tuple(draw.shape) == tuple(shape), (self.used - 1, tuple(draw.shape), tuple(shape))
        return draw.to(device=device, dtype=dtype)

    @property
    def exhausted(self) -> bool:
        return self.used == len(self.draws)


def _inject(golden: Golden, monkeypatch) -> UpstreamDraws:
    draws = UpstreamDraws(golden, len(get_recipe(RECIPE).settings["video_denoising_steps"]))
    monkeypatch.setattr(stream_module, "randn_tensor", draws)
    monkeypatch.setattr(scheduler_module, "randn_tensor", draws)
    return draws


def _exact_pixels(golden: Golden, monkeypatch):
    """`video=` for the call (the golden's frames as an (F, H, W, 3) array in [0, 1], which the request checks), with
    the reader handing the stream upstream's float pixels themselves, chunk by chunk."""
    video = golden.tensor("video")  # (1, 3, frames, H, W) in [-1, 1]

    def next_chunk(self, num_frames):
        frames = video[:, :, self.frames_read : self.frames_read + num_frames]
        self.frames_read += frames.shape[2]
        return frames if frames.shape[2] else None

    monkeypatch.setattr(VideoInput, "next_chunk", next_chunk)
    return ((video[0].permute(1, 2, 3, 0) + 1) / 2).clamp(0, 1).numpy()


def _replay(golden: Golden, monkeypatch, switch_at: int | None = None, **extra):
    """Our stream under the recipe on the golden's input: each chunk's latents and, after every chunk but the first,
    each transformer block's eviction queue. `switch_at`: `switch_prompt` to the golden's prompt "b" before that
    chunk."""
    pipe = _pipeline(golden)
    draws = _inject(golden, monkeypatch)
    video = _exact_pixels(golden, monkeypatch)
    stream = pipe.stream(
        num_frames=NUM_FRAMES, prompt_embeds=golden.text["a"], video=video, strength=golden.settings["noise_scale"],
        output_type="latent", recipe=RECIPE, **extra,
    )  # fmt: skip
    chunks, queues = [], []
    for chunk in stream:
        chunks.append(chunk.float())
        if len(chunks) > 1 and isinstance(stream.caches[0][0], AdaptiveSinkLayer):
            queues.append([list(layer.queue) for layer in stream.caches[0]])
        if len(chunks) == switch_at:
            assert stream.switch_prompt(prompt_embeds=golden.text["b"]) == switch_at
    return stream, chunks, queues, draws


def _errors(golden: Golden, chunks: list[torch.Tensor]) -> list[float]:
    assert len(chunks) == len(golden.clean) == 9
    return [float((made - expected).abs().max()) for made, expected in zip(chunks, golden.clean)]


# ----------------------------------------------------------------------------------------- the recipe's replay
@pytest.mark.parametrize("scenario", ["plain", "v2v"])
@torch.no_grad()
def test_the_recipe_matches_upstream_block_by_block(scenario, monkeypatch):
    """Block 0 (two latent frames) and 8 one-frame chunks, every one within 1e-4 of upstream's; the eviction queues
    are upstream's after every chunk in every transformer block, and the sink refreshed in our run."""
    golden = load_golden(RECIPE, scenario)
    stream, chunks, queues, draws = _replay(golden, monkeypatch)
    errors = _errors(golden, chunks)
    refreshes = [layer.refreshes for layer in stream.caches[0]]
    print(
        f"\n{RECIPE}/{scenario} through the pipeline: max |ours - upstream| {max(errors):.1e} over {len(errors)} "
        f"blocks, floor (upstream fp32 vs fp64) {golden.floor:.1e}; sink refreshes per transformer block {refreshes}"
    )
    assert draws.exhausted
    assert max(errors) <= TOLERANCE, errors
    assert queues == golden.settings["evict_queues"]
    assert sum(refreshes) > 0  # the adaptive sink rewrote a sink frame in OUR run


@torch.no_grad()
def test_a_prompt_switch_matches_upstreams_switch_with_the_cache_kept(monkeypatch):
    """`switch_prompt` before chunk 5 against the authors' loop switched as their `prepare()` does when it finds a
    cache (the text K/V refilled, the self-attention cache and its sink kept; their demos restart the session
    instead): every block within 1e-4, the eviction queues upstream's, and the chunks from 5 on differ from the
    unswitched golden's (the switch is seen)."""
    golden = load_golden(RECIPE, "prompt_switch")
    switch = golden.settings["switch_block"]
    stream, chunks, queues, draws = _replay(golden, monkeypatch, switch_at=switch)
    errors = _errors(golden, chunks)
    print(f"\n{RECIPE}/prompt_switch: max |ours - upstream| {max(errors):.1e}, floor {golden.floor:.1e}")
    assert draws.exhausted
    assert max(errors) <= TOLERANCE, errors
    assert queues == golden.settings["evict_queues"]
    unswitched = load_golden(RECIPE, "v2v").clean
    assert min(float((a - b).abs().max()) for a, b in zip(chunks[switch:], unswitched[switch:])) > 100 * TOLERANCE


@torch.no_grad()
def test_without_refreshes_the_v2v_golden_is_missed(monkeypatch):
    """The control: the same loop with a threshold that never refreshes (upstream's -1) misses the v2v golden by far
    more than the tolerance, so the match above depends on the adaptive sink's decisions."""
    golden = load_golden(RECIPE, "v2v")
    stream, chunks, _, _ = _replay(golden, monkeypatch, adaptive_sink_threshold=-1.0)
    errors = _errors(golden, chunks)
    print(f"\n{RECIPE}/v2v without refreshes: max |ours - upstream| {max(errors):.2e} (tolerance {TOLERANCE:.0e})")
    assert sum(layer.refreshes for layer in stream.caches[0]) == 0
    assert max(errors[:4]) <= TOLERANCE  # the queue is read once the buffer is full (chunk 4): the same until then
    assert max(errors) > 100 * TOLERANCE


@torch.no_grad()
def test_without_the_motion_adaptive_step_the_v2v_golden_is_missed(monkeypatch):
    """The control of the noise mix: a fixed `strength` mix (every chunk from step 700) misses from chunk 1 on."""
    golden = load_golden(RECIPE, "v2v")
    _, chunks, _, _ = _replay(golden, monkeypatch, video_noise_mix="strength")
    errors = _errors(golden, chunks)
    assert errors[0] <= TOLERANCE and min(errors[1:]) > 100 * TOLERANCE, errors


def test_the_motion_adaptive_first_steps_are_upstreams():
    """`VideoNoiseMix("motion")` over the golden's pixels picks the first timestep upstream fed each chunk."""
    for scenario in ("plain", "v2v"):
        golden = load_golden(RECIPE, scenario)
        video, mix = golden.tensor("video"), VideoNoiseMix("motion", golden.settings["noise_scale"])
        plan = plan_steps([700, 500, 400, 200], "table", 8.0)
        mapping = StepMapping("table", 8.0)
        fed = []
        for index in range(9):
            start = 0 if index == 0 else 1 + 4 * index
            mix.observe(video[:, :, start : 5 + 4 * index])
            chunk_plan, _ = mix.plan_and_level(plan, mapping)
            fed.append([int(t) for t in chunk_plan.timesteps])
        assert fed[0] == [700, 500, 400, 200]
        assert fed[1:] == golden.settings["steps_fed"], scenario


# ----------------------------------------------------------------------------------------- the stream batch
STEPS = (700.0, 500.0, 400.0, 200.0)
BATCH_CHUNKS = 8  # the chunks after block 0


def _upstream_stream_batch(golden: Golden, entering: list, draw) -> list[torch.Tensor]:
    """Upstream's stream batch spelled out through our model and `AdaptiveSinkLayer`: `entering[f]` is chunk f's
    latents before its first step and its plan (block 0 first), `draw(i)` upstream's draw i; the chunks as shown.

    `streamv2v/inference.py:298-371` with `causal_stream_inference.py:202-296`: block 0 is denoised alone (4 steps,
    one cache), then its cache is copied into one row per step (`:221-225`) and every forward runs a batch of 4 rows,
    row r holding chunk f - r at step r and attending to and writing its own cache row; rows never meet, so each
    cache holds the earlier chunks' K/V written at its own step, and pops its queue at every write once full
    (`cache_bs > 1`, `causal_model.py:310-316`). Until the batch is full, rows 1..3 hold zeros and their re-noised
    predictions (`prepare`'s `hidden_states` are zeros): they write into their caches at chunk 1's position, and
    their similarity decisions stay in the queues (left out, chunks 6-8 differ by ~0.1). Once the input ends, row 0
    takes pure noise (those rows are never shown and are skipped here)."""
    from rolldiff.caching import AdaptiveSinkPolicy, CrossAttentionLayer, RollingKVCache
    from rolldiff.models import ChunkLayout

    model, text, steps, chunks = _transformer(), golden.text["a"], STEPS, len(entering) - 1
    layout = ChunkLayout(tokens_per_frame=golden.tokens_per_frame, chunk_frames=2, sink_frames=3, window_frames=3)

    def cache() -> RollingKVCache:
        policy = AdaptiveSinkPolicy(0.2, len(steps))  # block 0's: its 4 steps (and the fill rows') before a commit
        sizes = (layout.sink_tokens, layout.window_tokens, layout.chunk_tokens)
        layers = [AdaptiveSinkLayer(*sizes, frame_tokens=layout.tokens_per_frame, policy=policy) for _ in model.blocks]
        return RollingKVCache(layers, [CrossAttentionLayer() for _ in model.blocks])

    def predict(latents, timestep, sigma, step_cache) -> torch.Tensor:
        return (
            latents - sigma * model(latents, torch.tensor([timestep]), text, kv_cache=step_cache, layout=layout).sample
        )

    latents, plan = entering[0]
    first = cache()
    for step, (timestep, sigma) in enumerate(zip(plan.timesteps, plan.sigmas)):  # block 0: `prepare`, draws 0-3
        clean = predict(latents, timestep, sigma, first)
        if step + 1 < len(steps):
            latents = (1 - plan.sigmas[step + 1]) * clean + plan.sigmas[step + 1] * draw(step + 1)
    first.commit()
    made = [clean]
    caches = [cache() for _ in steps]
    for row_cache in caches:
        row_cache.load_state_dict(first.state_dict())
    rows = [torch.zeros_like(clean[:, :, :1]) for _ in steps]  # `hidden_states`: zeros until chunks fill the batch
    plans = [plan] * len(steps)
    for forward in range(1, chunks + len(steps)):
        drawn = 4 + 4 * (forward - 1)  # this forward's draws: the entering chunk's noise, then re-noises of rows 0-2
        entering_plan = None
        if forward <= chunks:  # the input's next chunk
            chunk_latents, entering_plan = entering[forward]
            rows = [chunk_latents] + rows[:-1]
        else:
            rows = [None] + rows[:-1]  # pure noise after the input ends: never shown, skipped
        plans = [entering_plan] + plans[:-1]
        for row, row_cache in enumerate(caches):
            chunk = forward - row
            if rows[row] is None or chunk > chunks:
                continue
            row_plan = plans[row] if chunk >= 1 else plan  # a fill row runs at its row's step of the list
            rows[row] = predict(rows[row], row_plan.timesteps[row], row_plan.sigmas[row], row_cache)
            if chunk >= 1:  # a fill row's writes stay pending: chunk 1 writes the same slots after them
                row_cache.commit()
                for layer in row_cache:
                    layer.policy = AdaptiveSinkPolicy(0.2, 1)  # one write a chunk from now on: every write pops
            if row + 1 < len(steps):
                next_sigma = plan.sigmas[row + 1]
                rows[row] = (1 - next_sigma) * rows[row] + next_sigma * draw(drawn + row + 1)
        if forward >= len(steps):
            made.append(rows[-1])
    return made


def _golden_draws(golden: Golden) -> list[torch.Tensor]:
    return [golden.tensor(f"draw.{i}") for i in range(len(golden.settings["draw_shapes"]))]


def _as_draw(draws: list[torch.Tensor]):
    """`draw(i)`: draw i (upstream's layout, `(batch, frames, channels, h, w)`) in diffusers' layout."""

    def draw(index: int) -> torch.Tensor:
        noise = draws[index]
        return (noise if noise.ndim == 5 else noise.unsqueeze(0)).permute(0, 2, 1, 3, 4)

    return draw


def _v2v_entering(golden: Golden, draw) -> list:
    """Each input chunk mixed at its motion-adapted level with its noise (draw 4f), and its plan, block 0 first."""
    mapping, video = StepMapping("table", 8.0), golden.tensor("video")
    mix = VideoNoiseMix("motion", golden.settings["noise_scale"])
    entering = []
    for chunk in range(BATCH_CHUNKS + 1):
        mix.observe(video[:, :, :5] if chunk == 0 else video[:, :, 1 + 4 * chunk : 5 + 4 * chunk])
        plan, level = mix.plan_and_level(mapping.plan(STEPS), mapping)
        entering.append((level * draw(4 * chunk) + (1 - level) * golden.tensor(f"encoded.{chunk}"), plan))
    return entering


@torch.no_grad()
def test_the_stream_batch_is_one_cache_per_step_with_its_fill_rows():
    """The reference: upstream's stream batch driven from outside (`_upstream_stream_batch`) matches its golden,
    every block within 1e-4."""
    golden = load_golden(RECIPE, "stream_batch")
    draw = _as_draw(_golden_draws(golden))
    errors = _errors(golden, _upstream_stream_batch(golden, _v2v_entering(golden, draw), draw))
    print(
        f"\n{RECIPE}/stream_batch, one cache per step with its fill rows: max {max(errors):.1e}, floor {golden.floor:.1e}"
    )
    assert max(errors) <= TOLERANCE, errors


class StreamBatchDraws:
    """Stands in for `randn_tensor` in the stream, the scheduler and the stream batch: `draws` (upstream's layout) in
    the order the stream-batch loop asks for them, which is upstream's order less the rows it leaves out. Block 0:
    its noise and 3 re-noises (zeros after the last step); forward f: the entering chunk's noise (draw 4f, while the
    input lasts), then the re-noise of each row r < 3 that holds a chunk (draw 4f + r + 1)."""

    def __init__(self, draws: list[torch.Tensor], steps: int = 4, chunks: int = BATCH_CHUNKS) -> None:
        self.draws, self.order = draws, [0, 1, 2, 3, None]
        for forward in range(1, chunks + steps):
            self.order += [steps * forward] if forward <= chunks else []
            self.order += [steps * forward + row + 1 for row in range(steps - 1) if forward - row <= chunks]
        self.used = 0

    def __call__(self, shape, generator=None, device=None, dtype=None, **kwargs) -> torch.Tensor:
        index = self.order[self.used]
        self.used += 1
        if index is None:
            return torch.zeros(shape, device=device, dtype=dtype)
        draw = self.draws[index]
        draw = (draw if draw.ndim == 5 else draw.unsqueeze(0)).permute(0, 2, 1, 3, 4)
        assert tuple(draw.shape) == tuple(shape), (index, tuple(draw.shape), tuple(shape))
        return draw.to(device=device, dtype=dtype)

    @property
    def exhausted(self) -> bool:
        return self.used == len(self.order)


def _inject_stream_batch(draws: list[torch.Tensor], monkeypatch, chunks: int = BATCH_CHUNKS) -> StreamBatchDraws:
    from rolldiff.pipelines import stream_batch as stream_batch_module

    tape = StreamBatchDraws(draws, chunks=chunks)
    for module in (stream_module, scheduler_module, stream_batch_module):
        monkeypatch.setattr(module, "randn_tensor", tape)
    return tape


@torch.no_grad()
def test_the_pipelines_stream_batch_matches_upstream(monkeypatch):
    """`denoising="stream_batch"` through the public API on the golden's input with upstream's draws: every block
    within 1e-4 of upstream's stream batch, every draw used, and the S = 4 caches' adaptive sinks decided."""
    golden = load_golden(RECIPE, "stream_batch")
    pipe = _pipeline(golden)
    draws = _inject_stream_batch(_golden_draws(golden), monkeypatch)
    video = _exact_pixels(golden, monkeypatch)
    stream = pipe.stream(
        num_frames=NUM_FRAMES, prompt_embeds=golden.text["a"], video=video, strength=0.7, output_type="latent",
        recipe=RECIPE, denoising="stream_batch",
    )  # fmt: skip
    chunks = [chunk.float() for chunk in stream]
    errors = _errors(golden, chunks)
    print(
        f"\n{RECIPE}/stream_batch through the pipeline: max |ours - upstream| {max(errors):.1e}, floor {golden.floor:.1e}"
    )
    assert draws.exhausted
    assert max(errors) <= TOLERANCE, errors


@torch.no_grad()
def test_without_refreshes_the_stream_batch_golden_is_missed(monkeypatch):
    """The control: the same pipeline loop with a threshold that never refreshes misses the stream-batch golden by far
    more than the tolerance, so the match above depends on the S caches' adaptive-sink decisions."""
    golden = load_golden(RECIPE, "stream_batch")
    _inject_stream_batch(_golden_draws(golden), monkeypatch)
    stream = _pipeline(golden).stream(
        num_frames=NUM_FRAMES, prompt_embeds=golden.text["a"], video=_exact_pixels(golden, monkeypatch), strength=0.7,
        output_type="latent", recipe=RECIPE, denoising="stream_batch", adaptive_sink_threshold=-1.0,
    )  # fmt: skip
    errors = _errors(golden, [chunk.float() for chunk in stream])
    print(f"\n{RECIPE}/stream_batch without refreshes: max |ours - upstream| {max(errors):.2e}")
    assert max(errors) > 100 * TOLERANCE, errors


@torch.no_grad()
def test_a_stream_batch_ends_with_its_input(monkeypatch):
    """An input of 25 frames (block 0 and 5 chunks) for a 37-frame call: the rows drain once it ends, and the 6
    chunks made are upstream's first 6 (a row never sees a later chunk, and each draw keeps its index)."""
    golden = load_golden(RECIPE, "stream_batch")
    draws = _inject_stream_batch(_golden_draws(golden), monkeypatch, chunks=5)
    video = _exact_pixels(golden, monkeypatch)
    short = golden.tensor("video")[:, :, :25]

    def next_chunk(self, num_frames):
        frames = short[:, :, self.frames_read : self.frames_read + num_frames]
        self.frames_read += frames.shape[2]
        return frames if frames.shape[2] else None

    monkeypatch.setattr(VideoInput, "next_chunk", next_chunk)
    stream = _pipeline(golden).stream(
        num_frames=NUM_FRAMES, prompt_embeds=golden.text["a"], video=video, strength=0.7, output_type="latent",
        recipe=RECIPE, denoising="stream_batch",
    )  # fmt: skip
    made = [chunk.float() for chunk in stream]
    errors = [float((ours - theirs).abs().max()) for ours, theirs in zip(made, golden.clean[:6], strict=True)]
    assert draws.exhausted and max(errors) <= TOLERANCE, errors


def _synthetic_draws(golden: Golden, seed: int = 5) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in golden.settings["draw_shapes"]]


@torch.no_grad()
def test_text_to_video_stream_batch_matches_the_reference_loop(monkeypatch):
    """Text-to-video (no input: each chunk enters as pure noise, with the recipe's 1000/750/500/250): the pipeline's
    stream batch against `_upstream_stream_batch` fed the same draws, every chunk within 1e-4."""
    golden = load_golden(RECIPE, "stream_batch")
    pipe = _pipeline(golden)
    draws = _synthetic_draws(golden)
    tape = _inject_stream_batch(draws, monkeypatch)
    stream = pipe.stream(
        num_frames=NUM_FRAMES, prompt_embeds=golden.text["a"], output_type="latent", recipe=RECIPE,
        denoising="stream_batch",
    )  # fmt: skip
    made = [chunk.float() for chunk in stream]
    plan = stream.request.step_plan
    assert plan.timesteps == (1000.0, 750.0, 500.0, 250.0)
    draw = _as_draw(draws)
    expected = _upstream_stream_batch(golden, [(draw(4 * chunk), plan) for chunk in range(BATCH_CHUNKS + 1)], draw)
    errors = [float((ours - theirs).abs().max()) for ours, theirs in zip(made, expected, strict=True)]
    print(f"\n{RECIPE} text-to-video stream batch against the reference loop: max {max(errors):.1e}")
    assert tape.exhausted and len(made) == 9
    assert max(errors) <= TOLERANCE, errors


def _seeded_stream(pipe, golden: Golden, **extra):
    return pipe.stream(
        num_frames=NUM_FRAMES, prompt_embeds=golden.text["a"], output_type="latent", recipe=RECIPE,
        denoising="stream_batch", generator=torch.Generator().manual_seed(3), **extra,
    )  # fmt: skip


@pytest.mark.parametrize("saved_after", [1, 3, 7])
@torch.no_grad()
def test_a_stream_batch_resumes_exactly(saved_after, monkeypatch, tmp_path):
    """State saved after block 0 (before any batch), after chunk 2 (the batch full) and after chunk 6 (draining:
    the input is over, rows are leaving), written to a resume file and loaded into a fresh stream gives the
    uninterrupted stream's chunks bit for bit: the S caches, their policies, the rows in flight and the input's
    position are state."""
    from rolldiff.pipelines.io.resume import RunState, load_state, save_state

    golden = load_golden(RECIPE, "stream_batch")
    pipe = _pipeline(golden)
    video = _exact_pixels(golden, monkeypatch)
    whole = [chunk.clone() for chunk in _seeded_stream(pipe, golden, video=video, strength=0.7)]
    first = _seeded_stream(pipe, golden, video=video, strength=0.7)
    for _ in range(saved_after):
        next(first)
    save_state(tmp_path / "state.safetensors", RunState({}, 0, first.state_dict()))
    state = load_state(tmp_path / "state.safetensors").stream
    assert ("stream_batch.forwards" in state) == (saved_after > 1)
    resumed = _seeded_stream(pipe, golden, video=video, strength=0.7)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == 9 - saved_after
    for made, expected in zip(rest, whole[saved_after:], strict=True):
        torch.testing.assert_close(made, expected, atol=0, rtol=0)


@torch.no_grad()
def test_a_stream_batch_holds_one_cache_per_step_allocated_once():
    """Memory is flat: after block 0 one cache, from the first batched chunk on S = 4 copies of it, the same bytes
    at every chunk; `__call__` gives the stream's chunks."""
    golden = load_golden(RECIPE, "stream_batch")
    pipe = _pipeline(golden)
    stream = _seeded_stream(pipe, golden)
    chunks, sizes = [], []
    for chunk in stream:
        chunks.append(chunk)
        sizes.append(stream.memory_bytes())
    assert len(chunks) == 9 and sizes[1] == 4 * sizes[0] and set(sizes[1:]) == {sizes[1]}, sizes
    called = pipe(
        num_frames=NUM_FRAMES, prompt_embeds=golden.text["a"], output_type="latent", recipe=RECIPE,
        denoising="stream_batch", generator=torch.Generator().manual_seed(3),
    ).frames  # fmt: skip
    torch.testing.assert_close(called, torch.cat(chunks, dim=2), atol=0, rtol=0)


@torch.no_grad()
def test_a_stream_batch_callback_sees_the_rows_that_go_on():
    """`callback_on_step_end` runs after each of block 0's 4 steps, then after every batched forward that leaves
    rows going on (all but the last), with those rows along the frame axis; what it returns is what goes on."""
    golden = load_golden(RECIPE, "stream_batch")
    pipe = _pipeline(golden)
    plain = list(_seeded_stream(pipe, golden))
    seen = []

    def callback(pipe, step, timestep, tensors):
        seen.append(tensors["latents"].shape[2])
        return {"latents": tensors["latents"] * 1.0}

    called = list(_seeded_stream(pipe, golden, callback_on_step_end=callback))
    assert seen == [2] * 4 + [3] * 8 + [2, 1], seen  # block 0; the full batch 3 rows go on; then the rows drain
    for made, expected in zip(called, plain, strict=True):
        torch.testing.assert_close(made, expected, atol=0, rtol=0)

    def zero(pipe, step, timestep, tensors):
        return {"latents": torch.zeros_like(tensors["latents"])} if step >= 4 else None

    assert not torch.equal(list(_seeded_stream(pipe, golden, callback_on_step_end=zero))[1], plain[1])


def test_a_stream_batch_refuses_a_prompt_switch():
    golden = load_golden(RECIPE, "plain")
    stream = _seeded_stream(_pipeline(golden), golden)
    with pytest.raises(ValueError, match=r"`denoising='stream_batch'`.*denoising='sequential'"):
        stream.switch_prompt(prompt_embeds=golden.text["a"])


# ----------------------------------------------------------------------------------------- what the goldens hold
def test_golden_weights_load_through_our_converter():
    model = load_transformer(RECIPE)  # strict: every upstream key has a home, none is left over
    assert model.config.num_layers == load_meta(RECIPE)["upstream_model_config"]["num_layers"]


@pytest.mark.parametrize("scenario", ["v2v", "stream_batch"])
@torch.no_grad()
def test_our_streaming_encoder_gives_the_latents_upstream_encoded(scenario):
    """Block 0 is 1 + 4 pixel frames (2 latent frames), every later block 4 (1 latent frame), each encoded with the
    feature cache of the blocks before, as the authors' `WanVAE_.stream_encode` (vae.py:546-583) does."""
    golden = load_golden(RECIPE, scenario)
    encoder = StreamingWanEncoder(load_vae(RECIPE).double(), normalize=False)
    video = golden.tensor("video").double()
    encoded = sorted((k for k in golden._tensors if k.startswith("encoded.")), key=lambda k: int(k.split(".")[1]))
    assert len(encoded) == 9  # the 37 input frames: 5, then 8 x 4
    start, errors = 0, []
    for index, name in enumerate(encoded):
        frames = 5 if index == 0 else 4
        ours = encoder.encode(video[:, :, start : start + frames])
        start += frames
        expected = golden.tensor(name).double()
        assert ours.shape == expected.shape, (index, ours.shape, expected.shape)
        errors.append(float((ours - expected).abs().max()))
    print(f"\n{scenario}: encoder max |ours - upstream| {max(errors):.1e} over {len(errors)} blocks")
    assert max(errors) <= TOLERANCE, errors


def test_the_v2v_golden_refreshes_the_adaptive_sink():
    """The scenario the adaptive sink needs: some block rewrites a sink frame. Upstream queues a refresh by putting a
    sink frame's end index in front of its eviction queue (causal_model.py:284-299) and consumes it with the chunk's
    last step once the cache is full (`:302-322`): a sink entry leaving the queue's front is a refresh."""
    meta = load_meta(RECIPE)
    tokens, sink = meta["tokens_per_frame"], meta["settings"]["config"]["num_sink_tokens"]
    kv_frames = meta["settings"]["config"]["num_kv_cache"]
    queues = meta["scenarios"]["v2v"]["evict_queues"]  # per chunk after block 0: per transformer block
    refreshes = []
    for index in range(1, len(queues)):  # queues[i]: after chunk i + 1, whose one frame is frame i + 2
        full = index + 2 >= kv_frames  # block 0 holds frames 0 and 1
        for layer, (before, after) in enumerate(zip(queues[index - 1], queues[index])):
            if full and before and before[0] <= sink * tokens and before[0] not in after[: len(after) - 2]:
                refreshes.append((index + 1, layer, before[0] // tokens - 1))
    print(f"\nv2v sink refreshes (chunk, transformer block, sink frame): {refreshes}")
    assert refreshes, queues
    assert meta["scenarios"]["v2v"]["queues_match_fp64"]  # the refresh decisions are not rounding noise


@pytest.mark.parametrize("scenario", ["plain", "v2v", "stream_batch"])
def test_goldens_hold_every_draw_and_a_small_floor(scenario):
    golden = load_golden(RECIPE, scenario)
    draws = [k for k in golden._tensors if k.startswith("draw.")]
    assert len(draws) == len(golden.settings["draw_shapes"])
    assert len(golden.clean) == 9  # block 0 (two latent frames), then 8 blocks of one
    assert golden.floor < 1e-5


# ----------------------------------------------------------------------------------------- the request
def test_the_recipe_sets_upstreams_loop(monkeypatch):
    golden = load_golden(RECIPE, "v2v")
    pipe = _pipeline(golden)
    video = _exact_pixels(golden, monkeypatch)
    request = pipe.stream(num_frames=NUM_FRAMES, prompt_embeds=golden.text["a"], video=video, recipe=RECIPE).request
    assert request.geometry.first_chunk_frames == 2 and request.geometry.chunk_frames == 1
    assert request.num_chunks == 9 and request.layout.context_frames == 6  # num_kv_cache: 6
    assert request.options.adaptive_sink and request.options.adaptive_sink_threshold == 0.2
    assert request.context_policy == "last_step" and request.video_noise_mix == "motion"
    assert not request.normalize_input_latents
    assert request.conditioning.strength == 0.8  # upstream's --noise_scale default
    plan = request.step_plan_for(1)  # the video list, whole: the strength is the mix, not a cut
    assert plan.timesteps == (700.0, 500.0, 400.0, 200.0)
    assert list(plan.sigmas) == pytest.approx(golden.settings["sigmas"], abs=1e-7)
    assert request.writes_per_chunk == 4  # upstream's per-block `total_steps`
    text = pipe.stream(num_frames=NUM_FRAMES, prompt_embeds=golden.text["a"], recipe=RECIPE).request
    assert text.step_plan.timesteps == (1000.0, 750.0, 500.0, 250.0) and text.conditioning is None
    assert "adaptive_sink = True" in describe_recipe(RECIPE)


def test_a_pipeline_folder_may_name_the_recipe_and_an_argument_still_wins():
    golden = load_golden(RECIPE, "plain")
    pipe = _pipeline(golden)
    pipe.register_to_config(recipe=RECIPE)  # what `"recipe": "streamdiffusionv2"` in model_index.json does
    call = dict(num_frames=NUM_FRAMES, prompt_embeds=golden.text["a"], output_type="latent")
    assert pipe.stream(**call).request.options.adaptive_sink
    assert pipe.stream(**call, adaptive_sink_threshold=0.5).request.options.adaptive_sink_threshold == 0.5


BAD_CALLS = {
    "chunks of 3": (dict(chunk_frames=3, window_frames=5), r"chunk_frames=1"),
    "past the RoPE table": (dict(num_frames=1 + 4 * 1024), r"1025 latent frames exceed .* `adaptive_sink=True`"),
    "quantized": (dict(kv_quantization="int8"), r"no kv_quantization"),
    "relative": (dict(position_mode="relative"), r"position_mode='absolute'"),
    "threshold": (dict(adaptive_sink_threshold=1.5), r"`adaptive_sink_threshold` must be a number in \[-1, 1\]"),
    "threshold kind": (dict(adaptive_sink_threshold="high"), r"`adaptive_sink_threshold`"),
    "flag": (dict(adaptive_sink="yes"), r"`adaptive_sink` must be True or False"),
    "pipelined with the motion mix": (
        dict(denoising="pipelined", video=np.zeros((NUM_FRAMES, 32, 48, 3))),
        r"`video_noise_mix='motion'`",
    ),
    "extra frame alone": (dict(adaptive_sink=False), r"needs the adaptive sink"),
    "policy": (dict(context_policy="clean"), r"`context_policy` must be one of .*'last_step'"),
    "mix without video": (dict(video_noise_mix="motion", recipe=None), r"`video_noise_mix` applies to `video="),
    "steps without video": (dict(video_denoising_steps=[700, 500], recipe=None), r"`video_denoising_steps` applies"),
    "normalize without input": (dict(normalize_input_latents=False, recipe=None), r"`normalize_input_latents`"),
    "normalize an image": (
        dict(normalize_input_latents=False, image=np.zeros((32, 48, 3)), num_frames=33),
        r"`normalize_input_latents` applies to an input video .*a start image is frame 0",
    ),
    "stream batch, context pass": (
        dict(denoising="stream_batch", context_policy="rolling"),
        r"`denoising='stream_batch'`.*context_policy='last_step'.*\"context_policy='rolling'\"",
    ),
    "stream batch, guidance": (dict(denoising="stream_batch", guidance_scale=3.0), r"got \['guidance_scale=3.0'\]"),
    "stream batch, schedule": (
        dict(denoising="stream_batch", prompt_schedule=[(17, "a cat")]),
        r"`denoising='stream_batch'`.*one prompt.*`prompt_schedule`.*denoising='sequential'",
    ),
    "stream batch, no sink": (
        dict(denoising="stream_batch", recipe=None, context_policy="last_step", num_frames=33),
        r"`denoising='stream_batch'`.*adaptive_sink=True.*got \['adaptive_sink=False'\]",
    ),
    "stream batch, image": (
        dict(denoising="stream_batch", image=np.zeros((32, 48, 3))),
        r"`denoising='stream_batch'` .* got \['a start image'\]",
    ),
    "stream batch, misspelt": (dict(denoising="batch"), r"`denoising` must be one of .*'stream_batch'"),
}


@pytest.mark.parametrize("case", BAD_CALLS, ids=BAD_CALLS)
def test_bad_streamdiffusionv2_options_are_refused_naming_the_argument(case):
    golden = load_golden(RECIPE, "plain")
    pipe = _pipeline(golden)
    extra, match = BAD_CALLS[case]
    call = dict(num_frames=NUM_FRAMES, prompt_embeds=golden.text["a"], output_type="latent", recipe=RECIPE) | extra
    with pytest.raises((TypeError, ValueError), match=match):
        pipe.stream(**call)


@torch.no_grad()
def test_image_to_video_matches_upstreams_pieces(monkeypatch):
    """`image=` under the recipe: the image's latent frame committed by one t=0 pass into the fresh adaptive sink,
    then 8 one-frame chunks from noise in 4 steps. Upstream has no image input: the golden is its own VAE encode,
    model, adaptive-sink cache and `inference_wo_batch` put together so (tools/record_streamdiffusionv2_goldens.py
    `run_i2v_scenario`). Every chunk within 1e-4 (the image's encoding too), the eviction queues upstream's after
    every chunk (the image's one-frame write is decided too, against the unwritten sink, as upstream's rule does)."""
    golden = load_golden(RECIPE, "i2v")
    pipe = _pipeline(golden)
    draws = _inject(golden, monkeypatch)
    image = golden.tensor("image").numpy()
    stream = pipe.stream(
        num_frames=1 + 4 * 8, prompt_embeds=golden.text["a"], image=image, output_type="latent", recipe=RECIPE
    )
    assert stream.request.geometry.first_chunk_frames == 1
    chunks, queues = [], []
    for chunk in stream:
        chunks.append(chunk.float())
        if len(chunks) > 1:
            queues.append([list(layer.queue) for layer in stream.caches[0]])
    errors = _errors(golden, chunks)
    print(f"\n{RECIPE}/i2v: max |ours - upstream| {max(errors):.1e} (image {errors[0]:.1e}), floor {golden.floor:.1e}")
    assert draws.exhausted
    assert max(errors) <= TOLERANCE, errors
    assert queues == golden.settings["evict_queues"]
    _inject(golden, monkeypatch)  # the control: another picture, the same noise, and the video after it differs
    other = pipe.stream(
        num_frames=1 + 4 * 8, prompt_embeds=golden.text["a"], image=image[::-1].copy(), output_type="latent",
        recipe=RECIPE,
    )  # fmt: skip
    assert min(_errors(golden, [chunk.float() for chunk in other])[1:]) > 100 * TOLERANCE


# ----------------------------------------------------------------------------------------- resume, normalisation
@torch.no_grad()
def test_a_streamdiffusionv2_stream_resumes_exactly(monkeypatch):
    """State saved after chunk 6 (the adaptive sink's queues, counters and refreshes, the noise mix's scale and last
    pixel frame) and loaded into a fresh stream gives the uninterrupted stream's chunks."""
    golden = load_golden(RECIPE, "v2v")
    pipe = _pipeline(golden)
    video = _exact_pixels(golden, monkeypatch)

    def stream():
        return pipe.stream(
            num_frames=NUM_FRAMES, prompt_embeds=golden.text["a"], video=video, strength=0.7, output_type="latent",
            recipe=RECIPE, generator=torch.Generator().manual_seed(3),
        )  # fmt: skip

    whole = [chunk.clone() for chunk in stream()]
    first = stream()
    for _ in range(6):
        next(first)
    state = first.state_dict()
    assert sum(layer.refreshes for layer in first.caches[0]) > 0  # the saved state holds refreshed sinks
    resumed = stream()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == 3
    for made, expected in zip(rest, whole[6:]):
        torch.testing.assert_close(made, expected, atol=0, rtol=0)


@pytest.mark.parametrize("saved_after", [1, 5])  # right after the image's chunk; after the buffer filled
@torch.no_grad()
def test_an_image_to_video_stream_resumes_exactly(saved_after):
    """An image-to-video stream saved after chunk `saved_after` and loaded into a fresh one (another seed: the state
    carries the generator) gives the uninterrupted stream's chunks, bit for bit."""
    golden = load_golden(RECIPE, "i2v")
    pipe = _pipeline(golden)
    image = golden.tensor("image").numpy()

    def stream(seed: int = 3):
        return pipe.stream(
            num_frames=1 + 4 * 8, prompt_embeds=golden.text["a"], image=image, output_type="latent", recipe=RECIPE,
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip

    whole = [chunk.clone() for chunk in stream()]
    first = stream()
    for _ in range(saved_after):
        next(first)
    resumed = stream(seed=99)
    resumed.load_state_dict(first.state_dict())
    for made, expected in zip(list(resumed), whole[saved_after:], strict=True):
        torch.testing.assert_close(made, expected, atol=0, rtol=0)


@torch.no_grad()
def test_normalize_input_latents_false_gives_the_vae_latents_as_encoded():
    """On a VAE with non-trivial statistics: `normalize=False` returns what `normalize=True` returns before
    `(x - mean) / std` (StreamDiffusionV2's `stream_encode(..., is_scale=False)`)."""
    from tiny_components import tiny_vae

    vae = tiny_vae()
    z_dim = vae.config.z_dim
    vae.register_to_config(
        latents_mean=[0.1 * i for i in range(z_dim)], latents_std=[1.0 + 0.1 * i for i in range(z_dim)]
    )
    frames = torch.rand(1, 3, 5, 32, 32) * 2 - 1
    normalised = StreamingWanEncoder(vae).encode(frames)
    raw = StreamingWanEncoder(vae, normalize=False).encode(frames)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    torch.testing.assert_close(normalised, (raw - mean) / std, atol=1e-6, rtol=1e-6)
    assert (raw - normalised).abs().max() > 0.1
