"""Record the `longsana` goldens from the authors' code: tiny random SANA-Video weights, CPU, fp32 (+ an fp64 floor).

Upstream: github.com/meefs/Sana at 5498e5b, a fork of NVlabs/Sana whose LongSANA sampler and model files are the
NVlabs ones (NVlabs/Sana itself is over the fetch tool's size limit). Extract the tree OUTSIDE this repository, then

    python tools/record_longsana_goldens.py --upstream /work/upstream/sana --out tests/goldens/longsana/

What is recorded (file:line at 5498e5b):
- `golden.plain.safetensors`, plain generation: `LongLiveFlowEuler.sample`
  (diffusion/scheduler/longlive_flow_euler_sampler.py:443-535) over `SanaMSVideo.forward_long`
  (diffusion/model/nets/sana_multi_scale_video.py:673-768): chunks of `base_chunk_frames` with the first chunk
  taking the leftover frames (:401-412), raw steps [1000, 960, 889, 727] fed as the model's timestep, truncated to
  integers (sana_multi_scale_video.py:686), each step's sigma the nearest entry of the 1000-entry shift-7 table
  (:192-193, 237-239), x0 = x - sigma v (in fp64, :233-240), re-noised with a fresh draw (:500-506), then the clean
  t = 0 pass that writes the chunk's state (:521-533). Plus `forward.*`: one `forward_long` on an empty state (the
  base model on one chunk; the converter's check, tests/test_sana_conversion.py).
- `golden.switch_early.safetensors` / `golden.switch_late.safetensors`: the interactive pipeline
  `SanaInferenceInteractivePipeline.inference_interactive`
  (diffusion/longsana/pipeline/sana_inference_interactive_pipeline.py:159-386) with `recache_on_prompt_switch`
  (:277-309): before the first chunk of a new prompt, chunk i-1 is re-run at t = 0 under the new prompt on
  `_accumulate_kv_cache(kv_cache, i - 1)` (:135-156) and its state replaced. Early: switch at chunk 1, where
  `_accumulate_kv_cache(kv_cache, 0)` returns chunk 0's OWN saved entry (:137-138), so chunk 0 is re-run over its
  own old state (vk, k_sum and temporal-conv frame). Late: switch at chunk 3 (chunk 2 re-run on chunks 0-1).
- `transformer.safetensors`: the tiny model's random weights in upstream's own key layout (`SanaMSVideo.state_dict()`,
  buffers included); `meta.json`: configs (upstream and diffusers terms), settings, segments, sigmas and the floor
  (max |upstream fp32 - upstream fp64| over the clean latents, same weights, embeddings and noise).

Stubs needed on CPU (none replaces upstream maths):
- package `__init__`s are skipped (they import every sampler, trainer, VAE and mmcv): `diffusion`, `diffusion.model`,
  ... are empty packages whose modules load from the tree;
- `timm` (not installable here without torchvision): `Attention` (the `qkv`/`proj` layers that `LiteLAReLURope`
  subclasses; its forward is never called), `Mlp` (fc1 -> act -> fc2: the caption projection), `DropPath`
  (drop_path = 0);
- `mmcv.Registry` (registration only), `mmcv.runner.get_dist_info`, `termcolor.colored`, `importlib_metadata`
  (-> `importlib.metadata`); `diffusion.model.builder` (only `MODELS`; the real one imports every VAE and dataset),
  `diffusion.utils.dist_utils` (`get_rank` -> 0), `diffusion.utils.logger`, `diffusion.model.wan.model`
  (`BlockHook`, a type annotation);
- xformers is absent, so the cross-attention takes its SDPA branch with the text mask as an additive -10000 bias
  (sana_blocks.py:86-91); that branch needs `mask` (sana_multi_scale_video.py:730-743), which the real pipeline passes;
- `torch.randn_like` is wrapped while sampling so every re-noising draw is recorded (and replayed in the fp64 run);
- `fp32_attention` (true in the LongSANA config) is left unset: a no-op in fp32, and it would cast the fp64 run to fp32.
No CUDA call is made at import on this path and no size is hard-coded for the 2B model.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.machinery
import importlib.metadata
import json
import logging
import sys
import types
from pathlib import Path
from unittest import mock

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput  # noqa: F401  loaded before the stubs
from einops import rearrange
from safetensors.torch import save_file
from torch import nn

UPSTREAM_REPO = "github.com/meefs/Sana"
UPSTREAM_COMMIT = "5498e5b2070ef8c808ee7eab7f7c7707b53cd8ea"

# The tiny model in upstream terms (`SanaMSVideo` arguments); the LongSANA 2B config
# (configs/sana_video_config/Sana_2000M_480px_adamW_fsdp_longsana.yaml) with sizes shrunk. Self-attention heads are
# hidden_size // linear_head_dim = 2 x 16; cross-attention heads num_heads = 4 x 8 (different on purpose, so a
# converter that mixes them up fails).
UPSTREAM_CONFIG = dict(
    input_size=4,
    patch_size=(1, 2, 2),
    in_channels=4,
    hidden_size=32,
    depth=3,
    num_heads=4,
    mlp_ratio=3.0,
    pred_sigma=False,
    learn_sigma=False,
    caption_channels=24,
    model_max_length=8,
    qk_norm=True,
    y_norm=True,
    y_norm_scale_factor=0.01,
    attn_type="cachedcausal",
    ffn_type="CachedGLUMBConvTemp",
    linear_head_dim=16,
    cross_norm=True,
    mlp_acts=("silu", "silu", None),
    use_pe=True,
    pos_embed_type="casual_wan_rope",
    t_kernel_size=3,
    class_dropout_prob=0.0,
)
# The same model as diffusers' `SanaVideoTransformer3DModel` config (what our converter's weights load into).
DIFFUSERS_CONFIG = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=3,
    num_cross_attention_heads=4,
    cross_attention_head_dim=8,
    cross_attention_dim=32,
    caption_channels=24,
    mlp_ratio=3.0,
    attention_bias=False,
    patch_size=[1, 2, 2],
    norm_elementwise_affine=False,
    norm_eps=1e-6,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=1024,
)
RECIPE = dict(
    base_chunk_frames=10,  # LongSANA's 10 latent frames per chunk (inference_sana_video.py:305)
    num_cached_blocks=-1,  # every earlier chunk (the default)
    denoising_step_list=[1000, 960, 889, 727],  # LongLiveFlowEuler's default (:333), also the longsana.yaml list
    flow_shift=7.0,  # inference_flow_shift of the LongSANA config
)
LATENT_FRAMES, LATENT_HEIGHT, LATENT_WIDTH = 53, 4, 6  # 5 chunks: 13 (10 + the 3 leftover frames), then 10 each
TEXT_LENGTHS = {"a": 5, "b": 7, "c": 6}  # valid tokens of each prompt; the rest is padding (zeros, mask 0)
# scenario -> (prompts, chunks per prompt); None: the plain sampler. Switches before chunk 1 (early) and 3 (late).
SCENARIOS = {"plain": (["a"], None), "switch_early": (["a", "b"], [1, 4]), "switch_late": (["a", "c"], [3, 2])}
FORWARD_FRAMES, FORWARD_TIMESTEP = 5, 500


# ----------------------------------------------------------------------------------------- CPU stubs
class _TimmAttention(nn.Module):
    """The layers of timm's `Attention(dim, num_heads, qkv_bias)` that upstream's linear attention inherits."""

    def __init__(self, dim, num_heads=8, qkv_bias=False, qk_norm=False, attn_drop=0.0, proj_drop=0.0, **_):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm, self.k_norm = nn.Identity(), nn.Identity()
        self.attn_drop, self.proj, self.proj_drop = nn.Dropout(attn_drop), nn.Linear(dim, dim), nn.Dropout(proj_drop)


class _TimmMlp(nn.Module):
    """timm's `Mlp`: fc1 -> act -> fc2 (dropout 0, no norm)."""

    def __init__(self, in_features, hidden_features=None, out_features=None, act_layer=nn.GELU, drop=0.0, **_):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features or in_features)
        self.act = act_layer()
        self.fc2 = nn.Linear(hidden_features or in_features, out_features or in_features)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class _Registry:
    def __init__(self, name):
        self.name = name

    def register_module(self, name=None, force=False, module=None):
        return module if module is not None else (lambda cls: cls)


