"""The chunk loops users compare rolldiff with, re-implemented on diffusers' Wan blocks, and rolldiff's own loop.

Every loop generates the same stream: chunks of `chunk_frames` latent frames, each denoised in 4 steps
(1000, 750, 500, 250 warped by shift 5; predict x0, re-noise with fresh noise), then (where the loop does
one) a clean context pass at t = 0 that writes the chunk's K/V. Noise and text embeddings come from the
same seeds, the weights from the same seed, so the loops differ only in how they keep context:

  ours            `KreaRealtimeTransformer3DModel.make_cache` + cached forward + `cache.commit()`, what
                  `KreaRealtimeVideoPipeline` runs.
  self-forcing    the Self-Forcing / LongLive loop: one dict per block `{"k", "v", "global_end_index",
                  "local_end_index"}`, the indices stored as tensors and read with `.item()` in every
                  block (a host sync per block on a GPU); keys stored after RoPE at absolute frame
                  positions, RoPE applied per block in float64 complex arithmetic; when a new chunk would
                  overflow the buffer, everything after the sink is shifted left with a `.clone()`; the
                  attention reads a contiguous slice of the buffer (no mask). Text K/V computed once
                  (`crossattn_cache["is_init"]`).
  krea-recompute  Krea Realtime's server loop: no cache survives a chunk. Each chunk rebuilds a fresh
                  cache from clean latents (the first frame + the last `window - chunk` frames) in one
                  block-causal pass at t = 0, at positions 0.., then denoises the chunk after them; no
                  context pass (the next chunk rebuilds). Built on the same dict cache as self-forcing
                  (Krea's code descends from it). The VAE re-encode of the first frame is not counted.
  cat             diffusers-style: each block keeps the committed K/V (after RoPE) as plain tensors and
                  every step attends to `torch.cat([committed, new])` (a new allocation per step and
                  block, as diffusers' `GlmImageKVCache` reads its condition); the context pass's
                  concatenation becomes the cache, trimmed to sink + recent with another `torch.cat`.

The baselines run diffusers' `WanTransformer3DModel` (the parent of our model) with their own attention
processors, so the blocks, embeddings and weights are the same modules as ours.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_wan import WanAttention, WanTransformer3DModel

from rolldiff import ChunkLayout, KreaRealtimeTransformer3DModel

DENOISING_STEPS = (1000, 750, 500, 250)
SHIFT = 5.0
APPROACHES = ("ours", "self-forcing", "krea-recompute", "cat")
LABELS = {
    "ours": "rolldiff `RollingKVCache` (ours)",
    "self-forcing": "Self-Forcing / LongLive loop (dict cache, `.item()`, shift-with-clone)",
    "krea-recompute": "Krea recompute-each-chunk loop",
    "cat": "diffusers-style per-step `torch.cat`",
}


@dataclasses.dataclass
class Setup:
    """What every loop shares; picklable, so it can be sent to a worker process."""

    model_config: dict
    latent_hw: tuple[int, int]
    text_tokens: int
    chunk_frames: int = 3
    sink_frames: int = 1
    window_frames: int = 5
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0


def sigma_for_step(step: float) -> float:
    """Wan's shifted flow-matching noise level of a denoising step value in [0, 1000]."""
    s = step / 1000.0
    return SHIFT * s / (1 + (SHIFT - 1) * s)


def build_model(setup: Setup, cls=KreaRealtimeTransformer3DModel) -> torch.nn.Module:
    """The model from the setup's seed (every loop gets the same weights), cast as `from_pretrained` would."""
    from _common import cast_like_from_pretrained

    torch.manual_seed(setup.seed)
    with torch.device(setup.device):
        model = cls(**setup.model_config).eval().requires_grad_(False)
    cast_like_from_pretrained(model, getattr(torch, setup.dtype))
    return model


def weight_checksum(model: torch.nn.Module) -> float:
    return float(sum(p.double().sum() for p in model.parameters()))


def _sdpa(query, key, value, mask=None):
    """SDPA on `(batch, tokens, heads, head_dim)` tensors."""
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), mask)
    return out.transpose(1, 2)


def _project(attn: WanAttention, hidden_states: torch.Tensor):
    """q, k, v `(B, L, H, D)` of a self-attention, with Wan's q/k RMS norms."""
    query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
    key = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
    value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
    return query, key, value


