"""Record the TAEHV test data from the upstream implementation: the taew2_1 key/shape list and a golden decode/encode.

    python tools/record_taehv_golden.py --upstream /path/to/taehv

`--upstream` is a directory holding upstream's `taehv.py` (madebyollin/taehv). Recorded from commit 1f14a56
("Add ComfyUI TAEH3 PR link"), `taehv.py` unchanged, no stubs (it imports torch and tqdm only); the file's sha256
is stored in the golden's metadata. Nothing of upstream is committed here: this script imports it from the path.

What it writes (tests/data/taehv/):
- `taew2_1_keys.json`: `[key, shape]` of every tensor of `TAEHV(checkpoint_path=None)` (the class defaults are
  taew2_1's), in state dict order.
- `golden.safetensors`: upstream's outputs on seeded random weights and inputs. The weights come from
  `seeded_state_dict(key_shapes, seed)` below, which the test imports, so both sides build the same tensors from
  the key list and a seed; the inputs from `seeded_latents` / `seeded_frames`. Only the seeds, the input shapes
  and the outputs are stored (in upstream's layout, `(N, T, C, H, W)`, pixels in [0, 1]):
  `decoded` = `decode_video(latents, parallel=True)`, `encoded` = `encode_video(frames, parallel=True)`.

It also checks upstream against itself (parallel vs sequential vs `StreamingTAEHV`) and prints the differences,
the fp32 floor that our tolerance is measured against.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "taehv"
WEIGHT_SEED, LATENT_SEED, FRAME_SEED = 0, 1, 2
LATENT_SHAPE = (2, 4, 16, 3, 4)  # (N, T, C, h, w): batch 2, 4 latent frames -> 13 pixel frames of 24x32
FRAME_SHAPE = (2, 13, 3, 24, 32)  # (N, T, C, H, W): 13 frames, padded by upstream to 16 -> 4 latent frames


def seeded_state_dict(key_shapes: list[tuple[str, tuple[int, ...]]], seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random weights for a key/shape list, drawn in list order from one CPU generator.

    Convolution weights ~ N(0, 1 / fan_in) (activations stay O(1) through the ~20 layers), biases ~ N(0, 0.1^2),
    and the bias of the decoder's last convolution shifted by +0.5 (mid-grey), so that most decoded pixels fall
    inside upstream's [0, 1] clamp (84% on the golden's inputs) and the comparison means something.
    """
    last_decoder_bias = [key for key, _ in key_shapes if key.startswith("decoder.") and key.endswith(".bias")][-1]
    generator = torch.Generator().manual_seed(seed)
    state_dict = {}
    for key, shape in key_shapes:
        values = torch.randn(shape, generator=generator, dtype=torch.float32)
        if key.endswith(".weight"):
            state_dict[key] = values / math.prod(shape[1:]) ** 0.5
        else:
            state_dict[key] = values * 0.1 + (0.5 if key == last_decoder_bias else 0.0)
    return state_dict


def seeded_latents(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Standard normal latents (the diffusion model's latent space is ~N(0, 1))."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def seeded_frames(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Uniform pixels in [0, 1) (upstream's pixel range)."""
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed))


def load_key_shapes(path: Path = DATA / "taew2_1_keys.json") -> list[tuple[str, tuple[int, ...]]]:
    return [(key, tuple(shape)) for key, shape in json.loads(path.read_text())]


def _import_upstream(directory: Path):
    source = directory / "taehv.py"
    if not source.is_file():
        raise SystemExit(f"--upstream {str(directory)!r} has no taehv.py (clone madebyollin/taehv there).")
    spec = importlib.util.spec_from_file_location("upstream_taehv", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, hashlib.sha256(source.read_bytes()).hexdigest()


def _streamed_decode(upstream, model, latents: torch.Tensor) -> torch.Tensor:
    streaming = upstream.StreamingTAEHV(model)
    frames = []
    for t in range(latents.shape[1]):
        frame = streaming.decode(latents[:, t : t + 1])
        while frame is not None:
            frames.append(frame)
            frame = streaming.decode()
    return torch.cat(frames, dim=1)


def _streamed_encode(upstream, model, frames: torch.Tensor) -> torch.Tensor:
    streaming = upstream.StreamingTAEHV(model)
    latents = [streaming.encode(frames[:, t : t + 1]) for t in range(frames.shape[1])]
    latents = [latent for latent in latents if latent is not None] + streaming.flush_encoder()
    return torch.cat(latents, dim=1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", type=Path, required=True, help="directory holding upstream's taehv.py")
    parser.add_argument("--out", type=Path, default=DATA, help="where to write the key list and the golden")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    upstream, source_sha256 = _import_upstream(args.upstream)

    model = upstream.TAEHV(checkpoint_path=None).eval()  # the class defaults are taew2_1's
    key_shapes = [(key, tuple(value.shape)) for key, value in model.state_dict().items()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "taew2_1_keys.json").write_text(json.dumps([[key, list(shape)] for key, shape in key_shapes]) + "\n")
    model.load_state_dict(seeded_state_dict(key_shapes, WEIGHT_SEED), strict=True)
    print(f"{len(key_shapes)} tensors, {sum(model.state_dict()[k].numel() for k, _ in key_shapes):,} parameters")

    latents, frames = seeded_latents(LATENT_SHAPE, LATENT_SEED), seeded_frames(FRAME_SHAPE, FRAME_SEED)
    with torch.no_grad():
        decoded = model.decode_video(latents, parallel=True, show_progress_bar=False)
        encoded = model.encode_video(frames, parallel=True, show_progress_bar=False)
        checks = {
            "decode parallel vs sequential": (decoded, model.decode_video(latents, False, False)),
            "decode parallel vs StreamingTAEHV": (decoded, _streamed_decode(upstream, model, latents)),
            "encode parallel vs sequential": (encoded, model.encode_video(frames, False, False)),
            "encode parallel vs StreamingTAEHV": (encoded, _streamed_encode(upstream, model, frames)),
        }
    for name, (a, b) in checks.items():
        print(f"upstream {name}: max |diff| {(a - b).abs().max().item():.2e}")
    saturated = ((decoded == 0) | (decoded == 1)).float().mean().item()
    print(
        f"decoded {tuple(decoded.shape)}, std {decoded.std():.3f}, {saturated:.1%} at the clamp; "
        f"encoded {tuple(encoded.shape)}, std {encoded.std():.3f}"
    )

    tensors = {
        "decoded": decoded.contiguous(),
        "encoded": encoded.contiguous(),
        "weight_seed": torch.tensor(WEIGHT_SEED),
        "latent_seed": torch.tensor(LATENT_SEED),
        "latent_shape": torch.tensor(LATENT_SHAPE),
        "frame_seed": torch.tensor(FRAME_SEED),
        "frame_shape": torch.tensor(FRAME_SHAPE),
    }
    metadata = {
        "upstream": "madebyollin/taehv@1f14a56 taehv.py",
        "taehv_py_sha256": source_sha256,
        "torch": torch.__version__,
    }
    save_file(tensors, str(args.out / "golden.safetensors"), metadata=metadata)
    print(f"wrote {args.out / 'taew2_1_keys.json'} and {args.out / 'golden.safetensors'}")


if __name__ == "__main__":
    sys.exit(main())
