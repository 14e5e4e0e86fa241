"""Record the `krea-realtime` goldens: Krea Realtime's own server loop, run on CPU with tiny random weights.

Usage:
    python tools/record_krea_goldens.py --upstream /work/upstream/krea --out tests/goldens/krea-realtime/

Upstream: github.com/krea-ai/realtime-video at acf4b7b4e1a3049a0e04782e751d12203334038d. What runs is the
authors' `GenerationSession` (`release_server.py`) itself, block by block through `generate_block_internal`:
- `init_models` (`:542-561`): cache of `kv_cache_num_frames + 3` frames, blocks with `local_attn_size=-1`, the
  scheduler `FlowMatchScheduler(shift=5, sigma_min=0, extra_one_step=True)` with 1000 training steps and a 0
  appended; `get_denoising_schedule` (`v2v.py:133-136`) picks t = 1000, 937.5, 833.3, 625, 0 from it.
- `recompute_kv_cache` (`:588-633`): every block from block 1 builds a fresh K/V buffer in one t=0 forward over
  3 clean context frames at positions 0..2 under the block mask of one 3-frame block (bidirectional);
  `get_clean_context_frames` (`:563-576`): block 1 `[z0, z1, z2]`, later `[z0, z[n-2], z[n-1]]` with
  `keep_first_frame=True`, or (`reencode`, the default) from block 2 the first slot is the VAE re-encode of the
  oldest of the last 9 decoded pixel frames (`frame_context_cache[0]`: the last pixel frame of z[n-3]).
- the denoising steps (`:669-706`): the chunk at positions 3..5 (0..2 in block 0), x0 predicted at each step and
  re-noised to the next t with a fresh draw; the t=0 step is the last, its x0 is the block's latents; no context
  pass after it.
- prompt change (`interpolate_prompt_embeds`, `:459-468`, called by the websocket loop `:1049-1056`): the embeddings
  lerped over 4 blocks; each block pops one after its context rebuild (`:662-666`), resetting the text K/V.
Model: `wan/modules/causal_model.py` (`CausalWanModel`, built tiny) inside `utils/wan_wrapper.py`
(`WanDiffusionWrapper`, x0 from the flow prediction with the sigma of the nearest table entry, `:181-205`).

Stubs needed to run it on a CPU-only torch (nothing else is changed):
- `torch.cuda.current_device()` -> "cpu" (import time and `device=` arguments), inert `torch.cuda.Stream/Event`.
- imports the inference path never calls: `cv2`, `msgpack`, `omegaconf`, `dotenv`, `torchvision` as empty
  modules; `demo_utils.memory` (builds `torch.device("cuda:N")` at import) as names only; the `pipeline` and `wan`
  packages registered by path (their `__init__`s import training code and the 14B/I2V generators).
- attention: `causal_model.attention` and the cross-attention's flash path routed to SDPA at the input dtype (the
  SDPA fallback casts to bf16); `flex_attention` run eagerly (upstream wraps it in `torch.compile` at import).
- hard-coded Wan-1.3B sizes: `frame_seqlen = 1560` in `CausalWanSelfAttention.forward` (a line patch) and
  `CausalInferencePipeline.frame_seq_length` set from the tiny model.
- bf16: `release_server`'s `torch.bfloat16` names the working dtype (fp32, or fp64 for the floor) via a module
  proxy whose `randn` hands out recorded noise; the models run in the working dtype.
- the text encoder returns the stored embeddings; `CausalWanModel.from_pretrained` returns the tiny model;
  `fuse_projections()` runs as in `load_transformer`.
- the VAE (`reencode`): the authors' `VAEEncoderWrapper` / `VAEDecoderWrapper` around a tiny `WanVAE_` (dim 2; the
  decoder's `VAEDecoder3d` built with the same sizes); fed the full-precision tensors the server casts to fp16 right
  before each call; `encode_video_latent` (`v2v.py:138-158`) called at the tiny size instead of the hard-coded
  480x832 (bicubic to the same size is the identity) and without `.cuda()`; the decoder's final `.float()` dropped
  (the floor run is fp64).
- ONE deliberate change (it matters for `reencode` only): Krea's decoder (`demo_utils/vae_block3.py:57-59`, same in its
  `wan/modules/vae.py:115-117`) refills the upsampling time conv's cache with the CURRENT frame twice where Wan 2.1
  (and diffusers' `AutoencoderKLWan`) keeps the previous frame and the current one, so its pixels differ from
  latent frame 3 on (1.68 max on the tiny VAE; unknown on the trained one). The patch restores Wan 2.1's rule, so
  the golden tests the context policy (which pixel frame is re-encoded, how) with a standard Wan VAE.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from unittest import mock

import torch
from _wan_upstream import (
    DIFFUSERS_CONFIG,
    HEIGHT,
    LATENT_SIZE,
    TINY_MODEL,
    TOKENS_PER_FRAME,
    WIDTH,
    NoiseTape,
    load_causal_tree,
    proxied_torch,
    randomize_,
    record_scenario,
    recorder_main,
    table_sigmas,
    text_embeddings,
    tiny_weights,
    tiny_wrapper,
    to_diffusers_layout,
)
from safetensors.torch import save_file

UPSTREAM = {"repo": "krea-ai/realtime-video", "commit": "acf4b7b4e1a3049a0e04782e751d12203334038d"}
MODEL_KWARGS = {"local_attn_size": -1, "sink_size": 0}  # the server sets -1 on every block (`init_models`)
PROMPTS = {"a": 5, "b": 6}  # name -> tokens before the zero padding
SCENARIOS = {
    "keep_first_frame": {"num_blocks": 5, "keep_first_frame": True, "switch": None},
    "prompt_lerp": {"num_blocks": 6, "keep_first_frame": True, "switch": {"before_block": 1, "to": "b", "steps": 4}},
    "reencode": {"num_blocks": 5, "keep_first_frame": False, "switch": None},
}
# The tiny Wan 2.1 VAE (`wan/modules/vae.py` `WanVAE_` init arguments; the real one has dim 96), and the same as
# diffusers' `AutoencoderKLWan` config, with the latent statistics the authors' wrappers hard-code.
VAE_CONFIG = {
    "dim": 2, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
    "temperal_downsample": [False, True, True], "dropout": 0.0,
}  # fmt: skip
VAE_SEED = 3
VAE_BLOCK3_PATCHES = [
    ("out = out.float().clamp_(-1, 1)", "out = out.clamp_(-1, 1)"),  # a cast to fp32: the floor run is fp64
    # Krea's decoder caches the CURRENT frame twice for the upsampling time conv where Wan 2.1 (and diffusers'
    # AutoencoderKLWan) caches the previous one; from latent frame 3 on its pixels differ (see the docstring).
    (
        "padding = torch.where(feat_cache[idx][:, :, -1:, :, :] == 0, 0, cache_x)",
        "padding = feat_cache[idx][:, :, -1:, :, :]",
    ),
]


def load_upstream(root: Path) -> types.SimpleNamespace:
    patches = {
        "wan.modules.causal_model": [("frame_seqlen = 1560", f"frame_seqlen = {TOKENS_PER_FRAME}")],
        "demo_utils.vae_block3": VAE_BLOCK3_PATCHES,
        "v2v": [("interpolate(frames.cuda(),", "interpolate(frames,")],  # the CPU: no `.cuda()`
    }
    return load_causal_tree(
        root,
        patches,
        "demo_utils.memory",
        server="release_server",
        v2v="v2v",
        vae="wan.modules.vae",
        vae_block3="demo_utils.vae_block3",
    )


class FullPrecisionVae:
    """The session's VAE: the authors' `VAEEncoderWrapper` / `VAEDecoderWrapper` (`demo_utils/vae_block3.py`) around
    the tiny VAE, fed the full-precision tensors the server casts to fp16 just before each call
    (`denoised_pred.half()`, `release_server.py:719`; `frame_context_cache[0][0].half()`, `:574`), and encoding at
    the tiny size instead of the hard-coded 480x832 (`:574`)."""

    def __init__(self, up: types.SimpleNamespace, vae_weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        vae = up.vae.WanVAE_(**VAE_CONFIG)
        vae.load_state_dict(vae_weights)
        self.encoder = up.vae_block3.VAEEncoderWrapper(types.SimpleNamespace(model=vae)).to(dtype).eval()
        decoder = up.vae_block3.VAEDecoderWrapper()
        decoder.decoder = up.vae_block3.VAEDecoder3d(
            **{k: VAE_CONFIG[k] for k in ("dim", "z_dim", "dim_mult", "num_res_blocks", "attn_scales")},
            temperal_upsample=VAE_CONFIG["temperal_downsample"][::-1],
        )
        decoder_weights = {k: v for k, v in vae_weights.items() if "decoder." in k or "conv2" in k}  # as `load_vae`
        missing = decoder.load_state_dict(decoder_weights, strict=False).missing_keys
        if sorted(missing) != ["mean", "std"]:  # the wrapper's own latent statistics, not in the checkpoint
            raise RuntimeError(f"VAE decoder weights missing: {missing}")
        self.decoder = decoder.to(dtype).eval()
        self.v2v, self.dtype, self.session = up.v2v, dtype, None

    def decode(self, latents: torch.Tensor, *feature_cache):
        full = self.session.last_pred
        if not torch.equal(latents, full.half()):
            raise RuntimeError("the server decoded something other than the block's latents")
        return self.decoder(full, *feature_cache)

    def encode_video_latent(self, vae, encode_vae_cache, frames=None, **kwargs):
        """`v2v.encode_video_latent` as the server calls it (`:574`), at the tiny size and the working dtype."""
        full = self.session.frame_context_cache[0][0]
        if not torch.equal(frames, full.half()):
            raise RuntimeError("the server re-encoded something other than the oldest cached pixel frame")
        kwargs |= {"frames": full, "height": HEIGHT, "width": WIDTH, "dtype": self.dtype}
        return self.v2v.encode_video_latent(vae, encode_vae_cache, **kwargs)


def tiny_vae_weights(up: types.SimpleNamespace) -> dict[str, torch.Tensor]:
    """Seeded weights of the tiny VAE, keyed as `Wan2.1_VAE.pth` is."""
    vae = up.vae.WanVAE_(**VAE_CONFIG)
    randomize_(vae, VAE_SEED)
    return {k: v.contiguous() for k, v in vae.state_dict().items()}


def build_models(up: types.SimpleNamespace, weights: dict, vae_weights: dict, embeds, dtype: torch.dtype):
    """The server's `Models` around the tiny transformer and VAE, as `load_all` wires them."""
    transformer = tiny_wrapper(up.wan_wrapper, up.causal_model, weights, dtype, timestep_shift=5.0, **MODEL_KWARGS)
    for block in transformer.model.blocks:  # as `load_transformer` does
        block.self_attn.fuse_projections()

    def text_encoder(text_prompts):
        return {"prompt_embeds": embeds[text_prompts[0]].to(dtype).clone()}

    vae = FullPrecisionVae(up, vae_weights, dtype)
    config = types.SimpleNamespace(
        denoising_step_list=[1000, 937, 833, 625, 0], warp_denoising_step=False, num_frame_per_block=3,
        independent_first_frame=False, use_taehv=False,
    )  # fmt: skip
    pipeline = up.causal_inference.CausalInferencePipeline(
        config, device="cpu", generator=transformer, text_encoder=text_encoder, vae=vae.decode
    )
    pipeline.frame_seq_length = TOKENS_PER_FRAME  # hard-coded 1560 (Wan-1.3B at 480x832)
    return up.server.Models(text_encoder, transformer, pipeline, vae.encoder, vae.decode), config, vae


