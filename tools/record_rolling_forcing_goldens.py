"""Record the `rolling-forcing` goldens (Causal Forcing's long-video Rolling Forcing loop), on CPU with tiny weights.

Usage:
    python tools/record_rolling_forcing_goldens.py --upstream /work/upstream/causal-forcing \\
        --out tests/goldens/rolling-forcing/

Upstream: github.com/thu-ml/Causal-Forcing at 1fc7bbc19a503c1bce80ecef08158b20e702f386, its `long_video/` tree
(Rolling Forcing, TencentARC/RollingForcing, on Causal Forcing's weights). What runs is the authors'
`CausalInferencePipeline.inference_rolling_forcing` (`long_video/pipeline/rolling_forcing_inference.py`, as
`long_video/inference.py:169-174` calls it) with `configs/rolling_forcing_dmd.yaml` over `default_config.yaml`:
`num_frame_per_block: 3`, steps 1000, 750, 500, 250 warped (`warp_denoising_step: true`, `:27-29`), shift 5
(`model_kwargs.timestep_shift`), `context_noise: 0`, `independent_first_frame: false`; the model keeps
`CausalWanModel`'s defaults (its Rolling Forcing attention, `wan/modules/causal_model.py:180-300`, ignores
`local_attn_size` / `sink_size`). The loop, as the recording exercises it:
- windows (`:169-180`): S = 4 blocks in flight (one per step), one forward for all of them (`:235-242`), each
  block at its own timestep (`:189-231`); the oldest leaves clean, the others are re-noised to their next step, one
  `randn_like` of the whole window per block that goes on, oldest first (`:248-270`); then ONE clean pass of the
  window's first block at `context_noise` (`:273-295`), the only block written to the cache (`causal_model.py:
  205-235`; the window forward wrote it noisy first, the clean pass overwrites it);
- the window forward (`causal_model.py:264-300`) attends to the anchor (block 0's clean K/V, kept before RoPE and
  rotated to sit right before the working cache), the latest `21 - query_frames - 3` committed frames (6 with 4
  blocks in flight, 9 / 12 / 15 as the window empties at the end of the video) and the window itself, in both
  directions;
- the clean pass (`:247-262`) attends to the last 21 frames of the buffer ending with its block
  (`max_attention_size` = 21 frames): 18 committed frames and itself, the anchor only while the video is 21 frames
  or shorter; the buffer holds 24 frames (`rolling_forcing_inference.py:348`) and rolls past them (`:212-226`).
Scenarios (each block's clean latents, fp32, and the fp32-vs-fp64 floor):
- `plain`: 14 blocks (42 latent frames): the buffer rolls from block 8 on, the anchor leaves the clean pass's view
  from block 7 on, the last 3 windows empty;
- `short`: 5 blocks (15 latent frames): every view holds the whole past (our layout is fitted to the video).
`meta.json` also records, per window, how many key frames each self-attention call attended to (window forward,
clean pass; read from the calls), the spec of both views. `noise.<block>.<step>` is block `block`'s slice of the
draw its re-noise to step `step` used (`step` 0: its slice of the video's noise); `noise_order` lists them in the
order a pipelined loop consumes them (the entering block's noise, then the re-noises, oldest first).

No prompt switch: the tree has no code that changes the prompt within a video (`long_video/inference.py`,
`pipeline/rolling_forcing_inference.py` and `app.py` encode one prompt per video), so none is recorded. No
image-to-video either: `inference_rolling_forcing` reads `current_start_frame` before assigning it when
`initial_latent` is given (`:141`, `:151`), so `--i2v` cannot run; and no video shorter than 4 blocks, where its
filling windows draw fresh noise for a block already in flight (`:215-219`).

Stubs needed to run it on a CPU-only torch (nothing else is changed): those of `tools/record_causal_forcing_goldens.py`
(CUDA stubs, `COMMON_STUBS` for imports the inference path never calls, attention routed to SDPA at the input dtype,
`num_transformer_blocks` / `frame_seq_length` set from the tiny model, recorded noise for `torch.randn_like`, stored
text embeddings, a zero VAE decoder), the packages `pipeline`, `wan`, `wan.modules` registered by path (their
`__init__` imports training code), and line patches for the sizes hard-coded for Wan-1.3B: the K/V buffers'
`12, 128` (`_initialize_kv_cache` / `_initialize_crossattn_cache`), the buffer of `1560 * 24` tokens
(`rolling_forcing_inference.py:348`) and `self.frame_length = 1560` (`causal_model.py:75`, from which the 21-frame
`max_attention_size` and the 3-frame `block_length` follow) as the tiny model's 6 tokens per frame.
"""

from __future__ import annotations

import contextlib
import io
import json
import types
from pathlib import Path