def _out(attn: WanAttention, out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(like)))


# ----------------------------------------------------------------------------------------- state of a call
@dataclasses.dataclass
class ResearchCall:
    """What the research loops pass down to their blocks (their forward takes `kv_cache`, `current_start`)."""

    grid: tuple[int, int, int] = (1, 1, 1)  # post-patch (frames, height, width) of this call
    current_start: int = 0  # global token index of the call's first token
    kv_cache: list[dict] = dataclasses.field(default_factory=list)
    crossattn_cache: list[dict] = dataclasses.field(default_factory=list)
    frame_mask: torch.Tensor | None = None  # (tokens, tokens) bool for a block-causal multi-chunk pass
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin) (1, L, 1, D) of this call (cat loop)


def complex_rope_tables(model: WanTransformer3DModel) -> list[torch.Tensor]:
    """Per-axis complex128 RoPE tables `(positions, dim/2)` for (frames, height, width), as Self-Forcing keeps
    them: built once, from the model's own (float64) cos/sin tables."""
    rope = model.rope
    split = [rope.t_dim, rope.h_dim, rope.w_dim]
    cos, sin = rope.freqs_cos.double().split(split, dim=1), rope.freqs_sin.double().split(split, dim=1)
    return [torch.complex(c[:, 0::2], s[:, 0::2]) for c, s in zip(cos, sin)]


def rope_apply_complex(x: torch.Tensor, grid, tables, start_frame: int) -> torch.Tensor:
    """Rotate `x` `(1, L, H, D)` at frames `start_frame..` in float64 complex arithmetic (Self-Forcing's way)."""
    frames, height, width = grid
    seq_len = frames * height * width
    x_complex = torch.view_as_complex(x[0].to(torch.float64).reshape(seq_len, x.shape[2], -1, 2))
    table_f, table_h, table_w = tables
    freqs = torch.cat(
        [
            table_f[start_frame : start_frame + frames].view(frames, 1, 1, -1).expand(frames, height, width, -1),
            table_h[:height].view(1, height, 1, -1).expand(frames, height, width, -1),
            table_w[:width].view(1, 1, width, -1).expand(frames, height, width, -1),
        ],
        dim=-1,
    ).reshape(seq_len, 1, -1)
    return torch.view_as_real(x_complex * freqs).flatten(2)[None].type_as(x)


