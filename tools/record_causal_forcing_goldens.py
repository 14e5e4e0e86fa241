"""Record the Causal Forcing goldens (chunk-wise 4-step, frame-wise 4-, 2- and 1-step; frame-wise image-to-video),
on CPU with tiny weights.

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
  1000, 750, 500, 250 for block 0 (`:36-45`, used at `:222-228`).
- `framewise_1step` (`..._framewise_1step.yaml`): step 1000, the same 4-step first chunk.
- `i2v_framewise`, `i2v_framewise_2step`, `i2v_framewise_1step`: the same three frame-wise configs as
  `inference.py --i2v` runs them (`:150-166`): the start image (uint8, `/ 127.5 - 1` as the script's
  `ToTensor` + `Normalize([0.5], [0.5])`, `:96-100`, at the output size so its `Resize` is the identity) encoded
  by the authors' `WanVAEWrapper.encode_to_latent` (`utils/wan_wrapper.py:73-87`) into `initial_latent`, one
  latent frame, and noise for the 8 frames after it (`num_output_frames - 1`, `:164-166`). `inference` writes that
  frame to the output and caches it in one t=0 pass (`causal_inference.py:165-199`), then denoises 8 one-frame
  blocks, block 0 (the first after the image) with the first-chunk list where the config has one (`:222-228`).
  Golden: `image` (the uint8 `(height, width, 3)` picture), `clean.0` (the image's latent, what upstream outputs
  first), `clean.1..8`; `noise.<block>.<step>` numbers the denoised blocks (block 0: the frame after the image).
  No chunk-wise image-to-video: `inference.py:151` asserts `num_frame_per_block == 1` for `--i2v` (and a one-frame
  `initial_latent` fails `causal_inference.py:183`'s `num_input_frames % num_frame_per_block == 0` at 3).
`default_config.yaml` supplies `independent_first_frame: false` and `context_noise: 0`; the model keeps
`CausalWanModel`'s defaults (`local_attn_size=-1`, `sink_size=0`: global attention over the whole buffer).
Frame-wise scenarios run 9 latent frames (9 blocks; image-to-video: the image and 8 blocks) to keep the goldens small.
No prompt switch: the tree has no code that changes the prompt within a video (`inference.py`,
`pipeline/causal_inference.py`, `demo.py` and `long_video/` encode one prompt per video), so none is recorded.

Stubs needed to run it on a CPU-only torch: those of `tools/record_self_forcing_goldens.py` (this tree is
Self-Forcing's with the first-chunk list added): CUDA stubs, attention routed to SDPA at the input dtype, the K/V
buffers' hard-coded `12, 128` patched to the tiny model's, `num_transformer_blocks` / `frame_seq_length` set from the
tiny model, recorded noise for `torch.randn_like`, stored text embeddings, a zero VAE decoder. Image-to-video adds
the VAE encoder: the authors' `WanVAEWrapper` (its hard-coded latent mean / std) around a tiny `WanVAE_`
(`wan/modules/vae.py`; `_video_vae`, which would load the 1.3B checkpoint, returns it), the same tiny VAE and seed
as the `krea-realtime` goldens, saved as `vae.safetensors` in `Wan2.1_VAE.pth`'s keys; one line patch drops
`encode_to_latent`'s `.float()` (a cast to fp32: the floor run is fp64).
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from unittest import mock

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
    randomize_,
    record_scenario,
    recorder_main,
    start_image,
    switch_before,
    table_sigmas,
    text_embeddings,
    tiny_weights,
    tiny_wrapper,
    to_diffusers_layout,
)
from record_krea_goldens import VAE_CONFIG, VAE_SEED  # the same tiny Wan 2.1 VAE as the krea-realtime goldens
from safetensors.torch import save_file

UPSTREAM = {"repo": "thu-ml/Causal-Forcing", "commit": "1fc7bbc19a503c1bce80ecef08158b20e702f386"}
MODEL_KWARGS = {"local_attn_size": -1, "sink_size": 0}
PROMPTS = {"a": 5, "b": 4}  # "a" is drawn first: adding "b" left "a" as it was
FOUR_STEPS = [1000, 750, 500, 250]
SCENARIOS = {  # name -> (recipe, chunk frames, latent frames, steps, first-chunk steps, start image, switch block)
    "chunkwise": ("causal-forcing", 3, 21, FOUR_STEPS, None, False, None),
    "framewise": ("causal-forcing-framewise", 1, 9, FOUR_STEPS, None, False, None),
    "framewise_2step": ("causal-forcing-2step", 1, 9, [1000, 500], FOUR_STEPS, False, None),
    "framewise_1step": ("causal-forcing-1step", 1, 9, [1000], FOUR_STEPS, False, None),
    "i2v_framewise": ("causal-forcing-framewise", 1, 9, FOUR_STEPS, None, True, None),
    "i2v_framewise_2step": ("causal-forcing-2step", 1, 9, [1000, 500], FOUR_STEPS, True, None),
    "i2v_framewise_1step": ("causal-forcing-1step", 1, 9, [1000], FOUR_STEPS, True, None),
    "switch_chunkwise": ("causal-forcing", 3, 21, FOUR_STEPS, None, False, 3),
    "switch_framewise": ("causal-forcing-framewise", 1, 9, FOUR_STEPS, None, False, 4),
    "switch_framewise_2step": ("causal-forcing-2step", 1, 9, [1000, 500], FOUR_STEPS, False, 4),
    "switch_framewise_1step": ("causal-forcing-1step", 1, 9, [1000], FOUR_STEPS, False, 4),
}
IMAGE_SEED = 4
ENCODE_PATCH = (  # `encode_to_latent`'s cast to fp32 (the floor run is fp64)
    "self.model.encode(u.unsqueeze(0), scale).float().squeeze(0)",
    "self.model.encode(u.unsqueeze(0), scale).squeeze(0)",
)


def load_upstream(root: Path) -> types.SimpleNamespace:
    patches = {"pipeline.causal_inference": kv_buffer_patches(), "utils.wan_wrapper": [ENCODE_PATCH]}
    return load_causal_tree(root, patches, "demo_utils.memory", vae="wan.modules.vae")


def tiny_vae_weights(up: types.SimpleNamespace) -> dict[str, torch.Tensor]:
    """Seeded weights of the tiny VAE, keyed as `Wan2.1_VAE.pth` is."""
    vae = up.vae.WanVAE_(**VAE_CONFIG)
    randomize_(vae, VAE_SEED)
    return {k: v.contiguous() for k, v in vae.state_dict().items()}


def upstream_vae(up: types.SimpleNamespace, vae_weights: dict[str, torch.Tensor], dtype: torch.dtype):
    """The authors' `WanVAEWrapper` around the tiny VAE (its `_video_vae` would load the 1.3B checkpoint)."""
    vae = up.vae.WanVAE_(**VAE_CONFIG)
    vae.load_state_dict(vae_weights)
    with mock.patch.object(up.wan_wrapper, "_video_vae", lambda **kwargs: vae):
        wrapper = up.wan_wrapper.WanVAEWrapper()
    return wrapper.to(dtype).eval().requires_grad_(False)


