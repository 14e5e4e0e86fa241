"""Model families, each owning its cache."""

from .glm_image import GlmImageCachedTransformer2DModel
from .krea_realtime import (
    ChunkLayout,
    KreaRealtimeTransformer3DModel,
    block_causal_frame_mask,
    teacher_forcing_frame_mask,
)
from .long_sana import LongSanaTransformer3DModel, sana_layout
from .sana_conversion import (
    convert_original_sana_video_state_dict,
    infer_sana_video_config,
    load_original_sana_video_checkpoint,
)
from .tiny_autoencoder import TinyVideoAutoencoder
from .wan_conversion import convert_original_wan_state_dict, infer_wan_config, load_original_wan_checkpoint

__all__ = [
    "ChunkLayout",
    "GlmImageCachedTransformer2DModel",
    "KreaRealtimeTransformer3DModel",
    "LongSanaTransformer3DModel",
    "TinyVideoAutoencoder",
    "block_causal_frame_mask",
    "convert_original_sana_video_state_dict",
    "convert_original_wan_state_dict",
    "infer_sana_video_config",
    "infer_wan_config",
    "load_original_sana_video_checkpoint",
    "load_original_wan_checkpoint",
    "sana_layout",
    "teacher_forcing_frame_mask",
]
