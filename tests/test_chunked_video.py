"""The shared chunk loop (`ChunkedVideoPipeline`): diffusers' conventions and constant memory.

Callbacks see each step's result before the next step's input is formed and their latents are
used; `interrupt` stops a run; `prompt_embeds` stand in for a prompt; noise is drawn chunk by chunk, so
starting a stream of any length costs the same memory; one pipeline serves concurrent streams.
"""

import inspect

import pytest
import torch
from concurrency import assert_same_as_alone, run_together
from tiny_components import tiny_pipeline

from rolldiff.pipelines import stream as stream_module
from rolldiff.pipelines.families.chunked_video import CacheAllocationError

PROMPT = "a red circle moving left"
SIZE = dict(height=16, width=16)


@pytest.fixture(scope="module")
def pipe():
    pipeline = tiny_pipeline()
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def _seed(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _latents(pipe, **kwargs) -> torch.Tensor:
    return pipe(PROMPT, output_type="latent", generator=_seed(), **SIZE, **kwargs).frames


def test_latents_returned_by_the_callback_become_the_next_step_input(pipe):
    replacement = torch.full((1, 4, 2, 4, 4), 0.25)
    seen_inputs = []
    hook = pipe.transformer.register_forward_pre_hook(lambda module, args: seen_inputs.append(args[0].clone()))

    def callback(pipeline, step, timestep, tensors):
        return {"latents": replacement} if step == 0 else {}

    try:
        _latents(pipe, num_frames=2, denoising_steps=[1000, 500], callback_on_step_end=callback)
    finally:
        hook.remove()
    # forward calls: step 0, step 1, context pass; step 1 ran on exactly what the callback returned
    assert torch.equal(seen_inputs[1], replacement)


def test_latents_returned_at_the_last_step_are_the_chunk(pipe):
    replacement = torch.full((1, 4, 2, 4, 4), -0.5)

    def callback(pipeline, step, timestep, tensors):
        return {"latents": replacement} if step == 1 else None

    latents = _latents(pipe, num_frames=4, denoising_steps=[1000, 500], callback_on_step_end=callback)
    assert torch.equal(latents[:, :, :2], replacement)  # chunk 0 is what the callback said
    assert not torch.equal(latents[:, :, 2:], replacement)


def test_interrupt_stops_the_run_before_the_next_step(pipe):
    def callback(pipeline, step, timestep, tensors):
        if step == 4:  # chunk 1, step 0 of 4
            pipeline.interrupt = True
        return {}

    chunks = list(pipe.stream(PROMPT, num_frames=8, generator=_seed(), callback_on_step_end=callback, **SIZE))
    assert len(chunks) == 1  # chunk 0 finished; chunk 1 stopped at its next step
    assert len(list(pipe.stream(PROMPT, num_frames=4, generator=_seed(), **SIZE))) == 2  # a new run starts clean


def test_prompt_embeds_give_the_same_video_as_the_prompt(pipe):
    embeds = pipe.encode_prompt([PROMPT], pipe.config.max_sequence_length)
    from_embeds = pipe(prompt_embeds=embeds, num_frames=4, output_type="latent", generator=_seed(), **SIZE).frames
    torch.testing.assert_close(from_embeds, _latents(pipe, num_frames=4), atol=0, rtol=0)
    negative = pipe.encode_prompt(["a cat"], pipe.config.max_sequence_length)
    guided = pipe(
        PROMPT, num_frames=4, guidance_scale=3.0, negative_prompt_embeds=negative, output_type="latent",
        generator=_seed(), **SIZE,
    ).frames  # fmt: skip
    torch.testing.assert_close(guided, _latents(pipe, num_frames=4, guidance_scale=3.0, negative_prompt="a cat"))
    with pytest.raises(ValueError, match="prompt_embeds"):
        pipe(PROMPT, prompt_embeds=embeds, num_frames=4, **SIZE)


def test_a_chunk_depends_only_on_the_seed_and_its_index(pipe):
    short = _latents(pipe, num_frames=4)
    long = _latents(pipe, num_frames=8)
    torch.testing.assert_close(long[:, :, :4], short, atol=0, rtol=0)  # noise drawn when each chunk starts


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_starting_a_very_long_stream_allocates_nothing_the_size_of_the_video(pipe, monkeypatch):
    requested = []
    original = stream_module.randn_tensor

    def recording_randn(shape, *args, **kwargs):
        requested.append(int(torch.Size(shape).numel()))
        return original(shape, *args, **kwargs)

    monkeypatch.setattr(stream_module, "randn_tensor", recording_randn)
    num_frames = 4_000_000  # 4 M latent frames: 1 GB of float32 noise if drawn up front
    before = _rss_bytes()
    stream = pipe.stream(PROMPT, num_frames=num_frames, position_mode="relative", generator=_seed(), **SIZE)
    first = next(stream)
    second = next(stream)
    grown = _rss_bytes() - before
    stream.close()
    assert first.shape == second.shape == (1, 2, 16, 16, 3)
    assert max(requested) == 1 * 4 * 2 * 4 * 4  # one chunk of noise at a time
    assert grown < 64 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB starting a {num_frames}-frame stream"


def test_one_pipeline_serves_concurrent_streams_as_alone(pipe):
    alone = {seed: pipe(PROMPT, num_frames=6, output_type="latent", generator=_seed(seed), **SIZE).frames
             for seed in range(3)}  # fmt: skip

    def run(seed: int) -> torch.Tensor:
        chunks = pipe.stream(PROMPT, num_frames=6, output_type="latent", generator=_seed(seed), **SIZE)
        return torch.cat(list(chunks), dim=2)

    together = run_together(run, [(seed,) for seed in range(3)])
    for seed in range(3):
        assert_same_as_alone(together[seed], alone[seed])


def test_prompt_checks_and_encodings_on_other_threads_never_change_an_embeddings_length(pipe):
    """A fast tokenizer's padding/truncation are shared settings; unlocked, an encoding could come back unpadded
    while another thread checked a prompt, and that stream generated another video."""
    import sys
    import threading
    import time

    from rolldiff.pipelines.request.text_encoding import check_prompts, encode_prompts

    done = threading.Event()

    def check_until_done() -> None:
        while not done.is_set():
            check_prompts(pipe.tokenizer, [PROMPT], 16)
            time.sleep(0)  # lets a waiting encoder take the lock (unfair: it could wait minutes)

    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads switch often: unlocked, this test failed 5 runs of 5
    checker = threading.Thread(target=check_until_done)
    checker.start()
    try:
        lengths = {encode_prompts(pipe.tokenizer, pipe.text_encoder, [PROMPT], 16).shape[1] for _ in range(400)}
    finally:
        done.set()
        checker.join()
        sys.setswitchinterval(switch_interval)
    assert lengths == {16}


def test_unknown_arguments_are_refused_before_work(pipe):
    with pytest.raises(TypeError, match="window_chunks"):
        pipe.stream(PROMPT, num_frames=4, window_chunks=3, **SIZE)


def test_the_call_signature_is_explicit(pipe):
    """IDEs and `inspect.signature` see every argument (no `**kwargs`), and `stream` takes the same ones."""
    call = inspect.signature(pipe.__call__).parameters
    stream = inspect.signature(pipe.stream).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in [*call.values(), *stream.values()])
    assert set(call) - {"return_dict"} == set(stream)
    assert set(pipe.cache_options) <= set(stream)
    assert "window_frames" in (pipe.__call__.__doc__ or "") and "window_frames" in (pipe.stream.__doc__ or "")