import torch
import torch.nn.attention.flex_attention  # noqa: F401 (`route_attention` names it; this tree never imports it)
from _wan_upstream import (
    COMMON_STUBS,
    DIFFUSERS_CONFIG,
    LATENT_SIZE,
    NOISE_SEED,
    TINY_MODEL,
    TOKENS_PER_FRAME,
    NoiseTape,
    UpstreamTree,
    causal_pipeline,
    cpu_cuda_stubs,
    kv_buffer_patches,
    max_abs,
    proxied_torch,
    recorder_main,
    route_attention,
    switch_before,
    table_sigmas,
    text_embeddings,
    tiny_weights,
    tiny_wrapper,
    to_diffusers_layout,
)
from safetensors.torch import save_file

UPSTREAM = {
    "repo": "thu-ml/Causal-Forcing",
    "commit": "1fc7bbc19a503c1bce80ecef08158b20e702f386",
    "tree": "long_video",
}
MODEL_KWARGS = {"local_attn_size": -1, "sink_size": 0}
CHUNK_FRAMES = 3  # num_frame_per_block
STEPS = [1000, 750, 500, 250]
PROMPTS = {"a": 5, "b": 4}  # "a" is drawn first: adding "b" left "a" as it was
SCENARIOS = {"plain": 14, "short": 5, "prompt_switch": 14}  # name -> blocks
# name -> the block before which the prompt becomes "b" (the tree has none: `SwitchingGenerator` performs it as
# rolldiff's `switch_prompt` does, the anchor kept; block 4 while all committed frames are still in the buffer)
SWITCHES = {"prompt_switch": 4}


def size_patches() -> dict:
    """The Wan-1.3B sizes hard-coded in the tree, as the tiny model's (each must match exactly once)."""
    return {
        "pipeline.rolling_forcing_inference": [
            *kv_buffer_patches(),
            ("kv_cache_size = 1560 * 24", f"kv_cache_size = {TOKENS_PER_FRAME} * 24"),
        ],
        "wan.modules.causal_model": [("self.frame_length = 1560", f"self.frame_length = {TOKENS_PER_FRAME}")],
    }


def load_upstream(root: Path) -> types.SimpleNamespace:
    """`long_video/` imported on a CPU: its causal model (attention routed to SDPA), wrapper and loop."""
    cpu_cuda_stubs()
    tree = UpstreamTree(
        root / "long_video",
        patches=size_patches(),
        bare_packages=["pipeline", "wan", "wan.modules"],
        stubs=COMMON_STUBS,
    )
    causal_model = tree.module("wan.modules.causal_model")
    route_attention(causal_model, tree.module("wan.modules.model"))
    return types.SimpleNamespace(
        causal_model=causal_model,
        wan_wrapper=tree.module("utils.wan_wrapper"),
        rolling=tree.module("pipeline.rolling_forcing_inference"),
    )


