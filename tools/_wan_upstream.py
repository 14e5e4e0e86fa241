"""Run the authors' causal Wan 2.1 code (Krea Realtime, LongLive, Self-Forcing) on CPU with tiny random weights.

Shared by `tools/record_*_goldens.py`. The upstream trees live outside this repository (`--upstream`); nothing here
is copied from them. What each recording needs to run the authors' code unchanged on a CPU-only torch:

- `UpstreamTree`: the tree on `sys.path`, with optional *line patches* (an exact upstream line -> its replacement,
  each required to match exactly once, applied to the module source when it is imported; used only for sizes the
  authors hard-code for Wan-1.3B, e.g. `frame_seqlen = 1560`), packages whose `__init__` imports training code
  registered by path only, and stub modules for imports the inference path never calls (`cv2`, `omegaconf`...).
- `cpu_cuda_stubs`: `torch.cuda.current_device()` -> "cpu" (called at import and for `device=` arguments), dummy
  `torch.cuda.Stream` / `Event`.
- `sdpa_at_input_dtype`: the SDPA fallback every tree routes to when flash-attention is absent, without the
  fallback's cast to bf16 (the recordings run in fp32 and fp64).
- `TorchProxy`: replaces a module's `torch` global so that `torch.bfloat16` / `torch.float16` name the working
  dtype and `torch.randn` hands out noise from a `NoiseTape` (recorded in the fp32 run, replayed in fp64).
- `randomize_`: seeded random weights for a module (upstream zero-initialises its output head).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import math
import sys
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

# The tiny causal Wan every recording uses. CausalWanModel init arguments (upstream terms): 3 blocks, 2 heads x 16,
# 16 latent channels (Wan's), text padded to 8 tokens inside the model.
TINY_MODEL = {
    "model_type": "t2v", "patch_size": [1, 2, 2], "text_len": 8, "in_dim": 16, "dim": 32, "ffn_dim": 64,
    "freq_dim": 16, "text_dim": 16, "out_dim": 16, "num_heads": 2, "num_layers": 3, "qk_norm": True,
    "cross_attn_norm": True, "eps": 1e-6,
}  # fmt: skip
# The same model as diffusers' `WanTransformer3DModel` config (what our model class is built from).
DIFFUSERS_CONFIG = {
    "patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 16,
    "out_channels": 16, "text_dim": 16, "freq_dim": 16, "ffn_dim": 64, "num_layers": 3, "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024,
}  # fmt: skip
HEIGHT, WIDTH = 32, 48  # pixels; latent 4 x 6, patch 2 x 2: 2 x 3 = 6 tokens per latent frame
LATENT_SIZE = (HEIGHT // 8, WIDTH // 8)
TOKENS_PER_FRAME = 6
WEIGHT_SEED, NOISE_SEED, TEXT_SEED = 0, 1, 2
# Imports the inference paths never call, stubbed so the trees import on a bare CPU environment.
COMMON_STUBS = {
    "cv2": {}, "ftfy": {}, "msgpack": {"packb": None, "unpackb": None}, "omegaconf": {"OmegaConf": None},
    "dotenv": {"load_dotenv": lambda *a, **k: None}, "torchvision": {}, "torchvision.transforms": {},
    "torchvision.transforms.functional": {}, "torchvision.io": {"write_video": None},
}  # fmt: skip
MEMORY_HELPERS = [  # `demo_utils.memory` / `utils.memory` build `torch.device("cuda:N")` at import: names only
    "gpu", "get_cuda_free_memory_gb", "DynamicSwapInstaller", "move_model_to_device_with_memory_preservation",
    "log_gpu_memory",
]  # fmt: skip

LinePatches = Mapping[str, Sequence[tuple[str, str]]]  # module name -> [(exact upstream text, replacement)]


class _PatchedSourceLoader(importlib.machinery.SourceFileLoader):
    """Compiles the module from its source with the line patches applied (never from a stale .pyc)."""

    def __init__(self, fullname: str, path: str, patches: Sequence[tuple[str, str]]) -> None:
        super().__init__(fullname, path)
        self.patches = patches

    def get_code(self, fullname: str):
        source = Path(self.path).read_text()
        for old, new in self.patches:
            count = source.count(old)
            if count != 1:
                raise RuntimeError(f"Patch for {fullname}: {old!r} occurs {count} times in {self.path}, expected 1.")
            source = source.replace(old, new)
        return compile(source, self.path, "exec", dont_inherit=True)


class _PatchFinder(importlib.abc.MetaPathFinder):
    def __init__(self, root: Path, patches: LinePatches) -> None:
        self.root, self.patches = root, patches

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.patches:
            return None
        file = self.root.joinpath(*fullname.split(".")).with_suffix(".py")
        loader = _PatchedSourceLoader(fullname, str(file), self.patches[fullname])
        return importlib.util.spec_from_file_location(fullname, file, loader=loader)


class UpstreamTree:
    """An upstream checkout made importable: on `sys.path`, with line patches, bare packages and stub modules."""

    def __init__(
        self,
        root: str | Path,
        patches: LinePatches | None = None,
        bare_packages: Sequence[str] = (),
        stubs: Mapping[str, Mapping[str, object]] | None = None,
    ) -> None:
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise SystemExit(f"--upstream {root!s} is not a directory; extract the pinned tree there first.")
        sys.path.insert(0, str(self.root))
        sys.meta_path.insert(0, _PatchFinder(self.root, dict(patches or {})))
        for name in bare_packages:  # the package's submodules import; its __init__ (training code) never runs
            package = types.ModuleType(name)
            package.__path__ = [str(self.root.joinpath(*name.split(".")))]
            sys.modules[name] = package
        importlib.import_module("diffusers")  # its package probes must see the real environment, not the stubs
        for name, attributes in (stubs or {}).items():  # always stubbed, installed or not: same run everywhere
            stub = types.ModuleType(name)
            stub.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            stub.__path__ = []  # lets `import a.b` resolve stubbed submodules
            for key, value in attributes.items():
                setattr(stub, key, value)
            sys.modules[name] = stub

    def module(self, name: str) -> types.ModuleType:
        return importlib.import_module(name)


class _Dummy:
    """Stands in for a CUDA stream/event (or any object the CPU path only constructs and forgets)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def cpu_cuda_stubs() -> None:
    """`torch.cuda.current_device()` names the CPU; streams and events are inert."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.Stream = _Dummy
    torch.cuda.Event = _Dummy
    torch.cuda.device = lambda *args, **kwargs: contextlib.nullcontext()


def sdpa_at_input_dtype(q, k, v, *args, **kwargs) -> torch.Tensor:
    """The trees' `attention(q, k, v)` / `flash_attention(q, k, v, k_lens=None)` on `(B, L, H, D)`, in q's dtype."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).contiguous()


