"""Gradio demo: type a prompt, watch the video appear chunk by chunk, switch the prompt while it runs.

One pipeline (read-only weights) serves every browser session; each generation owns its KV cache, its VAE
feature cache and its random generator, so sessions never see each other's frames. The transformer keeps
per-call state on the module, so model work is done one chunk at a time under a lock: concurrent sessions
take turns chunk by chunk instead of waiting for whole videos.

Live prompt switching drives the pipeline's own chunk loop (`_generate_latents`) with a `LivePrompt` in place
of its fixed `PromptSchedule`: the loop asks the schedule for the active prompt at every chunk boundary, and on a
change it re-encodes the text and re-caches the recent window (LongLive's re-cache), exactly as a
`prompt_schedule` switch at that frame would.

Importing this module starts nothing; `build_demo(...)` returns the `gr.Blocks`, `launch()` serves it.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import imageio_ffmpeg
import numpy as np
import torch

from .defaults import frames_for_seconds, load_pipeline, native_size
from .pipelines import KreaRealtimeVideoPipeline, StreamingVideoWriter, StreamingWanDecoder, denormalize_wan_latents

EXAMPLE_PROMPTS = ["a red circle moving left", "a blue square moving up", "a green triangle moving right"]


class LivePrompt:
    """The prompt of one running generation, read at every chunk boundary; duck-types `PromptSchedule`.

    `switch` may be called from any thread; the switch lands at the next chunk that starts. `applied` lists
    `(frame, prompt)` for every prompt the video actually used: the `prompt_schedule` that reproduces it.
    """

    batch_size = 1

    def __init__(self, prompt: str) -> None:
        self._lock = threading.Lock()
        self._prompts = [prompt]
        self._active = 0
        self.applied: list[tuple[int, str]] = [(0, prompt)]

    def switch(self, prompt: str) -> None:
        with self._lock:
            self._prompts.append(prompt)

    def active_index(self, frame: int) -> int:
        """Called by the chunk loop with the pixel frame each chunk starts at: the latest prompt wins."""
        with self._lock:
            latest = len(self._prompts) - 1
            if latest != self._active:
                self._active = latest
                self.applied.append((frame, self._prompts[latest]))
            return latest

    def prompts(self, index: int) -> list[str]:
        with self._lock:
            return [self._prompts[index]]


@dataclass
class DemoSession:
    """What one browser session owns: the prompt of its running generation, if any."""

    live: LivePrompt | None = None


def generate_frames(
    pipe: KreaRealtimeVideoPipeline,
    live: LivePrompt,
    num_frames: int,
    height: int,
    width: int,
    seed: int,
    model_lock: threading.Lock,
) -> Iterator[np.ndarray]:
    """Each chunk's frames `(frames, height, width, 3)` uint8, following `live`'s prompt as it changes.

    Checks every argument now (raising the pipeline's ValueError) and returns the generator of chunks;
    `model_lock` is held while a chunk is made, so sessions sharing `pipe` take turns chunk by chunk.
    """
    run = pipe._prepare_run(
        prompt=live.prompts(0), prompt_schedule=None, negative_prompt=None, num_frames=num_frames, height=height,
        width=width, denoising_steps=None, guidance_scale=1.0, output_type="np", latents=None, chunk_frames=None,
        sink_frames=None, window_frames=None, position_mode=None, attention_bias=None, max_sequence_length=None,
    )  # fmt: skip
    run = dataclasses.replace(run, schedule=live)
    generator = torch.Generator("cpu").manual_seed(seed)
    return _chunks(pipe, run, generator, model_lock)


def _chunks(pipe: KreaRealtimeVideoPipeline, run, generator: torch.Generator, model_lock: threading.Lock):
    decoder = StreamingWanDecoder(pipe.vae)  # this video's own causal feature cache
    latents = pipe._generate_latents(run, generator, None, None, [])  # this video's own KV cache
    while True:
        with model_lock, torch.no_grad():
            clean = next(latents, None)  # (1, channels, chunk_frames, h, w)
            if clean is None:
                return
            video = decoder.decode(denormalize_wan_latents(clean.to(pipe.vae.dtype), pipe.vae))
            frames = pipe._postprocess(video, "np")[0]  # (frames, height, width, 3) in [0, 1]
        yield (frames * 255.0).round().clip(0, 255).astype(np.uint8)


def concat_mp4(segments: list[Path], out: Path) -> Path:
    """Join mp4 segments of the same size and codec into `out` without re-encoding."""
    listing = out.with_suffix(".txt")
    listing.write_text("".join(f"file '{segment.resolve()}'\n" for segment in segments))
    command = [imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-v", "error", "-f", "concat", "-safe", "0"]
    subprocess.run([*command, "-i", str(listing), "-c", "copy", str(out)], check=True, capture_output=True)
    return out


def streaming_available() -> bool:
    """Gradio's streaming video output needs ffmpeg and ffprobe on the PATH."""
    return bool(shutil.which("ffmpeg") and shutil.which("ffprobe"))


def build_demo(
    model_path: str | Path | None = None,
    pipeline: KreaRealtimeVideoPipeline | None = None,
    max_concurrency: int = 2,
    *,
    device: str | None = None,
    dtype: str | None = None,
    height: int | None = None,
    width: int | None = None,
    fps: int = 16,
    max_seconds: int = 60,
    streaming: bool | None = None,
):
    """The demo's `gr.Blocks`, queued with `max_concurrency` generations at once; call `launch()` to serve it.

    Args:
        model_path: a pipeline folder or Hub id; `None` is the embedded default. Ignored if `pipeline` is given.
        pipeline: an already loaded pipeline to serve (its weights are shared, read-only, by every session).
        height, width: pixels; default: the model's native size.
        streaming: stream mp4 segments into a `gr.Video(streaming=True)`; default: when ffmpeg and ffprobe are on
            the PATH. Otherwise the whole video so far is sent again after every chunk.
    """
    import gradio as gr

    pipe = pipeline if pipeline is not None else load_pipeline(model_path, device=device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    native_height, native_width = native_size(pipe)
    height, width = height or native_height, width or native_width
    streaming = streaming_available() if streaming is None else streaming
    model_lock = threading.Lock()

    def generate(prompt: str, seconds: float, seed: float, session: DemoSession):
        prompt = (prompt or "").strip()
        if not prompt:
            raise gr.Error("Type a prompt first.")
        live = LivePrompt(prompt)
        try:
            num_frames = frames_for_seconds(pipe, float(seconds), fps)
            chunks = generate_frames(pipe, live, num_frames, height, width, int(seed or 0), model_lock)
        except ValueError as exc:
            raise gr.Error(str(exc)) from exc
        session.live = live
        workdir = Path(tempfile.mkdtemp(prefix="rolldiff-demo-"))
        segments: list[Path] = []
        written, start = 0, time.perf_counter()
        try:
            for index, frames in enumerate(chunks):
                segment = workdir / f"segment-{index:05d}.mp4"
                with StreamingVideoWriter(segment, fps=fps) as writer:
                    writer.write(frames)
                segments.append(segment)
                written += len(frames)
                video = segment if streaming else concat_mp4(segments, workdir / f"video-{index:05d}.mp4")
                details = {
                    "frames": f"{written} / {num_frames}",
                    "size": f"{height}x{width} at {fps} fps",
                    "frames_per_second": round(written / (time.perf_counter() - start), 2),
                    "prompt_schedule": [[frame, text] for frame, text in live.applied],
                }
                yield video, details
                if not streaming:  # Gradio copied it into its cache before asking for the next chunk
                    video.unlink()
        finally:
            if session.live is live:
                session.live = None
            shutil.rmtree(workdir, ignore_errors=True)

    def switch_prompt(prompt: str, session: DemoSession) -> str:
        prompt = (prompt or "").strip()
        if not prompt:
            return "Type the prompt to switch to."
        if session.live is None:
            return "Nothing is generating: press Generate first."
        session.live.switch(prompt)
        return f"Switching to “{prompt}” at the next chunk."

    with gr.Blocks(title="rolldiff") as demo:
        gr.Markdown(
            "# rolldiff\nLong videos chunk by chunk with a rolling KV cache. "
            "Change the prompt while it runs: the switch lands at the next chunk."
        )
        session = gr.State(DemoSession())
        with gr.Row():
            with gr.Column():
                prompt = gr.Textbox(label="Prompt", value=EXAMPLE_PROMPTS[0], elem_id="prompt")
                seconds = gr.Slider(1, max_seconds, value=5, step=1, label="Length (seconds)")
                seed = gr.Number(value=0, precision=0, label="Seed")
                with gr.Row():
                    generate_button = gr.Button("Generate", variant="primary", elem_id="generate")
                    stop_button = gr.Button("Stop", elem_id="stop")
                new_prompt = gr.Textbox(label="Switch prompt to", value=EXAMPLE_PROMPTS[1], elem_id="new-prompt")
                switch_button = gr.Button("Switch prompt", elem_id="switch")
                switch_status = gr.Markdown()
            with gr.Column():
                video = gr.Video(label="Video", streaming=streaming, autoplay=True, elem_id="video")
                details = gr.JSON(label="Run")
        run = generate_button.click(generate, [prompt, seconds, seed, session], [video, details], api_name="generate")
        stop_button.click(None, cancels=[run])
        # Unlimited concurrency: a switch must never wait behind the generations it is meant to steer.
        switch = dict(fn=switch_prompt, inputs=[new_prompt, session], outputs=switch_status, concurrency_limit=None)
        switch_button.click(**switch, api_name="switch_prompt")
        new_prompt.submit(**switch, api_visibility="private")
        demo.queue(default_concurrency_limit=max_concurrency)
    return demo
