"""Record the `streamdiffusionv2` goldens: the authors' own single-GPU loops, run on CPU with tiny random weights.

Usage:
    python tools/record_streamdiffusionv2_goldens.py --upstream /work/upstream/streamdiffusionv2 \
        --out tests/goldens/streamdiffusionv2/

Upstream: github.com/chenfengxu714/StreamDiffusionV2 at c5a0f20, `configs/wan_causal_dmd_v2v.yaml` (steps
700/500/400/200 + 0, `num_frame_per_block: 1`, `num_kv_cache: 6`, `num_sink_tokens: 3`, `adapt_sink_threshold: 0.2`,
`warp_denoising_step: false`; the wrapper's `FlowMatchScheduler(shift=8.0, sigma_min=0.0, extra_one_step=True)`,
`models/wan/wan_wrapper.py:163-166`), `--step 4` (all four steps; the CLI default is `--step 2`,
`streamv2v/inference_common.py:83-89`). What runs is the authors' driver itself:

- non-batched (`streamv2v/inference_wo_batch.py` `SingleGPUInferencePipeline.run_inference`, `:236-372`): block 0 is
  the first `1 + 4` pixel frames (2 latent frames) denoised by `prepare(batch_denoise=False)`
  (`models/wan/causal_stream_inference.py:124-200`) with the step list as configured; every later block is 4 pixel
  frames (1 latent frame) denoised by `inference_wo_batch` (`:298-348`) whose first step is the motion-adaptive
  `current_step` of `compute_noise_scale_and_step` (`streamv2v/inference.py:51-57`). Each step's forward writes its
  K/V into the cache (`causal_model.py:301-337`): no separate context pass, the last step's K/V stay.
- stream batch (`streamv2v/inference.py` `SingleGPUInferencePipeline.run_inference`, `:270-420`): block 0 as above
  through `prepare(batch_denoise=True)`, then `inference_stream` (`causal_stream_inference.py:257-296`) once per
  input block, the batch holding one block per step at staggered noise levels.

Scenarios: `plain` (noise_scale 1: the input's latents are multiplied by 0, pure noise in), `v2v` (a moving seeded
input video at noise_scale 0.7; the adaptive sink refreshes), `stream_batch` (the same input through the stream
batch), `prompt_switch` (`v2v` with prompt "b" from block 5 on). The drivers never change the prompt inside a stream
(the demo restarts the session at a new prompt: `demo/vid2vid.py:551-568`, `inference_wo_batch.py:140-150`); the
recording switches the way the authors' `prepare()` does when it finds a cache (`causal_stream_inference.py:139-158`):
the text re-encoded into `conditional_dict` and every cross-attention cache marked `is_init = False`, the
self-attention cache (and its adaptive sink) kept. Nothing else is changed. Stubs to run it on a CPU-only torch (nothing else is changed):
- the model and text-encoder wrappers' `from_pretrained` / checkpoint reads: the tiny `CausalWanModel`, stored
  embeddings; `load_generator_state_dict` returns the tiny weights; `omegaconf` is not needed (the config is a plain
  attribute dict with the YAML's keys and the CLI's).
- hard-coded Wan-1.3B sizes: `num_transformer_blocks = 30`, `num_heads = 12` (set to the tiny model's after
  construction, before any cache exists) and the cache buffers' head dim 128 (a line patch).
- attention: the cross-attention's `flash_attention` routed to SDPA at the input dtype; the self-attention's own
  SDPA fallback (`attention_with_kvcache_fallback`) runs as is.
- bf16: the drivers' `torch.bfloat16` names the working dtype (fp32, or fp64 for the floor) through a module proxy
  whose `randn`/`randn_like` hand out recorded noise. The manager is built outside the proxy, so its
  `pipeline.to(dtype=torch.bfloat16)` (`inference_wo_batch.py:74`) is a real bf16 cast, and `load_model` then copies
  the stored weights into bf16 parameters: the model that runs (moved to fp32 / fp64 afterwards) holds the stored
  weights rounded to bf16, as upstream's own run does. A replay loads them so (tests/test_recipes_streamdiffusionv2.py).
- the VAE: the authors' `WanVAE_` (`models/wan/wan_base/modules/vae.py`) built tiny with seeded weights, its
  `stream_encode` unchanged (NO latent normalisation: `WanVAEWrapper.stream_encode(video, is_scale=False)`,
  `wan_wrapper.py:134-141`); decode returns zeros (only the latents are compared). The input pixels are in [-1, 1].
"""

from __future__ import annotations

import contextlib
import json
import types
from pathlib import Path
from unittest import mock

