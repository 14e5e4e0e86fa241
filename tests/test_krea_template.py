"""The model template: one compiled graph per window state, concurrent streams, diffusers features kept.

A cached step compiles with `fullgraph=True` into at most two graphs (window filling, window full)
and never recompiles as the video grows; one model instance serves several threads with their own
caches exactly as it serves one; LoRA, attention backends and gradient checkpointing still work.
"""

import pytest
import torch
from concurrency import assert_same_as_alone, run_together
from tiny_components import tiny_transformer
from torch._dynamo.testing import CompileCounter

from rolldiff import ChunkLayout

TOKENS_PER_FRAME = 4  # 4x4 latent, patch 2x2


def _text(seed: int = 1) -> torch.Tensor:
    return torch.randn(1, 7, 16, generator=torch.Generator().manual_seed(seed))


def _run_chunks(model, layout, num_chunks: int, text: torch.Tensor, seed: int = 0, steps=(1.0, 0.5)) -> list:
    """A few-step chunk loop on `model` (compiled or not); returns each chunk's last output."""
    generator = torch.Generator().manual_seed(seed)
    cache = model.make_cache(layout, batch_size=1)
    model.prepare_conditioning(cache, text) if hasattr(model, "prepare_conditioning") else None
    outputs = []
    for _ in range(num_chunks):
        noisy = torch.randn(1, 4, layout.chunk_frames, 4, 4, generator=generator)
        for sigma in steps:
            out = model(noisy, torch.tensor([sigma * 1000.0]), text, kv_cache=cache, layout=layout).sample
        model(out, torch.tensor([0.0]), text, kv_cache=cache, layout=layout)
        cache.commit()
        outputs.append(out)
    return outputs


@pytest.mark.parametrize("position_mode", ["absolute", "relative"])
@torch.no_grad()
def test_cached_step_compiles_into_two_graphs_and_never_recompiles(position_mode):
    model = tiny_transformer(num_layers=12, rope_max_seq_len=512)
    layout = ChunkLayout(TOKENS_PER_FRAME, chunk_frames=1, sink_frames=1, window_frames=3, position_mode=position_mode)
    counter = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    try:
        compiled_out = _run_chunks(compiled, layout, num_chunks=8, text=_text())
        assert counter.frame_count == 2  # window filling, then full (mask dropped)
        _run_chunks(compiled, layout, num_chunks=105, text=_text(), steps=(0.5,))  # a new stream, same graphs
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 2  # never recompiled over 100+ chunks
    eager_out = _run_chunks(model, layout, num_chunks=8, text=_text())
    for compiled_chunk, eager_chunk in zip(compiled_out, eager_out):
        torch.testing.assert_close(compiled_chunk, eager_chunk, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_full_window_attends_without_a_mask_and_matches_the_masked_step():
    model = tiny_transformer()
    layout = ChunkLayout(TOKENS_PER_FRAME, chunk_frames=1, sink_frames=1, window_frames=2)
    cache = model.make_cache(layout)
    text = _text()
    for _ in range(3):
        out = model(torch.randn(1, 4, 1, 4, 4), torch.tensor([0.0]), text, kv_cache=cache, layout=layout).sample
        cache.commit()
    assert cache[0].window_full
    noisy = torch.randn(1, 4, 1, 4, 4)
    unmasked = model(noisy, torch.tensor([500.0]), text, kv_cache=cache, layout=layout).sample
    assert bool(cache[0].attention_mask.all())  # the dropped mask was all True
    dense_inputs = torch.cat([torch.randn(1, 4, 3, 4, 4), noisy], dim=2)  # context differs: only a sanity check
    assert unmasked.shape == out.shape and dense_inputs.shape[2] == 4


@torch.no_grad()
def test_one_model_serves_concurrent_streams_as_alone():
    model = tiny_transformer()
    layout = ChunkLayout(TOKENS_PER_FRAME, chunk_frames=2, sink_frames=2, window_frames=4, position_mode="relative")
    alone = [_run_chunks(model, layout, 6, _text(seed), seed=seed) for seed in range(4)]
    together = run_together(
        lambda seed: _run_chunks(model, layout, 6, _text(seed), seed=seed), [(s,) for s in range(4)]
    )
    for seed in range(4):
        assert_same_as_alone(together[seed], alone[seed])
    assert model._call_slot.context is None  # nothing left bound after the calls


@torch.no_grad()
def test_prompt_change_is_explicit_and_recomputes_text_key_values():
    model = tiny_transformer()
    layout = ChunkLayout(TOKENS_PER_FRAME, chunk_frames=2, sink_frames=2, window_frames=4)
    cache = model.make_cache(layout)
    first, second = _text(1), _text(2)
    model.prepare_conditioning(cache, first)
    model(torch.randn(1, 4, 2, 4, 4), torch.tensor([0.0]), first, kv_cache=cache, layout=layout)
    assert cache.cross[0].num_computations == 1  # read, not recomputed, by the step
    model.prepare_conditioning(cache, second)
    keys_second = cache.cross[0].keys.clone()
    fresh = model.make_cache(layout)
    model(torch.randn(1, 4, 2, 4, 4), torch.tensor([0.0]), second, kv_cache=fresh, layout=layout)
    assert torch.equal(fresh.cross[0].keys, keys_second)  # lazily filled on the first step == prepared


def test_attention_backend_selection_reaches_the_cached_processors(monkeypatch):
    from diffusers.models import attention_dispatch

    model = tiny_transformer()
    layout = ChunkLayout(TOKENS_PER_FRAME, chunk_frames=2, sink_frames=2, window_frames=4)
    seen = []
    original = attention_dispatch.dispatch_attention_fn

    def spy(*args, backend=None, **kwargs):
        seen.append(backend)
        return original(*args, backend=backend, **kwargs)

    monkeypatch.setattr("rolldiff.models.krea_realtime.dispatch_attention_fn", spy)
    model.set_attention_backend("_native_math")
    with torch.no_grad():
        latents, text = torch.randn(1, 4, 2, 4, 4), _text()
        cached = model(latents, torch.tensor([500.0]), text, kv_cache=model.make_cache(layout), layout=layout).sample
    assert seen and all(str(b) == "AttentionBackendName._NATIVE_MATH" or b == "_native_math" for b in seen)
    model.reset_attention_backend()
    with torch.no_grad():
        default = model(latents, torch.tensor([500.0]), text, kv_cache=model.make_cache(layout), layout=layout).sample
    torch.testing.assert_close(cached, default, atol=1e-5, rtol=1e-5)


def test_gradient_checkpointing_gives_the_same_gradients_on_the_dense_path():
    layout = ChunkLayout(TOKENS_PER_FRAME, chunk_frames=2, sink_frames=2, window_frames=4)
    latents, text = torch.randn(1, 4, 4, 4, 4), _text()
    timestep = torch.tensor([[0.0, 0.0, 500.0, 500.0]])
    grads = []
    for checkpointing in (False, True):
        model = tiny_transformer().train()
        if checkpointing:
            model.enable_gradient_checkpointing()
        model(latents, timestep, text, layout=layout).sample.square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


@torch.no_grad()
def test_lora_adapter_scale_applies_to_cached_steps():
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig
    from tiny_components import TRANSFORMER_CONFIG

    model = tiny_transformer()
    layout = ChunkLayout(TOKENS_PER_FRAME, chunk_frames=2, sink_frames=2, window_frames=4)
    latents, text = torch.randn(1, 4, 2, 4, 4), _text()

    def step(**kwargs):
        cache = model.make_cache(layout)
        return model(latents, torch.tensor([500.0]), text, kv_cache=cache, layout=layout, **kwargs).sample

    base = step()
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False))
    full = step()
    off = step(attention_kwargs={"scale": 0.0})
    half = step(attention_kwargs={"scale": 0.5})
    assert not torch.allclose(full, base, atol=1e-4)
    torch.testing.assert_close(off, base, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(half, full, atol=1e-5) and not torch.allclose(half, base, atol=1e-5)
    reference = WanTransformer3DModel(**TRANSFORMER_CONFIG).eval()  # the first chunk equals plain Wan, adapter too
    reference.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"]))
    reference.load_state_dict(model.state_dict())
    expected = reference(latents, torch.tensor([500.0]), text, attention_kwargs={"scale": 0.5}).sample
    torch.testing.assert_close(half, expected, atol=1e-5, rtol=1e-5)


def test_from_pretrained_refuses_weights_that_do_not_match_the_config(tmp_path):
    import json

    from rolldiff import KreaRealtimeTransformer3DModel

    tiny_transformer().save_pretrained(tmp_path)
    assert isinstance(KreaRealtimeTransformer3DModel.from_pretrained(tmp_path), KreaRealtimeTransformer3DModel)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "num_layers": config["num_layers"] + 1}))
    with pytest.raises(ValueError, match="missing"):
        KreaRealtimeTransformer3DModel.from_pretrained(tmp_path)


