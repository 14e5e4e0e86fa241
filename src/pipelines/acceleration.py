"""Speed switches for a loaded transformer: float8 linear layers, the fastest attention backend, CUDA graphs.

Each switch changes how the same step runs, never what it computes beyond the stated rounding:

- `enable_fp8`: torchao's float8 dynamic-activation / float8-weight quantization (per-row scales) of the
  linear layers that run at every denoising step. Kept in the model's dtype: everything outside the block
  stack (patch embedding, time and text embedders, `proj_out`) and the cross-attention K/V projections of the
  text, which run once per prompt (their K/V live in the cache). Layers whose sides are not multiples of 16
  (the float8 GEMM's alignment) are kept too, by name, rather than skipped silently as torchao would.
- `fastest_attention_backend` / `set_attention_backend`: diffusers' attention dispatcher. Offered: exact
  backends only (FA3, flash-attn 2, cuDNN, torch's own SDPA kernels), each checked against the model's head
  sizes and dtype before it is set; lossy ones (Sage, int8) and those that download kernels at run time
  (`*_hub`) are not.
- `capture_cuda_graphs`: the cached step under `torch.compile(mode="reduce-overhead")`, i.e. inductor's CUDA
  graph trees. Replay is valid because every tensor the step writes or reads across calls has a fixed
  address: the cache's ring buffers and device counters are registered `nn.Module` buffers, allocated once and
  written in place (`commit`, eviction and `reset()` never reallocate), which dynamo marks as static inputs; the
  per-call inputs (latents, timestep, text) are copied into the graph's own input buffers. The step's shapes
  never grow with the video and the only host-side guard is "window full", so a stream records 2 graphs (window
  filling, window full) and never re-captures as the video grows. A graph's outputs are overwritten by its next
  replay, so the returned velocity is cloned (a chunk-sized copy) before the next call can run.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..models.attention_backends import MASK_FREE_BACKENDS as MASK_FREE_BACKENDS  # re-exported
from ..models.attention_backends import attention_backend_for as attention_backend_for  # re-exported
from ..models.placement import execution_device, is_offloaded
from .memory import fp8_storage

FP8_MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.x, 12.x)
FP8_ALIGNMENT = 16  # torch._scaled_mm needs both sides of the weight to be multiples of 16
# Cross-attention projections of the text: run once per prompt, their K/V are kept in the cache.
TEXT_KV_PROJECTIONS = ("attn2.to_k", "attn2.to_v", "attn2.add_k_proj", "attn2.add_v_proj")
# Fastest first. Exact kernels only; every one takes the (batch, tokens, heads, head_dim) layout. cuDNN is offered
# but not preferred: on an H200 at Wan 2.1 1.3B's shapes it was slower than torch's SDPA ("native", which picks its
# own flash kernel for an unmasked bf16 call): 423 against 391 ms a chunk (docs/gpu/h200_gpu_fps.txt).
ATTENTION_PREFERENCE = ("_flash_3", "flash", "native")
OFFERED_BACKENDS = (*ATTENTION_PREFERENCE, "_native_cudnn", "_native_flash", "_native_efficient", "_native_math")
STEP_RECOMPILE_LIMIT = 64  # graphs of the cached step one process may record (`compile_cached_step`)


class AccelerationUnavailable(ValueError, RuntimeError):  # noqa: N818 (a refusal, named for what it says)
    """A speed switch refused on this model or machine (float8 without the GPU, weights or torchao it needs, an
    attention backend the device cannot run, CUDA graphs off CUDA or under offload hooks); the message names the
    switch and why, before anything is changed. A ValueError and a RuntimeError (what the switches raised
    before), so callers catching either keep working; benchmarks catch it to skip a row instead of failing it."""


# ----------------------------------------------------------------------------------------- helpers
def transformer_device(transformer: nn.Module) -> torch.device:
    """Where the transformer's matmuls run: its first parameter's device, or the GPU its offload hooks bring the
    weights to (`placement.execution_device`)."""
    try:
        return execution_device(transformer)
    except StopIteration:
        raise ValueError("The transformer has no parameters; load its weights first.") from None


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """`(major, minor)` compute capability of a CUDA device, None for any other device."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