def install_upstream_imports(upstream: Path) -> None:
    """Make `diffusion.*` importable from the upstream tree with the stubs listed in the module docstring."""

    def module(name, **attributes):
        stub = types.ModuleType(name)
        stub.__spec__ = importlib.machinery.ModuleSpec(name, None)  # `find_spec` (diffusers' probes) reads it
        stub.__dict__.update(attributes)
        sys.modules[name] = stub
        return stub

    sys.path.insert(0, str(upstream))
    module("timm")
    module("timm.models")
    module("timm.models.layers", DropPath=lambda p=0.0: nn.Identity())
    module("timm.models.vision_transformer", Attention=_TimmAttention, Mlp=_TimmMlp)
    module("mmcv", Registry=_Registry)
    module("mmcv.runner", get_dist_info=lambda: (0, 1))
    module("mmcv.utils")
    module("mmcv.utils.logging", logger_initialized={})
    module("termcolor", colored=lambda text, *_, **__: text)
    sys.modules["importlib_metadata"] = importlib.metadata
    for package in ("diffusion", "diffusion.model", "diffusion.model.nets", "diffusion.model.wan", "diffusion.utils"):
        module(package).__path__ = [str(upstream / package.replace(".", "/"))]
    for package in ("diffusion.scheduler", "diffusion.longsana", "diffusion.longsana.pipeline"):
        module(package).__path__ = [str(upstream / package.replace(".", "/"))]
    module("diffusion.model.builder", MODELS=_Registry("models"))
    module("diffusion.utils.dist_utils", get_rank=lambda: 0, is_local_master=lambda: True, get_world_size=lambda: 1)
    logger = logging.getLogger("upstream-sana")
    module("diffusion.utils.logger", get_root_logger=lambda *_, **__: logger, get_logger=lambda *_, **__: logger)
    module("diffusion.model.wan.model", BlockHook=type("BlockHook", (), {}))