import torch
from _wan_upstream import (
    COMMON_STUBS,
    DIFFUSERS_CONFIG,
    HEIGHT,
    LATENT_SIZE,
    TINY_MODEL,
    TOKENS_PER_FRAME,
    WIDTH,
    NoiseTape,
    UpstreamTree,
    cpu_cuda_stubs,
    max_abs,
    proxied_torch,
    randomize_,
    recorder_main,
    sdpa_at_input_dtype,
    start_image,
    table_sigmas,
    text_embeddings,
    tiny_weights,
    to_diffusers_layout,
)
from safetensors.torch import save_file

UPSTREAM = {"repo": "chenfengxu714/StreamDiffusionV2", "commit": "c5a0f20"}
STEPS = [700, 500, 400, 200]  # configs/wan_causal_dmd_v2v.yaml with --step 4 (the trailing 0 dropped for v2v)
CONFIG = {
    "model_name": "wan", "generator_name": "causal_wan", "model_type": "T2V-1.3B", "denoising_step_list": STEPS + [0],
    "warp_denoising_step": False, "num_frame_per_block": 1, "num_kv_cache": 6, "num_sink_tokens": 3,
    "adapt_sink_threshold": 0.2, "t2v": False, "height": HEIGHT, "width": WIDTH, "profile": False,
    "use_taehv": False, "use_tensorrt": False, "target_fps": None, "fixed_noise_scale": False,
}  # fmt: skip
PROMPTS = {"a": 5, "b": 4}
VAE_CONFIG = {
    "dim": 2, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
    "temperal_downsample": [False, True, True], "dropout": 0.0,
}  # fmt: skip
VAE_SEED, VIDEO_SEED = 3, 4
NUM_BLOCKS = 10  # latent blocks: 1 of two frames, then 9 of one (the window of 6 frames wraps from block 5)
SCENARIOS = {
    "plain": {"driver": "wo_batch", "noise_scale": 1.0},
    "v2v": {"driver": "wo_batch", "noise_scale": 0.7},
    "stream_batch": {"driver": "stream_batch", "noise_scale": 0.7},
    # prompt "b" from block 5 on (after the 6-frame window wrapped), the cache kept
    "prompt_switch": {"driver": "wo_batch", "noise_scale": 0.7, "switch_block": 5},
    # a start image (no upstream path): its latent frame written by one t=0 forward, then 8 one-frame blocks from noise
    "i2v": {"driver": "i2v", "noise_scale": 1.0},
}
I2V_STEPS = [1000, 750, 500, 250]  # the recipe's text-to-video list (configs/wan_causal_dmd_t2v.yaml's)
IMAGE_SEED = 5


class Config(dict):
    """The merged OmegaConf the drivers read (`config.key` and `config.get(key)`)."""

    __getattr__ = dict.__getitem__


def load_upstream(root: Path) -> types.SimpleNamespace:
    import transformers.modeling_utils  # noqa: F401 (diffusers' `.to` imports it; it must see the real torchvision)

    cpu_cuda_stubs()
    buffer = "torch.zeros([batch_size, {n}, self.num_heads, 128], dtype=dtype, device=device)"
    head_dim = TINY_MODEL["dim"] // TINY_MODEL["num_heads"]
    patches = {
        "models.wan.causal_stream_inference": [
            (f'"{kv}": ' + buffer.format(n=n), f'"{kv}": ' + buffer.format(n=n).replace("128", str(head_dim)))
            for n in ("cache_length", "512")
            for kv in ("k", "v")
        ]
    }
    stubs = COMMON_STUBS | {"av": {}, "torchvision.transforms.functional": {}}  # the mp4 reader is never called
    tree = UpstreamTree(root, patches=patches, bare_packages=["streamv2v"], stubs=stubs)
    up = types.SimpleNamespace(
        models=tree.module("models"),
        causal_model=tree.module("models.wan.causal_model"),
        model_module=tree.module("models.wan.wan_base.modules.model"),
        vae=tree.module("models.wan.wan_base.modules.vae"),
        stream=tree.module("models.wan.causal_stream_inference"),
        wo_batch=tree.module("streamv2v.inference_wo_batch"),
        batch=tree.module("streamv2v.inference"),
    )
    up.model_module.flash_attention = sdpa_at_input_dtype
    return up


def tiny_vae(up, weights: dict[str, torch.Tensor], dtype: torch.dtype):
    vae = up.vae.WanVAE_(**VAE_CONFIG)
    vae.load_state_dict(weights)
    return vae.to(dtype).eval().requires_grad_(False)