@contextlib.contextmanager
def key_frames_log(causal_model: types.ModuleType):
    """Count the key frames of every self-attention call (`attention(q, k, v)`), per forward (block 0's)."""
    routed, log = causal_model.attention, []

    def attention(q, k, v, *args, **kwargs):
        log.append(k.shape[1] // TOKENS_PER_FRAME)
        return routed(q, k, v, *args, **kwargs)

    causal_model.attention = attention
    try:
        yield log
    finally:
        causal_model.attention = routed


def run_scenario(up, weights, embeds, num_blocks: int, tape: NoiseTape, dtype: torch.dtype, switch=None) -> dict:
    generator = tiny_wrapper(up.wan_wrapper, up.causal_model, weights, dtype, timestep_shift=5.0, **MODEL_KWARGS)
    args = types.SimpleNamespace(
        denoising_step_list=STEPS, warp_denoising_step=True, num_frame_per_block=CHUNK_FRAMES,
        independent_first_frame=False, context_noise=0,
    )  # fmt: skip
    pipeline = causal_pipeline(up.rolling.CausalInferencePipeline, args, generator, embeds, dtype)
    if switch is not None:  # the anchor (block 0) is the sink
        switch_before(pipeline, embeds, dtype, switch, CHUNK_FRAMES, sink_blocks=1)
    noise = tape.randn(1, num_blocks * CHUNK_FRAMES, TINY_MODEL["in_dim"], *LATENT_SIZE).to(dtype)  # inference.py:164
    with (
        proxied_torch([up.rolling], tape, dtype),
        contextlib.redirect_stdout(io.StringIO()),
        key_frames_log(up.causal_model) as log,
    ):
        _, latents = pipeline.inference_rolling_forcing(noise, text_prompts=["a"], return_latents=True)
    layers = TINY_MODEL["num_layers"]
    per_forward = log[::layers]  # every block of a forward attends to the same keys
    timesteps = [float(t) for t in pipeline.denoising_step_list]
    return {
        "clean": [to_diffusers_layout(block) for block in latents.split(CHUNK_FRAMES, dim=1)],
        "timesteps": timesteps,
        "sigmas": table_sigmas(pipeline.scheduler, timesteps),
        "key_frames": [per_forward[i : i + 2] for i in range(0, len(per_forward), 2)],  # [window, clean pass]
    }


def pipelined_noise(tape: NoiseTape, num_blocks: int) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Name the tape: draw 0 is the video's noise, then one whole-window draw per block that goes on, window by
    window, oldest block first (`rolling_forcing_inference.py:249-270`); block b's slice of it is its re-noise.
    Returns `noise.<block>.<step>` (diffusers' layout) and the order a pipelined loop consumes them in."""
    initial, *renoise = tape.draws
    steps, chunk = len(STEPS), CHUNK_FRAMES
    tensors, order, used = {}, [], 0
    for window in range(num_blocks + steps - 1):
        start, end = max(0, window - steps + 1), min(num_blocks - 1, window)
        if window < num_blocks:  # the entering block: its slice of the video's noise
            order.append(f"noise.{window}.0")
            tensors[order[-1]] = to_diffusers_layout(initial[:, chunk * window : chunk * (window + 1)])
        for block in range(start, end + 1):
            step = window - block
            if step == steps - 1:  # it leaves clean: no draw (`:257-258`)
                continue
            offset = chunk * (block - start)
            order.append(f"noise.{block}.{step + 1}")
            tensors[order[-1]] = to_diffusers_layout(renoise[used][None, offset : offset + chunk])
            used += 1
    if used != len(renoise):
        raise RuntimeError(f"Named {used} re-noise draws, upstream made {len(renoise)}.")
    return tensors, order


def record(upstream: Path, out: Path) -> None:
    torch.manual_seed(0)
    up = load_upstream(upstream)
    weights = tiny_weights(up.causal_model, **MODEL_KWARGS)
    embeds = text_embeddings(PROMPTS)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "transformer.safetensors")
    scenarios = {}
    for name, num_blocks in SCENARIOS.items():
        tape, switch = NoiseTape(NOISE_SEED), SWITCHES.get(name)
        fp32 = run_scenario(up, weights, embeds, num_blocks, tape, torch.float32, switch)
        replay = NoiseTape(NOISE_SEED, replay=tape.draws)
        fp64 = run_scenario(up, weights, embeds, num_blocks, replay, torch.float64, switch)
        floor = max_abs(fp32["clean"], fp64["clean"])
        noise, order = pipelined_noise(tape, num_blocks)
        texts = {"text.a": embeds["a"]} | ({} if switch is None else {"text.b": embeds["b"]})
        tensors = texts | noise | {f"clean.{i}": c for i, c in enumerate(fp32["clean"])}
        save_file({k: v.contiguous() for k, v in tensors.items()}, out / f"golden.{name}.safetensors")
        print(f"{name}: {num_blocks} blocks, floor (fp32 vs fp64) {floor:.3e}")
        scenarios[name] = {
            "num_chunks": num_blocks, "chunk_frames": CHUNK_FRAMES, "latent_frames": num_blocks * CHUNK_FRAMES,
            "prompt": "a", "raw_steps": STEPS, "timesteps": fp32["timesteps"], "sigmas": fp32["sigmas"],
            "noise_order": order, "floor": floor, "key_frames": fp32["key_frames"],
        }  # fmt: skip
        if switch is not None:  # the re-cache's calls join the log: the key frames are the plain run's
            del scenarios[name]["key_frames"]
            scenarios[name]["switch"] = {"before_block": switch, "to": "b", "recache": "causal", "anchor": "kept"}
    meta = {
        "upstream": UPSTREAM,
        "recipe": "rolling-forcing",
        "upstream_model_config": TINY_MODEL | MODEL_KWARGS,
        "diffusers_config": DIFFUSERS_CONFIG,
        "latent_size": list(LATENT_SIZE),
        "tokens_per_frame": TOKENS_PER_FRAME,
        "settings": {
            "chunk_frames": CHUNK_FRAMES,
            "blocks_in_flight": len(STEPS),
            "anchor_frames": 3,
            "max_attention_frames": 21,
            "buffer_frames": 24,
            "window_forward": "anchor (re-roped before the working cache) + the latest 21 - query - 3 committed "
            "frames + the window, bidirectional",
            "clean_pass": "the last 21 frames ending with the block (the anchor only while inside them)",
            "positions": "upstream: absolute, keys RoPE'd when written, the anchor re-roped; ours: relative",
            "timestep_shift": 5.0,
            "context_noise": 0,
            "key_frames": "per window: [window forward, clean pass] key frames attended to (block 0's calls)",
            "text_len": TINY_MODEL["text_len"],
            "text_tokens": PROMPTS,
            "dtype": "float32 (upstream bf16, cast away)",
        },
        "scenarios": scenarios,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    recorder_main(__doc__, record, "thu-ml/Causal-Forcing", "tests/goldens/rolling-forcing/")
