"""The video-family contract, one suite over every family (tests/family_cases.py lists them).

Each test states one promise the shared chunk loop relies on: the transformer implements the Protocol with its
exact signatures, the pipeline provides its hooks, the cached chunk loop equals the dense block-causal reference
at every step, the first chunk equals diffusers' own class, a compiled step is at most two graphs, a stream
round-trips through its state dict (and a resume file), a prompt switch lands at a chunk boundary whether it
comes from the schedule or from `switch_prompt`, concurrent callers get what each gets alone (through `__call__`
and `stream`), and `stream`, `__call__` and `generate_to_file` give the same frames.
"""

from __future__ import annotations

import inspect

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from concurrency import assert_same_as_alone, run_together
from family_cases import BLOCKS, FAMILIES

from rolldiff.models.family import PIPELINE_HOOKS, TRANSFORMER_METHODS, VideoTransformer
from rolldiff.pipelines.families.chunked_video import ChunkedVideoPipeline
from rolldiff.pipelines.io.resume import RunState, load_state, save_state
from rolldiff.pipelines.io.video_writer import StreamingVideoWriter

PROMPT, OTHER = "a red circle moving left", "a blue square moving up"
CHUNKS = 5  # chunks of 2 latent frames; one latent frame per pixel frame with these VAEs
STEPS = 4  # the pipelines' default denoising steps
TOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda case: case.name)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def pipe(family):
    return family.make_pipeline()


def _seed(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _frames(pipe, chunks: int = CHUNKS) -> int:
    return pipe.latent_to_frames(chunks * pipe.config.chunk_frames)


def _run(pipe, prompt=PROMPT, seed=0, **kwargs):
    return pipe(prompt, num_frames=_frames(pipe), generator=_seed(seed), **kwargs).frames


# ----------------------------------------------------------------------------------------- the contract itself
def test_the_transformer_implements_the_protocol_with_its_exact_signatures(pipe):
    assert isinstance(pipe.transformer, VideoTransformer)
    layout = pipe.stream(PROMPT, _frames(pipe)).request.layout
    assert len(pipe.transformer.make_cache(layout)) == BLOCKS  # 3 blocks: one block's error cannot hide
    for name in TRANSFORMER_METHODS:
        expected = list(inspect.signature(getattr(VideoTransformer, name)).parameters.values())
        got = list(inspect.signature(getattr(type(pipe.transformer), name)).parameters.values())
        assert [(p.name, p.kind) for p in got[: len(expected)]] == [(p.name, p.kind) for p in expected], name
        assert all(p.default is not inspect.Parameter.empty for p in got[len(expected) :]), name


def test_the_transformer_methods_are_the_protocols_own_methods():
    assert TRANSFORMER_METHODS == (
        "tokens_per_frame", "make_cache", "prepare_conditioning", "frame_budget", "check_frame_budget",
        "committed_frames",
    )  # fmt: skip
    assert all(callable(getattr(VideoTransformer, name)) for name in TRANSFORMER_METHODS)


def test_the_pipeline_implements_what_the_stream_needs_with_its_exact_signatures(pipe):
    """`StreamPipeline` is every pipeline member `ChunkStream` calls; each family's pipeline has them all, with the
    Protocol's parameters (names and kinds) first."""
    from rolldiff.pipelines.stream import StreamPipeline

    assert isinstance(pipe, StreamPipeline)
    attributes = list(StreamPipeline.__annotations__)  # components: `transformer`, `scheduler`
    members = [name for name in vars(StreamPipeline) if not name.startswith("_")]
    assert len(attributes) + len(members) >= 20
    assert all(getattr(pipe, name) is not None for name in attributes)
    for name in members:
        declared = getattr(StreamPipeline, name)
        if not callable(declared):
            continue
        expected = list(inspect.signature(declared).parameters.values())
        got = list(inspect.signature(getattr(type(pipe), name)).parameters.values())
        assert [p.name for p in got[: len(expected)]] == [p.name for p in expected], name


def test_the_stream_calls_nothing_on_its_pipeline_that_the_protocol_does_not_declare():
    import ast
    from pathlib import Path

    import rolldiff.pipelines.stream as stream_module

    tree = ast.parse(Path(stream_module.__file__).read_text())
    called = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute) is False
        and isinstance(node.value, ast.Name)
        and node.value.id == "pipe"
    } | {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "self"
        and node.value.attr == "_pipe"
    }
    declared = {name for name in dir(stream_module.StreamPipeline) if not name.startswith("_")}
    declared |= set(getattr(stream_module.StreamPipeline, "__annotations__", {}))
    assert called and called <= declared, called - declared


def test_the_pipeline_provides_every_required_hook(pipe):
    for name, required in PIPELINE_HOOKS.items():
        assert callable(getattr(pipe, name)), name
        if required:
            assert getattr(type(pipe), name) is not getattr(ChunkedVideoPipeline, name), f"{name} not implemented"


