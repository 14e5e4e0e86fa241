"""Record the `infinity-rope` goldens (its block-relative RoPE, its KV flush at a prompt switch and its RoPE cut), on
CPU with tiny weights.

Usage:
    python tools/record_infinity_rope_goldens.py --upstream /work/upstream/infinity-rope --out tests/goldens/infinity-rope/

Upstream: github.com/yesiltepe-hidir/infinity-rope at 63d7b84 (Self-Forcing's tree with Infinity-RoPE's changes).
What runs is the authors' `CausalInferencePipeline.inference` (`pipeline/causal_inference.py`, as `inference.py` calls
it) with the released settings (`configs/self_forcing_dmd.yaml` over `default_config.yaml`: 3-frame chunks, shift 5,
steps 1000, 750, 500, 250 warped, `context_noise: 0`; `model_kwargs`: `local_attn_size: 6`, `sink_size: 1`).
What Infinity-RoPE changes against Self-Forcing:
- `wan/modules/causal_model.py:47-80,225-300` (`block_relativistic_rope`): keys are cached before RoPE and rotated
  at each read at their place in the 6-frame buffer (positions 0..5, the one-frame sink first; the sink's key is
  stored rotated at 0), the chunk's queries at the buffer's last positions: any length, never past the RoPE table;
- `pipeline/causal_inference.py:213-236` (`kv_flush`, at every scene boundary of the prompt): the text K/V reset,
  the buffer cut to the sink and its last 2 frames (`[:, 1560:4680] = [:, -3120:]`, `local_end_index` 4680);
- `causal_model.py:27-44` (`rope_cut`, while `kv_cache["scene_cut"]`: the first block of a scene marked `#`): the
  block's 3 frames, queries and keys, sit at RoPE frames 45, 46, 47 while the frames before them keep 0.. (a jump in
  time the model reads as a cut); the block's keys are cached unrotated, so later blocks see them at plain positions.
The prompt is upstream's own syntax, `"a[2.25s#] | b"`: a scene of `int(seconds * 16 / 12)` blocks, the next one
starting after it. Its `#` marks the boundary AFTER its scene (`causal_inference.py:101-108` reads
`scene_cut_flags[i]` for the boundary between scenes i and i + 1), so `a[2.25s#] | b` cuts where b starts.
Scenarios (each chunk's clean latents, fp32, and the fp32-vs-fp64 floor), 8 chunks each:
- `plain`: prompt a; the buffer rolls from chunk 2 on;
- `switch`: `a[2.25s] | b`: to b at block 3 (the flush keeps what the 5-frame window holds anyway), no cut;
- `scene_cut`: `a[2.25s#] | b`: the same switch, with the RoPE cut at block 3;
- `wide_scene_cut`: `local_attn_size: 9` (the sink and a window of 8), `a[3s#] | b`: at block 4 the flush really
  drops frames (the buffer of 9 keeps the sink and the last 2 of its 8 window frames), then the cut.
Not recorded: a switch before the buffer is full (the flush then copies buffer slots no block has written yet), and
a flush without a cut in a buffer wider than the recipe's: there the block after the flush places its queries at
the full buffer's last frames (`causal_model.py:287`, `max_attention_frames - num_new_frames`: 6..8) while its own
keys sit at 3..5, right after the kept frames; the cut's positions (45..) do not depend on that line, and with the
released buffer of 6 the two agree.

Stubs needed to run it on a CPU-only torch (nothing else is changed): those of `tools/record_self_forcing_goldens.py`
(CUDA stubs, `demo_utils.memory` as names, attention routed to SDPA at the input dtype, `num_transformer_blocks` /
`frame_seq_length` from the tiny model, recorded noise, stored text embeddings, a zero VAE decoder), plus line
patches for the sizes hard-coded for Wan-1.3B: the K/V buffers' `12, 128`, the buffer `local_attn_size * 1560`
(`causal_model.py:104`) and the flush's token offsets (1560, 3120, 4680: frames 1, 2 and 3) as the tiny model's 6
tokens per frame. Its per-step `print`s are silenced.
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
    tiny_wrapper,
)

UPSTREAM = {"repo": "yesiltepe-hidir/infinity-rope", "commit": "63d7b84f043a2536ccb62d5171ed54dfadc0a721"}
MODEL_KWARGS = {"local_attn_size": 6, "sink_size": 1}  # configs/self_forcing_dmd.yaml model_kwargs
CHUNK_FRAMES = 3
NUM_CHUNKS = 8
CUT_POSITION = 45  # rope_cut's transition_from
PROMPTS = {"a": 5, "b": 4}
SCENARIOS = {
    "plain": {"prompt": "a"},
    "switch": {"prompt": "a[2.25s] | b", "switch_before_block": 3, "scene_cut": False},
    "scene_cut": {"prompt": "a[2.25s#] | b", "switch_before_block": 3, "scene_cut": True},
    "wide_scene_cut": {"prompt": "a[3s#] | b", "switch_before_block": 4, "scene_cut": True, "local_attn_size": 9},
}


def size_patches() -> dict:
    """The Wan-1.3B sizes hard-coded in the tree, as the tiny model's (each must match exactly once)."""
    t = TOKENS_PER_FRAME
    flush = [
        (f"self.kv_cache1[i]['{kv}'][:, 1560:4680] = self.kv_cache1[i]['{kv}'][:, -3120:]",
         f"self.kv_cache1[i]['{kv}'][:, {t}:{3 * t}] = self.kv_cache1[i]['{kv}'][:, -{2 * t}:]")
        for kv in ("k", "v")
    ]  # fmt: skip
    return {
        "pipeline.causal_inference": [
            *kv_buffer_patches(),
            *flush,
            ("torch.tensor([4680], dtype=torch.long", f"torch.tensor([{3 * t}], dtype=torch.long"),
        ],
        "wan.modules.causal_model": [
            (
                "self.max_attention_size = 32760 if local_attn_size == -1 else local_attn_size * 1560",
                f"self.max_attention_size = 32760 if local_attn_size == -1 else local_attn_size * {t}",
            )
        ],
    }