def test_quantized_and_offloaded_caches_are_pipeline_options(pipe):
    plain = _latents(pipe, num_frames=8)
    offloaded = _latents(pipe, num_frames=8, kv_offload=True)
    torch.testing.assert_close(offloaded, plain, atol=0, rtol=0)  # offload moves bytes, never changes them
    quantized = _latents(pipe, num_frames=8, kv_quantization="int8")
    assert (quantized - plain).abs().max() < 0.05  # int8 K/V: small, bounded error (docs/cache.md)
    with pytest.raises(ValueError, match="kv_quantization"):
        pipe.stream(PROMPT, num_frames=4, kv_quantization="int4", **SIZE)


def test_a_window_longer_than_the_video_allocates_only_what_the_video_fills(pipe):
    """`window_frames=100000` for an 8-frame video: the cache holds the video (plus one chunk at most), and the
    frames are those of the window that exactly fits (a window past the video evicts nothing either way)."""
    huge = pipe.stream(PROMPT, num_frames=8, window_frames=100_000, generator=_seed(), output_type="latent", **SIZE)
    fitting = pipe.stream(PROMPT, num_frames=8, window_frames=6, generator=_seed(), output_type="latent", **SIZE)
    latents = torch.cat(list(huge), dim=2)
    torch.testing.assert_close(latents, torch.cat(list(fitting), dim=2), atol=1e-6, rtol=0)
    layout = huge.request.layout
    assert layout.context_frames <= huge.request.num_latent_frames + layout.chunk_frames + 1
    assert huge.memory_bytes() == fitting.memory_bytes()


