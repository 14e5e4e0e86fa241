"""Recipes: each checkpoint's own inference settings, by name, as its authors' code runs them.

`pipe(prompt, recipe="self-forcing")` (or `stream(...)`, `rolldiff generate --recipe NAME`, or `"recipe"` in a
pipeline folder's `model_index.json`) sets every argument the recipe names; an argument given explicitly wins.
`list_recipes()` lists them, `describe_recipe(name)` shows what one sets and the upstream file it follows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Recipe:
    """A named set of call arguments for one pipeline class, with where it comes from."""

    name: str
    pipeline: str  # the pipeline class it applies to
    upstream: str  # repository, commit and file the settings follow
    settings: dict[str, Any] = field(default_factory=dict)
    notes: str = ""


RECIPES: dict[str, Recipe] = {
    recipe.name: recipe
    for recipe in (
        Recipe(
            "self-forcing",
            "KreaRealtimeVideoPipeline",
            "guandeh17/Self-Forcing@33593df pipeline/causal_inference.py, configs/self_forcing_dmd.yaml",
            dict(
                chunk_frames=3,
                sink_frames=0,
                window_frames=21,  # local_attn_size -1: the whole 21-frame cache, no sink
                position_mode="absolute",
                denoising_steps=(1000, 750, 500, 250),
                sigma_mapping="shift",  # warp_denoising_step: true, through the shift-5 scheduler
                timestep_shift=5.0,
                context_noise=0.0,
                image_mode="frame",  # inference.py:136-147: the image's one latent frame, cached at t=0 first
            ),
            "warp_denoising_step: false is sigma_mapping='table' (the raw steps fed, each sigma the table's nearest "
            "entry); context_noise > 0 runs the context pass at that timestep on the clean latents "
            "(causal_inference.py:227-236). image= (--i2v upstream) commits the image's single latent frame before the first "
            "chunk (causal_inference.py:136-150).",
        ),
        Recipe(
            "rolling-sink",
            "KreaRealtimeVideoPipeline",
            "haodong2000/RollingSink@d7fc0d9 wan/modules/causal_model.py:209,232-283, pipeline/causal_inference.py:277-296, "
            "configs/self_forcing_dmd.yaml",
            dict(
                chunk_frames=3,  # num_frame_per_block: 3
                sink_frames=0,  # the model's sink_size 0
                window_frames=21,  # the 32760-token buffer (21 frames of 1560), now rolling (:209 drops the -1 guard)
                position_mode="relative",  # keys kept before RoPE (k_original), rotated at their slots' positions
                sink_mode="rolling",  # :232-283: past frame 18, each older chunk is replaced by frames 0-17, walked
                denoising_steps=(1000, 750, 500, 250),
                sigma_mapping="shift",  # warp_denoising_step: true
                timestep_shift=5.0,  # model_kwargs.timestep_shift
                context_noise=0.0,  # default_config.yaml; the roll runs at the t = 0 pass only (:247)
            ),
            "Training-free on Self-Forcing (or Causal Forcing chunk-wise) weights for 5-30 minute videos: past the "
            "first 21 frames, at each commit the previous chunk is overwritten by the first 18 frames' K/V walked "
            "forward and back, at its own positions (the sink's content and positions slide). Upstream draws one "
            "chunk of noise and repeats it for every chunk (inference.py:165-170); the stream draws each chunk's.",
        ),
        Recipe(
            "infinity-rope",
            "KreaRealtimeVideoPipeline",
            "yesiltepe-hidir/infinity-rope@63d7b84 wan/modules/causal_model.py:27-80,225-300, "
            "pipeline/causal_inference.py:97-236, configs/self_forcing_dmd.yaml",
            dict(
                chunk_frames=3,  # num_frame_per_block: 3
                sink_frames=1,  # model_kwargs.sink_size: 1
                window_frames=5,  # model_kwargs.local_attn_size: 6 frames with the sink
                position_mode="relative",  # block_relativistic_rope: keys rotated at their place in the buffer
                denoising_steps=(1000, 750, 500, 250),
                sigma_mapping="shift",  # warp_denoising_step: true
                timestep_shift=5.0,
                context_noise=0.0,  # default_config.yaml
                recache="flush",  # kv_flush at every scene boundary: the sink + the last 2 frames, nothing re-run
                image_mode="frame",
            ),
            "Training-free on Self-Forcing-trained weights (its README: Infinite-Forcing's sink checkpoint, or Causal "
            "Forcing chunk-wise) for videos of any length with prompt switches. scene_cuts=[frame, ...] (--cut-at on "
            "the command line) makes a switch a hard cut: its first chunk at RoPE frame 45 (rope_cut). Upstream's "
            "prompt syntax 'a[10s#] | b' marks the cut on the scene BEFORE it (causal_inference.py:101-108); ours names "
            "the frame where the new scene starts. A switch before the window holds 2 frames after the sink keeps "
            "what it has (upstream's flush then copies buffer slots no chunk has written yet). Its --i2v path asserts "
            "on a 1-frame image with 3-frame chunks; image= commits the image's latent frame as self-forcing does.",
        ),
        Recipe(
            "reward-forcing",
            "KreaRealtimeVideoPipeline",
            "JaydenLyh/Reward-Forcing@4317f5a wan/modules/causal_model.py:29-236, pipeline/causal_inference.py, "
            "configs/reward_forcing.yaml",
            dict(
                chunk_frames=3,  # num_frame_per_block: 3
                sink_frames=3,  # model_kwargs.sink_size: 3
                window_frames=6,  # model_kwargs.local_attn_size: 9 frames with the sink
                position_mode="relative",  # causal_rope_apply over [sink, window] from 0: keys rotated where they sit
                sink_mode="ema",  # incremental_update: each evicted chunk blended into the sink, alpha 0.999
                denoising_steps=(1000, 750, 500, 250),
                sigma_mapping="shift",  # warp_denoising_step: true
                timestep_shift=5.0,
                context_noise=0.0,  # default_config.yaml
            ),
            "Reward Forcing's own weights (JaydenLu666/Reward-Forcing-T2V-1.3B rewardforcing.pt): the 3-frame sink is "
            "an exponential average of every chunk that left the 6-frame window (sink = 0.999 sink + 0.001 chunk, "
            "keys before RoPE and values), so it carries the whole video slowly. Its authors switch no prompt (a "
            "prompt_schedule runs our recache='causal', proven on their loop switched alike) and run text-to-video "
            "only (image= commits the picture's chunk as the Krea-like default does).",
        ),
        Recipe(
            "streamdiffusionv2",
            "KreaRealtimeVideoPipeline",
            "chenfengxu714/StreamDiffusionV2@c5a0f20 streamv2v/inference_wo_batch.py:236-372, "
            "models/wan/causal_model.py:268-342, configs/wan_causal_dmd_v2v.yaml",
            dict(
                chunk_frames=1,  # num_frame_per_block: 1
                sink_frames=3,  # num_sink_tokens: 3 (frames)
                window_frames=3,  # num_kv_cache: 6 frame slots = the sink + 3 (the chunk's own slot among them)
                position_mode="absolute",  # keys stored after RoPE, compared so by the adaptive sink
                adaptive_sink=True,  # causal_model.py:284-322, decided per step and per transformer block
                adaptive_sink_threshold=0.2,  # adapt_sink_threshold
                denoising_steps=(1000, 750, 500, 250),  # from pure noise: wan_causal_dmd_t2v.yaml's list
                video_denoising_steps=(700, 500, 400, 200),  # wan_causal_dmd_v2v.yaml, --step 4
                sigma_mapping="table",  # warp_denoising_step: false (the raw step fed, its sigma the table's)
                timestep_shift=8.0,  # FlowMatchScheduler(shift=8.0), models/wan/wan_wrapper.py:163-166
                context_policy="last_step",  # no clean pass: each step writes the cache (causal_model.py:301-337)
                first_chunk="extra_frame",  # block 0 is 1 + 4 pixel frames: 2 latent frames (inference_wo_batch.py:257)
                video_noise_mix="motion",  # noise*s + x*(1-s), s and the first step from the motion (inference.py:51-57)
                normalize_input_latents=False,  # stream_encode(..., is_scale=False) (wan_wrapper.py:134-141)
                image_mode="frame",  # ours (upstream has no image input): the image is the lone first pixel frame
            ),
            "Video-to-video in real time (`video=`, a file or a webcam iterator; `strength` is upstream's "
            "--noise_scale, 0.8 by default as upstream's): one latent frame a chunk after a first chunk of two, "
            "steps 700/500/400/200 with the first chosen by the input's motion, no context pass, and a 3-frame sink "
            "refreshed when a new frame stops resembling it. Text-to-video runs the same loop from noise with "
            "1000/750/500/250; upstream's t2v uses another config (chunks of 3, a 21-frame cache, no sink), so that "
            "use is not proven. image= (not upstream's) is the lone first pixel frame, committed by one t=0 pass. Upstream moves positions past frame 50 back to frame 5 (t_refresh, "
            "inference_wo_batch.py:314-316); ours keep counting (RoPE table of 1024 frames).",
        ),
        Recipe(
            "rolling-forcing",
            "KreaRealtimeVideoPipeline",
            "thu-ml/Causal-Forcing@1fc7bbc long_video/pipeline/rolling_forcing_inference.py:169-300, "
            "long_video/wan/modules/causal_model.py:180-300, long_video/configs/rolling_forcing_dmd.yaml",
            dict(
                chunk_frames=3,  # num_frame_per_block: 3
                denoising="pipelined",  # :169-300: a window of one block per step, one forward for all of them
                sink_frames=3,  # causal_model.py:211: the first block kept as the anchor
                window_frames=18,  # :268: 21 frames (max_attention_size) less the anchor: the query + the working cache
                elastic_window=True,  # :268-272: the working cache grows as the window empties (6, 9, 12, 15 frames)
                context_window_frames=21,  # :247-251: the clean pass sees the last 21 frames, itself included
                position_mode="relative",  # :277-281: the anchor, kept before RoPE, re-roped before the working cache
                denoising_steps=(1000, 750, 500, 250),  # rolling_forcing_dmd.yaml
                sigma_mapping="shift",  # warp_denoising_step: true (rolling_forcing_inference.py:27-29)
                timestep_shift=5.0,  # model_kwargs.timestep_shift
                context_noise=0.0,  # default_config.yaml; the clean pass at t = context_noise (:273-295)
            ),
            "Causal Forcing's minute-long videos (checkpoint chunkwise/longvideo.pt; TencentARC/RollingForcing's loop): "
            "4 chunks in flight at staggered noise levels, one forward per chunk; the leaving chunk's clean pass writes "
            "its K/V seeing the last 21 frames, the anchor only while the video is that short. Upstream has no prompt "
            "switch (a prompt_schedule runs our recache='causal', proven on its loop switched alike) and no image-to-video (its --i2v path "
            "reads `current_start_frame` before assigning it, :141); videos shorter than 4 chunks differ (its filling "
            "windows redraw a block's noise, :215-219).",
        ),
        Recipe(
            "causal-forcing",
            "KreaRealtimeVideoPipeline",
            "thu-ml/Causal-Forcing@1fc7bbc pipeline/causal_inference.py, configs/causal_forcing_dmd_chunkwise.yaml",
            dict(
                chunk_frames=3,  # num_frame_per_block: 3
                sink_frames=0,
                window_frames=21,  # the model's local_attn_size -1: global over the 21-frame buffer
                position_mode="absolute",
                denoising_steps=(1000, 750, 500, 250),  # warp_denoising_step: true (causal_inference.py:29-32)
                sigma_mapping="shift",
                timestep_shift=5.0,  # model_kwargs.timestep_shift
                context_noise=0.0,  # default_config.yaml
                image_mode="frame",  # as self-forcing; upstream refuses chunk-wise --i2v (inference.py:151): unproven
            ),
            "Self-Forcing's loop (the same architecture and causal_inference.py) on Causal Forcing's chunk-wise "
            "distilled weights (causal_ode.pt or causal_cd.pt).",
        ),
        Recipe(
            "causal-forcing-framewise",
            "KreaRealtimeVideoPipeline",
            "thu-ml/Causal-Forcing@1fc7bbc pipeline/causal_inference.py, configs/causal_forcing_dmd_framewise.yaml",
            dict(
                chunk_frames=1,  # num_frame_per_block: 1: a chunk of one latent frame
                sink_frames=0,
                window_frames=21,
                position_mode="absolute",
                denoising_steps=(1000, 750, 500, 250),
                sigma_mapping="shift",
                timestep_shift=5.0,
                context_noise=0.0,
                image_mode="frame",  # a start image is the first latent frame: one block, as every block
            ),
            "Frame-wise: every block is one latent frame, denoised in 4 warped steps.",
        ),
        Recipe(
            "causal-forcing-2step",
            "KreaRealtimeVideoPipeline",
            "thu-ml/Causal-Forcing@1fc7bbc pipeline/causal_inference.py:36-45, configs/causal_forcing_dmd_framewise_2step.yaml",
            dict(
                chunk_frames=1,
                sink_frames=0,
                window_frames=21,
                position_mode="absolute",
                denoising_steps=(1000, 500),
                first_chunk_steps=(1000, 750, 500, 250),  # denoising_step_list_first_chunk (ASD's first frame)
                sigma_mapping="shift",
                timestep_shift=5.0,
                context_noise=0.0,
                image_mode="frame",
            ),
            "Causal Forcing++ 2-step, frame-wise; the first denoised frame runs its own 4-step list.",
        ),
        Recipe(
            "causal-forcing-1step",
            "KreaRealtimeVideoPipeline",
            "thu-ml/Causal-Forcing@1fc7bbc pipeline/causal_inference.py:36-45, configs/causal_forcing_dmd_framewise_1step.yaml",
            dict(
                chunk_frames=1,
                sink_frames=0,
                window_frames=21,
                position_mode="absolute",
                denoising_steps=(1000,),
                first_chunk_steps=(1000, 750, 500, 250),
                sigma_mapping="shift",
                timestep_shift=5.0,
                context_noise=0.0,
                image_mode="frame",
            ),
            "Causal Forcing++ 1-step, frame-wise; the first denoised frame runs its own 4-step list.",
        ),
        Recipe(
            "longlive",
            "KreaRealtimeVideoPipeline",
            "NVlabs/LongLive@2462895 pipeline/causal_inference.py, interactive_causal_inference.py",
            dict(
                chunk_frames=3,
                sink_frames=3,
                window_frames=9,  # local_attn_size 12 = sink 3 + window 9
                position_mode="absolute",
                denoising_steps=(1000, 750, 500, 250),
                sigma_mapping="shift",
                timestep_shift=5.0,
                recache="longlive",
            ),
            "A prompt switch re-runs the last min(12, frame) frames in one unmasked t=0 pass under the new prompt "
            "(interactive_causal_inference.py:54-90); inside the first 12 frames it rewrites the sink too. LongLive's code "
            "takes no start image: image= follows the default (image_mode='chunk').",
        ),
        Recipe(
            "krea-realtime",
            "KreaRealtimeVideoPipeline",
            "krea-ai/realtime-video@acf4b7b release_server.py GenerationSession, v2v.py:133-136",
            dict(
                chunk_frames=3,
                sink_frames=0,
                window_frames=6,  # 3 context frames + the chunk, rebuilt every block
                position_mode="absolute",
                denoising_steps=(1000, 750, 500, 250, 0),  # warped: 1000, 937.5, 833.3, 625, then t = 0
                sigma_mapping="shift",
                timestep_shift=5.0,
                context_policy="recompute",
                recompute_first_frame="reencode",
                prompt_blend_chunks=4,
                image_mode="chunk",  # setup_start_frame: the image repeated 9 times, encoded to block 0
            ),
            "Each chunk rebuilds its context in one t=0 pass from [the first frame, the last 2 latent frames]; from "
            "chunk 2 the first frame is the VAE re-encode of the oldest decoded pixel frame of the last chunk's span "
            "(recompute_first_frame='keep' is upstream's keep_first_frame=True). A prompt change is blended over 4 "
            "chunks (interpolate_prompt_embeds). A start image fills the first chunk (setup_start_frame, release_server.py:578-594).",
        ),
        Recipe(
            "longsana",
            "LongSanaVideoPipeline",
            "NVlabs/Sana (meefs/Sana@5498e5b) diffusion/scheduler/longlive_flow_euler_sampler.py:324-535",
            dict(
                chunk_frames=10,
                sink_frames=0,
                window_frames="all",  # every earlier chunk in the state (num_cached_blocks -1)
                position_mode="absolute",
                denoising_steps=(1000, 960, 889, 727),
                sigma_mapping="table",
                timestep_shift=7.0,
                integer_timesteps=True,
                first_chunk="remainder",
                recache="longsana",
            ),
            "The first chunk takes the leftover frames (53 latent frames = 13 + 4 x 10); every earlier chunk stays in "
            "the state. recache='longsana': a switch re-runs the last chunk at t=0 under the new prompt; before chunk "
            "1 upstream re-runs chunk 0 over chunk 0's own old state, and so does this recipe. The long sampler takes no "
            "start image: image= follows the default (image_mode='chunk').",
        ),
    )
}


def list_recipes(pipeline: str | None = None) -> list[str]:
    """The recipe names (for one pipeline class name, if given)."""
    return sorted(name for name, recipe in RECIPES.items() if pipeline in (None, recipe.pipeline))


def get_recipe(name: str, pipeline: str | None = None) -> Recipe:
    """The recipe `name`; a clear error naming the recipes there are (for `pipeline`) otherwise."""
    recipe = RECIPES.get(name)
    if recipe is None or (pipeline is not None and recipe.pipeline != pipeline):
        raise ValueError(
            f"`recipe` must be one of {list_recipes(pipeline)} for {pipeline or 'rolldiff'}, got {name!r}."
        )
    return recipe


def describe_recipe(name: str) -> str:
    """What `name` sets, one argument a line, with the upstream file it follows."""
    recipe = get_recipe(name)
    lines = [f"{recipe.name} ({recipe.pipeline}): {recipe.upstream}"]
    lines += [f"  {key} = {value!r}" for key, value in recipe.settings.items()]
    if recipe.notes:
        lines.append(f"  note: {recipe.notes}")
    return "\n".join(lines)
