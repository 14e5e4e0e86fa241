"""Load the recipes' upstream goldens (`tests/goldens/<recipe>/`, written by `tools/record_*_goldens.py`).

A recipe folder holds the tiny transformer in the authors' own key layout (`transformer.safetensors`; Krea and Causal
Forcing also a tiny VAE, `vae.safetensors`, keyed as `Wan2.1_VAE.pth`), `meta.json`
(upstream repo and commit, the tiny config in upstream terms and as our diffusers config, the recipe's settings
and, per scenario, the exact timesteps / sigmas fed, the order noise is drawn in and the fp32-vs-fp64 floor), and
one `golden.<scenario>.safetensors` per scenario: the text embeddings fed to the model (`text.<name>`, with
`text_mask.<name>` where upstream masks padding), every noise tensor upstream drew (`noise.<chunk>.<step>`) and each
chunk's clean latents (`clean.<chunk>`), all in diffusers' layout `(batch, channels, frames, height, width)`;
an image-to-video scenario also its start picture (`image`, uint8 `(height, width, 3)`).

`meta["family"]` names the model the weights go into: "wan" (the default: `KreaRealtimeTransformer3DModel` through
`convert_original_wan_state_dict`) or "sana" (`LongSanaTransformer3DModel` through
`convert_original_sana_video_state_dict`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
from safetensors.torch import load_file

from rolldiff.models import (
    KreaRealtimeTransformer3DModel,
    LongSanaTransformer3DModel,
    convert_original_sana_video_state_dict,
    convert_original_wan_state_dict,
)

GOLDENS = Path(__file__).parent / "goldens"
_FAMILIES = {
    "wan": (KreaRealtimeTransformer3DModel, convert_original_wan_state_dict),
    "sana": (LongSanaTransformer3DModel, convert_original_sana_video_state_dict),
}


class RecordedNoise:
    """Hands out upstream's noise in the order upstream drew it; asking out of order is an error."""

    def __init__(self, tensors: dict[str, torch.Tensor], order: list[str]) -> None:
        self.tensors, self.order, self.position = tensors, order, 0

    def draw(self, chunk: int, step: int) -> torch.Tensor:
        """The noise upstream drew for `chunk` at denoising `step` (0: the chunk's initial noise)."""
        name = f"noise.{chunk}.{step}"
        expected = self.order[self.position] if self.position < len(self.order) else "nothing (all used)"
        if name != expected:
            raise AssertionError(f"The loop asked for {name}, but upstream drew {expected} next.")
        self.position += 1
        return self.tensors[name]

    @property
    def exhausted(self) -> bool:
        return self.position == len(self.order)


@dataclass
class Golden:
    """One scenario of a recipe: its settings, inputs and the upstream clean latents per chunk."""

    recipe: str
    scenario: str
    meta: dict  # the recipe's meta.json
    settings: dict  # meta["scenarios"][scenario]
    text: dict[str, torch.Tensor]
    clean: list[torch.Tensor]
    text_mask: dict[str, torch.Tensor] = field(default_factory=dict)  # (1, text_len), 1 = a real token
    _tensors: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)

    @property
    def tokens_per_frame(self) -> int:
        return self.meta["tokens_per_frame"]

    @property
    def floor(self) -> float:
        """max |upstream fp32 - upstream fp64| over the clean latents: the tolerance nobody can beat."""
        return self.settings["floor"]

    def noise(self) -> RecordedNoise:
        """A fresh noise source for one replay."""
        noise = {k: v for k, v in self._tensors.items() if k.startswith("noise.")}
        return RecordedNoise(noise, self.settings["noise_order"])

    def tensor(self, name: str) -> torch.Tensor:
        """Any other recorded tensor by name (e.g. `forward.input`)."""
        return self._tensors[name]


@cache
def load_meta(recipe: str) -> dict:
    return json.loads((GOLDENS / recipe / "meta.json").read_text())


def load_golden(recipe: str, scenario: str) -> Golden:
    meta = load_meta(recipe)
    tensors = load_file(GOLDENS / recipe / f"golden.{scenario}.safetensors")
    text = {k.removeprefix("text."): v for k, v in tensors.items() if k.startswith("text.")}
    masks = {k.removeprefix("text_mask."): v for k, v in tensors.items() if k.startswith("text_mask.")}
    num_chunks = sum(1 for k in tensors if k.startswith("clean."))
    clean = [tensors[f"clean.{i}"] for i in range(num_chunks)]
    return Golden(recipe, scenario, meta, meta["scenarios"][scenario], text, clean, masks, tensors)


def load_upstream_weights(recipe: str) -> dict[str, torch.Tensor]:
    """The tiny transformer's weights exactly as upstream's `state_dict()` names them."""
    return load_file(GOLDENS / recipe / "transformer.safetensors")


def load_transformer(recipe: str):
    """The recipe's tiny transformer: upstream-format weights through our converter into our model class."""
    meta = load_meta(recipe)
    model_class, convert = _FAMILIES[meta.get("family", "wan")]
    model = model_class(**meta["diffusers_config"])
    model.load_state_dict(convert(load_upstream_weights(recipe)), strict=True)
    return model.eval().requires_grad_(False)