# ----------------------------------------------------------------------------------------- model and inputs
def build_upstream_model(seed: int = 0) -> nn.Module:
    """The tiny `SanaMSVideo` with every weight random (seeded): upstream zero-inits the temporal conv and the gates."""
    videos = importlib.import_module("diffusion.model.nets.sana_multi_scale_video")
    torch.manual_seed(seed)
    model = videos.SanaMSVideo(**UPSTREAM_CONFIG).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith("norm.weight"):  # RMSNorm gains (q/k norms, the caption norm)
                parameter.copy_(1.0 + 0.1 * noise)
            elif parameter.ndim == 1:  # biases
                parameter.copy_(0.1 * noise)
            elif name.endswith("scale_shift_table"):
                parameter.copy_(noise / parameter.shape[-1] ** 0.5)
            else:  # weights: unit gain, fan_in = everything but the output axis
                parameter.copy_(noise / (parameter[0].numel() ** 0.5))
    return model


def text_embeddings(generator: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`name -> (embeds (1, L, C), mask (1, L) int64)`; padding rows are zeros and masked out."""
    length, channels = UPSTREAM_CONFIG["model_max_length"], UPSTREAM_CONFIG["caption_channels"]
    out = {}
    for name, valid in TEXT_LENGTHS.items():
        mask = (torch.arange(length) < valid).long()[None]
        out[name] = (torch.randn(1, length, channels, generator=generator) * mask[..., None], mask)
    return out


class NoiseTape:
    """`torch.randn_like` for the sampler: draws (recording) or hands back recorded draws in order (replay)."""

    def __init__(self, generator: torch.Generator | None = None, replay: list[torch.Tensor] | None = None) -> None:
        self.generator, self.replay, self.draws = generator, replay, []

    def randn_like(self, tensor: torch.Tensor, **_) -> torch.Tensor:
        if self.replay is not None:
            draw = self.replay[len(self.draws)]
        else:
            draw = torch.randn(tensor.shape, generator=self.generator)
        self.draws.append(draw)
        return draw.to(tensor.dtype)


# ----------------------------------------------------------------------------------------- upstream runs
def run_plain(model, embeds, mask, latents, tape):
    """`LongLiveFlowEuler.sample` on `latents` (1, C, F, H, W): the clean latents (1, C, F, H, W)."""
    sampler = importlib.import_module("diffusion.scheduler.longlive_flow_euler_sampler")
    flow = sampler.LongLiveFlowEuler(
        model,
        condition=embeds[:, None].to(latents.dtype),  # (B, 1, L, C), as inference_sana_video.py:193
        model_kwargs={"mask": mask},
        flow_shift=RECIPE["flow_shift"],
        base_chunk_frames=RECIPE["base_chunk_frames"],
        num_cached_blocks=RECIPE["num_cached_blocks"],
        denoising_step_list=list(RECIPE["denoising_step_list"]),
    )
    with mock.patch.object(torch, "randn_like", tape.randn_like):
        return flow.sample(latents)


class _FixedTextEncoder:
    """Stands in for Gemma: `forward_chi` returns the injected embeddings of the prompts, in order."""

    def __init__(self, embeds: dict[str, tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> None:
        self.embeds, self.dtype = embeds, dtype

    def forward_chi(self, prompts, use_chi_prompt=True):
        return {
            "prompt_embeds": torch.cat([self.embeds[p][0] for p in prompts]).to(self.dtype),
            "mask": torch.cat([self.embeds[p][1] for p in prompts]),
        }


def run_interactive(model, embeds, prompts, prompt_blocks, latents, tape):
    """`SanaInferenceInteractivePipeline.inference_interactive` with the re-cache on: clean latents (1, C, F, H, W)."""
    sampler = importlib.import_module("diffusion.scheduler.longlive_flow_euler_sampler")
    interactive = importlib.import_module("diffusion.longsana.pipeline.sana_inference_interactive_pipeline")
    args = types.SimpleNamespace(
        num_frame_per_block=RECIPE["base_chunk_frames"],
        denoising_step_list=list(RECIPE["denoising_step_list"]),
        timestep_shift=RECIPE["flow_shift"],
        num_cached_blocks=RECIPE["num_cached_blocks"],
        recache_on_prompt_switch=True,
        prompt_blocks=prompt_blocks,
        motion_score=0,
    )
    generator = sampler.SanaModelWrapper(model, flow_shift=RECIPE["flow_shift"])
    pipeline = interactive.SanaInferenceInteractivePipeline(
        args, latents.device, generator, _FixedTextEncoder(embeds, latents.dtype), vae=None
    )
    with mock.patch.object(torch, "randn_like", tape.randn_like):
        video, _ = pipeline.inference_interactive(latents, prompts, return_latents=True)
    return rearrange(video, "b f c h w -> b c f h w")


def run_forward(model, x, embeds, mask):
    """One `forward_long` of `x` (1, C, F, H, W) at frames 0..F-1 on an empty state: the velocity (1, C, F, H, W)."""
    empty = [[None, None, None] for _ in model.blocks]
    timestep = torch.full((1,), float(FORWARD_TIMESTEP), dtype=x.dtype)
    out, _ = model(x, timestep, embeds[:, None].to(x.dtype), mask=mask, start_f=0, end_f=x.shape[2], kv_cache=empty)
    return out


# ----------------------------------------------------------------------------------------- recording
def segments(draws: list[torch.Tensor]) -> list[list[int]]:
    """`[start, end)` latent frames of each chunk, read off upstream's own draws (one per step after the first).

    Upstream's rule (`_create_autoregressive_segments`, :401-412): chunks of `base_chunk_frames`, the first one
    taking the leftover frames; the recorded sizes are checked against it.
    """
    per_chunk = len(RECIPE["denoising_step_list"]) - 1
    sizes = [draw.shape[0] for draw in draws[::per_chunk]]  # (B * F, C, H, W) with B = 1
    chunk = RECIPE["base_chunk_frames"]
    expected = [chunk + LATENT_FRAMES % chunk] + [chunk] * (LATENT_FRAMES // chunk - 1)
    if sizes != expected:
        raise RuntimeError(f"upstream made chunks of {sizes} frames, expected {expected}")
    ends = torch.tensor(sizes).cumsum(0).tolist()
    return [[end - size, end] for size, end in zip(sizes, ends)]


def step_sigmas() -> list[float]:
    """The sigma upstream uses at each raw step: the nearest entry of SanaModelWrapper's table (fp64, as :233-238)."""
    sampler = importlib.import_module("diffusion.scheduler.longlive_flow_euler_sampler")
    scheduler = sampler.SanaModelWrapper(nn.Identity(), flow_shift=RECIPE["flow_shift"]).scheduler
    timesteps, sigmas = scheduler.timesteps.double(), scheduler.sigmas.double()
    return [float(sigmas[(timesteps - t).abs().argmin()]) for t in RECIPE["denoising_step_list"]]


def noise_entries(latents: torch.Tensor, draws: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """`noise.<chunk>.<step>` in diffusers' layout, in the order a chunk loop consumes them.

    Step 0 is the chunk's slice of the one initial draw (the whole video's noise, drawn before the loop); steps
    1.. are the re-noising draws, one per step after the first (`randn_like(pred_x0.flatten(0, 1))`, (B * F, C, H, W)).
    """
    out, steps = {}, len(RECIPE["denoising_step_list"])
    for chunk, (start, end) in enumerate(segments(draws)):
        out[f"noise.{chunk}.0"] = latents[:, :, start:end]
        for step in range(1, steps):
            draw = draws[chunk * (steps - 1) + step - 1]
            out[f"noise.{chunk}.{step}"] = rearrange(draw, "(b f) c h w -> b c f h w", b=latents.shape[0])
    return out


def record_scenario(model, model64, embeds, run, generator) -> tuple[dict[str, torch.Tensor], float, list]:
    """Run `run(model, embeds, latents, tape)` in fp32 (recording the noise) and in fp64 (replaying it)."""
    shape = (1, UPSTREAM_CONFIG["in_channels"], LATENT_FRAMES, LATENT_HEIGHT, LATENT_WIDTH)
    latents = torch.randn(shape, generator=generator)
    tape = NoiseTape(generator)
    clean = run(model, embeds, latents, tape)
    embeds64 = {name: (e.double(), m) for name, (e, m) in embeds.items()}
    clean64 = run(model64, embeds64, latents.double(), NoiseTape(replay=tape.draws))
    tensors = noise_entries(latents, tape.draws)
    bounds = segments(tape.draws)
    for chunk, (start, end) in enumerate(bounds):
        tensors[f"clean.{chunk}"] = clean[:, :, start:end]
    return tensors, float((clean.double() - clean64).abs().max()), bounds


def record(upstream: Path, out: Path) -> dict:
    """Write the golden folder `out`; returns the meta."""
    install_upstream_imports(upstream.resolve())
    model = build_upstream_model(seed=0)
    model64 = copy.deepcopy(model).double()
    generator = torch.Generator().manual_seed(1)
    embeds = text_embeddings(generator)
    text = {f"text.{n}": e for n, (e, _) in embeds.items()} | {f"text_mask.{n}": m for n, (_, m) in embeds.items()}

    tensors, floors, bounds = {}, {}, {}
    with torch.no_grad():
        for scenario, (prompts, blocks) in SCENARIOS.items():
            if blocks is None:  # plain LongLiveFlowEuler.sample, one prompt
                run = lambda m, e, x, tape, p=prompts[0]: run_plain(m, *e[p], x, tape)  # noqa: E731
            else:
                run = lambda m, e, x, tape, p=prompts, b=blocks: run_interactive(m, e, p, b, x, tape)  # noqa: E731
            tensors[scenario], floors[scenario], bounds[scenario] = record_scenario(
                model, model64, embeds, run, generator
            )
        shape = (1, UPSTREAM_CONFIG["in_channels"], FORWARD_FRAMES, LATENT_HEIGHT, LATENT_WIDTH)
        x = torch.randn(shape, generator=generator)
        forward = run_forward(model, x, *embeds["a"])
        floors["forward"] = float((forward.double() - run_forward(model64, x.double(), *embeds["a"])).abs().max())
    tensors["plain"] |= {"forward.input": x, "forward.output": forward}

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "transformer.safetensors"))
    for scenario, entries in tensors.items():
        save_file(
            {k: v.contiguous() for k, v in (entries | text).items()}, str(out / f"golden.{scenario}.safetensors")
        )
    meta = build_meta(floors, bounds)
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def scenario_meta(scenario: str, floor: float, bounds: list[list[int]]) -> dict:
    prompts, blocks = SCENARIOS[scenario]
    chunk_prompts = (
        [prompts[0]] * len(bounds) if blocks is None else [p for p, n in zip(prompts, blocks) for _ in range(n)]
    )
    switch = None
    if blocks is not None:
        before = blocks[0]
        switch = {
            "before_chunk": before,
            "to": prompts[1],
            "recache_chunk": before - 1,
            "recache_past": (
                "chunk 0's OWN saved state: _accumulate_kv_cache(kv_cache, 0) returns kv_cache[0] (:137-138), which "
                "holds chunk 0's vk, k_sum and conv frame from its context pass"
                if before == 1
                else f"the state summed over chunks 0..{before - 2}, the conv frame of chunk {before - 2}"
            ),
        }
    return {
        "num_chunks": len(bounds),
        "segments": bounds,
        "chunk_prompts": chunk_prompts,
        "prompt_switch": switch,
        "timesteps": [float(int(t)) for t in RECIPE["denoising_step_list"]],  # timestep.long() (:686)
        "sigmas": step_sigmas(),
        "noise_order": [
            f"noise.{c}.{s}" for c in range(len(bounds)) for s in range(len(RECIPE["denoising_step_list"]))
        ],
        "floor": floor,
    }


