"""Record the `rolling-sink` goldens (a run that rolls, and one past our model's RoPE table), on CPU with tiny weights.

Usage:
    python tools/record_rolling_sink_goldens.py --upstream /work/upstream/rolling-sink --out tests/goldens/rolling-sink/

Upstream: github.com/haodong2000/RollingSink at d7fc0d9 (Self-Forcing's tree, guandeh17/Self-Forcing@33593df, with
Rolling Sink's changes). What runs is the authors' `CausalInferencePipeline.inference` (`pipeline/causal_inference.py`,
as `inference.py` calls it) with the released settings (`configs/self_forcing_dmd.yaml` over `default_config.yaml`:
3-frame chunks, shift 5, steps 1000, 750, 500, 250 warped, `context_noise: 0`; the model's `local_attn_size=-1`,
`sink_size=0`). What Rolling Sink changes against Self-Forcing (diff of the two trees):
- `wan/modules/causal_model.py:209`: the `local_attn_size != -1` guard dropped, so the 21-frame buffer
  (`max_attention_size` 32760 = 21 x 1560, `:78`) evicts its oldest chunk instead of overflowing (sink 0);
- `:237-239`: the pre-RoPE K/V of the first 21 frames kept in `k_original` / `v_original` (buffers added in
  `pipeline/causal_inference.py:293-294`);
- `:247-279`: at each t = 0 pass (`timestep`, passed down from `:856`) once `current_end - 3 frames >= 21 frames`,
  the previous chunk's 3 frames are overwritten with source frames `left..right` of the first 18
  (`reverse_window_size = 21 - 3`), forward on even laps, in reverse frame order on odd ones, RoPE'd at the
  previous chunk's own start frame;
- `:535-537`: the RoPE table grown from 1024 to 8192 frames (positions keep growing: they are never re-indexed);
- `inference.py:165-170` (also `app.py:68-79`): ONE chunk of noise drawn and repeated for every chunk.
Scenarios (each chunk's clean latents, fp32, and the fp32-vs-fp64 floor):
- `plain`: 14 chunks (42 latent frames): the roll starts at chunk 7 and walks back (frames 17..0) and forward
  again (0, 1, 2 at frames 36-38);
- `past_rope_table`: 20 chunks (60 latent frames), run against our model built with `rope_max_seq_len`
  `ROPE_TABLE_SHORT` (24 < 60): absolute positions would leave that table; upstream's keep growing (its table is
  8192), ours are re-indexed inside the 21-frame window, and both must give the same latents.

Stubs needed to run it on a CPU-only torch (nothing else is changed): those of `tools/record_self_forcing_goldens.py`
(CUDA stubs, `utils.memory` as names, attention routed to SDPA at the input dtype, `num_transformer_blocks` /
`frame_seq_length` from the tiny model, recorded noise, stored text embeddings, a zero VAE decoder, which here also
takes `return_in_cpu=`), plus line patches for the sizes hard-coded for Wan-1.3B: the K/V buffers' `12, 128` (the
four of `_initialize_kv_cache`, `k_original`/`v_original` included) and the 21-frame buffer `32760` (= 21 x 1560, in
`causal_model.py:78` and `causal_inference.py:287`) as 21 x the tiny model's 6 tokens per frame. The repeated noise
of `inference.py:165-170` is built as the script builds it: the tape's first draw (the video's noise) is one
chunk's, repeated.
"""

from __future__ import annotations

import contextlib
import io
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
    load_causal_tree,
    proxied_torch,
    record_scenario,
    recorder_main,
    switch_before,
    table_sigmas,
    text_embeddings,
    tiny_weights,
    tiny_wrapper,
    to_diffusers_layout,
)
from safetensors.torch import save_file

UPSTREAM = {"repo": "haodong2000/RollingSink", "commit": "d7fc0d9f1ebd2345256063aac95ea8add11c9ee6"}
MODEL_KWARGS = {"local_attn_size": -1, "sink_size": 0}  # CausalWanModel's defaults, as the released config keeps
CHUNK_FRAMES = 3
BUFFER_FRAMES = 21  # 32760 tokens / 1560 per frame: the buffer every layer rolls through
PROMPTS = {"a": 5, "b": 4}  # "a" is drawn first: adding "b" left "a" as it was
ROPE_TABLE_SHORT = 24  # our model's RoPE table in `past_rope_table`: above the window (21), below the run (60)
SCENARIOS = {
    "plain": {"num_chunks": 14},
    "past_rope_table": {"num_chunks": 20, "rope_max_seq_len": ROPE_TABLE_SHORT},
    # to prompt "b" before block 4 (frame 12), then on past the roll (frame 21): the source frames re-cached under b
    "prompt_switch": {"num_chunks": 14, "switch_before_block": 4},
}


def size_patches() -> dict:
    """The Wan-1.3B sizes hard-coded in the tree, as the tiny model's (each must match exactly once)."""
    heads, head_dim = TINY_MODEL["num_heads"], TINY_MODEL["dim"] // TINY_MODEL["num_heads"]
    buffer = BUFFER_FRAMES * TOKENS_PER_FRAME
    originals = [
        f'"{kv}_original": torch.zeros([batch_size, kv_cache_size, 12, 128], dtype=dtype, device=device)'
        for kv in ("k", "v")
    ]
    return {
        "pipeline.causal_inference": [
            *kv_buffer_patches(),
            *[(line, line.replace("12, 128", f"{heads}, {head_dim}")) for line in originals],
            ("kv_cache_size = 32760", f"kv_cache_size = {buffer}"),
        ],
        "wan.modules.causal_model": [
            (
                "self.max_attention_size = 32760 if local_attn_size == -1 else local_attn_size * 1560",
                f"self.max_attention_size = {buffer} if local_attn_size == -1 else local_attn_size * {TOKENS_PER_FRAME}",
            )
        ],
    }