class NoiseTape:
    """Every `torch.randn` upstream makes, in order: drawn in fp32 from a seeded generator, or replayed."""

    def __init__(self, seed: int, replay: list[torch.Tensor] | None = None) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.replay = replay
        self.draws: list[torch.Tensor] = []
        self.dtype = torch.float32

    def randn(self, *size, generator=None, device=None, dtype=None, **kwargs) -> torch.Tensor:
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], Sequence | torch.Size) else size
        if self.replay is None:
            draw = torch.randn(shape, generator=self.generator, dtype=torch.float32)
        else:
            draw = self.replay[len(self.draws)]
            if tuple(draw.shape) != tuple(shape):
                raise RuntimeError(
                    f"Replay draw {len(self.draws)} has shape {tuple(draw.shape)}, upstream asks {shape}."
                )
        self.draws.append(draw)
        return draw.to(self.dtype)


class TorchProxy(types.ModuleType):
    """`torch` as a module sees it, with half dtypes naming the working dtype and `randn` taken from a tape."""

    def __init__(self, tape: NoiseTape, dtype: torch.dtype) -> None:
        super().__init__("torch")
        self._tape, self._dtype = tape, dtype
        tape.dtype = dtype

    def __getattr__(self, name):
        if name in ("bfloat16", "float16", "half"):
            return self._dtype
        if name == "randn":
            return self._tape.randn
        if name == "randn_like":
            return lambda like, **kwargs: self._tape.randn(like.shape)
        return getattr(torch, name)