def test_a_cache_that_does_not_fit_is_a_clear_error_naming_the_window(pipe, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 921600000 bytes.")

    monkeypatch.setattr(pipe.transformer, "make_cache", out_of_memory)
    stream = pipe.stream(PROMPT, num_frames=8, generator=_seed(), **SIZE)
    with pytest.raises(CacheAllocationError, match="`window_frames`=.*kv_quantization"):
        next(stream)


def test_the_recompute_policy_keeps_the_text_keys_and_values_across_rebuilds(pipe):
    """Each chunk's context rebuild empties the self-attention layers only: the text K/V are computed once."""
    recompute = dict(context_policy="recompute", sink_frames=0, window_frames=4)
    stream = pipe.stream(PROMPT, num_frames=8, generator=_seed(), **recompute, **SIZE)
    list(stream)
    assert stream.caches[0].cross[0].num_computations == 1
    with pytest.raises(ValueError, match="`context_policy='recompute'` rebuilds 4 context frames"):
        pipe.stream(PROMPT, num_frames=8, context_policy="recompute", **SIZE)  # sink 2 + window 4 - chunk 2


def test_overlap_decode_with_a_reencoded_first_frame_decodes_serially_with_the_same_frames(pipe):
    """Chunk k + 1's rebuilt context is re-encoded from chunk k's pixels: `overlap_decode` cannot run ahead there,
    so the stream decodes serially and its frames are those without overlap."""
    reencode = dict(context_policy="recompute", recompute_first_frame="reencode", sink_frames=0, window_frames=4)
    serial = pipe(PROMPT, num_frames=pipe.latent_to_frames(8), generator=_seed(), **reencode, **SIZE).frames
    overlapped = pipe(
        PROMPT, num_frames=pipe.latent_to_frames(8), generator=_seed(), overlap_decode=True, **reencode, **SIZE
    ).frames
    assert overlapped.shape == serial.shape
    assert (overlapped == serial).all()


@pytest.mark.parametrize(("name", "value"), [("prompt_blend_chunks", 0), ("integer_timesteps", 1)])
def test_a_falsy_loop_option_is_checked_not_replaced_by_its_default(pipe, name, value):
    with pytest.raises(ValueError, match=f"`{name}`"):
        pipe.stream(PROMPT, num_frames=8, **{name: value}, **SIZE)


@pytest.mark.parametrize("denoising", ["sequential", "pipelined"])
def test_a_stream_finds_where_its_models_run_once_not_every_chunk(pipe, monkeypatch, denoising):
    """diffusers resolves a pipeline's device by walking every module for offload hooks (about 3 ms a call on the
    embedded model); a stream resolves it when it makes its caches, which binds it there, and never per chunk."""
    reads, vae_dtype_reads = [], []
    resolve = type(pipe).execution_device.fget
    monkeypatch.setattr(type(pipe), "execution_device", property(lambda self: reads.append(1) or resolve(self)))
    vae_dtype = type(pipe.vae).dtype.fget  # the same module walk, once per chunk in the decoder before
    monkeypatch.setattr(type(pipe.vae), "dtype", property(lambda self: vae_dtype_reads.append(1) or vae_dtype(self)))
    num_frames = pipe.num_frames_for(8, 1, **SIZE)  # whole chunks (pipelined denoising needs them)
    stream = pipe.stream(PROMPT, num_frames, generator=_seed(), denoising=denoising, window_frames="all", **SIZE)
    next(stream)
    after_first, vae_after_first = len(reads), len(vae_dtype_reads)
    frames = [next(stream) for _ in range(stream.num_chunks - 1)]
    assert len(frames) >= 3 and frames[-1] is not None
    assert len(reads) == after_first <= 3, reads
    assert len(vae_dtype_reads) == vae_after_first, vae_dtype_reads
