"""Record the `self-forcing` goldens of the two options our pipeline cannot express yet, on CPU with tiny weights.

Usage:
    python tools/record_self_forcing_goldens.py --upstream /work/upstream/self-forcing --out tests/goldens/self-forcing/

Upstream: github.com/guandeh17/Self-Forcing at 33593df3e81fa3ec10239271dd2c100facac6de1. What runs is the authors'
`CausalInferencePipeline.inference` (`pipeline/causal_inference.py:47-276`, as `inference.py` calls it) with the
released settings (`configs/self_forcing_dmd.yaml`: 3-frame chunks, shift 5, steps 1000, 750, 500, 250; the model
defaults `local_attn_size=-1`, `sink_size=0`: global attention, the 32760-token buffer never rolls; 21 latent
frames, `inference.py`'s default length), changing one option per scenario:
- `no_warp`: `warp_denoising_step: false` (`default_config.yaml`): the raw steps are fed as timesteps (`:29-31`
  skipped) and each sigma is the table's entry nearest to them (x0: `utils/wan_wrapper.py`
  `_convert_flow_pred_to_x0`; re-noise: `utils/scheduler.py` `add_noise`).
- `context_noise`: `context_noise: 100`: the context pass runs the clean chunk at timestep 100, without noising it
  (`:225-235`).
Plain inference (warped steps, `context_noise: 0`) is already reproduced by our loop; see REFERENCE.md.
Model: `wan/modules/causal_model.py` (`CausalWanModel`, built tiny) in `utils/wan_wrapper.py` (`WanDiffusionWrapper`).

Stubs needed to run it on a CPU-only torch (nothing else is changed):
- `torch.cuda.current_device()` -> "cpu", inert `torch.cuda.Stream/Event`; `demo_utils.memory` (builds
  `torch.device("cuda:N")` at import) as names only; imports never called (`ftfy`, `omegaconf`...) as empty modules;
  the `pipeline`, `wan` and `wan.modules` packages registered by path (their `__init__`s import training code).
- attention: `causal_model.attention` and the cross-attention's `flash_attention` routed to SDPA at the input dtype;
  `flex_attention` eager.
- hard-coded Wan-1.3B sizes: the K/V buffers' `12, 128` (line patches in `pipeline/causal_inference.py`),
  `num_transformer_blocks = 30` and `frame_seq_length = 1560` set from the tiny model after construction.
- `torch.randn_like` in the pipeline hands out recorded noise (a module proxy); the text encoder returns the
  stored embeddings; the VAE returns zeros; `CausalWanModel.from_pretrained` returns the tiny model.
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

UPSTREAM = {"repo": "guandeh17/Self-Forcing", "commit": "33593df3e81fa3ec10239271dd2c100facac6de1"}
MODEL_KWARGS = {"local_attn_size": -1, "sink_size": 0}  # CausalWanModel's defaults, as the released config keeps
CHUNK_FRAMES = 3
NUM_CHUNKS = 7  # 21 latent frames
PROMPTS = {"a": 5}
SCENARIOS = {
    "no_warp": {"warp_denoising_step": False, "context_noise": 0},
    "context_noise": {"warp_denoising_step": True, "context_noise": 100},
}


def load_upstream(root: Path) -> types.SimpleNamespace:
    patches = {"pipeline.causal_inference": kv_buffer_patches()}
    return load_causal_tree(root, patches, "demo_utils.memory")


def make_pipeline(up, weights, embeds, scenario: dict, dtype: torch.dtype):
    """The pipeline as `inference.py` builds it, around the tiny model."""
    generator = tiny_wrapper(up.wan_wrapper, up.causal_model, weights, dtype, timestep_shift=5.0, **MODEL_KWARGS)
    args = types.SimpleNamespace(
        denoising_step_list=[1000, 750, 500, 250], num_frame_per_block=CHUNK_FRAMES, independent_first_frame=False,
        **scenario,
    )  # fmt: skip
    return causal_pipeline(up.causal_inference.CausalInferencePipeline, args, generator, embeds, dtype)


def run_scenario(up, weights, embeds, scenario: dict, tape: NoiseTape, dtype: torch.dtype) -> dict:
    pipeline = make_pipeline(up, weights, embeds, scenario, dtype)
    noise = tape.randn(1, NUM_CHUNKS * CHUNK_FRAMES, TINY_MODEL["in_dim"], *LATENT_SIZE).to(dtype)
    with proxied_torch([up.causal_inference], tape, dtype):
        _, latents = pipeline.inference(noise, text_prompts=["a"], return_latents=True)
    clean = [to_diffusers_layout(chunk) for chunk in latents.split(CHUNK_FRAMES, dim=1)]
    timesteps = [float(t) for t in pipeline.denoising_step_list]
    return {"clean": clean, "timesteps": timesteps, "sigmas": table_sigmas(pipeline.scheduler, timesteps)}


def record(upstream: Path, out: Path) -> None:
    torch.manual_seed(0)
    up = load_upstream(upstream)
    weights = tiny_weights(up.causal_model, **MODEL_KWARGS)
    embeds = text_embeddings(PROMPTS)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "transformer.safetensors")
    scenarios = {}
    for name, scenario in SCENARIOS.items():

        def run(tape, dtype, scenario=scenario):
            return run_scenario(up, weights, embeds, scenario, tape, dtype)

        recorded = record_scenario(run, out, name, NUM_CHUNKS, CHUNK_FRAMES, {"a": embeds["a"]})
        scenarios[name] = {"num_chunks": NUM_CHUNKS, "prompt": "a", **scenario, **recorded}
    meta = {
        "upstream": UPSTREAM,
        "recipe": "self-forcing",
        "upstream_model_config": TINY_MODEL | MODEL_KWARGS,
        "diffusers_config": DIFFUSERS_CONFIG,
        "latent_size": list(LATENT_SIZE),
        "tokens_per_frame": TOKENS_PER_FRAME,
        "settings": {
            "chunk_frames": CHUNK_FRAMES,
            "attention": "global: every chunk sees all earlier frames (local_attn_size -1, 32760-token buffer)",
            "sink_frames": 0,
            "window_frames": NUM_CHUNKS * CHUNK_FRAMES,
            "positions": "absolute (keys stored after RoPE)",
            "context_policy": "rolling: after the last step one pass on the clean chunk at t = context_noise",
            "timestep_shift": 5.0,
            "raw_steps": [1000, 750, 500, 250],
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
    recorder_main(__doc__, record, "guandeh17/Self-Forcing", "tests/goldens/self-forcing/")
