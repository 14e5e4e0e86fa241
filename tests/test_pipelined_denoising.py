"""`denoising="pipelined"`: every step's chunk in flight, one forward for all (Rolling Forcing's rolling window).

The spec is a plain reference: the same model with NO cache, over the whole sequence [every committed clean
frame at t = 0; the in-flight chunks at their own timesteps] under the attention mask the pipelined cache
promises (a committed chunk sees what its context pass saw; the in-flight chunks see the sink, the latest
`window - steps x chunk` committed frames and each other), driven by a reference loop that draws the same noise
in the same order. Every chunk the pipeline makes must equal the reference's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from tiny_components import tiny_pipeline
from torch._dynamo.testing import CompileCounter

from rolldiff.caching.rolling_sink import source_frame
from rolldiff.models import ChunkLayout
from rolldiff.pipelines.acceleration import compile_cached_step

PROMPT = "a red circle moving left"
STEPS = (1000, 750, 500)
CHUNK, SINK, WINDOW = 1, 1, 5  # 3 chunks in flight + 2 committed frames visible after the sink
NUM_CHUNKS = 7
SIZE = dict(height=16, width=16)  # 4 x 4 latents


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline(chunk_frames=CHUNK, sink_frames=SINK, window_frames=WINDOW, denoising_steps=list(STEPS))


def _frames(pipe, chunks: int = NUM_CHUNKS) -> int:
    return pipe.latent_to_frames(chunks * CHUNK)


def _seed(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _run(pipe, chunks: int = NUM_CHUNKS, **kwargs) -> list[torch.Tensor]:
    arguments = dict(generator=_seed(), output_type="latent", denoising="pipelined", **SIZE) | kwargs
    return list(pipe.stream(PROMPT, _frames(pipe, chunks), **arguments))


def _visible(frame: int, committed: int) -> bool:
    """Whether committed `frame` is seen by a write after `committed` frames: the sink, then the latest `window -
    steps x chunk` frames (the window counts the in-flight chunks)."""
    recent = WINDOW - len(STEPS) * CHUNK
    return frame < min(SINK, committed) or max(SINK, committed - recent) <= frame < committed


def _mask(committed: int, in_flight: int) -> torch.Tensor:
    """`(frames, frames)` True = attend, over [committed frames; in-flight frames]: each committed chunk as its
    context pass saw the cache, the in-flight frames what a write after all committed frames sees, and each other."""
    total = committed + in_flight
    mask = torch.zeros(total, total, dtype=torch.bool)
    for start in [*range(0, committed, CHUNK), committed]:
        rows = slice(start, start + CHUNK if start < committed else total)
        mask[rows, [frame for frame in range(start) if _visible(frame, start)]] = True
        mask[rows, rows] = True
    return mask


@torch.no_grad()
def _dense_loop(pipe, prefix_and_mask) -> list[torch.Tensor]:
    """The pipelined loop spelled out over a cache-free dense model: each forward runs over [a prefix; the in-flight
    chunks at their own timesteps] under a mask, with the prefix, its timesteps, every frame's position and the mask
    from `prefix_and_mask(made, in_flight)` (`in_flight`: `(latents, timestep, chunk index)` per chunk); the oldest
    chunk leaves clean, the others are re-noised."""
    model, generator = pipe.transformer, _seed()
    text = pipe.encode_prompt([PROMPT], pipe.config.max_sequence_length)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    scheduler.set_timesteps(sigmas=[s / 1000 for s in STEPS])
    sigmas, timesteps = scheduler.sigmas, scheduler.timesteps.float()
    shape = (1, 4, CHUNK, 4, 4)
    in_flight, made, entering = [], [], 0
    while len(made) < NUM_CHUNKS:
        if entering < NUM_CHUNKS:
            in_flight.append([torch.randn(shape, generator=generator), 0, entering])
            entering += 1
        window = torch.cat([latents for latents, _, _ in in_flight], dim=2)
        prefix, prefix_timesteps, positions, mask = prefix_and_mask(
            made, [(latents, timesteps[step], index) for latents, step, index in in_flight]
        )
        held = prefix.shape[2]
        step_of_frame = [timesteps[step] for _, step, _ in in_flight for _ in range(CHUNK)]
        velocity = model(
            torch.cat([prefix, window], dim=2), torch.tensor([[*prefix_timesteps, *step_of_frame]]), text,
            layout=pipe_layout(pipe), frame_indices=torch.tensor(positions), frame_mask=mask,
        ).sample[:, :, held:]  # fmt: skip
        going_on = []
        for position, (latents, step, index) in enumerate(in_flight):
            x0 = latents - sigmas[step] * velocity[:, :, position * CHUNK : (position + 1) * CHUNK]
            if step + 1 == len(STEPS):
                made.append(x0)
                continue
            noise = torch.randn(x0.shape, generator=generator)
            going_on.append([(1 - sigmas[step + 1]) * x0 + sigmas[step + 1] * noise, step + 1, index])
        in_flight = going_on
    return made


def _no_frames() -> torch.Tensor:
    return torch.zeros(1, 4, 0, 4, 4)


def _clean_prefix(prefix: torch.Tensor, mask: torch.Tensor):
    """A prefix of clean frames at t = 0, every frame (the window's after it) at its place in the sequence."""
    return prefix, [0.0] * prefix.shape[2], list(range(mask.shape[0])), mask


def _reference(pipe) -> list[torch.Tensor]:
    """Rolling Forcing's loop: the prefix is every committed clean chunk, each seeing what its context pass saw."""

    def prefix_and_mask(made, in_flight):
        committed = torch.cat(made, dim=2) if made else _no_frames()
        return _clean_prefix(committed, _mask(committed.shape[2], len(in_flight) * CHUNK))

    return _dense_loop(pipe, prefix_and_mask)


def _recompute_reference(pipe, window: int) -> list[torch.Tensor]:
    """The same loop under `context_policy="recompute"` (Krea's): before every forward after the first chunk left,
    the context is rebuilt from clean frames alone ([chunk 0's first frame, the latest clean frames], at most
    `window - steps x chunk`, at t = 0, bidirectional among themselves); the in-flight chunks see it all and each
    other."""
    context_frames = window - len(STEPS) * CHUNK

    def prefix_and_mask(made, in_flight):
        context = _no_frames()
        if made:
            first, recent = made[0][:, :, :1], torch.cat(made, dim=2)[:, :, -(context_frames - 1) :]
            context = torch.cat([first, recent], dim=2)[:, :, :context_frames]
        held, frames = context.shape[2], len(in_flight) * CHUNK
        mask = torch.ones(held + frames, held + frames, dtype=torch.bool)
        mask[:held, held:] = False  # the rebuilt context sees only itself
        return _clean_prefix(context, mask)

    return _dense_loop(pipe, prefix_and_mask)


def _last_step_reference(pipe) -> list[torch.Tensor]:
    """The same loop under `context_policy="last_step"` (no context pass): chunk j's context is what the forward it
    left in wrote, so the prefix unrolls those forwards. It holds, for every committed chunk j, the whole window of
    that forward (its chunks at their timesteps then, at their own positions); those rows see each other and the
    committed chunks before j as that forward saw them, and only their first chunk (chunk j) is seen by later rows.
    The current window sees the committed chunks the same way."""
    left_in: list[tuple] = []  # per committed chunk: (latents, timesteps, positions) of the forward it left in
    last_forward: list[tuple] = []

    def prefix_and_mask(made, in_flight):
        if len(made) > len(left_in):
            left_in.append(last_forward[0])
        window = (
            torch.cat([latents for latents, _, _ in in_flight], dim=2),
            [float(t) for _, t, _ in in_flight for _ in range(CHUNK)],
            [index * CHUNK + k for _, _, index in in_flight for k in range(CHUNK)],
        )
        last_forward[:] = [window]
        groups = [*left_in, window]
        owner = [g for g, (latents, _, _) in enumerate(groups) for _ in range(latents.shape[2])]
        positions = [p for _, _, frames in groups for p in frames]
        committed_key = [
            g < len(left_in) and k < CHUNK for g, (lat, _, _) in enumerate(groups) for k in range(lat.shape[2])
        ]
        total = len(owner)
        mask = torch.zeros(total, total, dtype=torch.bool)
        for row in range(total):
            end = owner[row] * CHUNK  # frames committed when the row's forward ran
            for col in range(total):
                same = owner[col] == owner[row]
                mask[row, col] = same or (committed_key[col] and _visible(positions[col], end))
        prefix = torch.cat([latents for latents, _, _ in left_in], dim=2) if left_in else _no_frames()
        return prefix, [t for _, times, _ in left_in for t in times], positions, mask

    return _dense_loop(pipe, prefix_and_mask)


def _rolling_sink_reference(pipe) -> list[torch.Tensor]:
    """The same loop under Rolling Sink (`sink_mode="rolling"`, no fixed sink): a write after `e` committed frames
    sees the latest `R = window - steps x chunk` of them, where a frame past the source (the first `R` frames) and
    older than the last committed chunk holds source frame `m(p)` (walked forward and back) at its own position p.
    A cache-free model holds that as a copy of source frames `0..m(p)` (clean, each seeing the frames before it, as
    when committed) shifted by `p - m(p)`: relative positions make its last frame's keys the source's, seen at p."""
    source = WINDOW - len(STEPS) * CHUNK

    def providers(committed: int) -> list[tuple[str, int]]:
        seen = range(max(0, committed - source), committed)
        return [("real", q) if q < source or q >= committed - CHUNK else ("copy", q) for q in seen]

    def prefix_and_mask(made, in_flight):
        frames, positions, groups, provides = [], [], [], {}
        for j, latents in enumerate(made):  # each committed chunk as its context pass wrote it
            for k in range(CHUNK):
                provides[("real", j * CHUNK + k)] = len(frames)
                frames.append(latents[:, :, k : k + 1]), positions.append(j * CHUNK + k), groups.append(("chunk", j))
        committed_frames = torch.cat(made, dim=2) if made else _no_frames()
        ends = [j * CHUNK for j in range(len(made))] + [len(made) * CHUNK]
        rolled = sorted({q for end in ends for kind, q in providers(end) if kind == "copy"})
        for q in rolled:
            m = source_frame(q, source)
            for k in range(m + 1):
                frames.append(committed_frames[:, :, k : k + 1]), positions.append(k + q - m)
                groups.append(("copy", q, k))
            provides[("copy", q)] = len(frames) - 1
        held = len(frames)
        for _, _, index in in_flight:
            for k in range(CHUNK):
                positions.append(index * CHUNK + k), groups.append(("window",))
        mask = torch.zeros(len(groups), len(groups), dtype=torch.bool)
        for row, group in enumerate(groups):
            if group[0] == "copy":  # a source frame sees the source frames before it
                cols = [c for c, other in enumerate(groups) if other[:2] == group[:2] and other[2] <= group[2]]
            else:
                committed = group[1] * CHUNK if group[0] == "chunk" else len(made) * CHUNK
                cols = [provides[provider] for provider in providers(committed)]
                cols += [c for c, other in enumerate(groups) if other == group]
            mask[row, cols] = True
        prefix = torch.cat(frames, dim=2) if frames else _no_frames()
        return prefix, [0.0] * held, positions, mask

    return _dense_loop(pipe, prefix_and_mask)


ROLLING_SINK = dict(sink_frames=0, position_mode="relative", sink_mode="rolling")


def test_pipelined_rolling_sink_equals_its_dense_reference(pipe):
    """Rolling Sink with every step's chunk in flight: the source is the committed part of the window (2 frames
    here: 5 less the 3 in flight; `window_frames=30` keeps the recipe's 18 at its 4 steps of 3 frames), walked
    back and forth over frames 2..5 (source frames 1, 0, 0, 1)."""
    ours = _run(pipe, **ROLLING_SINK)
    errors = [float((a - b).abs().max()) for a, b in zip(ours, _rolling_sink_reference(pipe), strict=True)]
    assert max(errors) < 1e-5, errors
    fixed = _run(pipe, **(ROLLING_SINK | dict(sink_mode="fixed")))  # the control: the same window, no roll
    for a, b in zip(ours[:4], fixed[:4]):  # nothing rolled is seen before frame 3 is committed
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert min(float((a - b).abs().max()) for a, b in zip(ours[4:], fixed[4:])) > 1e-3


def test_pipelined_under_the_recompute_policy_equals_its_dense_reference(pipe):
    """Krea's context policy with every step's chunk in flight: the context rebuilt before each chunk (3 frames:
    the first frame and the latest 2) is what the in-flight window attends to, from 7 chunks on."""
    window = len(STEPS) * CHUNK + 3
    ours = _run(pipe, context_policy="recompute", recompute_first_frame="keep", sink_frames=0, window_frames=window)
    reference = _recompute_reference(pipe, window)
    errors = [float((a - b).abs().max()) for a, b in zip(ours, reference, strict=True)]
    assert max(errors) < 1e-5, errors
    rolling = _run(pipe, sink_frames=0, window_frames=window)  # the control: the same window, a context pass per chunk
    assert max(float((a - b).abs().max()) for a, b in zip(ours[2:], rolling[2:])) > 1e-3


def pipe_layout(pipe):
    return ChunkLayout(pipe.transformer.tokens_per_frame(4, 4), chunk_frames=CHUNK, sink_frames=0, window_frames=99)


def test_pipelined_chunks_equal_the_dense_reference(pipe):
    ours, reference = _run(pipe), _reference(pipe)
    assert len(ours) == NUM_CHUNKS
    errors = [float((a - b).abs().max()) for a, b in zip(ours, reference)]
    assert max(errors) < 1e-5, errors


def test_pipelined_under_the_last_step_policy_equals_its_dense_reference(pipe):
    """StreamDiffusionV2's policy (no context pass) with every step's chunk in flight: the leaving chunk's K/V from
    the forward it left in are committed, the other in-flight chunks' writes of that forward dropped."""
    ours = _run(pipe, context_policy="last_step")
    errors = [float((a - b).abs().max()) for a, b in zip(ours, _last_step_reference(pipe), strict=True)]
    assert max(errors) < 1e-5, errors
    rolling = _run(pipe)  # the control: a clean context pass per chunk
    assert max(float((a - b).abs().max()) for a, b in zip(ours[1:], rolling[1:])) > 1e-3


def test_pipelined_differs_from_sequential_but_keeps_the_shapes(pipe):
    pipelined = torch.cat(_run(pipe), dim=2)
    sequential = torch.cat(_run(pipe, denoising="sequential"), dim=2)
    assert pipelined.shape == sequential.shape
    assert not torch.allclose(pipelined, sequential)


def test_call_stream_and_file_give_the_same_frames(pipe, tmp_path):
    streamed = np.concatenate(
        list(pipe.stream(PROMPT, _frames(pipe), generator=_seed(), denoising="pipelined", **SIZE)), 1
    )
    called = pipe(PROMPT, _frames(pipe), generator=_seed(), denoising="pipelined", **SIZE).frames
    np.testing.assert_array_equal(streamed, called)


POLICIES = {  # the cache policies pipelined denoising runs under, by name
    "rolling": {},
    "last_step": dict(context_policy="last_step"),
    "rolling_sink": ROLLING_SINK,
    "rolling_sink_last_step": ROLLING_SINK | dict(context_policy="last_step"),
}


@pytest.mark.parametrize("policy", POLICIES)
def test_resume_mid_window_continues_the_same_video(pipe, policy):
    whole = _run(pipe, **POLICIES[policy])
    arguments = dict(output_type="latent", denoising="pipelined", **POLICIES[policy], **SIZE)
    first = pipe.stream(PROMPT, _frames(pipe), generator=_seed(), **arguments)
    head = [next(first) for _ in range(3)]  # chunks 3.. are in flight at different steps now
    state = first.state_dict()
    second = pipe.stream(PROMPT, _frames(pipe), generator=_seed(7), **arguments)
    second.load_state_dict(state)
    for mine, theirs in zip(head + list(second), whole):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_prompt_switch_changes_only_the_chunks_after_it(pipe, policy):
    plain = _run(pipe, **POLICIES[policy])
    arguments = dict(output_type="latent", denoising="pipelined", **POLICIES[policy], **SIZE)
    stream = pipe.stream(PROMPT, _frames(pipe), generator=_seed(), **arguments)
    chunks = [next(stream) for _ in range(3)]
    assert stream.switch_prompt("a blue square moving up") == 3
    chunks += list(stream)
    for before, after in zip(chunks[:3], plain[:3]):
        torch.testing.assert_close(before, after, rtol=0, atol=0)
    assert not torch.allclose(chunks[3], plain[3])


def test_guidance_image_and_video_inputs_run_pipelined(pipe):
    guided = _run(pipe, guidance_scale=3.0, negative_prompt="a green square")
    assert len(guided) == NUM_CHUNKS and all(torch.isfinite(chunk).all() for chunk in guided)
    guided_last_step = _run(pipe, guidance_scale=3.0, negative_prompt="a green square", context_policy="last_step")
    assert len(guided_last_step) == NUM_CHUNKS and not torch.allclose(guided_last_step[-1], guided[-1])
    image = np.random.default_rng(0).integers(0, 256, size=(16, 16, 3), dtype=np.uint8)
    with_image = _run(pipe, image=image)
    assert len(with_image) == NUM_CHUNKS
    video = np.random.default_rng(1).integers(0, 256, size=(_frames(pipe), 16, 16, 3), dtype=np.uint8)
    from_video = _run(pipe, video=video, strength=0.7)  # 2 of 3 steps: 2 chunks in flight
    assert len(from_video) == NUM_CHUNKS
    assert len(_run(pipe, video=video, strength=0.7, context_policy="last_step")) == NUM_CHUNKS
    # StreamDiffusionV2's mix: every input chunk mixed at `strength` runs all 3 steps, so 3 chunks are in flight
    # (sized so before any forward: this once failed mid-video, the window sized for the strength-cut 2)
    mixed = pipe.stream(
        PROMPT, _frames(pipe), generator=_seed(), output_type="latent", denoising="pipelined", video=video,
        strength=0.7, video_noise_mix="strength", **SIZE,
    )  # fmt: skip
    assert mixed.request.in_flight_frames == 3 * CHUNK
    mixed_chunks = list(mixed)
    assert len(mixed_chunks) == NUM_CHUNKS and not torch.allclose(mixed_chunks[0], from_video[0])


@pytest.mark.parametrize("policy", POLICIES)
def test_cache_memory_is_flat_as_the_video_grows(pipe, policy):
    stream = pipe.stream(
        PROMPT, _frames(pipe, 12), generator=_seed(), output_type="latent", denoising="pipelined",
        **POLICIES[policy], **SIZE,
    )  # fmt: skip
    next(stream)
    early = stream.memory_bytes()
    list(stream)
    assert stream.memory_bytes() == early


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        (dict(denoising="rolling"), "`denoising`"),
        (dict(denoising="pipelined", window_frames=3), "window_frames"),
        (dict(denoising="pipelined", first_chunk_steps=[1000, 750, 500, 250]), "first_chunk_steps"),
        (dict(denoising="pipelined", recipe="causal-forcing-2step"), "recipe='causal-forcing-2step' sets it"),
        (
            dict(denoising="pipelined", video=np.zeros((9, 16, 16, 3), np.uint8), video_noise_mix="motion"),
            r"`video_noise_mix='motion'` .* one step list; pass video_noise_mix='strength'",
        ),
        (
            dict(context_policy="recompute", denoising="pipelined", window_frames=10),
            "rebuilds 4 context frames .* at most the 3 latent frames",
        ),
    ],
)
def test_bad_pipelined_arguments_are_refused_by_name(pipe, arguments, named):
    with pytest.raises(ValueError, match=named):
        pipe.stream(PROMPT, _frames(pipe), **SIZE, **arguments)