def make_pipeline(up, weights, embeds, dtype: torch.dtype):
    """The pipeline as `inference.py` builds it, around the tiny model."""
    generator = tiny_wrapper(up.wan_wrapper, up.causal_model, weights, dtype, timestep_shift=5.0, **MODEL_KWARGS)
    args = types.SimpleNamespace(
        denoising_step_list=[1000, 750, 500, 250], warp_denoising_step=True, num_frame_per_block=CHUNK_FRAMES,
        independent_first_frame=False, context_noise=0,
    )  # fmt: skip
    pipeline = causal_pipeline(up.causal_inference.CausalInferencePipeline, args, generator, embeds, dtype)

    def decode_to_pixel(latents, use_cache=False, return_in_cpu=False):  # Rolling Sink's signature (:254)
        return torch.zeros(*latents.shape[:2], 3, 8, 8, dtype=dtype)

    pipeline.vae = types.SimpleNamespace(decode_to_pixel=decode_to_pixel)
    return pipeline


def run_scenario(up, weights, embeds, scenario: dict, tape: NoiseTape, dtype: torch.dtype) -> dict:
    num_chunks, switch_block = scenario["num_chunks"], scenario.get("switch_before_block")
    pipeline = make_pipeline(up, weights, embeds, dtype)
    if switch_block is not None:  # as rolldiff's `switch_prompt` (the tree has no switch)
        switch_before(pipeline, embeds, dtype, switch_block, CHUNK_FRAMES)
    frames = num_chunks * CHUNK_FRAMES
    drawn = tape.randn(1, frames, TINY_MODEL["in_dim"], *LATENT_SIZE)
    noise = drawn[:, :CHUNK_FRAMES].repeat(1, num_chunks, 1, 1, 1)  # inference.py:165-170
    tape.draws[0] = noise  # what the video starts from (the fp64 replay hands out this, and repeats it again)
    with proxied_torch([up.causal_inference], tape, dtype), contextlib.redirect_stdout(io.StringIO()) as log:
        _, latents = pipeline.inference(noise.to(dtype), text_prompts=["a"], return_latents=True)
    clean = [to_diffusers_layout(chunk) for chunk in latents.split(CHUNK_FRAMES, dim=1)]
    timesteps = [float(t) for t in pipeline.denoising_step_list]
    rolls = [line.split("\t")[0].strip() for line in log.getvalue().splitlines() if "sink:" in line]
    return {
        "clean": clean,
        "timesteps": timesteps,
        "sigmas": table_sigmas(pipeline.scheduler, timesteps),
        "rolls": rolls,
    }


def record(upstream: Path, out: Path) -> None:
    torch.manual_seed(0)
    up = load_causal_tree(upstream, size_patches(), "utils.memory")
    weights = tiny_weights(up.causal_model, **MODEL_KWARGS)
    embeds = text_embeddings(PROMPTS)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "transformer.safetensors")
    scenarios = {}
    for name, scenario in SCENARIOS.items():
        rolls = {}

        def run(tape, dtype, scenario=scenario, rolls=rolls):
            result = run_scenario(up, weights, embeds, scenario, tape, dtype)
            rolls[dtype] = result.pop("rolls")
            return result

        texts = {key: embeds[key] for key in ("a", "b") if key == "a" or "switch_before_block" in scenario}
        recorded = record_scenario(run, out, name, scenario["num_chunks"], CHUNK_FRAMES, texts)
        # upstream's own log of each roll (block 0): which source frames went where
        scenarios[name] = {**scenario, "prompt": "a", "upstream_rolls": rolls[torch.float32], **recorded}
    meta = {
        "upstream": UPSTREAM,
        "recipe": "rolling-sink",
        "upstream_model_config": TINY_MODEL | MODEL_KWARGS,
        "diffusers_config": DIFFUSERS_CONFIG,
        "latent_size": list(LATENT_SIZE),
        "tokens_per_frame": TOKENS_PER_FRAME,
        "settings": {
            "chunk_frames": CHUNK_FRAMES,
            "buffer_frames": BUFFER_FRAMES,
            "sink_frames": 0,
            "window_frames": BUFFER_FRAMES,
            "source_frames": BUFFER_FRAMES - CHUNK_FRAMES,
            "positions": "upstream: absolute, keys RoPE'd when written; ours: relative (keys before RoPE)",
            "rolling": "past frame 18, the previous chunk's frames p hold source frame m(p) (ping-pong over 0..17)",
            "timestep_shift": 5.0,
            "raw_steps": [1000, 750, 500, 250],
            "context_noise": 0,
            "noise": "inference.py:165-170: one chunk's noise repeated for every chunk",
            "text_len": TINY_MODEL["text_len"],
            "text_tokens": PROMPTS,
            "dtype": "float32 (upstream bf16, cast away)",
        },
        "scenarios": scenarios,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    recorder_main(__doc__, record, "haodong2000/RollingSink", "tests/goldens/rolling-sink/")