# ----------------------------------------------------------------------------------------- equivalence
def _record_steps(pipe, monkeypatch) -> list[tuple]:
    calls = []
    original = pipe.transformer_step

    def recording(latents, timestep, embeds, cache, request):
        out = original(latents, timestep, embeds, cache, request)
        calls.append((latents.clone(), timestep.clone(), embeds, out.clone(), request.layout))
        return out

    monkeypatch.setattr(pipe, "transformer_step", recording)
    return calls


@torch.no_grad()
def test_every_cached_step_equals_the_dense_block_causal_reference(pipe, family, monkeypatch):
    calls = _record_steps(pipe, monkeypatch)
    clean = torch.cat(list(pipe.stream(PROMPT, _frames(pipe), generator=_seed(), output_type="latent")), dim=2)
    chunk = pipe.config.chunk_frames
    assert len(calls) == CHUNKS * (STEPS + 1)  # every step, then the context pass, per chunk
    for index, (latents, timestep, text, velocity, layout) in enumerate(calls):
        chunk_index, step = divmod(index, STEPS + 1)
        if step == STEPS:  # the context pass at t = 0 writes the cache; its output is unused
            continue
        before = clean[:, :, : chunk_index * chunk]
        dense = family.dense_velocity(pipe.transformer, before, latents, timestep, text, layout)
        torch.testing.assert_close(velocity, dense, atol=TOL, rtol=0, msg=f"chunk {chunk_index} step {step}")


@torch.no_grad()
def test_the_first_chunk_equals_diffusers_own_class(pipe, family, monkeypatch):
    calls = _record_steps(pipe, monkeypatch)
    next(pipe.stream(PROMPT, _frames(pipe), generator=_seed(), output_type="latent"))
    reference = family.diffusers_class.from_config(pipe.transformer.config).eval()
    reference.load_state_dict(pipe.transformer.state_dict())
    latents, timestep, text, velocity, _ = calls[0]
    expected = family.diffusers_velocity(reference, latents, timestep, text)
    torch.testing.assert_close(velocity, expected, atol=1e-5, rtol=0)


@torch.no_grad()
def test_a_compiled_step_is_at_most_two_graphs_and_changes_nothing(family):
    pipe = family.make_pipeline()
    eager = torch.cat(list(pipe.stream(PROMPT, _frames(pipe, 6), generator=_seed(), output_type="latent")), 2)
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    pipe.transformer.compile(fullgraph=True, backend=counting_backend)
    try:
        compiled = torch.cat(list(pipe.stream(PROMPT, _frames(pipe, 6), generator=_seed(), output_type="latent")), 2)
    finally:
        torch._dynamo.reset()
    assert 1 <= len(graphs) <= 2, f"{len(graphs)} graphs for one window filling and full"
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------- the stream
@torch.no_grad()
def test_a_stream_round_trips_through_its_state_dict_and_a_resume_file(pipe, tmp_path):
    arguments = dict(num_frames=_frames(pipe), prompt_schedule=[(0, PROMPT), (_frames(pipe, 3), OTHER)])
    arguments.update(guidance_scale=2.0, negative_prompt="moving up")
    whole = list(pipe.stream(generator=_seed(), **arguments))
    stream = pipe.stream(generator=_seed(), **arguments)
    first = [next(stream), next(stream)]
    path = tmp_path / "state.safetensors"
    save_state(path, RunState({}, 0, stream.state_dict()))
    resumed = pipe.stream(generator=_seed(123), **arguments)  # the saved generator state replaces this seed
    resumed.load_state_dict(load_state(path).stream)
    assert resumed.next_chunk == 2
    rest = list(resumed)
    assert len(first) + len(rest) == len(whole) == CHUNKS
    for made, expected in zip([*first, *rest], whole):
        np.testing.assert_array_equal(made, expected)


@torch.no_grad()
def test_loading_a_state_runs_no_text_encoder(pipe, monkeypatch):
    """The saved embeddings condition a resumed stream's caches: loading encodes no prompt."""
    arguments = dict(num_frames=_frames(pipe), guidance_scale=2.0, negative_prompt="moving up")
    stream = pipe.stream(PROMPT, generator=_seed(), **arguments)
    next(stream)
    state = stream.state_dict()
    resumed = pipe.stream(PROMPT, generator=_seed(), **arguments)
    monkeypatch.setattr(pipe, "encode_prompt", lambda *a, **k: pytest.fail("a prompt was encoded on load"))
    resumed.load_state_dict(state)
    for made, loaded in zip(stream.embeds, resumed.embeds):
        torch.testing.assert_close(loaded, made, atol=0, rtol=0)
    monkeypatch.undo()
    np.testing.assert_array_equal(next(resumed), next(stream))