def build_meta(floors: dict[str, float], bounds: dict[str, list]) -> dict:
    return {
        "upstream": {"repo": UPSTREAM_REPO, "commit": UPSTREAM_COMMIT, "same_sampler_as": "github.com/NVlabs/Sana"},
        "recipe": "longsana",
        "family": "sana",
        "recorded_by": "tools/record_longsana_goldens.py",
        "upstream_model_config": {k: list(v) if isinstance(v, tuple) else v for k, v in UPSTREAM_CONFIG.items()},
        "diffusers_config": DIFFUSERS_CONFIG,
        "latent_size": [LATENT_HEIGHT, LATENT_WIDTH],
        "latent_frames": LATENT_FRAMES,
        "tokens_per_frame": (LATENT_HEIGHT // 2) * (LATENT_WIDTH // 2),
        "settings": {
            "chunk_frames": RECIPE["base_chunk_frames"],
            "first_chunk": "takes the leftover frames: total % chunk_frames more (53 frames -> 13, 10, 10, 10, 10)",
            "sink_frames": 0,
            "num_cached_blocks": RECIPE["num_cached_blocks"],
            "context_policy": "rolling state: every earlier chunk's (vk, k_sum) summed; conv_temp prefixed by the last "
            "input frame of the chunk before (zeros for chunk 0)",
            "context_pass_after_chunk": "t = 0 on the chunk's x0 under the chunk's prompt; writes its state, output discarded",
            "raw_steps": RECIPE["denoising_step_list"],
            "timestep_shift": RECIPE["flow_shift"],
            "sigma_table": "linspace(1, 0, 1001)[:-1] warped by shift 7 (float32); each step's sigma the nearest entry",
            "x0": "x_t - sigma * v, in fp64, cast back (:233-240)",
            "renoise": "(1 - sigma_next) * x0 + sigma_next * randn_like, sigma_next of the nearest entry (:146-162)",
            "output": "the last step's x0",
            "positions": "absolute latent-frame RoPE indices start_f..end_f - 1 (CausalWanRotaryPosEmbed)",
            "recache_on_prompt_switch": "chunk i-1 re-run at t = 0 under the new prompt at its own positions on "
            "_accumulate_kv_cache(kv_cache, i - 1); its (vk, k_sum, conv frame) replaced, not added; switches on chunk "
            "boundaries; no embedding blending",
            "cfg_scale": 1.0,
            "text_len": UPSTREAM_CONFIG["model_max_length"],
            "text_tokens": TEXT_LENGTHS,
            "text_mask": "additive -10000 bias on padded tokens (sana_blocks.py:86-91); padded rows stored as zeros",
            "eps": {
                "linear_attention": 1e-8,
                "self_attention_qk_norm": 1e-5,
                "cross_attention_qk_norm": 1e-6,
                "caption_norm": 1e-5,
                "block_norms": 1e-6,
            },
            "dtype": "float32 (upstream bf16 weights with fp32_attention; here fp32 throughout)",
        },
        "scenarios": {name: scenario_meta(name, floors[name], bounds[name]) for name in SCENARIOS},
        "forward": {
            "frames": FORWARD_FRAMES,
            "timestep": FORWARD_TIMESTEP,
            "text": "a",
            "state": "empty (frames 0..4)",
            "floor": floors["forward"],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", type=Path, required=True, help="extracted meefs/Sana tree at 5498e5b")
    parser.add_argument("--out", type=Path, required=True, help="golden folder, e.g. tests/goldens/longsana/")
    args = parser.parse_args()
    torch.set_num_threads(1)
    meta = record(args.upstream, args.out)
    print(json.dumps({"floors": {k: v["floor"] for k, v in meta["scenarios"].items()}}, indent=1))


if __name__ == "__main__":
    main()