@contextlib.contextmanager
def proxied_torch(modules: Sequence[types.ModuleType], tape: NoiseTape, dtype: torch.dtype) -> Iterator[None]:
    """Give `modules` a `TorchProxy` for the duration of a run."""
    proxy = TorchProxy(tape, dtype)
    saved = [module.torch for module in modules]
    for module in modules:
        module.torch = proxy
    try:
        yield
    finally:
        for module, original in zip(modules, saved):
            module.torch = original


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Seeded weights that keep activations O(1): matrices ~ 1/sqrt(fan_in), norms ~ 1, biases small."""
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in module.named_parameters():
        noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
        if name.endswith("modulation"):  # (1, k, dim) shift/scale tables, as Wan initialises them
            value = noise / math.sqrt(parameter.shape[-1])
        elif parameter.ndim >= 2:
            value = noise / math.sqrt(parameter[0].numel())
        elif ("norm" in name and name.endswith("weight")) or name.endswith("gamma"):  # gamma: the VAE's RMS norms
            value = 1 + 0.1 * noise
        else:
            value = 0.1 * noise
        parameter.copy_(value.to(parameter.dtype))


def kv_buffer_patches() -> list[tuple[str, str]]:
    """Line patches for Self-Forcing's / LongLive's `_initialize_kv_cache` / `_initialize_crossattn_cache`, which
    hard-code Wan-1.3B's 12 heads x 128 in the buffer shapes: the tiny model's instead."""
    heads, head_dim = TINY_MODEL["num_heads"], TINY_MODEL["dim"] // TINY_MODEL["num_heads"]
    lines = [
        f'"{kv}": torch.zeros([batch_size, {length}, 12, 128], dtype=dtype, device=device)'
        for length in ("kv_cache_size", "512")
        for kv in ("k", "v")
    ]
    return [(line, line.replace("12, 128", f"{heads}, {head_dim}")) for line in lines]


def text_embeddings(lengths: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """Seeded `(1, text_len, text_dim)` prompt embeddings, zero after `lengths[name]` tokens as UMT5's padding is."""
    generator = torch.Generator().manual_seed(TEXT_SEED)
    embeds = {}
    for name, length in lengths.items():
        embed = torch.randn(1, TINY_MODEL["text_len"], TINY_MODEL["text_dim"], generator=generator)
        embed[:, length:] = 0.0
        embeds[name] = embed
    return embeds


def route_attention(causal_model: types.ModuleType, model_module: types.ModuleType) -> None:
    """Self-attention (`attention`) and cross-attention (`flash_attention`) to SDPA at the input dtype; the
    block-mask path's `flex_attention` eager (the trees wrap it in `torch.compile` at import)."""
    causal_model.attention = sdpa_at_input_dtype
    causal_model.flex_attention = torch.nn.attention.flex_attention.flex_attention
    model_module.FLASH_ATTN_2_AVAILABLE = True  # Krea's cross-attention takes its flash branch only if set
    model_module.flash_attention = sdpa_at_input_dtype


def tiny_weights(causal_model: types.ModuleType, **model_kwargs) -> dict[str, torch.Tensor]:
    """Seeded weights of the tiny `CausalWanModel`, keyed as the released checkpoints are (`model.` + Wan names)."""
    model = causal_model.CausalWanModel(**TINY_MODEL, **model_kwargs)
    randomize_(model, WEIGHT_SEED)
    return {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}


def tiny_wrapper(wan_wrapper: types.ModuleType, causal_model: types.ModuleType, weights, dtype, **kwargs):
    """The tree's `WanDiffusionWrapper` around the tiny model (its `from_pretrained` would read a 1.3B folder)."""
    model_kwargs = {k: kwargs[k] for k in ("local_attn_size", "sink_size") if k in kwargs}
    model = causal_model.CausalWanModel(**TINY_MODEL, **model_kwargs)
    with mock.patch.object(causal_model.CausalWanModel, "from_pretrained", lambda *a, **k: model):
        wrapper = wan_wrapper.WanDiffusionWrapper(model_name="tiny", is_causal=True, **kwargs)
    wrapper.load_state_dict(weights)
    return wrapper.to(dtype).eval().requires_grad_(False)