# ----------------------------------------------------------------------------------------- fp8
def fp8_linear_names(transformer: nn.Module) -> list[str]:
    """Qualified names of the `nn.Linear` layers `enable_fp8` converts, in module order.

    Selected: linear layers inside the block stack (the children of the transformer's top-level
    `nn.ModuleList`s, e.g. `blocks.3.ffn.net.0.proj`), except the text K/V projections of cross-attention
    (`TEXT_KV_PROJECTIONS`) and layers whose input or output size is not a multiple of 16.
    """
    names = []
    for stack_name, stack in transformer.named_children():
        if not isinstance(stack, nn.ModuleList):
            continue
        for name, module in stack.named_modules(prefix=stack_name):
            if isinstance(module, nn.Linear) and not name.endswith(TEXT_KV_PROJECTIONS) and _fp8_aligned(module):
                names.append(name)
    return names


def _fp8_aligned(linear: nn.Linear) -> bool:
    return linear.in_features % FP8_ALIGNMENT == 0 and linear.out_features % FP8_ALIGNMENT == 0


def fp8_refusal(device: torch.device, capability: tuple[int, int] | None, dtype: torch.dtype) -> str | None:
    """Why float8 linear layers cannot run for this device / weights dtype (None: they can).

    Args:
        device: where the transformer's weights are.
        capability: its CUDA compute capability, None when it is not a CUDA device.
        dtype: the dtype of the layers to convert (per-row float8 scales are computed from bfloat16 weights).
    """
    why = "enable_fp8 (--fp8): float8 matmuls need an NVIDIA GPU of compute capability >= 8.9 (Ada, Hopper, "
    if capability is None:
        return why + f"Blackwell); the transformer is on {device}. Run without --fp8, or move it to such a GPU."
    if tuple(capability) < FP8_MIN_CAPABILITY:
        return why + f"Blackwell); {device} has {capability[0]}.{capability[1]}. Run without --fp8."
    if dtype != torch.bfloat16:
        return (
            f"enable_fp8 (--fp8): the linear layers are {dtype}; float8 with per-row scales converts bfloat16 "
            "weights. Load the pipeline with --dtype bfloat16 (from_pretrained(..., dtype=torch.bfloat16)) first."
        )
    return None


def enable_fp8(transformer: nn.Module) -> bool:
    """Quantize the per-step linear layers (`fp8_linear_names`) to float8, in place; True if any was converted.

    Activations are quantized dynamically (per row, at every call) and weights once (per row), with
    `Float8DynamicActivationFloat8WeightConfig`; the matmul is `torch._scaled_mm` with bfloat16 output. Fast
    only compiled (`torch.compile` fuses the activation quantization into the preceding kernel). Apply after
    loading and before compiling; a converted model is for inference, not for `save_pretrained`. torchao's
    `set_inductor_config` is off, so no global inductor flag is changed (its coordinate-descent tuning would
    multiply the compile time).

    Raises:
        AccelerationUnavailable: on a CPU or a GPU without float8 tensor cores, for non-bfloat16 weights, or when
            torchao is not installed; before anything is changed.
    """
    if fp8_storage(transformer):
        raise AccelerationUnavailable(
            "enable_fp8 (--fp8): the weights are stored in float8 already (enable_fp8_storage, --fp8-storage), cast up "
            "at each call; torchao's float8 matmuls need the bfloat16 weights: use one or the other"
        )
    names = fp8_linear_names(transformer)
    device = transformer_device(transformer)
    dtype = transformer.get_submodule(names[0]).weight.dtype if names else torch.bfloat16
    refusal = fp8_refusal(device, cuda_capability(device), dtype)
    if refusal is not None:
        raise AccelerationUnavailable(refusal)
    config = _fp8_config()
    if not names:
        return False
    from torchao.quantization import quantize_

    selected = set(names)
    quantize_(transformer, config, filter_fn=lambda module, name: name in selected)
    return True


def torchao_installed() -> bool:
    return importlib.util.find_spec("torchao") is not None