def test_pipelined_is_refused_where_the_family_does_not_offer_it():
    from test_long_sana_pipeline import tiny_sana_pipeline

    sana = tiny_sana_pipeline()
    with pytest.raises(ValueError, match="Krea-like pipeline, not by LongSanaVideoPipeline"):
        sana.stream(PROMPT, sana.latent_to_frames(4), denoising="pipelined")


@pytest.mark.parametrize("policy", POLICIES)
def test_compiled_fullgraph_keeps_a_bounded_number_of_graphs_as_the_video_grows(pipe, policy):
    eager = _run(pipe, **POLICIES[policy])
    compiled_pipe = tiny_pipeline(
        chunk_frames=CHUNK, sink_frames=SINK, window_frames=WINDOW, denoising_steps=list(STEPS)
    )
    counter = CompileCounter()
    torch.compiler.reset()
    try:
        compile_cached_step(compiled_pipe.transformer, backend=counter)  # fullgraph=True
        compiled = _run(compiled_pipe, **POLICIES[policy])
        graphs = counter.frame_count
        longer = _run(compiled_pipe, chunks=3 * NUM_CHUNKS, **POLICIES[policy])  # the window slid further
    finally:
        torch.compiler.reset()
    assert counter.frame_count == graphs  # no graph added as the video grows
    assert graphs <= 2 * len(STEPS) + 2  # window filling/emptying shapes, the context pass, the full window
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(longer) == 3 * NUM_CHUNKS


