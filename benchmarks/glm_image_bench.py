"""GLM-Image decoder: rolldiff's `ConditionKVCache` (two layouts) against diffusers' `GlmImageKVCache`, same run.

What is measured, per number of reference images (1 and 2), at GLM-Image's real layer shapes
(32 heads x 128 = 4096 wide, text_embed_dim 1472, codebook 16384) with `--layers` blocks (the real
model has 30), a 1024x1024 target (4096 image tokens + `--glyph-tokens`) and 1024x1024 references
(4096 condition tokens each):
  step s             wall time of one conditional ("read") decoder forward (the unconditional
                     "skip" pass is the same code for both caches and is not timed).
  step CPU s         CPU time of that forward, all threads (steadier than wall time on a shared machine).
  MiB alloc / step   bytes of new tensor storages in that forward, counted with a `TorchDispatchMode`
                     (an op output whose storage none of the op's inputs owns; views and in-place
                     writes count 0; scratch inside one kernel is invisible to it).
  cache op ms        the cache's read alone, per layer, CPU time (median of 20): per-block buffers write the
                     current K/V into the buffer and return a view; the shared workspace also copies the
                     layer's conditions in; diffusers `torch.cat`s `[conditions; current]`.
  cache op MiB       bytes that read allocates, per layer.
  MiB held           what the cache object keeps between steps (all `--layers` layers).
  peak MiB @30       the cache's peak at GLM-Image's 30 layers, from the measured per-layer sizes: per-block
                     buffers hold conditions + current tokens in every layer; the shared workspace holds each
                     layer's conditions once plus one `[conditions; current]` buffer; diffusers holds the
                     conditions plus one layer's `torch.cat` at a time.
Conditions are written with the same random post-RoPE K/V into both caches (the write phase runs
once per image and is not what differs); ours lays out its buffer once before the timed steps.
One untimed forward warms the process up; then the two approaches run interleaved step by step,
the order alternating, so background load falls on both alike. Both
decoders share one set of weights (diffusers' module is built on the meta device and assigned ours).

    python benchmarks/glm_image_bench.py [--layers 1] [--steps 1] [--batch 1] [--glyph-tokens 32] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from diffusers import GlmImageTransformer2DModel
from diffusers.models.transformers.transformer_glm_image import GlmImageKVCache
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rolldiff import ConditionKVCache, GlmImageCachedTransformer2DModel

MiB = 2**20
HEADS, HEAD_DIM = 32, 128
REAL_CONFIG = dict(
    patch_size=2,
    in_channels=16,
    out_channels=16,
    attention_head_dim=HEAD_DIM,
    num_attention_heads=HEADS,
    text_embed_dim=1472,
    time_embed_dim=512,
    condition_dim=256,
    prior_vq_quantizer_codebook_size=16384,
)
VAE_FACTOR = 8


class AllocationCounter(TorchDispatchMode):
    """Sums the storage bytes of op outputs that none of the op's inputs owns (new allocations)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        owned = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in owned:
                owned.add(tensor.untyped_storage().data_ptr())
                self.bytes += tensor.untyped_storage().nbytes()
        return out


def build_decoders(layers: int, dtype: torch.dtype):
    """Ours with random weights, and diffusers' class sharing the very same parameter tensors."""
    torch.manual_seed(0)
    ours = GlmImageCachedTransformer2DModel(num_layers=layers, **REAL_CONFIG).to(dtype).eval()
    with torch.device("meta"):
        theirs = GlmImageTransformer2DModel(num_layers=layers, **REAL_CONFIG)
    theirs.load_state_dict(ours.state_dict(), assign=True)
    return ours, theirs.eval()