def initial_latent(up, vae_weights, image: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`inference.py --i2v`'s `initial_latent` (`:160-162`): the picture in [-1, 1] as `(1, 3, 1, H, W)` (its
    `ToTensor` + `Normalize([0.5], [0.5])`), through `encode_to_latent`: `(1, 1, C, h, w)`."""
    pixels = (image.to(torch.float64) / 127.5 - 1.0).permute(2, 0, 1)[None, :, None].to(dtype)
    return upstream_vae(up, vae_weights, dtype).encode_to_latent(pixels).to(dtype)


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


def run_scenario(up, weights, embeds, scenario, tape: NoiseTape, dtype: torch.dtype, image=None) -> dict:
    """One scenario; `image`: `(vae_weights, uint8 picture)` for image-to-video (`initial_latent`), else None."""
    _, chunk_frames, frames, steps, first_steps, _, switch_block = scenario
    pipeline = make_pipeline(up, weights, embeds, chunk_frames, steps, first_steps, dtype)
    if switch_block is not None:  # to prompt "b" before that block, as rolldiff's `switch_prompt` (no upstream path)
        switch_before(pipeline, embeds, dtype, switch_block, chunk_frames)
    start = None if image is None else initial_latent(up, *image, dtype)
    denoised = frames - (0 if start is None else start.shape[1])  # --i2v: noise for num_output_frames - 1
    noise = tape.randn(1, denoised, TINY_MODEL["in_dim"], *LATENT_SIZE).to(dtype)
    with proxied_torch([up.causal_inference], tape, dtype):
        _, latents = pipeline.inference(noise, text_prompts=["a"], initial_latent=start, return_latents=True)
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
    vae_weights = tiny_vae_weights(up)
    embeds = text_embeddings(PROMPTS)
    image = start_image(IMAGE_SEED)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "transformer.safetensors")
    save_file(vae_weights, out / "vae.safetensors")
    scenarios = {}
    for name, scenario in SCENARIOS.items():
        recipe, chunk_frames, frames, steps, first_steps, with_image, switch_block = scenario
        extra: dict = {}
        given = (vae_weights, image) if with_image else None

        def run(tape, dtype, scenario=scenario, extra=extra, given=given):
            recorded = run_scenario(up, weights, embeds, scenario, tape, dtype, given)
            extra.update({k: v for k, v in recorded.items() if k.startswith("first_")})
            return recorded

        first_count = None if first_steps is None else len(first_steps)
        num_chunks = (frames - with_image) // chunk_frames  # the denoised blocks
        tensors = {"image": image} if with_image else None
        texts = {key: embeds[key] for key in ("a",) + (() if switch_block is None else ("b",))}
        recorded = record_scenario(run, out, name, num_chunks, chunk_frames, texts, first_count, extra=tensors)
        scenarios[name] = {
            "recipe": recipe, "num_chunks": num_chunks + with_image, "chunk_frames": chunk_frames,
            "latent_frames": frames, "image": with_image, "prompt": "a", "raw_steps": steps,
            "raw_first_chunk_steps": first_steps, **recorded, **extra,
        }  # fmt: skip
        if switch_block is not None:
            scenarios[name]["switch"] = {"before_block": switch_block, "to": "b", "recache": "causal"}
    statistics = upstream_vae(up, vae_weights, torch.float32)  # the wrapper's hard-coded latent mean / std
    meta = {
        "upstream": UPSTREAM,
        "recipe": "causal-forcing",
        "upstream_model_config": TINY_MODEL | MODEL_KWARGS,
        "diffusers_config": DIFFUSERS_CONFIG,
        "upstream_vae_config": VAE_CONFIG,
        "vae_diffusers_config": {
            "base_dim": VAE_CONFIG["dim"],
            **{k: VAE_CONFIG[k] for k in ("z_dim", "dim_mult", "num_res_blocks", "attn_scales")},
            "temperal_downsample": VAE_CONFIG["temperal_downsample"],
            "latents_mean": statistics.mean.tolist(),
            "latents_std": statistics.std.tolist(),
        },
        "vae_patches": [ENCODE_PATCH[1]],
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
