"""Speed switches on the CPU: which layers float8 converts and when it refuses, attention backends set on our
model without changing its output, and the compiled cached step (2 graphs, outputs that survive a replay).

The float8 matmuls, the GPU attention kernels and the CUDA-graph replay itself need a GPU:
`benchmarks/gpu_fps.py` measures them and `benchmarks/gpu_checks.py` compares their videos.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from tiny_components import tiny_transformer
from torch._dynamo.testing import CompileCounter

from rolldiff import ChunkLayout
from rolldiff.pipelines import acceleration
from rolldiff.pipelines.acceleration import (
    attention_accepts_mask,
    attention_backend_for,
    available_attention_backends,
    capture_cuda_graphs,
    clone_outputs,
    compile_cached_step,
    enable_fp8,
    fastest_attention_backend,
    fp8_linear_names,
    fp8_refusal,
    set_attention_backend,
)

ALIGNED = dict(attention_head_dim=16, ffn_dim=64, text_dim=32)  # inner dim 32: every block linear is 16-aligned
PER_BLOCK = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_out.0"]
FFN = ["ffn.net.0.proj", "ffn.net.2"]
LATENT_HW = (4, 4)  # 4 tokens per frame after the 2x2 patch


# ----------------------------------------------------------------------------------------- fp8: layers
def test_fp8_converts_the_block_linears_that_run_every_step():
    model = tiny_transformer(**ALIGNED)
    expected = [f"blocks.{block}.{name}" for block in range(2) for name in PER_BLOCK + FFN]
    assert fp8_linear_names(model) == expected


def test_fp8_keeps_embedders_proj_out_and_the_text_kv_projections():
    model = tiny_transformer(**ALIGNED)
    selected = set(fp8_linear_names(model))
    linears = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    kept = sorted(linears - selected)
    assert "proj_out" in kept and "condition_embedder.text_embedder.linear_1" in kept
    assert "condition_embedder.time_embedder.linear_1" in kept
    assert {"blocks.0.attn2.to_k", "blocks.0.attn2.to_v", "blocks.1.attn2.to_k"} <= set(kept)
    assert all(not name.startswith("blocks.") or ".attn2.to_" in name for name in kept)


def test_fp8_skips_layers_whose_sides_are_not_multiples_of_16():
    model = tiny_transformer(**{**ALIGNED, "ffn_dim": 40})  # 32 -> 40 -> 32: the FFN cannot run in float8
    assert fp8_linear_names(model) == [f"blocks.{block}.{name}" for block in range(2) for name in PER_BLOCK]
    assert fp8_linear_names(tiny_transformer(attention_head_dim=12)) == []  # inner dim 24: nothing aligned


# ----------------------------------------------------------------------------------------- fp8: refusals
def test_fp8_refuses_a_cpu_naming_the_option_and_the_need():
    message = fp8_refusal(torch.device("cpu"), None, torch.bfloat16)
    assert "--fp8" in message and "compute capability >= 8.9" in message and "on cpu" in message


def test_fp8_refuses_a_gpu_before_ada_naming_its_capability():
    message = fp8_refusal(torch.device("cuda:0"), (8, 0), torch.bfloat16)
    assert "cuda:0 has 8.0" in message and "--fp8" in message


def test_fp8_refuses_float32_weights_and_says_how_to_load_bfloat16():
    message = fp8_refusal(torch.device("cuda:0"), (9, 0), torch.float32)
    assert "torch.float32" in message and "bfloat16" in message
    assert fp8_refusal(torch.device("cuda:0"), (8, 9), torch.bfloat16) is None
    assert fp8_refusal(torch.device("cuda:0"), (10, 0), torch.bfloat16) is None


def test_enable_fp8_on_the_cpu_raises_before_changing_a_weight():
    model = tiny_transformer(**ALIGNED).to(torch.bfloat16)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"--fp8.*on cpu"):
        enable_fp8(model)
    after = model.state_dict()
    assert all(type(after[name]) is torch.Tensor and torch.equal(after[name], value) for name, value in before.items())


def test_enable_fp8_without_torchao_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(acceleration, "cuda_capability", lambda device: (9, 0))  # as on an H100
    monkeypatch.setattr(acceleration, "torchao_installed", lambda: False)
    with pytest.raises(RuntimeError, match=r"--fp8\) needs torchao: `pip install torchao`"):
        enable_fp8(tiny_transformer(**ALIGNED).to(torch.bfloat16))


# ----------------------------------------------------------------------------------------- attention
def test_native_is_the_fastest_and_only_exact_choice_on_the_cpu():
    assert fastest_attention_backend("cpu") == "native"
    assert available_attention_backends("cpu") == ["native", "_native_math"]


@pytest.mark.parametrize(
    "name, why", [("flash", "cannot run on cpu"), ("sage", "is not an offered"), ("fastest", "is not an offered")]
)
def test_an_unusable_backend_is_refused_listing_the_usable_ones(name, why):
    with pytest.raises(ValueError, match=rf"{name!r} {why}.*usable on cpu: native, _native_math"):
        set_attention_backend(tiny_transformer(), name)


def test_a_backend_that_cannot_run_the_models_head_size_is_refused_before_anything_changes(monkeypatch):
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    model = tiny_transformer(attention_head_dim=36)  # the embedded models' head size: no fused kernel takes it
    monkeypatch.setattr(acceleration, "available_attention_backends", lambda device: ["native", "_native_cudnn"])
    before = _AttentionBackendRegistry.get_active_backend()[0]
    with pytest.raises(
        acceleration.AccelerationUnavailable,
        match=r"'_native_cudnn' cannot run .* head size 36 in float32.*usable for it: native",
    ):
        set_attention_backend(model, "_native_cudnn")  # cuDNN is absent on a CPU, as it refuses 36 on a GPU
    assert _AttentionBackendRegistry.get_active_backend()[0] == before
    assert all(
        getattr(m.processor, "_attention_backend", None) is None for m in model.modules() if hasattr(m, "processor")
    )


def test_fastest_is_the_first_preferred_backend_that_runs_every_head_size(monkeypatch):
    monkeypatch.setattr(acceleration, "available_attention_backends", lambda device: ["flash", "native"])
    monkeypatch.setattr(acceleration, "attention_runs", lambda name, device, dim, dtype: dim % 8 == 0)
    assert fastest_attention_backend("cpu", [64, 128]) == "flash"
    assert fastest_attention_backend("cpu", [36, 64]) == "native"  # one head size the kernel refuses is enough
    assert acceleration.attention_head_dims(tiny_transformer(attention_head_dim=36)) == [36]


def test_setting_a_backend_on_one_model_leaves_other_models_on_the_default():
    """diffusers' `set_attention_backend` also sets its process-wide backend, which every processor without one
    of its own uses: a later pipeline (in float32, say) would run a kernel chosen for another."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    before = _AttentionBackendRegistry.get_active_backend()[0]
    chosen, other = tiny_transformer(), tiny_transformer(seed=1)
    set_attention_backend(chosen, "_native_math")
    assert _AttentionBackendRegistry.get_active_backend()[0] == before
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" not in attention_ops(chosen)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in attention_ops(other)