def _fp8_config():
    """torchao's float8 config, or a RuntimeError saying how to install it."""
    if not torchao_installed():
        raise AccelerationUnavailable("enable_fp8 (--fp8) needs torchao: `pip install torchao` (0.10 or newer).")
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow
    except ImportError as exc:
        raise AccelerationUnavailable(
            f"enable_fp8 (--fp8): the installed torchao has no Float8DynamicActivationFloat8WeightConfig ({exc}); "
            "`pip install -U torchao`."
        ) from None
    return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)


# ----------------------------------------------------------------------------------------- attention
def available_attention_backends(device: torch.device | str) -> list[str]:
    """The offered attention backends that can run on `device`, fastest first where known."""
    device = torch.device(device)
    if device.type != "cuda":
        return ["native", "_native_math"]
    from diffusers.utils import is_flash_attn_3_available, is_flash_attn_available

    capability = torch.cuda.get_device_capability(device)
    usable = {"native": True, "_native_math": True, "_native_efficient": True}
    usable["_native_flash"] = capability >= (8, 0)
    cudnn_version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    usable["_native_cudnn"] = capability >= (8, 0) and (cudnn_version or 0) >= 90000
    usable["flash"] = capability >= (8, 0) and is_flash_attn_available()
    usable["_flash_3"] = capability[0] == 9 and is_flash_attn_3_available()  # FA3 is Hopper-only
    return [name for name in OFFERED_BACKENDS if usable[name]]


def attention_head_dims(transformer: nn.Module) -> list[int]:
    """The head sizes the transformer's attentions run at (its config's `*head_dim` entries): fused kernels take
    only some (multiples of 8, up to a limit), so a backend is checked against each before it is set."""
    config = getattr(transformer, "config", {})
    return sorted({int(value) for key, value in config.items() if key.endswith("head_dim") and isinstance(value, int)})


def weights_dtype(transformer: nn.Module) -> torch.dtype:
    """The dtype the transformer computes (and its attention runs) in: a diffusers model's `dtype`, which is the
    compute dtype under float8 storage (`enable_layerwise_casting`), else its first floating-point parameter's."""
    if isinstance(getattr(transformer, "dtype", None), torch.dtype):
        return transformer.dtype
    return next((p.dtype for p in transformer.parameters() if p.is_floating_point()), torch.float32)