class VaeStub:
    """`WanVAEWrapper` as the drivers use it: `stream_encode` is the authors' (tiny), decode records the latents."""

    def __init__(self, model) -> None:
        self.model, self.decoded, self.encoded = model, [], []

    def to(self, *args, **kwargs):
        return self

    def stream_encode(self, video, is_scale=False):
        latents = self.model.stream_encode(video, None)
        self.encoded.append(latents.clone())
        return latents

    def stream_decode_to_pixel(self, latent):
        self.decoded.append(latent.clone())
        return torch.zeros(latent.shape[0], 4 * latent.shape[1], 3, HEIGHT, WIDTH, dtype=latent.dtype)


def build_manager(up, driver: str, weights, vae_weights, embeds, dtype):
    """The driver's `SingleGPUInferencePipeline` around the tiny model, text embeddings and VAE."""
    module = up.wo_batch if driver == "wo_batch" else up.batch
    model = up.causal_model.CausalWanModel(**TINY_MODEL)

    class TextEncoder(torch.nn.Module):
        def __init__(self, model_type=None) -> None:
            super().__init__()

        def forward(self, text_prompts):
            return {"prompt_embeds": embeds[text_prompts[0]].to(dtype).clone()}

    vae = VaeStub(tiny_vae(up, vae_weights, dtype))
    with (
        mock.patch.object(up.causal_model.CausalWanModel, "from_pretrained", lambda *a, **k: model),
        mock.patch.object(up.model_module.WanModel, "from_pretrained", lambda *a, **k: model),
        mock.patch.object(up.stream, "get_text_encoder_wrapper", lambda model_name: TextEncoder),
        mock.patch.object(up.stream, "get_vae_wrapper", lambda model_name: lambda model_type: vae),
    ):
        manager = module.SingleGPUInferencePipeline(Config(CONFIG), torch.device("cpu"))
    pipeline = manager.pipeline
    pipeline.num_transformer_blocks, pipeline.num_heads = TINY_MODEL["num_layers"], TINY_MODEL["num_heads"]
    with mock.patch.object(module, "load_generator_state_dict", lambda folder: ("tiny", weights)):
        manager.load_model("tiny")
    pipeline.generator.to(dtype).eval().requires_grad_(False)
    return module, manager, vae


def input_video(num_pixel_frames: int) -> torch.Tensor:
    """A seeded moving pattern `(1, 3, frames, H, W)` in [-1, 1]: a smooth field drifting one pixel a frame."""
    generator = torch.Generator().manual_seed(VIDEO_SEED)
    field = torch.randn(1, 3, 1, HEIGHT, WIDTH + num_pixel_frames, generator=generator, dtype=torch.float64)
    field = torch.nn.functional.avg_pool3d(field, (1, 5, 5), stride=1, padding=(0, 2, 2)) * 2.5
    frames = [field[..., t : t + WIDTH] for t in range(num_pixel_frames)]
    return torch.cat(frames, dim=2).clamp(-1, 1).float()


def sink_events(pipeline) -> list[list[int]]:
    """Each block's eviction queue (`CausalWanSelfAttention.evict_idx[0]`, token end indices) after a chunk."""
    return [list(block.self_attn.evict_idx[0]) for block in pipeline.generator.model.blocks]