def run_scenario(up, weights: tuple[dict, dict], embeds, scenario: dict, tape: NoiseTape, dtype) -> dict:
    """One session, block by block; returns its clean latents and the schedule it used."""
    models, config, vae = build_models(up, *weights, embeds, dtype)
    params = up.server.GenerateParams(
        prompt="a", width=WIDTH, height=HEIGHT, seed=0, keep_first_frame=scenario["keep_first_frame"],
        kv_cache_num_frames=3, num_blocks=scenario["num_blocks"], num_denoising_steps=5,
    )  # fmt: skip
    clean = []
    with (
        proxied_torch([up.server], tape, dtype),
        mock.patch.object(up.server, "encode_video_latent", vae.encode_video_latent),
    ):
        session = up.server.GenerationSession(params, config, frame_callback=lambda *a: None, models=models)
        vae.session = session
        for block in range(scenario["num_blocks"]):
            switch = scenario["switch"]
            if switch is not None and block == switch["before_block"]:  # the websocket loop, `:1049-1056`
                session.params.prompt = switch["to"]
                session.interpolate_prompt_embeds(models, switch["to"], switch["steps"])
            session.generate_block_internal(models)
            clean.append(to_diffusers_layout(session.last_pred))
    scheduler = models.pipeline.scheduler
    timesteps = [float(t) for t in session.denoising_step_list]
    return {"clean": clean, "timesteps": timesteps, "sigmas": table_sigmas(scheduler, timesteps)}