def causal_pipeline(pipeline_class, args, generator, embeds: Mapping[str, torch.Tensor], dtype: torch.dtype):
    """A Self-Forcing-family inference pipeline (`CausalInferencePipeline` or a subclass) as the trees' inference
    scripts build it, around the tiny model: the text encoder returns the stored embeddings, the VAE zeros, and
    the sizes hard-coded for Wan-1.3B (`num_transformer_blocks = 30`, `frame_seq_length = 1560`) the tiny model's."""

    def text_encoder(text_prompts):
        return {"prompt_embeds": embeds[text_prompts[0]].to(dtype).clone()}

    def decode_to_pixel(latents, use_cache=False):
        return torch.zeros(*latents.shape[:2], 3, 8, 8, dtype=dtype)

    vae = types.SimpleNamespace(decode_to_pixel=decode_to_pixel)
    pipeline = pipeline_class(args, "cpu", generator=generator, text_encoder=text_encoder, vae=vae)
    pipeline.num_transformer_blocks = TINY_MODEL["num_layers"]
    pipeline.frame_seq_length = TOKENS_PER_FRAME
    return pipeline


def to_diffusers_layout(latents: torch.Tensor) -> torch.Tensor:
    """Upstream's `(batch, frames, channels, h, w)` -> diffusers' `(batch, channels, frames, h, w)`, contiguous."""
    return latents.permute(0, 2, 1, 3, 4).contiguous()


def chunk_noise(
    tape: NoiseTape, num_chunks: int, chunk_frames: int, num_steps: int, first_chunk_steps: int | None = None
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Name a Self-Forcing-family tape: draw 0 is the whole video's noise `(1, frames, C, h, w)`, then one
    `(chunk_frames, C, h, w)` per re-noise, chunk by chunk. Returns `noise.<chunk>.<step>` (diffusers' layout)
    and the order the loop consumes them in. `first_chunk_steps`: chunk 0's own step count (Causal Forcing++'s
    `denoising_step_list_first_chunk`), when it has one."""
    initial, *renoise = tape.draws
    steps = [num_steps if first_chunk_steps is None or chunk else first_chunk_steps for chunk in range(num_chunks)]
    expected = sum(count - 1 for count in steps)
    if len(renoise) != expected:
        raise RuntimeError(f"Expected {expected} re-noise draws, upstream made {len(renoise)}.")
    tensors, order, used = {}, [], 0
    for chunk in range(num_chunks):
        for step in range(steps[chunk]):
            if step == 0:
                draw = initial[:, chunk_frames * chunk : chunk_frames * (chunk + 1)]
            else:
                draw, used = renoise[used][None], used + 1
            order.append(f"noise.{chunk}.{step}")
            tensors[order[-1]] = to_diffusers_layout(draw)
    return tensors, order


def table_sigmas(scheduler, timesteps: Sequence[float]) -> list[float]:
    """The sigma upstream uses at each fed timestep: its table's nearest entry (`argmin |timesteps - t|`)."""
    return [float(scheduler.sigmas[int((scheduler.timesteps - float(t)).abs().argmin())]) for t in timesteps]


def max_abs(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b, strict=True))


def record_scenario(
    run,
    out: Path,
    name: str,
    num_chunks: int,
    chunk_frames: int,
    texts: Mapping,
    first_chunk_steps: int | None = None,
    extra: Mapping[str, torch.Tensor] | None = None,
) -> dict:
    """Run one scenario (`run(tape, dtype)` -> clean latents, timesteps, sigmas) in fp32 and, replaying the same
    draws, in fp64; save its golden tensors (text, noise per chunk and step, clean latents, and `extra`, e.g. a
    start image) to `golden.{name}.safetensors`; return what the scenario's meta entry records (timesteps, sigmas,
    noise order and the fp32-vs-fp64 floor). `num_chunks`: the chunks upstream denoises (a start image's clean
    chunk, listed first in the clean latents, draws no noise)."""
    from safetensors.torch import save_file

    tape = NoiseTape(NOISE_SEED)
    fp32 = run(tape, torch.float32)
    fp64 = run(NoiseTape(NOISE_SEED, replay=tape.draws), torch.float64)
    floor = max_abs(fp32["clean"], fp64["clean"])
    noise, order = chunk_noise(tape, num_chunks, chunk_frames, len(fp32["timesteps"]), first_chunk_steps)
    tensors = {f"text.{key}": value for key, value in texts.items()} | noise
    tensors |= {f"clean.{i}": c for i, c in enumerate(fp32["clean"])} | dict(extra or {})
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / f"golden.{name}.safetensors")
    print(f"{name}: {num_chunks} chunks, floor (fp32 vs fp64) {floor:.3e}")
    return {"timesteps": fp32["timesteps"], "sigmas": fp32["sigmas"], "noise_order": order, "floor": floor}