def make_pipeline(up, weights, embeds, model_kwargs: dict, dtype: torch.dtype):
    """The pipeline as `inference.py` builds it, around the tiny model."""
    generator = tiny_wrapper(up.wan_wrapper, up.causal_model, weights, dtype, timestep_shift=5.0, **model_kwargs)
    args = types.SimpleNamespace(
        denoising_step_list=[1000, 750, 500, 250], warp_denoising_step=True, num_frame_per_block=CHUNK_FRAMES,
        independent_first_frame=False, context_noise=0,
    )  # fmt: skip
    return causal_pipeline(up.causal_inference.CausalInferencePipeline, args, generator, embeds, dtype)


def run_scenario(up, weights, embeds, scenario: dict, tape: NoiseTape, dtype: torch.dtype) -> dict:
    model_kwargs = MODEL_KWARGS | {k: scenario[k] for k in ("local_attn_size",) if k in scenario}
    pipeline = make_pipeline(up, weights, embeds, model_kwargs, dtype)
    return run_inference(up, pipeline, tape, dtype, NUM_CHUNKS, CHUNK_FRAMES, prompt=scenario["prompt"])


def record(upstream: Path, out: Path) -> None:
    up, weights, embeds = start_recording(upstream, size_patches(), MODEL_KWARGS, PROMPTS, out)
    scenarios = record_scenarios(
        out, SCENARIOS, lambda scenario, tape, dtype: run_scenario(up, weights, embeds, scenario, tape, dtype),
        embeds, NUM_CHUNKS, CHUNK_FRAMES,
    )  # fmt: skip
    for entry in scenarios.values():  # the window after the one-frame sink, as our `window_frames`
        entry["window_frames"] = (
            entry.get("local_attn_size", MODEL_KWARGS["local_attn_size"]) - MODEL_KWARGS["sink_size"]
        )
    meta = {
        "upstream": UPSTREAM,
        "recipe": "infinity-rope",
        "upstream_model_config": TINY_MODEL | MODEL_KWARGS,
        "diffusers_config": DIFFUSERS_CONFIG,
        "latent_size": list(LATENT_SIZE),
        "tokens_per_frame": TOKENS_PER_FRAME,
        "settings": {
            "chunk_frames": CHUNK_FRAMES,
            "sink_frames": MODEL_KWARGS["sink_size"],
            "window_frames": MODEL_KWARGS["local_attn_size"] - MODEL_KWARGS["sink_size"],
            "positions": "block-relative: keys cached before RoPE, rotated at their place in the buffer",
            "flush": "at a scene boundary: text K/V reset, the buffer cut to the sink + its last 2 frames",
            "scene_cut_position": CUT_POSITION,
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
    recorder_main(__doc__, record, "yesiltepe-hidir/infinity-rope", "tests/goldens/infinity-rope/")