def attention_runs(name: str, device: torch.device | str, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether backend `name` runs an unmasked attention of `head_dim` in `dtype` on `device`: a tiny call through
    diffusers' dispatcher, since which shapes a fused kernel takes is the kernel's to say (cuDNN and the flash
    kernels refuse a head size of 36 and float32)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    query = torch.randn(1, 8, 2, head_dim, device=device, dtype=dtype)  # (batch, tokens, heads, head_dim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns once per kernel it turns down before it raises
        try:
            dispatch_attention_fn(query, query, query, backend=AttentionBackendName(name))
        except Exception:  # noqa: BLE001 - any failure (no kernel, package missing) means it does not run here
            return False
    return True


def fastest_attention_backend(
    device: torch.device | str, head_dims: Sequence[int] = (), dtype: torch.dtype = torch.bfloat16
) -> str:
    """The first usable of FA3 (Hopper), flash-attn 2 and torch's SDPA ("native") that runs every head size in
    `head_dims` in `dtype` (`attention_runs`); "native" always does (SDPA falls back to its math kernel)."""
    device = torch.device(device)
    available = available_attention_backends(device)
    for name in ATTENTION_PREFERENCE:
        if name in available and all(attention_runs(name, device, dim, dtype) for dim in head_dims):
            return name
    return "native"


def set_attention_backend(transformer: nn.Module, name: str) -> None:
    """Run every attention of `transformer` through diffusers' backend `name` (an offered one for its device that
    runs its head sizes in its dtype).

    `transformer.set_attention_backend` also makes `name` diffusers' process-wide active backend (what processors
    with no backend of their own use, in every model of the process); the previous one is put back, so a backend
    set on one pipeline never reaches another loaded later (a float32 model would fail under cuDNN). Backends in
    `MASK_FREE_BACKENDS` raise on a masked call: a cached step passes a mask only while the window fills under
    `torch.compile`, or with `attention_bias != 1`; `attention_backend_for(backend, masked=True)` gives the
    processor a masked fallback.

    Raises:
        ValueError: for a name that is not offered; AccelerationUnavailable (a ValueError) for one not usable on
            the transformer's device, or not for its head sizes and dtype (the messages list the usable ones).
    """
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    device = transformer_device(transformer)
    available = available_attention_backends(device)
    if name not in available:
        offered = name in OFFERED_BACKENDS  # an offered one this device cannot run is a refusal, not a typo
        why = f"cannot run on {device}" if offered else "is not an offered attention backend"
        raise (AccelerationUnavailable if offered else ValueError)(
            f"attention backend {name!r} {why}; usable on {device}: {', '.join(available)} "
            "(FA3 needs the flash_attn_3 package on a Hopper GPU, 'flash' the flash-attn package)."
        )
    dims, dtype = attention_head_dims(transformer), weights_dtype(transformer)
    refused = [dim for dim in dims if not attention_runs(name, device, dim, dtype)]
    if refused:
        runs = [other for other in available if all(attention_runs(other, device, dim, dtype) for dim in dims)]
        raise AccelerationUnavailable(
            f"attention backend {name!r} cannot run this transformer's attention on {device}: head size "
            f"{refused[0]} in {str(dtype).removeprefix('torch.')} (fused kernels take multiples of 8 in 16-bit "
            f"dtypes); usable for it: {', '.join(runs)}, or 'fastest'."
        )
    previous, _ = _AttentionBackendRegistry.get_active_backend()
    transformer.set_attention_backend(name)
    _AttentionBackendRegistry.set_active_backend(previous)  # this transformer's processors keep `name`


def attention_accepts_mask(name: str, device: torch.device | str) -> bool:
    """Whether backend `name` runs a masked attention on `device` (a tiny bf16 call through the dispatcher).

    A compiled cached step attends with a mask while the window fills; a backend that refuses masks can then
    only serve an eager step (or a processor that falls back with `attention_backend_for`).
    """
    if name in MASK_FREE_BACKENDS:
        return False
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    query = torch.randn(1, 8, 2, 64, device=device, dtype=dtype)  # (batch, tokens, heads, head_dim)
    mask = torch.ones(1, 1, 8, 8, device=device, dtype=torch.bool).tril()
    try:
        dispatch_attention_fn(query, query, query, attn_mask=mask, backend=AttentionBackendName(name))
    except (RuntimeError, ValueError):
        return False
    return True


# ----------------------------------------------------------------------------------------- CUDA graphs
@dataclasses.dataclass
class CompiledStep:
    """The callable `compile_cached_step` installs as `transformer.forward`: the compiled forward, with its
    outputs cloned when graph replays would overwrite them. A call whose cache decides its writes on the host
    (`RollingKVCache.decides_on_host`: the adaptive sink's decided writes, one per chunk when pipelined) runs the
    eager forward (`eager`), which would otherwise break the full graph; `eager_calls` counts them."""

    compiled: Callable[..., Any]
    clone: bool
    mode: str | None
    eager: Callable[..., Any] | None = None
    eager_calls: int = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.eager is not None and _decides_on_host(kwargs.get("kv_cache")):
            self.eager_calls += 1
            return self.eager(*args, **kwargs)
        out = self.compiled(*args, **kwargs)
        return clone_outputs(out) if self.clone else out


def _decides_on_host(kv_cache: Any) -> bool:
    """Whether a step's cache (one, one per batch row, or none) decides a write on the host."""
    caches = kv_cache if isinstance(kv_cache, (list, tuple)) else [kv_cache]
    return any(getattr(cache, "decides_on_host", False) for cache in caches)


def clone_outputs(out: Any) -> Any:
    """`out` with every tensor cloned: a tensor, a tuple / list of them, or a diffusers `BaseOutput`."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(clone_outputs(item) for item in out)
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        fields = {field.name: clone_outputs(getattr(out, field.name)) for field in dataclasses.fields(out)}
        return dataclasses.replace(out, **fields)
    return out


def is_compiled(module: nn.Module) -> bool:
    """Whether `module` runs through `torch.compile`: `module.compile()`, `compile_cached_step` (CUDA graphs too)
    or a `torch.compile(module)` wrapper."""
    compiled_call = getattr(module, "_compiled_call_impl", None) is not None
    return compiled_call or isinstance(module.forward, CompiledStep) or hasattr(module, "_orig_mod")


def _untraceable_weights(transformer: nn.Module) -> str | None:
    """Why dynamo cannot trace the step in one graph (hooks it must not inline run around each layer), or None."""
    if is_offloaded(transformer):
        return "hooks move the transformer's weights at each call (--offload model or blocks)"
    if fp8_storage(transformer):
        return "its weights are stored in float8 and cast up by hooks at each call (--fp8-storage)"
    return None


def compile_cached_step(
    transformer: nn.Module, *, backend: Any = "inductor", mode: str | None = None, fullgraph: bool = True
) -> CompiledStep:
    """Compile `transformer.forward` (the cached step) in place; returns the installed `CompiledStep`.

    Args:
        backend: a `torch.compile` backend ("inductor"; "eager" or a `CompileCounter` to count graphs).
        mode: `torch.compile`'s mode; "reduce-overhead" (inductor) records CUDA graphs and clones the outputs.
        fullgraph: one graph per guard set, no graph breaks (the step is written to trace whole).
    """
    if isinstance(transformer.forward, CompiledStep):
        raise RuntimeError("The transformer's forward is compiled already; load a fresh transformer to recompile.")
    obstacle = _untraceable_weights(transformer)
    if obstacle is not None:
        raise AccelerationUnavailable(
            f"compile_cached_step (--compile): torch.compile cannot trace the cached step whole: {obstacle}. Compile "
            "a resident transformer in its compute dtype (--offload text-encoder keeps the transformer resident)."
        )
    options = {"mode": mode} if mode not in (None, "default") else {}
    # A stream records a few graphs (the window's sizes, full or not); one process serving other layouts (a start
    # image, a context policy, another recipe) adds theirs, past torch's default of 8 (a hard failure under
    # fullgraph). Raised, never lowered: it is process-wide.
    dynamo_config = importlib.import_module("torch._dynamo.config")
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, STEP_RECOMPILE_LIMIT)
    eager = transformer.forward
    compiled = torch.compile(eager, backend=backend, fullgraph=fullgraph, **options)
    step = CompiledStep(compiled, clone=mode == "reduce-overhead", mode=mode, eager=eager)
    transformer.forward = step  # nn.Module.__call__ runs hooks, then this
    return step


def capture_cuda_graphs(transformer: nn.Module) -> CompiledStep:
    """Run the cached step as replayed CUDA graphs (`torch.compile(fullgraph=True, mode="reduce-overhead")`).

    Graphs are recorded at the first calls (a stream's first chunks: one graph while the window fills, one once
    it is full) and replayed from then on. One stream per transformer: another stream's cache has other buffer
    addresses, so alternating streams would re-record at every switch (serve concurrent streams with a plain
    `compile_cached_step`). The cache must be compileable (not `kv_offload`).

    Raises:
        AccelerationUnavailable: when the transformer is not on a CUDA device (on the CPU use `compile_cached_step`, the CLI's
            `--compile`: a silent fallback would make a "CUDA graphs" row or claim untrue), or when its weights
            are moved by offload hooks (a graph needs them resident).
    """
    device = transformer_device(transformer)
    if device.type != "cuda":
        raise AccelerationUnavailable(
            f"capture_cuda_graphs (--cuda-graphs): CUDA graphs need the transformer on a CUDA device; it is on "
            f"{device}. Use compile_cached_step(transformer) (--compile) instead."
        )
    if is_offloaded(transformer):
        raise AccelerationUnavailable(
            "capture_cuda_graphs (--cuda-graphs): the transformer has offload hooks (--offload model or blocks: "
            "enable_model_cpu_offload, group offloading, or a device_map); a CUDA graph replays fixed weight "
            "addresses. Load it without offloading (--offload text-encoder keeps the transformer resident)."
        )
    return compile_cached_step(transformer, backend="inductor", mode="reduce-overhead", fullgraph=True)