def real_rope(model: WanTransformer3DModel, grid, start_frame: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' real-valued RoPE `(cos, sin)` `(1, L, 1, D)` for frames `start_frame..` (once per forward)."""
    rope = model.rope
    frames, height, width = grid
    split = [rope.t_dim, rope.h_dim, rope.w_dim]
    tables = []
    for full in (rope.freqs_cos, rope.freqs_sin):
        part_f, part_h, part_w = full.split(split, dim=1)
        table = torch.cat(
            [
                part_f[start_frame : start_frame + frames].view(frames, 1, 1, -1).expand(frames, height, width, -1),
                part_h[:height].view(1, height, 1, -1).expand(frames, height, width, -1),
                part_w[:width].view(1, 1, width, -1).expand(frames, height, width, -1),
            ],
            dim=-1,
        )
        tables.append(table.reshape(1, frames * height * width, 1, -1).to(torch.float32))
    return tables[0], tables[1]


def apply_real_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' Wan rotation of interleaved pairs."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)


# ----------------------------------------------------------------------------------------- processors
class DictCacheSelfAttn:
    """Self-Forcing / LongLive cached self-attention of block `index` (their causal attention, re-implemented)."""

    def __init__(self, index: int, call: ResearchCall, tables: list[torch.Tensor], sink_tokens: int) -> None:
        self.index, self.call, self.tables, self.sink_tokens = index, call, tables, sink_tokens

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        call = self.call
        query, key, value = _project(attn, hidden_states)
        cache = call.kv_cache[self.index]
        frame_tokens = call.grid[1] * call.grid[2]
        start_frame = call.current_start // frame_tokens
        query = rope_apply_complex(query, call.grid, self.tables, start_frame).type_as(value)
        key = rope_apply_complex(key, call.grid, self.tables, start_frame).type_as(value)
        num_new = query.shape[1]
        current_end = call.current_start + num_new
        capacity = cache["k"].shape[1]
        global_end, local_end = cache["global_end_index"].item(), cache["local_end_index"].item()  # host syncs
        if current_end > global_end and num_new + local_end > capacity:  # a new chunk overflows: shift left
            evicted = num_new + local_end - capacity
            rolled = local_end - evicted - self.sink_tokens
            source = slice(self.sink_tokens + evicted, self.sink_tokens + evicted + rolled)
            target = slice(self.sink_tokens, self.sink_tokens + rolled)
            cache["k"][:, target] = cache["k"][:, source].clone()
            cache["v"][:, target] = cache["v"][:, source].clone()
            local_end = local_end + current_end - cache["global_end_index"].item() - evicted
        else:
            local_end = local_end + current_end - cache["global_end_index"].item()
        local_start = local_end - num_new
        cache["k"][:, local_start:local_end] = key
        cache["v"][:, local_start:local_end] = value
        mask = call.frame_mask
        if mask is not None:  # a multi-chunk rebuild pass: block-causal among the tokens written now
            keys, values = cache["k"][:, local_start:local_end], cache["v"][:, local_start:local_end]
            out = _sdpa(query, keys, values, mask[None, None])
        else:
            out = _sdpa(query, cache["k"][:, :local_end], cache["v"][:, :local_end])
        cache["global_end_index"].fill_(current_end)
        cache["local_end_index"].fill_(local_end)
        return _out(attn, out, query)


class CatSelfAttn:
    """diffusers-style cached self-attention: `torch.cat([committed, new])` at every step."""

    def __init__(self, index: int, call: ResearchCall) -> None:
        self.index, self.call = index, call

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        query, key, value = _project(attn, hidden_states)
        query, key = apply_real_rope(query, *self.call.rope), apply_real_rope(key, *self.call.rope)
        cache = self.call.kv_cache[self.index]
        if cache["k"] is not None:
            key, value = torch.cat([cache["k"], key], dim=1), torch.cat([cache["v"], value], dim=1)
        cache["pending"] = (key, value)
        return _out(attn, _sdpa(query, key, value), query)


class OnceCrossAttn:
    """Text cross-attention whose K/V are computed at the first call and reused (`is_init`)."""

    def __init__(self, index: int, call: ResearchCall) -> None:
        self.index, self.call = index, call

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        cache = self.call.crossattn_cache[self.index]
        if not cache["is_init"]:
            cache["k"] = attn.norm_k(attn.to_k(encoder_hidden_states)).unflatten(2, (attn.heads, -1))
            cache["v"] = attn.to_v(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            cache["is_init"] = True
        return _out(attn, _sdpa(query, cache["k"], cache["v"]), query)


# ----------------------------------------------------------------------------------------- loops
class ChunkLoop:
    """The few-step chunk loop every approach shares; subclasses keep context their own way."""

    def __init__(self, setup: Setup, model_cls=KreaRealtimeTransformer3DModel) -> None:
        self.setup = setup
        self.device, self.dtype = setup.device, getattr(torch, setup.dtype)
        self.model = build_model(setup, model_cls)
        config = setup.model_config
        _, p_h, p_w = config["patch_size"]
        self.grid_hw = (setup.latent_hw[0] // p_h, setup.latent_hw[1] // p_w)
        self.tokens_per_frame = self.grid_hw[0] * self.grid_hw[1]
        self.layout = ChunkLayout(
            tokens_per_frame=self.tokens_per_frame,
            chunk_frames=setup.chunk_frames,
            sink_frames=setup.sink_frames,
            window_frames=setup.window_frames,
            position_mode="absolute",
        )
        text_generator = torch.Generator(self.device).manual_seed(setup.seed + 1)
        self.text = torch.randn(
            1, setup.text_tokens, config["text_dim"], generator=text_generator, device=self.device
        ).to(self.dtype)
        self.noise = torch.Generator(self.device).manual_seed(setup.seed + 2)
        self.chunk_shape = (1, config["in_channels"], setup.chunk_frames, *setup.latent_hw)
        self.sigmas = [sigma_for_step(step) for step in DENOISING_STEPS]
        self.frames_done = 0
        self.forward = self.model  # what `denoise` calls; `compile` may swap it

    def velocity(self, latents: torch.Tensor, sigma: float) -> torch.Tensor:
        raise NotImplementedError

    def context_pass(self, clean: torch.Tensor) -> None:
        """Write the clean chunk's K/V (loops that keep a cache)."""

    def before_chunk(self) -> None:
        """Rebuild context (loops that recompute)."""

    def memory_bytes(self) -> int:
        raise NotImplementedError

    def restart(self) -> None:
        """Start a new stream on the same model (and buffers), same prompt, fresh noise; inside inference mode."""
        self.frames_done = 0
        self.noise = torch.Generator(self.device).manual_seed(self.setup.seed + 2)

    def timestep(self, sigma: float) -> torch.Tensor:
        return torch.full((1,), sigma * 1000.0, device=self.device, dtype=torch.float32)

    @torch.inference_mode()
    def chunk(self) -> torch.Tensor:
        """One chunk; returns its clean latents `(1, C, chunk_frames, h, w)`."""
        self.before_chunk()
        noisy = torch.randn(self.chunk_shape, generator=self.noise, device=self.device).to(self.dtype)
        for i, sigma in enumerate(self.sigmas):
            velocity = self.velocity(noisy, sigma)
            clean = (noisy.float() - sigma * velocity.float()).to(self.dtype)
            if i + 1 < len(self.sigmas):
                noise = torch.randn(self.chunk_shape, generator=self.noise, device=self.device)
                sigma_next = self.sigmas[i + 1]
                noisy = ((1 - sigma_next) * clean.float() + sigma_next * noise).to(self.dtype)
        self.context_pass(clean)
        self.frames_done += self.setup.chunk_frames
        return clean


class OursLoop(ChunkLoop):
    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        self.cache = self.model.make_cache(self.layout, 1, self.dtype, self.device)
        self.prepare()

    @torch.inference_mode()
    def prepare(self) -> None:
        """The text K/V into the cache before the first step, as the pipeline does (the prompt-change signal)."""
        self.model.prepare_conditioning(self.cache, self.text)

    def velocity(self, latents, sigma):
        return self.forward(latents, self.timestep(sigma), self.text, kv_cache=self.cache, layout=self.layout).sample

    def context_pass(self, clean):
        self.velocity(clean, 0.0)
        self.cache.commit()

    def memory_bytes(self) -> int:
        return self.cache.memory_bytes()

    @torch.inference_mode()
    def restart(self) -> None:
        super().restart()
        self.cache.reset()
        self.prepare()


class OursPipelinedLoop(OursLoop):
    """Ours with `denoising="pipelined"` (Rolling Forcing's rolling window): every step's chunk in flight at its own
    noise level, ONE forward for all of them per chunk made, then the leaving chunk's context pass. The cache's
    pending region holds the in-flight chunks; the window grows by them, so the committed context each forward
    sees is the sequential loop's (`window - chunk` frames)."""

    def __init__(self, setup: Setup) -> None:
        in_flight = len(DENOISING_STEPS) * setup.chunk_frames
        self.pipelined_layout = ChunkLayout(
            tokens_per_frame=1,  # replaced below, once the grid is known
            chunk_frames=in_flight,
            sink_frames=setup.sink_frames,
            window_frames=setup.window_frames + in_flight - setup.chunk_frames,
        )
        ChunkLoop.__init__(self, setup)
        self.pipelined_layout = dataclasses.replace(self.pipelined_layout, tokens_per_frame=self.tokens_per_frame)
        self.layout = self.pipelined_layout
        self.cache = self.model.make_cache(self.layout, 1, self.dtype, self.device)
        self.in_flight: list[list] = []  # [latents, step]
        self.prepare()

    def _timesteps(self) -> torch.Tensor:
        frames = [self.sigmas[step] * 1000.0 for _, step in self.in_flight for _ in range(self.setup.chunk_frames)]
        return torch.tensor([frames], device=self.device, dtype=torch.float32)

    @torch.inference_mode()
    def chunk(self) -> torch.Tensor:
        """Forwards until the oldest in-flight chunk leaves clean (as many as steps at the start, then one)."""
        while True:
            if len(self.in_flight) < len(self.sigmas):
                noise = torch.randn(self.chunk_shape, generator=self.noise, device=self.device)
                self.in_flight.append([noise.to(self.dtype), 0])
            window = torch.cat([latents for latents, _ in self.in_flight], dim=2)
            velocity = self.forward(window, self._timesteps(), self.text, kv_cache=self.cache, layout=self.layout)
            velocity, clean, going_on = velocity.sample.float(), None, []
            for position, (latents, step) in enumerate(self.in_flight):
                frames = slice(position * self.setup.chunk_frames, (position + 1) * self.setup.chunk_frames)
                x0 = latents.float() - self.sigmas[step] * velocity[:, :, frames]
                if step + 1 == len(self.sigmas):
                    clean = x0.to(self.dtype)
                    continue
                noise = torch.randn(self.chunk_shape, generator=self.noise, device=self.device)
                sigma_next = self.sigmas[step + 1]
                going_on.append([((1 - sigma_next) * x0 + sigma_next * noise).to(self.dtype), step + 1])
            self.in_flight = going_on
            if clean is not None:
                self.context_pass(clean)
                self.frames_done += self.setup.chunk_frames
                return clean

    @torch.inference_mode()
    def restart(self) -> None:
        super().restart()
        self.in_flight = []


class _ResearchLoop(ChunkLoop):
    """A loop on diffusers' `WanTransformer3DModel` with processors that read a `ResearchCall`."""

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup, WanTransformer3DModel)
        self.call = ResearchCall()
        blocks = self.model.blocks
        self.call.crossattn_cache = [{"is_init": False, "k": None, "v": None} for _ in blocks]
        for index, block in enumerate(blocks):
            block.attn2.set_processor(OnceCrossAttn(index, self.call))

    def run(self, latents, sigma, start_frame):
        self.call.grid = (latents.shape[2], *self.grid_hw)
        self.call.current_start = start_frame * self.tokens_per_frame
        return self.forward(latents, self.timestep(sigma), self.text).sample

    def _dict_cache(self, frames: int) -> None:
        """Self-Forcing's `_initialize_kv_cache`: per block, K/V buffers and two index tensors."""
        config = self.setup.model_config
        shape = (1, frames * self.tokens_per_frame, config["num_attention_heads"], config["attention_head_dim"])
        self.call.kv_cache = [
            {
                "k": torch.zeros(shape, dtype=self.dtype, device=self.device),
                "v": torch.zeros(shape, dtype=self.dtype, device=self.device),
                "global_end_index": torch.tensor([0], dtype=torch.long, device=self.device),
                "local_end_index": torch.tensor([0], dtype=torch.long, device=self.device),
            }
            for _ in self.model.blocks
        ]
        tables = complex_rope_tables(self.model)
        sink_tokens = self.setup.sink_frames * self.tokens_per_frame
        for index, block in enumerate(self.model.blocks):
            block.attn1.set_processor(DictCacheSelfAttn(index, self.call, tables, sink_tokens))

    def memory_bytes(self) -> int:
        tensors = [t for layer in self.call.kv_cache + self.call.crossattn_cache for t in layer.values()]
        tensors += [t for layer in self.call.kv_cache for t in layer.get("pending") or ()]
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in tensors
            if isinstance(t, torch.Tensor)
        }
        return sum(storages.values())


class SelfForcingLoop(_ResearchLoop):
    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        self._dict_cache(setup.sink_frames + setup.window_frames)

    @torch.inference_mode()
    def restart(self) -> None:
        super().restart()
        for layer in self.call.kv_cache:
            layer["global_end_index"].zero_()
            layer["local_end_index"].zero_()

    def velocity(self, latents, sigma):
        return self.run(latents, sigma, self.frames_done)

    def context_pass(self, clean):
        self.run(clean, 0.0, self.frames_done)


class KreaRecomputeLoop(_ResearchLoop):
    """Rebuild the cache every chunk from the first frame + the last frames, in one block-causal pass."""

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        self.recent_frames = setup.window_frames - setup.chunk_frames
        self.context_frames = setup.sink_frames + self.recent_frames
        self._dict_cache(self.context_frames + setup.chunk_frames)
        self.first = None  # (1, C, sink, h, w) clean latents of the first frames
        self.recent = None  # (1, C, <= recent, h, w) the last clean latent frames
        self.start_frame = 0

    @torch.inference_mode()
    def restart(self) -> None:
        super().restart()
        self.first = self.recent = None

    def before_chunk(self):
        for layer in self.call.kv_cache:  # a fresh cache: Krea re-initialises it every chunk
            layer["global_end_index"].zero_()
            layer["local_end_index"].zero_()
        self.start_frame = 0
        if self.first is None:
            return
        if self.frames_done <= self.setup.sink_frames + self.recent_frames:
            context = torch.cat([self.first, self.recent], dim=2)[:, :, : self.frames_done]  # nothing dropped yet
        else:
            context = torch.cat([self.first, self.recent], dim=2)
        frames = context.shape[2]
        self.call.frame_mask = block_causal_token_mask(frames, self.setup.chunk_frames, self.tokens_per_frame)
        self.run(context, 0.0, 0)
        self.call.frame_mask = None
        self.start_frame = frames

    def velocity(self, latents, sigma):
        return self.run(latents, sigma, self.start_frame)

    def context_pass(self, clean):  # no pass: remember the clean frames for the next rebuild
        sink = self.setup.sink_frames
        if self.first is None:
            self.first, rest = clean[:, :, :sink], clean[:, :, sink:]
            self.recent = rest[:, :, -self.recent_frames :]
        else:
            self.recent = torch.cat([self.recent, clean], dim=2)[:, :, -self.recent_frames :]


def block_causal_token_mask(frames: int, chunk_frames: int, tokens_per_frame: int) -> torch.Tensor | None:
    """`(tokens, tokens)` bool, True = attend: frame f sees frames of its own and earlier chunks; None if one chunk."""
    if frames <= chunk_frames:
        return None
    chunk_of = torch.arange(frames) // chunk_frames
    frame_mask = chunk_of[None, :] <= chunk_of[:, None]
    return frame_mask.repeat_interleave(tokens_per_frame, 0).repeat_interleave(tokens_per_frame, 1)


class CatLoop(_ResearchLoop):
    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        self.call.kv_cache = [{"k": None, "v": None, "pending": None} for _ in self.model.blocks]
        for index, block in enumerate(self.model.blocks):
            block.attn1.set_processor(CatSelfAttn(index, self.call))
        self.sink_tokens = setup.sink_frames * self.tokens_per_frame
        self.recent_tokens = (setup.window_frames - setup.chunk_frames) * self.tokens_per_frame

    @torch.inference_mode()
    def restart(self) -> None:
        super().restart()
        for layer in self.call.kv_cache:
            layer.update(k=None, v=None, pending=None)

    def run(self, latents, sigma, start_frame):
        grid = (latents.shape[2], *self.grid_hw)
        self.call.rope = real_rope(self.model, grid, start_frame, self.dtype)
        return super().run(latents, sigma, start_frame)

    def velocity(self, latents, sigma):
        return self.run(latents, sigma, self.frames_done)

    def context_pass(self, clean):
        self.run(clean, 0.0, self.frames_done)
        for layer in self.call.kv_cache:  # commit: the concatenation, trimmed to sink + recent
            keys, values = layer.pop("pending")
            if keys.shape[1] > self.sink_tokens + self.recent_tokens:
                keep = self.recent_tokens
                keys = torch.cat([keys[:, : self.sink_tokens], keys[:, keys.shape[1] - keep :]], dim=1)
                values = torch.cat([values[:, : self.sink_tokens], values[:, values.shape[1] - keep :]], dim=1)
            layer.update(k=keys, v=values, pending=None)


LOOPS = {
    "ours": OursLoop,
    "ours-pipelined": OursPipelinedLoop,
    "self-forcing": SelfForcingLoop,
    "krea-recompute": KreaRecomputeLoop,
    "cat": CatLoop,
}


def make_loop(approach: str, setup: Setup) -> ChunkLoop:
    if approach not in LOOPS:
        raise ValueError(f"approach must be one of {list(LOOPS)}, got {approach!r}.")
    return LOOPS[approach](setup)


def agree_until(approach: str) -> int:
    """Chunks whose clean latents must equal ours: all for self-forcing and cat (same frames, same positions);
    Krea's recompute only until its rebuilt context first drops a frame (then it re-indexes and re-encodes)."""
    return 2 if approach == "krea-recompute" else math.inf