def load_vae(recipe: str) -> AutoencoderKLWan:
    """The recipe's tiny Wan VAE: `Wan2.1_VAE.pth`-format weights through diffusers' converter into its class."""
    weights = load_file(GOLDENS / recipe / "vae.safetensors")
    vae = AutoencoderKLWan(**load_meta(recipe)["vae_diffusers_config"])
    vae.load_state_dict(convert_wan_vae_to_diffusers(weights), strict=True)
    return vae.eval().requires_grad_(False)


def switched_stream(
    pipe, golden: Golden, recipe: str, latent_frames: int, switch: int, scene_cut: bool = False, **call
) -> list[torch.Tensor]:
    """A switch golden replayed: the stream under `recipe` (and `call`'s other arguments) on prompt "a",
    `switch_prompt` to "b" (a hard cut with `scene_cut`) before chunk `switch` (it must apply there); every chunk's
    latents."""
    stream = pipe.stream(
        num_frames=pipe.latent_to_frames(latent_frames), prompt_embeds=golden.text["a"], output_type="latent",
        recipe=recipe, **call,
    )  # fmt: skip
    made = []
    for index in range(stream.num_chunks):
        if index == switch:
            assert stream.switch_prompt(prompt_embeds=golden.text["b"], scene_cut=scene_cut) == switch
        made.append(next(stream))
    return made


def assert_switch_seen(golden: Golden, plain: Golden, switch: int, tolerance: float) -> None:
    """The control of a switch golden: from the switch on, upstream's chunks are far from the unswitched run's."""
    after = zip(golden.clean[switch:], plain.clean[switch:], strict=True)
    assert min(float((a - b).abs().max()) for a, b in after) > 100 * tolerance


class InjectedNoise:
    """Stands in for `randn_tensor` in the stream and the scheduler: upstream's draws, in upstream's order.

    Per chunk the pipeline draws the chunk's noise, then one re-noise per step; upstream draws no re-noise after
    the last step (it would be multiplied by sigma 0), so that draw gets zeros.
    """

    def __init__(self, golden: Golden, steps: int, first_chunk_steps: int | None = None) -> None:
        self.noise, self.steps, self.draws = golden.noise(), steps, 0
        self.first = steps if first_chunk_steps is None else first_chunk_steps  # chunk 0's own step count

    def _chunk_step(self) -> tuple[int, int, int]:
        """(chunk, step, steps of that chunk) of the current draw: chunk 0 draws `first + 1`, the rest `steps + 1`."""
        if self.draws <= self.first:
            return 0, self.draws, self.first
        chunk, step = divmod(self.draws - self.first - 1, self.steps + 1)
        return chunk + 1, step, self.steps

    def __call__(self, shape, generator=None, device=None, dtype=None, **kwargs) -> torch.Tensor:
        chunk, step, steps = self._chunk_step()
        self.draws += 1
        if step == steps:
            return torch.zeros(shape, device=device, dtype=dtype)
        drawn = self.noise.draw(chunk, step)
        assert tuple(drawn.shape) == tuple(shape), (chunk, step, drawn.shape, shape)
        return drawn.to(device=device, dtype=dtype)


def chunk_errors(golden: Golden, chunks: list[torch.Tensor]) -> list[float]:
    """Each chunk's largest difference from upstream's clean latents (the chunks must pair up)."""
    assert len(chunks) == len(golden.clean)
    return [float((made.float() - expected).abs().max()) for made, expected in zip(chunks, golden.clean)]


def inject_noise(golden: Golden, monkeypatch) -> InjectedNoise:
    """Upstream's draws handed to the stream and the scheduler (`InjectedNoise`), in upstream's order, for the
    golden's step counts (a first chunk's own step list included)."""
    from diffusers.schedulers import scheduling_flow_match_euler_discrete as scheduler_module

    from rolldiff.pipelines import stream as stream_module

    first = golden.settings.get("first_timesteps")
    noise = InjectedNoise(golden, len(golden.settings["timesteps"]), None if first is None else len(first))
    monkeypatch.setattr(stream_module, "randn_tensor", noise)
    monkeypatch.setattr(scheduler_module, "randn_tensor", noise)
    return noise


def call_errors(pipe, golden: Golden, recipe: str, monkeypatch) -> list[float]:
    """`pipe(...)` under `recipe` on the golden's prompt "a" with upstream's noise (every draw used): each chunk's
    error against upstream's clean latents, printed with the floor."""
    noise = inject_noise(golden, monkeypatch)
    chunk_frames = golden.meta["settings"]["chunk_frames"]
    latents = pipe(
        num_frames=pipe.latent_to_frames(chunk_frames * len(golden.clean)), prompt_embeds=golden.text["a"],
        output_type="latent", recipe=recipe,
    ).frames  # fmt: skip
    errors = chunk_errors(golden, list(latents.split(chunk_frames, dim=2)))
    print(f"\n{recipe}/{golden.scenario} through pipe(...): max {max(errors):.1e}, floor {golden.floor:.1e}")
    assert noise.noise.exhausted
    return errors