@torch.no_grad()
def test_a_cached_step_skips_the_text_projection_once_every_block_holds_its_text_kv():
    """The projected text is only read to fill the cross-attention K/V; the research loops redo it every step."""
    from diffusers import WanTransformer3DModel

    model = tiny_transformer()
    projections = []
    model.condition_embedder.text_embedder.linear_1.register_forward_hook(lambda *_: projections.append(1))
    layout = ChunkLayout(TOKENS_PER_FRAME, chunk_frames=1, sink_frames=1, window_frames=2)
    cache, text, noisy = model.make_cache(layout), _text(), torch.randn(1, 4, 1, 4, 4)
    projected = model(noisy, torch.tensor([500.0]), text, kv_cache=cache, layout=layout).sample  # fills the K/V
    assert len(projections) == 1
    skipped = model(noisy, torch.tensor([500.0]), text, kv_cache=cache, layout=layout).sample  # same step again
    assert len(projections) == 1
    assert torch.equal(skipped, projected)
    cache.cross[1].reset()  # one block without its K/V: the text is projected again
    again = model(noisy, torch.tensor([500.0]), text, kv_cache=cache, layout=layout).sample
    assert len(projections) == 2 and torch.equal(again, projected)
    torch.manual_seed(0)  # tiny_transformer's seed: the same weights, keys and random draws as diffusers' model
    reference = WanTransformer3DModel(**model.config).eval()
    expected = reference.state_dict()
    assert model.state_dict().keys() == expected.keys()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in model.state_dict().items())
    plain = model(noisy, torch.tensor([500.0]), text).sample  # no cache: diffusers' forward, text projected
    assert len(projections) == 3 and torch.equal(plain, reference(noisy, torch.tensor([500.0]), text).sample)
