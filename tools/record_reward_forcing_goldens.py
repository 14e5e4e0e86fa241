"""Record the `reward-forcing` goldens (its EMA sink, at the released alpha and at one that shows), on CPU with tiny
weights.

Usage:
    python tools/record_reward_forcing_goldens.py --upstream /work/upstream/reward-forcing --out tests/goldens/reward-forcing/

Upstream: github.com/JaydenLyh/Reward-Forcing at 4317f5a (Self-Forcing's tree with Reward Forcing's changes). What runs
is the authors' `CausalInferencePipeline.inference` (`pipeline/causal_inference.py`, as `inference.py` calls it) with
the released settings (`configs/reward_forcing.yaml` over `default_config.yaml`: 3-frame chunks, shift 5, steps 1000,
750, 500, 250 warped, `context_noise: 0`; `model_kwargs`: `local_attn_size: 9`, `sink_size: 3`). What Reward Forcing
changes in the model (`wan/modules/causal_model.py`, `CausalWanSelfAttention`):
- `:88-108,151-192`: its 9-frame buffer (the 3-frame sink + 6) evicts the oldest chunk after the sink at the first
  forward of each new chunk, and the evicted 3 frames are blended into the sink, token by token:
  `sink = alpha * sink + (1 - alpha) * evicted`, keys and values, `alpha = compression_alpha = 0.999` (the
  constructor's default; no config sets it);
- `:29-58,199-236`: keys cached before RoPE and rotated at each read at their place (the sink at 0..2, the window
  after it), the chunk's queries at the last places.
Scenarios (each chunk's clean latents, fp32, and the fp32-vs-fp64 floor), 10 chunks each, 7 blends:
- `plain`: prompt a, the released alpha 0.999 (a blend moves the sink by 0.1 % a chunk);
- `alpha_half`: the same with every block's `compression_alpha` set to 0.5 on the built model (an attribute, read at
  each blend), so the blends show far above the tolerance;
- `prompt_switch`: alpha 0.5, to prompt b before chunk 2 (the tree has no switch: `tools/_wan_upstream.py`
  `SwitchingGenerator`, chunk 0 kept as the sink), so the chunk re-cached under b is the one blended at chunk 3.

Stubs needed to run it on a CPU-only torch (nothing else is changed): those of `tools/record_self_forcing_goldens.py`
(CUDA stubs, `demo_utils.memory` as names, attention routed to SDPA at the input dtype, `num_transformer_blocks` /
`frame_seq_length` from the tiny model, recorded noise, stored text embeddings, a zero VAE decoder; its
`WanDiffusionWrapper` takes a `checkpoint_path`, given as "tiny"), plus line patches for the sizes hard-coded for
Wan-1.3B: the K/V buffers' `12, 128` and the buffer `local_attn_size * 1560` (`causal_model.py:78`) as the tiny
model's 6 tokens per frame.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import torch
from _wan_upstream import (
    DIFFUSERS_CONFIG,
    LATENT_SIZE,
    TINY_MODEL,
    TOKENS_PER_FRAME,
    NoiseTape,
    causal_pipeline,
    kv_buffer_patches,
    record_scenarios,
    recorder_main,
    run_inference,
    start_recording,
    switch_before,
    tiny_wrapper,
)

UPSTREAM = {"repo": "JaydenLyh/Reward-Forcing", "commit": "4317f5a0d29d1cee6a0f2e80ed5f5724bee97c66"}
MODEL_KWARGS = {"local_attn_size": 9, "sink_size": 3}  # configs/reward_forcing.yaml model_kwargs
CHUNK_FRAMES = 3
NUM_CHUNKS = 10
PROMPTS = {"a": 5, "b": 4}
SCENARIOS = {
    "plain": {"alpha": 0.999},
    "alpha_half": {"alpha": 0.5},
    "prompt_switch": {"alpha": 0.5, "switch_before_block": 2},
}


def size_patches() -> dict:
    """The Wan-1.3B sizes hard-coded in the tree, as the tiny model's (each must match exactly once)."""
    return {
        "pipeline.causal_inference": kv_buffer_patches(),
        "wan.modules.causal_model": [
            (
                "self.max_attention_size = 32760 if local_attn_size == -1 else local_attn_size * 1560",
                f"self.max_attention_size = 32760 if local_attn_size == -1 else local_attn_size * {TOKENS_PER_FRAME}",
            )
        ],
    }


def make_pipeline(up, weights, embeds, alpha: float, dtype: torch.dtype):
    """The pipeline as `inference.py` builds it, around the tiny model, every block's EMA at `alpha`."""
    generator = tiny_wrapper(
        up.wan_wrapper, up.causal_model, weights, dtype, checkpoint_path="tiny", timestep_shift=5.0, **MODEL_KWARGS
    )
    for block in generator.model.blocks:
        block.self_attn.compression_alpha = alpha
    args = types.SimpleNamespace(
        denoising_step_list=[1000, 750, 500, 250], warp_denoising_step=True, num_frame_per_block=CHUNK_FRAMES,
        independent_first_frame=False, context_noise=0, checkpoint_path="tiny",
    )  # fmt: skip
    return causal_pipeline(up.causal_inference.CausalInferencePipeline, args, generator, embeds, dtype)


def run_scenario(up, weights, embeds, scenario: dict, tape: NoiseTape, dtype: torch.dtype) -> dict:
    pipeline = make_pipeline(up, weights, embeds, scenario["alpha"], dtype)
    switch_block = scenario.get("switch_before_block")
    if switch_block is not None:  # as rolldiff's `switch_prompt` (the tree has no switch); chunk 0 is the sink
        switch_before(pipeline, embeds, dtype, switch_block, CHUNK_FRAMES, sink_blocks=1)
    return run_inference(up, pipeline, tape, dtype, NUM_CHUNKS, CHUNK_FRAMES)


def record(upstream: Path, out: Path) -> None:
    up, weights, embeds = start_recording(upstream, size_patches(), MODEL_KWARGS, PROMPTS, out)
    scenarios = record_scenarios(
        out, SCENARIOS, lambda scenario, tape, dtype: run_scenario(up, weights, embeds, scenario, tape, dtype),
        embeds, NUM_CHUNKS, CHUNK_FRAMES,
    )  # fmt: skip
    meta = {
        "upstream": UPSTREAM,
        "recipe": "reward-forcing",
        "upstream_model_config": TINY_MODEL | MODEL_KWARGS,
        "diffusers_config": DIFFUSERS_CONFIG,
        "latent_size": list(LATENT_SIZE),
        "tokens_per_frame": TOKENS_PER_FRAME,
        "settings": {
            "chunk_frames": CHUNK_FRAMES,
            "sink_frames": MODEL_KWARGS["sink_size"],
            "window_frames": MODEL_KWARGS["local_attn_size"] - MODEL_KWARGS["sink_size"],
            "positions": "relative: keys cached before RoPE, rotated at their place (the sink first)",
            "ema": "at each eviction of one chunk: sink = alpha * sink + (1 - alpha) * evicted (keys and values)",
            "timestep_shift": 5.0,
            "raw_steps": [1000, 750, 500, 250],
            "context_noise": 0,
            "text_len": TINY_MODEL["text_len"],
            "text_tokens": PROMPTS,
            "dtype": "float32 (upstream bf16, cast away)",
        },
        "scenarios": scenarios,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    recorder_main(__doc__, record, "JaydenLyh/Reward-Forcing", "tests/goldens/reward-forcing/")
