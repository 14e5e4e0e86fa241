"""Record the `longlive` goldens: LongLive's own inference pipelines, run on CPU with tiny random weights.

Usage:
    python tools/record_longlive_goldens.py --upstream /work/upstream/longlive --out tests/goldens/longlive/

Upstream: github.com/NVlabs/LongLive at 2462895575c579617af5089c9a05c7b500dc0036 (the 1.3B code, parent of
"LongLive 2.0"), settings from `configs/longlive_inference.yaml` / `longlive_interactive_inference.yaml`: steps
1000, 750, 500, 250 warped through the shift-5 table (`warp_denoising_step: true`), 3-frame chunks,
`local_attn_size: 12` (sink + window, counting the chunk), `sink_size: 3`, `global_sink: true`, `context_noise: 0`.
What runs is the authors' code itself:
- `plain`: `CausalInferencePipeline.inference` (`pipeline/causal_inference.py:56-243`, as `inference.py` calls it):
  per chunk 4 denoising steps (x0 re-noised with `randn_like`), then a t=0 pass on the clean chunk that writes its
  K/V (`:191-200`); the cache rolls past the sink in `CausalWanSelfAttention.forward` (`causal_model.py:205-352`),
  keys stored after RoPE at absolute frame positions.
- `prompt_switch`: `InteractiveCausalInferencePipeline.inference` (`pipeline/interactive_causal_inference.py:98-269`)
  with 3 prompts switching at frames 6 (<= local_attn_size: early) and 18 (late). At a switch
  `_recache_after_switch` (`:34-96`) resets the text K/V and re-runs `min(local_attn_size, frame)` clean frames in
  ONE cached forward at t=0 under the new prompt, attention unmasked; `causal_model.py:230, 291-342` writes from the
  slot after the sink when the pass starts past frame 0 (`is_recompute`), else from slot 0, rewriting the sink.
Model: `wan/modules/causal_model.py` (`CausalWanModel`, built tiny) in `utils/wan_wrapper.py`
(`WanDiffusionWrapper`, x0 with the sigma of the nearest table entry). The LoRA the released model adds is merged
weights as far as inference goes; the tiny model has plain random weights.

Stubs needed to run it on a CPU-only torch (nothing else is changed):
- `torch.cuda.current_device()` -> "cpu", inert `torch.cuda.Stream/Event`; `utils.memory` (builds
  `torch.device("cuda:N")` at import) as names only; imports never called (`ftfy`, `omegaconf`, `torchvision`...)
  as empty modules; the `pipeline`, `wan` and `wan.modules` packages registered by path (their `__init__`s import
  training code).
- attention: `causal_model.attention` and the cross-attention's `flash_attention` routed to SDPA at the input dtype;
  `flex_attention` eager.
- hard-coded Wan-1.3B sizes: the K/V buffers' `12, 128` heads x head_dim (line patches in
  `pipeline/causal_inference.py`), `num_transformer_blocks = 30` and `frame_seq_length = 1560` set from the tiny
  model after construction.
- `torch.randn_like` in the pipelines hands out recorded noise (a module proxy); the text encoder returns the
  stored embeddings; the VAE returns zeros (only latents are compared); `CausalWanModel.from_pretrained` returns
  the tiny model.
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

UPSTREAM = {"repo": "NVlabs/LongLive", "commit": "2462895575c579617af5089c9a05c7b500dc0036"}
MODEL_KWARGS = {"local_attn_size": 12, "sink_size": 3}  # configs/longlive_*inference.yaml `model_kwargs`
CHUNK_FRAMES = 3
NUM_CHUNKS = 8  # 24 latent frames: the 12-frame cache rolls from chunk 4 on
PROMPTS = {"a": 5, "b": 6, "c": 4}
SCENARIOS = {
    "plain": {"prompts": ["a"], "switch_frames": []},
    "prompt_switch": {"prompts": ["a", "b", "c"], "switch_frames": [6, 18]},
}


def load_upstream(root: Path) -> types.SimpleNamespace:
    patches = {"pipeline.causal_inference": kv_buffer_patches()}
    return load_causal_tree(root, patches, "utils.memory", interactive="pipeline.interactive_causal_inference")


def make_pipeline(up, weights, embeds, interactive: bool, dtype: torch.dtype):
    """The pipeline as `inference.py` / `interactive_inference.py` build it, around the tiny model."""
    generator = tiny_wrapper(up.wan_wrapper, up.causal_model, weights, dtype, timestep_shift=5.0, **MODEL_KWARGS)
    args = types.SimpleNamespace(
        denoising_step_list=[1000, 750, 500, 250], warp_denoising_step=True, num_frame_per_block=CHUNK_FRAMES,
        model_kwargs=types.SimpleNamespace(timestep_shift=5.0, **MODEL_KWARGS), context_noise=0, global_sink=True,
    )  # fmt: skip
    pipeline_class = (
        up.interactive.InteractiveCausalInferencePipeline
        if interactive
        else up.causal_inference.CausalInferencePipeline
    )
    return causal_pipeline(pipeline_class, args, generator, embeds, dtype)


def run_scenario(up, weights, embeds, scenario: dict, tape: NoiseTape, dtype: torch.dtype) -> dict:
    interactive = bool(scenario["switch_frames"])
    pipeline = make_pipeline(up, weights, embeds, interactive, dtype)
    noise = tape.randn(1, NUM_CHUNKS * CHUNK_FRAMES, TINY_MODEL["in_dim"], *LATENT_SIZE).to(dtype)
    with proxied_torch([up.causal_inference, up.interactive], tape, dtype):
        if interactive:
            _, latents = pipeline.inference(
                noise, text_prompts_list=[[p] for p in scenario["prompts"]],
                switch_frame_indices=scenario["switch_frames"], return_latents=True,
            )  # fmt: skip
        else:
            _, latents = pipeline.inference(noise, text_prompts=scenario["prompts"], return_latents=True)
    clean = [to_diffusers_layout(chunk) for chunk in latents.split(CHUNK_FRAMES, dim=1)]
    scheduler = pipeline.scheduler
    timesteps = [float(t) for t in pipeline.denoising_step_list]
    return {"clean": clean, "timesteps": timesteps, "sigmas": table_sigmas(scheduler, timesteps)}


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

        texts = {p: embeds[p] for p in scenario["prompts"]}
        recorded = record_scenario(run, out, name, NUM_CHUNKS, CHUNK_FRAMES, texts)
        scenarios[name] = {"num_chunks": NUM_CHUNKS, **scenario, **recorded}
    meta = {
        "upstream": UPSTREAM,
        "recipe": "longlive",
        "upstream_model_config": TINY_MODEL | MODEL_KWARGS,
        "diffusers_config": DIFFUSERS_CONFIG,
        "latent_size": list(LATENT_SIZE),
        "tokens_per_frame": TOKENS_PER_FRAME,
        "settings": {
            "chunk_frames": CHUNK_FRAMES,
            "local_attn_size": MODEL_KWARGS["local_attn_size"],
            "sink_frames": MODEL_KWARGS["sink_size"],
            "window_frames": MODEL_KWARGS["local_attn_size"] - MODEL_KWARGS["sink_size"],
            "positions": "absolute (keys stored after RoPE)",
            "context_policy": "rolling: after the last step one t=0 pass on the clean chunk writes its K/V",
            "context_noise": 0,
            "timestep_shift": 5.0,
            "raw_steps": [1000, 750, 500, 250],
            "warp_denoising_step": True,
            "x0": "x_t - sigma * flow; sigma of the nearest entry of the 1000-entry table",
            "renoise": "(1 - sigma_next) * x0 + sigma_next * noise",
            "recache": "at a switch: text K/V reset; min(local_attn_size, frame) clean frames re-run at t=0 in ONE "
            "cached forward, unmasked, under the new prompt; written after the sink if the pass starts past "
            "frame 0, else from frame 0 (the sink rewritten); global_sink true (K/V not zeroed first)",
            "text_len": TINY_MODEL["text_len"],
            "text_tokens": PROMPTS,
            "eps": 1e-6,
            "dtype": "float32 (upstream bf16, cast away)",
        },
        "scenarios": scenarios,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    recorder_main(__doc__, record, "NVlabs/LongLive (at 2462895)", "tests/goldens/longlive/")