def run_i2v_scenario(up, weights, vae_weights, embeds, tape: NoiseTape, dtype) -> dict:
    """Image-to-video, which the tree does not have, done with its own pieces only: the image (`/ 127.5 - 1`, one
    pixel frame) through the authors' `WanVAE_.encode` (unnormalised, as `stream_encode`) is block 0, written into the fresh adaptive-sink cache by ONE
    forward at t=0 (`prepare()`'s set-up, `causal_stream_inference.py:139-158`, then its generator call with the
    step list's t = 0 entry instead of a denoising loop); then 8 one-frame blocks from noise through
    `inference_wo_batch` (`:298-348`) with the text-to-video steps 1000/750/500/250, each block's noise drawn
    before it (as the drivers' `torch.randn_like` of the block's latents)."""
    config = dict(CONFIG, denoising_step_list=I2V_STEPS + [0])
    with mock.patch.dict(CONFIG, config):
        _, manager, vae = build_manager(up, "wo_batch", weights, vae_weights, embeds, dtype)
    pipeline, image = manager.pipeline, start_image(IMAGE_SEED)
    pixels = (image.to(torch.float64) / 127.5 - 1.0).permute(2, 0, 1)[None, :, None].to(dtype)
    # `stream_encode` takes 1 + 4 frames first; the model's own `encode` takes one (its first causal chunk). Scale
    # (0, 1): the tiny VAE's statistics are the identity here (`vae_diffusers_config`), so this is also the
    # normalised latent rolldiff encodes a start image to (frame 0 of the output, in the decoder's space)
    encoded = vae.model.encode(pixels, (0.0, 1.0))
    vae.encoded.append(encoded.clone())
    latent = encoded.transpose(2, 1).contiguous()  # (1, 1, C, h, w)
    frame = pipeline.frame_seq_length
    queues, steps_fed, clean = [], [], [latent]
    with proxied_torch([up.stream], tape, dtype):
        pipeline.conditional_dict = pipeline.text_encoder(text_prompts=["a"])
        pipeline._initialize_kv_cache(batch_size=1, dtype=dtype, device="cpu")
        pipeline._initialize_crossattn_cache(batch_size=1, dtype=dtype, device="cpu")
        pipeline.generator(
            noisy_image_or_video=latent, conditional_dict=pipeline.conditional_dict,
            timestep=torch.zeros(1, 1, dtype=torch.int64), kv_cache=pipeline.kv_cache1,
            crossattn_cache=pipeline.crossattn_cache, current_start=torch.tensor([0]), current_end=torch.tensor([frame]),
        )  # fmt: skip
        for block in range(1, NUM_BLOCKS - 1):
            noise = tape.randn(1, 1, TINY_MODEL["in_dim"], *LATENT_SIZE).to(dtype)
            pred = pipeline.inference_wo_batch(noise, block * frame, (block + 1) * frame, I2V_STEPS[0])
            clean.append(pred)
            steps_fed.append([int(t) for t in pipeline.denoising_step_list])
            queues.append(sink_events(pipeline))
    return {
        "clean": [to_diffusers_layout(block) for block in clean], "timesteps": [float(t) for t in I2V_STEPS],
        "sigmas": table_sigmas(pipeline.scheduler, I2V_STEPS), "steps_fed": steps_fed, "queues": queues,
        "image": image, "encoded": vae.encoded,
    }  # fmt: skip


def run_scenario(up, weights, vae_weights, embeds, scenario: dict, tape: NoiseTape, dtype) -> dict:
    if scenario["driver"] == "i2v":
        return run_i2v_scenario(up, weights, vae_weights, embeds, tape, dtype)
    module, manager, vae = build_manager(up, scenario["driver"], weights, vae_weights, embeds, dtype)
    pixels = 1 + 4 * (NUM_BLOCKS - 1)
    video = input_video(pixels).to(dtype)
    steps = len(STEPS)
    # the wo-batch driver runs `num_chunks + num_steps - 1` chunks after block 0 (`:293`) and re-runs the last input
    # block once the input is exhausted (`:300`): ask for exactly the 8 input blocks after block 0. The batched
    # pipeline is `num_steps - 1` blocks deep and drains by re-feeding its last block (`inference.py:345`)
    blocks = (pixels - 1) // 4 - 1
    num_chunks = blocks - (steps - 1) if scenario["driver"] == "wo_batch" else blocks
    queues, steps_fed = [], []
    original = manager.pipeline.inference_wo_batch if scenario["driver"] == "wo_batch" else None

    def traced(*args, **kwargs):
        if len(steps_fed) + 1 == scenario.get("switch_block"):  # block 0 ran in prepare(); this call makes block k
            switch_prompt(manager.pipeline, "b")
        out = original(*args, **kwargs)
        steps_fed.append([int(t) for t in manager.pipeline.denoising_step_list])
        queues.append(sink_events(manager.pipeline))
        return out

    patches = [mock.patch.object(module, "export_to_video", lambda *a, **k: None)]
    if original is not None:
        patches.append(mock.patch.object(manager.pipeline, "inference_wo_batch", traced))
    with proxied_torch([module, up.stream], tape, dtype), contextlib_nested(patches):
        # the two drivers' signatures: (video, prompts, num_chunks, chunk_size, noise_scale, folder, fps, [target_fps,]
        # num_steps); the output folder is never written (`export_to_video` is stubbed)
        extra = (steps,) if scenario["driver"] == "wo_batch" else (None, steps)
        manager.run_inference(video, ["a"], num_chunks, 4, scenario["noise_scale"], "/tmp/unused", 16, *extra)
    clean = [to_diffusers_layout(latents) for latents in vae.decoded]
    scheduler = manager.pipeline.scheduler
    return {
        "clean": clean, "timesteps": [float(t) for t in STEPS], "sigmas": table_sigmas(scheduler, STEPS),
        "steps_fed": steps_fed, "queues": queues, "video": video, "encoded": vae.encoded,
    }  # fmt: skip