def record(upstream: Path, out: Path) -> None:
    torch.manual_seed(0)
    up = load_upstream(upstream)
    weights = tiny_weights(up.causal_model, **MODEL_KWARGS)  # Krea's flat `model.` keys
    vae_weights = tiny_vae_weights(up)
    embeds = text_embeddings(PROMPTS)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "transformer.safetensors")
    save_file(vae_weights, out / "vae.safetensors")
    weights = (weights, vae_weights)
    statistics = FullPrecisionVae(up, vae_weights, torch.float32).encoder  # the wrappers' hard-coded mean / std
    scenarios = {}
    for name, scenario in SCENARIOS.items():

        def run(tape, dtype, scenario=scenario):
            return run_scenario(up, weights, embeds, scenario, tape, dtype)

        recorded = record_scenario(run, out, name, scenario["num_blocks"], 3, embeds)
        scenarios[name] = {
            "num_blocks": scenario["num_blocks"],
            "keep_first_frame": scenario["keep_first_frame"],
            "prompt": "a",
            "prompt_switch": scenario["switch"],
            **recorded,
        }
    meta = {
        "upstream": UPSTREAM,
        "recipe": "krea-realtime",
        "upstream_model_config": TINY_MODEL | MODEL_KWARGS,
        "diffusers_config": DIFFUSERS_CONFIG,
        "upstream_vae_config": VAE_CONFIG,
        "vae_diffusers_config": {
            "base_dim": VAE_CONFIG["dim"],
            **{k: VAE_CONFIG[k] for k in ("z_dim", "dim_mult", "num_res_blocks")},
            "attn_scales": VAE_CONFIG["attn_scales"],
            "temperal_downsample": VAE_CONFIG["temperal_downsample"],
            "latents_mean": statistics.mean.tolist(),
            "latents_std": statistics.std.tolist(),
        },
        "vae_patches": [new for _, new in VAE_BLOCK3_PATCHES],
        "latent_size": list(LATENT_SIZE),
        "tokens_per_frame": TOKENS_PER_FRAME,
        "settings": {
            "chunk_frames": 3,
            "context_frames": 3,
            "context_policy": "recompute every block: fresh K/V, one t=0 pass over 3 clean frames at positions "
            "0..2 (block 1: z0, z1, z2; later: z0, z[n-2], z[n-1]), chunk at positions 3..5; block 0: no context",
            "context_pass_after_chunk": False,
            "sink_frames": 0,
            "kv_cache_frames": 6,
            "timestep_shift": 5.0,
            "raw_steps": [1000, 750, 500, 250, 0],
            "x0": "x_t - sigma * flow; sigma of the nearest entry of the 1000-entry table (t=0 -> its last entry)",
            "renoise": "(1 - sigma_next) * x0 + sigma_next * noise, sigma_next of the nearest table entry",
            "text_len": TINY_MODEL["text_len"],
            "text_tokens": PROMPTS,
            "prompt_lerp": "torch.lerp(old, new, linspace(0, 1, steps)[i]) for the i-th block after the change; "
            "the context rebuild of a block runs before its step pops (previous embedding), the denoising after",
            "eps": 1e-6,
            "dtype": "float32 (upstream bf16, cast away)",
        },
        "scenarios": scenarios,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    recorder_main(__doc__, record, "krea-ai/realtime-video", "tests/goldens/krea-realtime/")
