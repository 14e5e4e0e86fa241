"""How much of each published checkpoint's weights sits on the GPU under each `--offload` mode, with and without
`--fp8-storage`: counted from the real configs (every component built on the "meta" device, so nothing is
allocated or downloaded), not measured. Activations, the K/V cache and the CUDA context come on top; the video they
make is compared by `gpu_checks.py`, and peak memory is what `gpu_fps.py` measures once a GPU is lent.

What is resident, per mode (`rolldiff.pipelines.memory`):
  none           every component
  text-encoder   the transformer and the VAE, plus the text encoder's two largest leaves (the one computing and
                 the one prefetched on a side stream) while a prompt is encoded
  model          the larger of: the text encoder alone; the transformer with the VAE (accelerate's hooks send the
                 transformer back only when the VAE runs, and the VAE only when the text encoder runs again)
  blocks         the transformer's parts outside its blocks, two blocks (computing, prefetched), the VAE, and the
                 text encoder's two largest leaves

    python benchmarks/weights_memory.py            # a markdown table, GB = 1e9 bytes
"""

from __future__ import annotations

import sys

import torch
from _common import SANA_2B, WAN_1_3B, markdown_table
from diffusers import AutoencoderKLWan, SanaVideoTransformer3DModel, WanTransformer3DModel
from diffusers.utils import logging as diffusers_logging
from transformers import Gemma2Config, Gemma2Model, UMT5Config, UMT5EncoderModel

from rolldiff.choices import OFFLOAD_MODES

WAN_14B = {**WAN_1_3B, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}
UMT5_XXL = dict(
    vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, feed_forward_proj="gated-gelu"
)  # google/umt5-xxl, the encoder Wan 2.1 ships
GEMMA_2_2B = dict(
    vocab_size=256000,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
)  # Gemma-2-2B, SANA-Video's encoder
CHECKPOINTS = {
    "Wan 2.1 1.3B (Self-Forcing, LongLive, Causal/Rolling Forcing, StreamDiffusionV2, Rolling Sink)": (
        lambda: WanTransformer3DModel(**WAN_1_3B),
        lambda: UMT5EncoderModel(UMT5Config(**UMT5_XXL)),
    ),
    "Wan 2.1 14B (Krea Realtime 14B)": (
        lambda: WanTransformer3DModel(**WAN_14B),
        lambda: UMT5EncoderModel(UMT5Config(**UMT5_XXL)),
    ),
    "SANA-Video 2B (LongSANA)": (
        lambda: SanaVideoTransformer3DModel(**SANA_2B, num_layers=20),
        lambda: Gemma2Model(Gemma2Config(**GEMMA_2_2B)),
    ),
}
GB = 1e9


def nbytes(module: torch.nn.Module, recurse: bool = True) -> int:
    return sum(t.nbytes for t in [*module.parameters(recurse), *module.buffers(recurse)])


def largest_leaves(module: torch.nn.Module, count: int = 2) -> int:
    """Bytes of the `count` largest leaf modules (what leaf-level group offloading holds on the GPU at once); a weight
    two leaves share (a tied embedding) counts once."""
    leaves = [m for m in module.modules() if not list(m.children())]
    sizes = sorted(({id(t): t.nbytes for t in [*m.parameters(), *m.buffers()]} for m in leaves),
                   key=lambda tensors: sum(tensors.values()), reverse=True)  # fmt: skip
    return sum({key: size for tensors in sizes[:count] for key, size in tensors.items()}.values())


def blocks_of(transformer: torch.nn.Module) -> torch.nn.ModuleList:
    return getattr(transformer, "blocks", None) or transformer.transformer_blocks


def resident_bytes(transformer, text_encoder, vae) -> dict[str, int]:
    """GPU-resident weight bytes per `OFFLOAD_MODES` entry (and `None`: everything resident)."""
    blocks = blocks_of(transformer)
    outside_blocks = nbytes(transformer) - nbytes(blocks)
    encoding = largest_leaves(text_encoder)
    resident = {
        None: nbytes(transformer) + nbytes(text_encoder) + nbytes(vae),
        "text-encoder": nbytes(transformer) + nbytes(vae) + encoding,
        "model": max(nbytes(text_encoder), nbytes(transformer) + nbytes(vae)),
        "blocks": outside_blocks + 2 * max(nbytes(block) for block in blocks) + nbytes(vae) + encoding,
    }
    assert set(resident) == {None, *OFFLOAD_MODES}
    return resident


def build(make_transformer, make_text_encoder, fp8_storage: bool):
    """The checkpoint's components on "meta", in bfloat16 (the transformer's weights in float8 if asked)."""
    with torch.device("meta"):
        transformer = make_transformer().to(torch.bfloat16)
        text_encoder = make_text_encoder().to(torch.bfloat16)
        vae = AutoencoderKLWan().to(torch.bfloat16)
    if fp8_storage:
        transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    return transformer, text_encoder, vae


def main() -> int:
    diffusers_logging.set_verbosity_error()  # "modules that should be kept in float32": meta tensors, nothing to keep
    header = ["checkpoint", "transformer weights", "text encoder", "VAE", "resident", *OFFLOAD_MODES]
    body = []
    for name, (make_transformer, make_text_encoder) in CHECKPOINTS.items():
        for fp8 in (False, True):
            transformer, text_encoder, vae = build(make_transformer, make_text_encoder, fp8)
            resident = resident_bytes(transformer, text_encoder, vae)
            body.append([
                name if not fp8 else "  + --fp8-storage",
                f"{nbytes(transformer) / GB:.1f} GB ({sum(p.numel() for p in transformer.parameters()) / 1e9:.2f} B)",
                f"{nbytes(text_encoder) / GB:.1f} GB",
                f"{nbytes(vae) / GB:.2f} GB",
                *[f"{resident[mode] / GB:.1f} GB" for mode in (None, *OFFLOAD_MODES)],
            ])  # fmt: skip
    print("GPU-resident weights, bfloat16, per --offload mode (counted from the configs; activations, K/V and the "
          "CUDA context come on top)\n")  # fmt: skip
    print(markdown_table(header, body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