def cached_velocities(model, chunks: int = 4, step=None) -> list[torch.Tensor]:
    """Velocities of `chunks` cached chunks (1 step + the context pass each), window 2 + 2 of chunk 1."""
    layout = ChunkLayout(tokens_per_frame=4, chunk_frames=1, sink_frames=1, window_frames=2)
    generator = torch.Generator().manual_seed(0)
    text = torch.randn(1, 6, model.config.text_dim, generator=generator)
    cache = model.make_cache(layout, 1, torch.float32, "cpu")
    model.prepare_conditioning(cache, text)
    step = step or model
    velocities = []
    with torch.no_grad():
        for _ in range(chunks):
            latents = torch.randn(1, 4, 1, *LATENT_HW, generator=generator)
            velocities.append(step(latents, torch.tensor([500.0]), text, kv_cache=cache, layout=layout).sample)
            step(latents, torch.tensor([0.0]), text, kv_cache=cache, layout=layout)
            cache.commit()
    return velocities


def attention_ops(model) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        cached_velocities(model, chunks=1)
    return {event.name for event in profile.events() if "attention" in event.name}


def test_setting_native_keeps_the_output_bit_for_bit():
    model = tiny_transformer()
    default = cached_velocities(model)
    set_attention_backend(model, "native")
    assert all(torch.equal(a, b) for a, b in zip(default, cached_velocities(model), strict=True))