def test_a_video_shorter_than_the_window_checks_the_window_asked_for(pipe):
    short = _run(pipe, chunks=2)  # 2 chunks in flight at most; the cache's window is fitted to the video
    assert len(short) == 2
    with pytest.raises(
        ValueError, match=r"`window_frames`=3 must be larger than the 3 latent frames .* Pass window_frames=5"
    ):
        pipe.stream(PROMPT, _frames(pipe), window_frames=3, denoising="pipelined", **SIZE)


@pytest.mark.parametrize("denoising", ["sequential", "pipelined"])
def test_under_last_step_a_start_image_is_committed_by_its_context_pass(pipe, denoising):
    """The image's chunk runs no denoising step, so its one write is a context pass, as under the rolling policy:
    the first denoised chunk, which sees only the image and the chunks in flight with it, is the rolling policy's
    bit for bit; the next one sees the last step's K/V of that chunk instead of its clean pass, and differs."""
    image = np.random.default_rng(0).integers(0, 256, size=(16, 16, 3), dtype=np.uint8)
    last_step = _run(pipe, image=image, denoising=denoising, context_policy="last_step")
    rolling = _run(pipe, image=image, denoising=denoising)
    for a, b in zip(last_step[:2], rolling[:2]):  # the image's chunk and the first denoised one
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert float((last_step[2] - rolling[2]).abs().max()) > 1e-3