def switch_prompt(pipeline, prompt: str) -> None:
    """`prepare()`'s own switch when a cache exists (`causal_stream_inference.py:139-158`): the new text encoded, the
    cross-attention caches to be refilled, the self-attention cache kept."""
    pipeline.conditional_dict = pipeline.text_encoder(text_prompts=[prompt])
    for cache in pipeline.crossattn_cache:
        cache["is_init"] = False


def contextlib_nested(managers):
    stack = contextlib.ExitStack()
    for manager in managers:
        stack.enter_context(manager)
    return stack


def record(upstream: Path, out: Path) -> None:
    torch.manual_seed(0)
    up = load_upstream(upstream)
    weights = tiny_weights(up.causal_model)
    vae = up.vae.WanVAE_(**VAE_CONFIG)
    randomize_(vae, VAE_SEED)
    vae_weights = {k: v.contiguous() for k, v in vae.state_dict().items()}
    embeds = text_embeddings(PROMPTS)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "transformer.safetensors")
    save_file(vae_weights, out / "vae.safetensors")
    scenarios = {}
    for name, scenario in SCENARIOS.items():
        tape = NoiseTape(1)
        fp32 = run_scenario(up, weights, vae_weights, embeds, scenario, tape, torch.float32)
        fp64 = run_scenario(up, weights, vae_weights, embeds, scenario, NoiseTape(1, replay=tape.draws), torch.float64)
        floor = max_abs(fp32["clean"], fp64["clean"])
        tensors = {"text.a": embeds["a"]} | {k: fp32[k] for k in ("video", "image") if k in fp32}
        if "switch_block" in scenario:
            tensors["text.b"] = embeds["b"]
        tensors |= {f"draw.{i}": draw for i, draw in enumerate(tape.draws)}
        tensors |= {f"clean.{i}": c for i, c in enumerate(fp32["clean"])}
        tensors |= {f"encoded.{i}": e for i, e in enumerate(fp32["encoded"])}  # (batch, channels, frames, h, w)
        save_file({k: v.contiguous() for k, v in tensors.items()}, out / f"golden.{name}.safetensors")
        print(f"{name}: {len(fp32['clean'])} outputs, {len(tape.draws)} draws, floor (fp32 vs fp64) {floor:.3e}")
        scenarios[name] = {
            **scenario,
            "timesteps": fp32["timesteps"],
            "sigmas": fp32["sigmas"],
            "steps_fed": fp32["steps_fed"],
            "evict_queues": fp32["queues"],
            "queues_match_fp64": fp32["queues"] == fp64["queues"],
            "draw_shapes": [list(d.shape) for d in tape.draws],
            "floor": floor,
        }
    meta = {
        "upstream": UPSTREAM,
        "recipe": "streamdiffusionv2",
        "upstream_model_config": TINY_MODEL,
        "diffusers_config": DIFFUSERS_CONFIG,
        "upstream_vae_config": VAE_CONFIG,
        "vae_diffusers_config": {
            "base_dim": VAE_CONFIG["dim"],
            **{k: VAE_CONFIG[k] for k in ("z_dim", "dim_mult", "num_res_blocks")},
            "attn_scales": VAE_CONFIG["attn_scales"],
            "temperal_downsample": VAE_CONFIG["temperal_downsample"],
            "latents_mean": [0.0] * 16,  # the authors' stream_encode skips the normalisation
            "latents_std": [1.0] * 16,
        },
        "latent_size": list(LATENT_SIZE),
        "tokens_per_frame": TOKENS_PER_FRAME,
        "settings": {
            "config": CONFIG,
            "text_len": TINY_MODEL["text_len"],
            "text_tokens": PROMPTS,
            "pixel_frames": 1 + 4 * (NUM_BLOCKS - 1),
            "draws": "every torch.randn / randn_like upstream made, in order (draw.<i>, upstream layout "
            "(batch, frames, channels, h, w)): per block the input noise, then one re-noise per step but the last",
            "encoded": "what the authors' stream_encode returned, block by block (5 pixel frames, then 4 each)",
            "clean": "what the driver decoded, in order (block 0: 2 latent frames; later: the last frame of the "
            "block's output; stream batch: the batch's last row once the pipeline is full)",
            "dtype": "float32 (upstream bf16, cast away)",
        },
        "scenarios": scenarios,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    recorder_main(__doc__, record, "chenfengxu714/StreamDiffusionV2", "tests/goldens/streamdiffusionv2/")