def start_recording(upstream: Path, patches: dict, model_kwargs: Mapping, prompts: Mapping[str, int], out: Path):
    """A Self-Forcing-family tree loaded (its memory helper `demo_utils.memory`), the tiny weights (saved to
    `out/transformer.safetensors`) and the prompts' embeddings: `(tree, weights, embeds)`."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    up = load_causal_tree(upstream, patches, "demo_utils.memory")
    weights = tiny_weights(up.causal_model, **model_kwargs)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "transformer.safetensors")
    return up, weights, text_embeddings(prompts)


def run_inference(up, pipeline, tape: NoiseTape, dtype: torch.dtype, num_chunks: int, chunk_frames: int,
                  prompt: str = "a") -> dict:  # fmt: skip
    """The tree's `pipeline.inference` on the tape's first draw (the video's noise), its prints silenced: each chunk's
    clean latents (diffusers' layout), the timesteps fed and their sigmas, as `record_scenario` takes them."""
    import io

    noise = tape.randn(1, num_chunks * chunk_frames, TINY_MODEL["in_dim"], *LATENT_SIZE).to(dtype)
    with proxied_torch([up.causal_inference], tape, dtype), contextlib.redirect_stdout(io.StringIO()):
        _, latents = pipeline.inference(noise, text_prompts=[prompt], return_latents=True)
    clean = [to_diffusers_layout(chunk) for chunk in latents.split(chunk_frames, dim=1)]
    timesteps = [float(t) for t in pipeline.denoising_step_list]
    return {"clean": clean, "timesteps": timesteps, "sigmas": table_sigmas(pipeline.scheduler, timesteps)}


def record_scenarios(out: Path, scenarios: Mapping[str, dict], run_scenario, embeds: Mapping, num_chunks: int,
                     chunk_frames: int) -> dict:  # fmt: skip
    """`record_scenario` for each of `scenarios` (`run_scenario(scenario, tape, dtype)`), prompt "a" and, for a
    scenario with a `switch_before_block`, "b" too; returns each scenario's meta entry (its settings and what
    `record_scenario` recorded)."""
    recorded = {}
    for name, scenario in scenarios.items():

        def run(tape, dtype, scenario=scenario):
            return run_scenario(scenario, tape, dtype)

        texts = {key: embeds[key] for key in ("a", "b") if key == "a" or "switch_before_block" in scenario}
        entry = record_scenario(run, out, name, num_chunks, chunk_frames, texts)
        recorded[name] = {"num_chunks": num_chunks, "prompt": "a", **scenario, **entry}
    return recorded


def recorder_main(doc: str, record, tree: str, golden_folder: str) -> None:
    """The recording scripts' command line: `--upstream` (the extracted `tree`) and `--out` (the golden folder)."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--upstream", type=Path, required=True, help=f"extracted {tree} tree")
    parser.add_argument("--out", type=Path, required=True, help=f"golden folder, e.g. {golden_folder}")
    args = parser.parse_args()
    record(args.upstream, args.out)


def load_causal_tree(root: Path, patches: dict, memory_module: str, **extra_modules: str) -> types.SimpleNamespace:
    """A Self-Forcing-family tree (Self-Forcing, LongLive, Krea) imported on a CPU: the causal Wan model with its
    attention routed to SDPA, its `WanDiffusionWrapper`, `pipeline.causal_inference` and `extra_modules`
    (attribute name -> module path). `memory_module` is the tree's CUDA-only memory helper, stubbed by name."""
    cpu_cuda_stubs()
    tree = UpstreamTree(
        root,
        patches=patches,
        bare_packages=["pipeline", "wan", "wan.modules"],
        stubs=COMMON_STUBS | {memory_module: dict.fromkeys(MEMORY_HELPERS)},
    )
    causal_model = tree.module("wan.modules.causal_model")
    route_attention(causal_model, tree.module("wan.modules.model"))
    return types.SimpleNamespace(
        causal_model=causal_model,
        wan_wrapper=tree.module("utils.wan_wrapper"),
        causal_inference=tree.module("pipeline.causal_inference"),
        **{name: tree.module(module) for name, module in extra_modules.items()},
    )


class SwitchingGenerator(torch.nn.Module):
    """A Self-Forcing-family tree's generator with a prompt switch the trees do not have, performed as rolldiff's
    `switch_prompt` defines it (`recache="causal"`), through the authors' own forward and K/V cache only.

    Before the first call of block `switch_start` (a token offset, `current_start`): the text K/V are reset (the
    trees' own `crossattn_cache[i]["is_init"] = False`, as LongLive's interactive loop and the trees' `inference`
    do for a new video) and every earlier block's clean context pass is called again under the new prompt, oldest
    first, at its own `current_start` (the sink's blocks, `sink_tokens`, left as they are: rolldiff's re-cache never
    rewrites the sink). The trees' caches take a write at an earlier position in place (`causal_model.py`:
    `local_end_index = local_end + current_end - global_end`, then `global_end_index` set to `current_end`; Rolling
    Forcing's clean pass, `updating_cache=True`, writes there without moving its ends), so this is the chunk-by-chunk
    re-cache, each block seeing its past as the next block will.
    From then on every call runs under the new prompt. Context passes are recognised by their timestep 0 (the
    recorded configs' `context_noise: 0`); denoising steps never feed 0. Only for a switch while every committed
    block is still in the buffer (nothing evicted yet): the re-runs rewrite every block, as rolldiff's re-cache
    rewrites its whole visible window."""

    def __init__(self, generator, new_conditional: dict, switch_start: int, sink_tokens: int = 0) -> None:
        super().__init__()
        self.generator, self.new_conditional, self.switch_start = generator, new_conditional, switch_start
        self.sink_tokens = sink_tokens  # blocks starting before it are the sink: the re-cache leaves them
        self.context_passes: dict[int, torch.Tensor] = {}  # current_start -> its last clean pass before the switch
        self.switched = False

    def forward(
        self, *, noisy_image_or_video, conditional_dict, timestep, kv_cache, crossattn_cache, current_start, **extra
    ):
        """The tree's call, switched (`extra`: a tree's own keywords, e.g. Rolling Forcing's `updating_cache`)."""
        call = dict(kv_cache=kv_cache, crossattn_cache=crossattn_cache, **extra)
        if current_start < self.switch_start:
            if bool((timestep == 0).all()):
                self.context_passes[current_start] = noisy_image_or_video.clone()
            return self.generator(
                noisy_image_or_video=noisy_image_or_video, conditional_dict=conditional_dict, timestep=timestep,
                current_start=current_start, **call,
            )  # fmt: skip
        if not self.switched:
            self.switched = True
            for block in crossattn_cache:
                block["is_init"] = False
            for start, clean in sorted(self.context_passes.items()):
                if start >= self.sink_tokens:
                    zeros = torch.zeros(clean.shape[:2], dtype=timestep.dtype)
                    self.generator(
                        noisy_image_or_video=clean, conditional_dict=self.new_conditional, timestep=zeros,
                        current_start=start, **call,
                    )  # fmt: skip
        return self.generator(
            noisy_image_or_video=noisy_image_or_video, conditional_dict=self.new_conditional, timestep=timestep,
            current_start=current_start, **call,
        )  # fmt: skip


def start_image(seed: int) -> torch.Tensor:
    """A seeded `(height, width, 3)` uint8 picture at the output size (an image-to-video golden's start image)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (HEIGHT, WIDTH, 3), generator=generator, dtype=torch.uint8)


def switch_before(pipeline, embeds, dtype: torch.dtype, block: int, chunk_frames: int, sink_blocks: int = 0) -> None:
    """Wrap `pipeline.generator` so the video switches to prompt "b" before `block` (`SwitchingGenerator`), the first
    `sink_blocks` blocks kept as the sink."""
    new, block_tokens = {"prompt_embeds": embeds["b"].to(dtype).clone()}, chunk_frames * TOKENS_PER_FRAME
    pipeline.generator = SwitchingGenerator(pipeline.generator, new, block * block_tokens, sink_blocks * block_tokens)