def step_inputs(size: int, glyph_tokens: int, batch: int, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(1)
    latent = size // VAE_FACTOR
    tokens = (latent // 2) ** 2
    return dict(
        hidden_states=torch.randn(batch, 16, latent, latent, generator=g).to(dtype),
        encoder_hidden_states=torch.randn(batch, glyph_tokens, 1472, generator=g).to(dtype),
        prior_token_id=torch.randint(0, 16384, (batch, tokens), generator=g),
        prior_token_drop=torch.zeros(batch, tokens, dtype=torch.bool),
        timestep=torch.full((batch,), 500.0),
        target_size=torch.tensor([[float(size), float(size)]] * batch),
        crop_coords=torch.zeros(batch, 2),
    )


def fill_caches(layers: int, references: int, tokens_per_reference: int, current_tokens: int, batch: int, dtype):
    """All caches get the same condition K/V per layer (one sample); ours lay out their read buffers once."""
    caches = ConditionKVCache(layers), ConditionKVCache(layers, shared_workspace=True), GlmImageKVCache(layers)
    for cache in caches:
        cache.set_mode("write")
    g = torch.Generator().manual_seed(2)
    for layer in range(layers):
        for _ in range(references):
            key, value = torch.randn(2, 1, tokens_per_reference, HEADS, HEAD_DIM, generator=g).to(dtype).unbind(0)
            caches[0][layer].update(key, value)
            caches[1][layer].update(key, value)
            caches[2][layer].store(key, value)
    current = torch.zeros(batch, current_tokens, HEADS, HEAD_DIM, dtype=dtype)
    for cache in caches:
        cache.set_mode("read")
    for cache in caches[:2]:
        for layer in cache:
            layer.update(current, current)  # the one-time layout of the read buffers
    return caches


def cache_op(layer_read, key, value, repeats: int = 20) -> tuple[float, float]:
    """Median ms and MiB allocated of one layer's read."""
    times = []
    for _ in range(repeats):
        start = time.process_time()  # CPU time of all threads: preemption on a shared machine does not count
        layer_read(key, value)
        times.append(time.process_time() - start)
    with AllocationCounter() as counter:
        layer_read(key, value)
    return statistics.median(times) * 1e3, counter.bytes / MiB


def held_mib(cache) -> tuple[float, float]:
    """(MiB the cache keeps between steps, of which a workspace shared by all layers)."""
    if isinstance(cache, GlmImageKVCache):
        tensors = [t for layer in cache.caches for t in layer.k_caches + layer.v_caches]
        return sum(t.numel() * t.element_size() for t in tensors) / MiB, 0.0
    shared = cache.workspace.memory_bytes() if cache.workspace is not None else 0
    return cache.memory_bytes() / MiB, shared / MiB


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1, help="decoder blocks (GLM-Image has 30)")
    parser.add_argument("--steps", type=int, default=1, help="timed conditional steps per approach")
    parser.add_argument("--size", type=int, default=1024, help="target and reference side, pixels")
    parser.add_argument("--glyph-tokens", type=int, default=32)
    parser.add_argument("--references", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, default=1, help="images read per step (num_images_per_prompt)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    ours_model, their_model = build_decoders(args.layers, dtype)
    inputs = step_inputs(args.size, args.glyph_tokens, args.batch, dtype)
    image_tokens = (args.size // VAE_FACTOR // 2) ** 2
    current_tokens = args.glyph_tokens + image_tokens
    print(
        f"GLM-Image decoder, {args.layers} layer(s) of {HEADS} heads x {HEAD_DIM}, {args.dtype}, {args.threads} threads; "
        f"target {args.size}x{args.size} ({image_tokens} image + {args.glyph_tokens} glyph tokens), "
        f"references {args.size}x{args.size} ({image_tokens} tokens each)\n"
    )
    ours_model(**inputs)  # process warm-up (kernels, first-touch pages), no cache: untimed
    header = (
        f"{'refs':>4} {'cache':<28} {'step s':>7} {'step CPU s':>9} {'MiB alloc/step':>14} {'cache op ms':>11} "
        f"{'cache op MiB':>12} "
        f"{'MiB held':>9} {'peak MiB @30 layers':>19}"
    )
    print(header)
    print("-" * len(header))
    names = ("rolldiff per-block buffers", "rolldiff shared workspace", "diffusers GlmImageKVCache")
    models = (ours_model, ours_model, their_model)
    for references in args.references:
        caches = fill_caches(args.layers, references, image_tokens, current_tokens, args.batch, dtype)
        steps = {name: [] for name in names}
        cpu = {name: [] for name in names}
        allocated = {}
        for step in range(args.steps):  # interleaved, the order rotating between steps and reference counts
            outputs = {}
            shift = (step + references) % 3
            for index in [(i + shift) % 3 for i in range(3)]:
                name, model, cache = names[index], models[index], caches[index]
                with AllocationCounter() as counter:
                    start, start_cpu = time.perf_counter(), time.process_time()
                    outputs[name] = model(**inputs, kv_caches=cache).sample
                    steps[name].append(time.perf_counter() - start)
                    cpu[name].append(time.process_time() - start_cpu)
                allocated[name] = counter.bytes / MiB
            for name in names[:2]:
                difference = (outputs[name].float() - outputs[names[2]].float()).abs().max().item()
                assert difference == 0, f"{name}: outputs differ from diffusers' by {difference}"
        key = torch.randn(args.batch, current_tokens, HEADS, HEAD_DIM).to(dtype)
        ops = [cache_op(cache[0].update, key, key) for cache in caches[:2]] + [cache_op(caches[2][0].get, key, key)]
        rows = {}
        for name, cache, (op_ms, op_mib) in zip(names, caches, ops):
            held, shared = held_mib(cache)
            per_layer = (held - shared) / args.layers
            peak = 30 * per_layer + shared + (op_mib if isinstance(cache, GlmImageKVCache) else 0.0)
            rows[name] = (statistics.median(steps[name]), allocated[name], op_ms, op_mib)
            print(
                f"{references:>4} {name:<28} {rows[name][0]:>7.2f} {statistics.median(cpu[name]):>9.2f} "
                f"{allocated[name]:>14.1f} {op_ms:>11.2f} {op_mib:>12.1f} {held:>9.1f} {peak:>19.0f}"
            )
        their_step, their_alloc, their_op, _ = rows[names[2]]
        their_cpu = statistics.median(cpu[names[2]])
        for name in names[:2]:
            step, alloc, op, _ = rows[name]
            print(
                f"{'':>4} diffusers / {name}: step time x{their_step / step:.3f} (CPU "
                f"x{their_cpu / statistics.median(cpu[name]):.3f}), bytes allocated per step "
                f"x{their_alloc / alloc:.3f} (-{their_alloc - alloc:.0f} MiB), cache op time x{their_op / op:.1f}"
            )
        print()
        del caches


if __name__ == "__main__":
    main()
