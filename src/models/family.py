"""The video-family contract: what a transformer provides so that the shared chunk loop can drive it.

A family is a transformer class (one file in `rolldiff.models`) plus a pipeline subclass of
`ChunkedVideoPipeline` (one file in `rolldiff.pipelines`). The transformer implements `VideoTransformer`
below with exactly these signatures; the pipeline implements the hooks listed in `PIPELINE_HOOKS`. Nothing
else is assumed: the loop (`ChunkStream`) reaches the model only through these methods and `forward`.

`tests/test_family_contract.py` runs one suite over every family (equivalence with the dense reference,
equality with diffusers at one chunk, compiled graph count, resume, prompt switch, concurrent callers);
adding a family means implementing this Protocol and joining that suite (docs/model_families.md).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..caching import RollingKVCache
from ..caching.layout import ChunkLayout


@runtime_checkable
class VideoTransformer(Protocol):
    """A causal video transformer that owns its cache layout (implemented by each family's model class)."""

    def tokens_per_frame(self, latent_height: int, latent_width: int) -> int:
        """Tokens of one latent frame of `latent_height x latent_width` latents (after patching)."""
        ...

    def make_cache(
        self,
        layout: ChunkLayout,
        batch_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> RollingKVCache:
        """The family's `RollingKVCache` for `layout`, allocated now if `batch_size` is given (else lazily).

        A family may take storage keywords beyond these (the Krea-like one: `quantization`, `offload`); the
        pipeline's `cache_storage(request)` supplies them.
        """
        ...

    def prepare_conditioning(self, kv_cache: RollingKVCache, encoder_hidden_states: torch.Tensor) -> None:
        """Compute every block's text K/V into `kv_cache` now: the explicit "the prompt changed" signal."""
        ...

    def frame_budget(self, layout: ChunkLayout) -> int | None:
        """The most latent frames whose positions under `layout` the model can represent (None: no limit)."""
        ...

    def check_frame_budget(self, num_latent_frames: int, layout: ChunkLayout) -> None:
        """Refuse, with a clear error, a video past `frame_budget(layout)`."""
        ...

    def committed_frames(self, kv_cache: RollingKVCache, layout: ChunkLayout) -> int:
        """The stream position: latent frames committed to `kv_cache` so far (host int; outside the hot path)."""
        ...


# What a family's pipeline (a `ChunkedVideoPipeline` subclass) implements or may override, by name. The base
# raises NotImplementedError for the first four; docs/model_families.md lists exactly these.
PIPELINE_HOOKS: dict[str, bool] = {  # name -> required
    "make_layout": True,
    "transformer_step": True,
    "recache_frames": True,
    "recache": True,
    "cache_storage": False,
    "make_stream_cache": False,
    "make_decoder": False,
    "make_encoder": False,
    "encode_prompt": False,
}

# The Protocol's methods, in declaration order (read from the class, so the two never drift apart).
TRANSFORMER_METHODS: tuple[str, ...] = tuple(name for name in vars(VideoTransformer) if not name.startswith("_"))
