"""Record the Causal Forcing goldens (chunk-wise 4-step, frame-wise 4-, 2- and 1-step), on CPU with tiny weights.

Usage:
    python tools/record_causal_forcing_goldens.py --upstream /work/upstream/causal-forcing \\
        --out tests/goldens/causal-forcing/

Upstream: github.com/thu-ml/Causal-Forcing at 1fc7bbc19a503c1bce80ecef08158b20e702f386. What runs is the authors'
`CausalInferencePipeline.inference` (`pipeline/causal_inference.py`, as `inference.py` calls it) with each
released config's settings:
- `chunkwise` (`configs/causal_forcing_dmd_chunkwise.yaml`): `num_frame_per_block: 3`, steps 1000, 750, 500, 250
  warped (`warp_denoising_step: true`: `:29-32`), shift 5 (`model_kwargs.timestep_shift`), 21 latent frames.
- `framewise` (`..._framewise.yaml`): the same with `num_frame_per_block: 1`.
- `framewise_2step` (`..._framewise_2step.yaml`): steps 1000, 500, and `denoising_step_list_first_chunk`
  1000, 750, 500, 250 for block 0 (`:36-45`, used at `:203-207`).
- `framewise_1step` (`..._framewise_1step.yaml`): step 1000, the same 4-step first chunk.
`default_config.yaml` supplies `independent_first_frame: false` and `context_noise: 0`; the model keeps
`CausalWanModel`'s defaults (`local_attn_size=-1`, `sink_size=0`: global attention over the whole buffer).
Frame-wise scenarios run 9 latent frames (9 blocks) to keep the goldens small.

Stubs needed to run it on a CPU-only torch: those of `tools/record_self_forcing_goldens.py` (this tree is
Self-Forcing's with the first-chunk list added): CUDA stubs, attention routed to SDPA at the input dtype, the K/V
buffers' hard-coded `12, 128` patched to the tiny model's, `num_transformer_blocks` / `frame_seq_length` set from the
tiny model, recorded noise for `torch.randn_like`, stored text embeddings, a zero VAE.
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
    load_causal_tree,
    proxied_torch,
    record_scenario,
    recorder_main,
    table_sigmas,
    text_embeddings,
    tiny_weights,
    tiny_wrapper,
    to_diffusers_layout,
)
from safetensors.torch import save_file

UPSTREAM = {"repo": "thu-ml/Causal-Forcing", "commit": "1fc7bbc19a503c1bce80ecef08158b20e702f386"}
MODEL_KWARGS = {"local_attn_size": -1, "sink_size": 0}
PROMPTS = {"a": 5}
FOUR_STEPS = [1000, 750, 500, 250]
SCENARIOS = {  # name -> (recipe, chunk frames, latent frames, steps, first-chunk steps)
    "chunkwise": ("causal-forcing", 3, 21, FOUR_STEPS, None),
    "framewise": ("causal-forcing-framewise", 1, 9, FOUR_STEPS, None),
    "framewise_2step": ("causal-forcing-2step", 1, 9, [1000, 500], FOUR_STEPS),
    "framewise_1step": ("causal-forcing-1step", 1, 9, [1000], FOUR_STEPS),
}


def load_upstream(root: Path) -> types.SimpleNamespace:
    return load_causal_tree(root, {"pipeline.causal_inference": kv_buffer_patches()}, "demo_utils.memory")


def make_pipeline(up, weights, embeds, chunk_frames: int, steps, first_steps, dtype: torch.dtype):
    """The pipeline as `inference.py` builds it from the config, around the tiny model."""
    generator = tiny_wrapper(up.wan_wrapper, up.causal_model, weights, dtype, timestep_shift=5.0, **MODEL_KWARGS)
    args = types.SimpleNamespace(
        denoising_step_list=steps, warp_denoising_step=True, num_frame_per_block=chunk_frames,
        independent_first_frame=False, context_noise=0,
    )  # fmt: skip
    if first_steps is not None:
        args.denoising_step_list_first_chunk = first_steps
    return causal_pipeline(up.causal_inference.CausalInferencePipeline, args, generator, embeds, dtype)


def run_scenario(up, weights, embeds, scenario, tape: NoiseTape, dtype: torch.dtype) -> dict:
    _, chunk_frames, frames, steps, first_steps = scenario
    pipeline = make_pipeline(up, weights, embeds, chunk_frames, steps, first_steps, dtype)
    noise = tape.randn(1, frames, TINY_MODEL["in_dim"], *LATENT_SIZE).to(dtype)
    with proxied_torch([up.causal_inference], tape, dtype):
        _, latents = pipeline.inference(noise, text_prompts=["a"], return_latents=True)
    clean = [to_diffusers_layout(chunk) for chunk in latents.split(chunk_frames, dim=1)]
    timesteps = [float(t) for t in pipeline.denoising_step_list]
    recorded = {"clean": clean, "timesteps": timesteps, "sigmas": table_sigmas(pipeline.scheduler, timesteps)}
    if pipeline.denoising_step_list_first_chunk is not None:
        first = [float(t) for t in pipeline.denoising_step_list_first_chunk]
        recorded |= {"first_timesteps": first, "first_sigmas": table_sigmas(pipeline.scheduler, first)}
    return recorded


def record(upstream: Path, out: Path) -> None:
    torch.manual_seed(0)
    up = load_upstream(upstream)
    weights = tiny_weights(up.causal_model, **MODEL_KWARGS)
    embeds = text_embeddings(PROMPTS)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "transformer.safetensors")
    scenarios = {}
    for name, scenario in SCENARIOS.items():
        recipe, chunk_frames, frames, steps, first_steps = scenario
        extra: dict = {}

        def run(tape, dtype, scenario=scenario, extra=extra):
            recorded = run_scenario(up, weights, embeds, scenario, tape, dtype)
            extra.update({k: v for k, v in recorded.items() if k.startswith("first_")})
            return recorded

        first_count = None if first_steps is None else len(first_steps)
        num_chunks = frames // chunk_frames
        recorded = record_scenario(run, out, name, num_chunks, chunk_frames, {"a": embeds["a"]}, first_count)
        scenarios[name] = {
            "recipe": recipe, "num_chunks": num_chunks, "chunk_frames": chunk_frames, "latent_frames": frames,
            "prompt": "a", "raw_steps": steps, "raw_first_chunk_steps": first_steps, **recorded, **extra,
        }  # fmt: skip
    meta = {
        "upstream": UPSTREAM,
        "recipe": "causal-forcing",
        "upstream_model_config": TINY_MODEL | MODEL_KWARGS,
        "diffusers_config": DIFFUSERS_CONFIG,
        "latent_size": list(LATENT_SIZE),
        "tokens_per_frame": TOKENS_PER_FRAME,
        "settings": {
            "attention": "global: every block sees all earlier frames (local_attn_size -1)",
            "sink_frames": 0,
            "positions": "absolute (keys stored after RoPE)",
            "context_policy": "rolling: after the last step one pass on the clean block at t = 0",
            "timestep_shift": 5.0,
            "x0": "x_t - sigma * flow; sigma of the nearest entry of the 1000-entry table",
            "renoise": "(1 - sigma_next) * x0 + sigma_next * noise",
            "text_len": TINY_MODEL["text_len"],
            "text_tokens": PROMPTS,
            "eps": 1e-6,
            "dtype": "float32 (upstream bf16, cast away)",
        },
        "scenarios": scenarios,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    recorder_main(__doc__, record, "thu-ml/Causal-Forcing", "tests/goldens/causal-forcing/")