def test_setting_math_runs_torchs_math_kernel_with_the_same_output():
    model = tiny_transformer()
    default = cached_velocities(model)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in attention_ops(model)
    set_attention_backend(model, "_native_math")
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" not in attention_ops(model)
    for a, b in zip(default, cached_velocities(model), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_masked_call_falls_back_from_mask_free_kernels():
    from diffusers.models.attention_dispatch import AttentionBackendName

    assert attention_backend_for(AttentionBackendName.FLASH, masked=True) == AttentionBackendName.NATIVE
    assert attention_backend_for("_flash_3", masked=True) == AttentionBackendName.NATIVE
    assert attention_backend_for(AttentionBackendName.FLASH, masked=False) == AttentionBackendName.FLASH
    assert attention_backend_for(AttentionBackendName("_native_cudnn"), masked=True) == "_native_cudnn"
    assert attention_backend_for(None, masked=True) is None


# ----------------------------------------------------------------------------------------- CUDA graphs
def test_cuda_graphs_on_the_cpu_are_refused_pointing_at_plain_compile():
    with pytest.raises(ValueError, match=r"--cuda-graphs.*on cpu.*compile_cached_step"):
        capture_cuda_graphs(tiny_transformer())


def test_the_compiled_cached_step_builds_two_graphs_and_gives_the_eager_output():
    eager = cached_velocities(tiny_transformer(), chunks=6)
    model = tiny_transformer()
    counter = CompileCounter()
    torch.compiler.reset()
    try:
        compile_cached_step(model, backend=counter)
        compiled = cached_velocities(model, chunks=6)  # 6 chunks: the window fills, then wraps 3 times
    finally:
        torch.compiler.reset()
    assert counter.frame_count == 2  # window filling, window full: no re-capture as the video grows
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def cut_velocities(model, cut_chunk: int | None, chunks: int = 5) -> list[torch.Tensor]:
    """Velocities of `chunks` cached chunks at relative positions, chunk `cut_chunk` (if any) a scene cut: its step
    and context pass placed at RoPE frame 45 (`RollingKVCache.set_cut_position`), as the stream places it."""
    layout = ChunkLayout(tokens_per_frame=4, chunk_frames=1, sink_frames=1, window_frames=2, position_mode="relative")
    generator = torch.Generator().manual_seed(0)
    text = torch.randn(1, 6, model.config.text_dim, generator=generator)
    cache = model.make_cache(layout, 1, torch.float32, "cpu")
    model.prepare_conditioning(cache, text)
    velocities = []
    with torch.no_grad():
        for index in range(chunks):
            cache.set_cut_position(45 * layout.tokens_per_frame if index == cut_chunk else None)
            latents = torch.randn(1, 4, 1, *LATENT_HW, generator=generator)
            velocities.append(model(latents, torch.tensor([500.0]), text, kv_cache=cache, layout=layout).sample)
            model(latents, torch.tensor([0.0]), text, kv_cache=cache, layout=layout)
            cache.commit()
    return velocities


def test_a_compiled_step_places_a_scene_cut_as_the_eager_one_does():
    """The cut's position is guarded by the compiled step (a graph of its own), never replayed from a plain one."""
    eager_cut, eager_plain = cut_velocities(tiny_transformer(), 3), cut_velocities(tiny_transformer(), None)
    assert not torch.allclose(eager_cut[3], eager_plain[3])  # the cut moves the chunk
    model = tiny_transformer()
    torch.compiler.reset()
    try:
        compile_cached_step(model, backend="eager")
        compiled = cut_velocities(model, 3)
    finally:
        torch.compiler.reset()
    for a, b in zip(eager_cut, compiled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_reduce_overhead_clones_outputs_and_a_second_compile_is_refused():
    # Imported first: the inductor backend's `reset()` imports it lazily, and its import registers another backend,
    # which would break the `torch.compiler.reset()` iterating them (torch 2.13: "dictionary changed size").
    importlib.import_module("torch._inductor.cudagraph_trees")
    model = tiny_transformer()
    try:
        step = compile_cached_step(model, mode="reduce-overhead")  # lazy: nothing compiles until the first call
        assert step.clone and model.forward is step
        with pytest.raises(RuntimeError, match="compiled already"):
            compile_cached_step(model)
        assert not compile_cached_step(tiny_transformer(), backend="eager").clone
    finally:
        torch.compiler.reset()  # no backend left behind for later tests' resets


def test_cloned_outputs_survive_the_next_replay_overwriting_the_graphs_buffer():
    graph_output = torch.arange(4.0)  # a CUDA graph writes every replay's output into the same memory
    cloned = clone_outputs(Transformer2DModelOutput(sample=graph_output))
    as_tuple = clone_outputs((graph_output, "kept"))
    graph_output.fill_(-1.0)  # the next replay
    assert torch.equal(cloned.sample, torch.arange(4.0)) and isinstance(cloned, Transformer2DModelOutput)
    assert torch.equal(as_tuple[0], torch.arange(4.0)) and as_tuple[1] == "kept"


def test_mask_support_is_probed_not_assumed():
    assert attention_accepts_mask("native", "cpu") and attention_accepts_mask("_native_math", "cpu")
    assert not attention_accepts_mask("flash", "cpu")  # flash-attn kernels take no mask at all


def test_the_pipeline_offers_each_speed_option():
    """The pipeline's own switches: on a CPU the fastest backend is SDPA ("native", frames unchanged) and fp8 /
    CUDA graphs are refused with a message saying why."""
    import numpy as np
    from tiny_components import tiny_pipeline

    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    before = pipe(
        "a red circle moving left", num_frames=6, height=16, width=16, generator=torch.Generator().manual_seed(0)
    )
    assert pipe.set_attention_backend() == "native"
    after = pipe(
        "a red circle moving left", num_frames=6, height=16, width=16, generator=torch.Generator().manual_seed(0)
    )
    np.testing.assert_allclose(after.frames, before.frames, atol=1e-6)
    with pytest.raises((ValueError, RuntimeError, ImportError), match="fp8|float8|CUDA|cuda"):
        pipe.enable_fp8()
    with pytest.raises((ValueError, RuntimeError), match="CUDA|cuda"):
        pipe.enable_cuda_graphs()


def test_refusals_are_acceleration_unavailable_and_a_typo_is_a_plain_value_error():
    """Benchmarks skip a row on AccelerationUnavailable (by type, not by message); a ValueError and RuntimeError
    both, so callers catching either keep working."""
    from rolldiff.pipelines.acceleration import AccelerationUnavailable, capture_cuda_graphs

    assert issubclass(AccelerationUnavailable, ValueError) and issubclass(AccelerationUnavailable, RuntimeError)
    with pytest.raises(AccelerationUnavailable, match="--fp8"):
        enable_fp8(tiny_transformer(**ALIGNED).to(torch.bfloat16))
    with pytest.raises(AccelerationUnavailable, match="--cuda-graphs"):
        capture_cuda_graphs(tiny_transformer())
    with pytest.raises(AccelerationUnavailable, match="cannot run on cpu"):
        set_attention_backend(tiny_transformer(), "flash")
    with pytest.raises(ValueError, match="is not an offered") as typo:
        set_attention_backend(tiny_transformer(), "sage")
    assert not isinstance(typo.value, AccelerationUnavailable)