@torch.no_grad()
def test_switch_prompt_lands_at_the_next_chunk_boundary_like_the_schedule(pipe):
    switch_frame = pipe.latent_to_pixel_start(2 * pipe.config.chunk_frames)  # chunk 2 starts here
    scheduled = _run(pipe, prompt=None, prompt_schedule=[(0, PROMPT), (switch_frame, OTHER)])
    plain = _run(pipe)
    stream = pipe.stream(PROMPT, _frames(pipe), generator=_seed())
    live = [next(stream), next(stream)]
    stream.switch_prompt(OTHER)
    live = np.concatenate([*live, *stream], axis=1)
    np.testing.assert_array_equal(live, scheduled)
    np.testing.assert_array_equal(live[:, :switch_frame], plain[:, :switch_frame])
    assert np.abs(live[:, switch_frame:] - plain[:, switch_frame:]).max() > 1e-3


def test_switch_prompt_checks_its_text_now(pipe):
    stream = pipe.stream(PROMPT, _frames(pipe), generator=_seed())
    with pytest.raises(ValueError, match="either `prompt` or `prompt_embeds`"):
        stream.switch_prompt()
    with pytest.raises(ValueError, match="prompt"):
        stream.switch_prompt(["a", "b"])  # batch of two for a batch of one


@torch.no_grad()
def test_concurrent_callers_get_what_each_gets_alone_through_call_and_stream(pipe):
    jobs = [(PROMPT, 0), (OTHER, 1)]

    def call(prompt, seed):
        return torch.from_numpy(_run(pipe, prompt=prompt, seed=seed))

    def stream(prompt, seed):
        return torch.from_numpy(np.concatenate(list(pipe.stream(prompt, _frames(pipe), generator=_seed(seed))), 1))

    for entry in (call, stream):
        alone = [entry(*job) for job in jobs]
        for together, expected in zip(run_together(entry, jobs), alone):
            assert_same_as_alone(together, expected)


@torch.no_grad()
def test_stream_call_and_file_give_the_same_frames(pipe, tmp_path, monkeypatch):
    called = _run(pipe)
    streamed = np.concatenate(list(pipe.stream(PROMPT, _frames(pipe), generator=_seed())), axis=1)
    np.testing.assert_array_equal(streamed, called)
    encoded = []
    real_write = StreamingVideoWriter.write
    monkeypatch.setattr(StreamingVideoWriter, "write", lambda self, f: (encoded.append(f.copy()), real_write(self, f)))
    path = tmp_path / "video.mp4"
    written = pipe.generate_to_file(str(path), PROMPT, num_frames=_frames(pipe), generator=_seed())
    expected = (called[0] * 255.0).round().clip(0, 255).astype(np.uint8)
    np.testing.assert_array_equal(np.concatenate(encoded), expected)  # the encoder was given exactly these
    assert written == iio.imread(path, plugin="FFMPEG", index=None).shape[0] == expected.shape[0]


def test_docs_list_exactly_the_hooks_of_the_contract():
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "model_families.md").read_text()
    for name in [*TRANSFORMER_METHODS, *PIPELINE_HOOKS]:
        assert f"`{name}(" in text, f"docs/model_families.md does not list `{name}`"
        assert hasattr(VideoTransformer if name in TRANSFORMER_METHODS else ChunkedVideoPipeline, name), name


@torch.no_grad()
def test_an_overlapped_decode_gives_the_serial_frames_and_resumes(pipe, tmp_path):
    """`overlap_decode=True` (a side stream on CUDA, in place here): the same frames in the same order, and a state
    saved one chunk ahead of the frames handed out (the pending decode travels with it) resumes exactly."""
    serial = list(pipe.stream(PROMPT, _frames(pipe), generator=_seed()))
    overlapped = pipe.stream(PROMPT, _frames(pipe), generator=_seed(), overlap_decode=True)
    first = [next(overlapped), next(overlapped)]
    save_state(tmp_path / "s.safetensors", RunState({}, 0, overlapped.state_dict()))
    rest = list(overlapped)
    for made, expected in zip([*first, *rest], serial, strict=True):
        np.testing.assert_array_equal(made, expected)
    resumed = pipe.stream(PROMPT, _frames(pipe), generator=_seed(), overlap_decode=True)
    resumed.load_state_dict(load_state(tmp_path / "s.safetensors").stream)
    for made, expected in zip(resumed, serial[2:], strict=True):
        np.testing.assert_array_equal(made, expected)


def test_a_switch_after_the_last_chunk_is_refused(pipe):
    stream = pipe.stream(PROMPT, _frames(pipe), generator=_seed(), output_type="latent")
    list(stream)
    with pytest.raises(RuntimeError, match="last chunk"):
        stream.switch_prompt(OTHER)
