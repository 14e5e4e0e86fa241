"""GlmImageCachedTransformer2DModel + ConditionKVCache against diffusers' model + GlmImageKVCache.

Same weights, the same write / read / skip call sequence, outputs compared at every call
(tolerance 1e-6; in practice they are bitwise equal). Cases diffusers cannot run (per-sample
condition lengths) are compared with diffusers run on each sample alone.
"""

from __future__ import annotations

import threading

import pytest
import torch
from diffusers import GlmImageTransformer2DModel
from diffusers.models.transformers.transformer_glm_image import GlmImageKVCache
from glm_tiny_components import DECODER_CONFIG, tiny_decoder
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rolldiff import ConditionKVCache, ConditionLayer, GlmImageCachedTransformer2DModel
from rolldiff.caching.workspace import CacheWorkspace

TOL = dict(rtol=1e-6, atol=1e-6)
NUM_LAYERS = 2


@pytest.fixture(scope="module")
def models() -> tuple[GlmImageCachedTransformer2DModel, GlmImageTransformer2DModel]:
    ours = tiny_decoder(0, num_layers=NUM_LAYERS)
    reference = GlmImageTransformer2DModel(**{**DECODER_CONFIG, "num_layers": NUM_LAYERS}).eval()
    reference.load_state_dict(ours.state_dict())
    return ours, reference


def decoder_inputs(batch: int, height: int, width: int, text_tokens: int, timestep: float, seed: int) -> dict:
    """One decoder call: latents (B, 4, h, w), glyph embeddings (B, text, 32), prior tokens per patch."""
    g = torch.Generator().manual_seed(seed)
    tokens = (height // 2) * (width // 2)
    return dict(
        hidden_states=torch.randn(batch, 4, height, width, generator=g),
        encoder_hidden_states=torch.randn(batch, text_tokens, 32, generator=g),
        prior_token_id=torch.randint(0, 32, (batch, tokens), generator=g),
        prior_token_drop=torch.zeros(batch, tokens, dtype=torch.bool),
        timestep=torch.full((batch,), timestep),
        target_size=torch.tensor([[height * 8.0, width * 8.0]] * batch),
        crop_coords=torch.zeros(batch, 2),
    )


def write_references(model, cache, samples: list[list[tuple[int, int]]], seed: int = 100) -> None:
    """The pipeline's write phase: one batch-1 forward per reference image at t = 0, then `next_sample()`."""
    cache.set_mode("write")
    for s, references in enumerate(samples):
        for r, (height, width) in enumerate(references):
            model(**decoder_inputs(1, height, width, 0, 0.0, seed + 10 * s + r), kv_caches=cache)
        cache.next_sample()


def condition_layer(workspace: CacheWorkspace | None) -> ConditionLayer:
    """A standalone layer: its own buffer, or reading through a given workspace (as a container shares one)."""
    layer = ConditionLayer(shared_workspace=workspace is not None)
    if workspace is not None:
        layer.share_workspace(workspace)
    return layer


def workspace_buffers(workspace: CacheWorkspace | None) -> list[torch.Tensor]:
    return [] if workspace is None else list(workspace.buffers())


def run(model, cache, mode: str, inputs: dict) -> torch.Tensor:
    cache.set_mode(mode)
    return model(**inputs, kv_caches=cache).sample


@torch.no_grad()
def test_without_cache_is_diffusers_model(models):
    ours, reference = models
    inputs = decoder_inputs(2, 4, 6, 3, 500.0, seed=0)
    torch.testing.assert_close(ours(**inputs).sample, reference(**inputs).sample, rtol=0, atol=0)


CASES = {
    "one reference": ([[(4, 4)]], 1),
    "two references append": ([[(4, 4), (6, 4)]], 1),
    "different references per sample": ([[(4, 4)], [(2, 8)]], 2),
    "one sample shared by the batch": ([[(4, 4)]], 3),
    "num_images_per_prompt": ([[(4, 4)], [(2, 8)]], 4),
}


@pytest.mark.parametrize("shared_workspace", [False, True], ids=["per-block buffers", "shared workspace"])
@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_write_read_skip_equal_diffusers(models, case, shared_workspace):
    ours, reference = models
    samples, batch = CASES[case]
    our_cache, their_cache = ours.make_cache(shared_workspace=shared_workspace), GlmImageKVCache(NUM_LAYERS)
    write_references(ours, our_cache, samples)
    write_references(reference, their_cache, samples)
    for step, timestep in enumerate((900.0, 500.0)):
        inputs = decoder_inputs(batch, 4, 4, 3, timestep, seed=step)
        read = run(ours, our_cache, "read", inputs)
        torch.testing.assert_close(read, run(reference, their_cache, "read", inputs), **TOL)
        skip = run(ours, our_cache, "skip", inputs)
        torch.testing.assert_close(skip, run(reference, their_cache, "skip", inputs), **TOL)
        assert not torch.allclose(read, skip, atol=1e-3)  # the conditions matter


@torch.no_grad()
def test_our_model_with_diffusers_cache_is_diffusers(models):
    ours, reference = models
    caches = GlmImageKVCache(NUM_LAYERS), GlmImageKVCache(NUM_LAYERS)
    write_references(ours, caches[0], [[(4, 4)]])
    write_references(reference, caches[1], [[(4, 4)]])
    inputs = decoder_inputs(1, 4, 4, 3, 700.0, seed=3)
    torch.testing.assert_close(run(ours, caches[0], "read", inputs), run(reference, caches[1], "read", inputs), **TOL)


@pytest.mark.parametrize("shared_workspace", [False, True], ids=["per-block buffers", "shared workspace"])
@pytest.mark.parametrize("rows_per_sample", [1, 2])
@torch.no_grad()
def test_per_sample_condition_lengths_equal_each_sample_alone(models, rows_per_sample, shared_workspace):
    """diffusers cannot batch samples whose conditions differ in length; ours masks the gap."""
    ours, reference = models
    samples = [[(4, 4)], [(4, 4), (6, 4)]]  # 4 and 10 condition tokens
    cache = ours.make_cache(shared_workspace=shared_workspace)
    write_references(ours, cache, samples)
    assert cache.condition_lengths == [4, 10]
    inputs = decoder_inputs(2 * rows_per_sample, 4, 4, 3, 600.0, seed=5)
    batched = run(ours, cache, "read", inputs)
    for s, references in enumerate(samples):
        alone = GlmImageKVCache(NUM_LAYERS)
        reference.eval()
        alone.set_mode("write")
        for r, (height, width) in enumerate(references):
            reference(**decoder_inputs(1, height, width, 0, 0.0, 100 + 10 * s + r), kv_caches=alone)
        rows = slice(s * rows_per_sample, (s + 1) * rows_per_sample)
        sample_inputs = {k: v[rows] for k, v in inputs.items()}
        expected = run(reference, alone, "read", sample_inputs)
        torch.testing.assert_close(batched[rows], expected, rtol=1e-5, atol=1e-5)


class AllocationCounter(TorchDispatchMode):
    """Bytes of op outputs whose storage none of the op's inputs owns (new allocations); views count 0."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        owned = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in owned:
                owned.add(tensor.untyped_storage().data_ptr())
                self.bytes += tensor.untyped_storage().nbytes()
                self.ops.append(str(func))
        return out


@pytest.mark.parametrize("workspace", [None, CacheWorkspace()], ids=["per-block buffer", "shared workspace"])
@torch.no_grad()
def test_layer_read_allocates_nothing_and_returns_buffer_views(workspace):
    layer = condition_layer(workspace)
    layer.mode = "write"
    for tokens in (6, 4):  # two reference images of one sample
        layer.update(*torch.randn(2, 1, tokens, 2, 8).unbind(0))
    layer.mode = "read"
    current = torch.randn(2, 3, 5, 2, 8).unbind(0)  # batch 3 reads the one sample
    layer.update(*current)  # the first read of a batch size lays the rows out (and may grow the buffer)
    for _ in range(3):
        with AllocationCounter() as counter:
            keys, values = layer.update(*current)
        assert counter.bytes == 0, counter.ops
        buffers = [layer.keys] if workspace is None else workspace_buffers(workspace)
        assert keys.untyped_storage().data_ptr() in {b.untyped_storage().data_ptr() for b in buffers}
        assert keys.shape == (3, 15, 2, 8) and torch.equal(keys[:, 10:], current[0])


@torch.no_grad()
def test_model_read_step_allocates_no_more_than_a_step_without_conditions(models):
    """Ours: a conditional step costs the same allocations as a step that skips the conditions.
    diffusers: each layer's `torch.cat` allocates `[conditions; current]` K and V at every step."""
    ours, reference = models
    samples, batch, inputs = [[(4, 4), (6, 4)]], 2, decoder_inputs(2, 4, 4, 3, 500.0, seed=1)
    measured = {}
    for name, model, cache in (
        ("ours", ours, ours.make_cache()),
        ("workspace", ours, ours.make_cache(shared_workspace=True)),
        ("diffusers", reference, GlmImageKVCache(NUM_LAYERS)),
    ):
        write_references(model, cache, samples)
        run(model, cache, "read", inputs)  # warm-up: ours lays out its buffer once
        for mode in ("read", "skip"):
            with AllocationCounter() as counter:
                run(model, cache, mode, inputs)
            measured[name, mode] = counter.bytes
    assert measured["ours", "read"] == measured["ours", "skip"]
    assert measured["workspace", "read"] == measured["workspace", "skip"]
    conditions, current = 10, 3 + 4
    concatenated = NUM_LAYERS * 2 * batch * (conditions + current) * 2 * 8 * 4  # K and V, fp32
    assert measured["diffusers", "read"] - measured["diffusers", "skip"] >= concatenated
    assert measured["diffusers", "read"] - measured["ours", "read"] >= concatenated


@torch.no_grad()
def test_allocated_ahead_cache_never_allocates(models):
    ours, _ = models
    cache = ours.make_cache(max_tokens=32, batch_size=2)
    pointers = [layer.keys.data_ptr() for layer in cache]
    write_references(ours, cache, [[(4, 4)], [(2, 8)]])
    for _ in range(2):
        run(ours, cache, "read", decoder_inputs(2, 4, 4, 3, 500.0, seed=2))
    assert [layer.keys.data_ptr() for layer in cache] == pointers


@pytest.mark.parametrize("workspace", [None, CacheWorkspace()], ids=["per-block buffer", "shared workspace"])
def test_condition_layer_scalar_trace(workspace):
    """1 head, head_dim 1: sample 0 writes [1, 2] then [3] (append), sample 1 writes [4]; batch 4 reads."""
    layer = condition_layer(workspace)
    layer.mode = "write"
    for values in ([1.0, 2.0], [3.0]):
        layer.update(torch.tensor(values).view(1, -1, 1, 1), -torch.tensor(values).view(1, -1, 1, 1))
    layer.next_sample()
    layer.update(torch.tensor([4.0]).view(1, 1, 1, 1), -torch.tensor([4.0]).view(1, 1, 1, 1))
    assert layer.condition_lengths == [3, 1] and layer.get_seq_length() == 3
    layer.mode = "read"
    current = torch.tensor([[10.0, 11.0], [20.0, 21.0], [30.0, 31.0], [40.0, 41.0]]).view(4, 2, 1, 1)
    keys, values = layer.update(current, -current)
    mask = layer.attention_mask
    assert mask.tolist() == [
        [True] * 5,
        [True] * 5,
        [True, False, False, True, True],
        [True, False, False, True, True],
    ]
    attended = [keys[row, mask[row], 0, 0].tolist() for row in range(4)]
    assert attended == [[1, 2, 3, 10, 11], [1, 2, 3, 20, 21], [4, 30, 31], [4, 40, 41]]
    assert torch.equal(values, -keys)
    conditions, _ = layer.get()
    first_rows = range(0, conditions.shape[0], conditions.shape[0] // 2)  # each sample's first row in the layout
    assert [conditions[row, :length, 0, 0].tolist() for row, length in zip(first_rows, [3, 1])] == [[1, 2, 3], [4]]
    layer.mode = "skip"
    assert layer.update(current, -current)[0] is current and layer.attention_mask is None


@torch.no_grad()
def test_stray_commit_never_turns_denoising_tokens_into_conditions(models):
    ours, reference = models
    cache, theirs = ours.make_cache(), GlmImageKVCache(NUM_LAYERS)
    write_references(ours, cache, [[(4, 4)]])
    write_references(reference, theirs, [[(4, 4)]])
    inputs = decoder_inputs(1, 4, 4, 3, 500.0, seed=4)
    run(ours, cache, "read", inputs)
    with pytest.raises(RuntimeError, match="nothing pending"):
        cache.commit()
    with pytest.raises(RuntimeError, match="never become conditions"):
        cache[0].commit()
    assert cache.condition_lengths == [4] and not cache.has_pending
    torch.testing.assert_close(run(ours, cache, "read", inputs), run(reference, theirs, "read", inputs), **TOL)


@torch.no_grad()
def test_condition_larger_than_the_cache_raises_before_writing(models):
    ours, _ = models
    cache = ours.make_cache(max_tokens=8)
    with pytest.raises(ValueError, match="max_tokens`=8"):
        write_references(ours, cache, [[(6, 6)]])  # 9 condition tokens
    assert cache.condition_lengths == [] and cache[0].keys is None
    write_references(ours, cache, [[(4, 4)]])  # 4 fit
    with pytest.raises(ValueError, match="max_tokens`=8"):
        run(ours, cache, "read", decoder_inputs(1, 4, 4, 3, 500.0, seed=0))  # 4 + 3 + 4 > 8
    assert cache.condition_lengths == [4]
    with pytest.raises(ValueError, match="4 condition tokens \\+ 7 current tokens = 11"):
        cache.check_fits([4], 7)


@torch.no_grad()
def test_bad_calls_are_refused(models):
    ours, _ = models
    cache = ours.make_cache()
    with pytest.raises(ValueError, match="'write', 'read', 'skip'"):
        cache.set_mode("append")
    cache.set_mode("write")
    with pytest.raises(ValueError, match="batch 1"):
        ours(**decoder_inputs(2, 4, 4, 0, 0.0, seed=0), kv_caches=cache)
    write_references(ours, cache, [[(4, 4)], [(4, 4)]])
    with pytest.raises(ValueError, match="Cannot match 2 cached samples to batch size 3"):
        run(ours, cache, "read", decoder_inputs(3, 4, 4, 3, 500.0, seed=0))
    with pytest.raises(ValueError, match="max_tokens"):
        ours.make_cache(batch_size=2)


@torch.no_grad()
def test_clear_keeps_buffers_and_a_reused_cache_gives_the_same_outputs(models):
    ours, _ = models
    cache = ours.make_cache()
    outputs, pointers = [], []
    for _ in range(2):
        cache.clear()
        assert cache.mode is None and cache.condition_lengths == [] and cache.get_seq_length() == 0
        write_references(ours, cache, [[(4, 4)]])
        outputs.append(run(ours, cache, "read", decoder_inputs(2, 4, 4, 3, 500.0, seed=0)))
        pointers.append([layer.keys.data_ptr() for layer in cache])
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
    assert pointers[0] == pointers[1]


@torch.no_grad()
def test_glyph_mask_write_and_skip_equal_diffusers(models):
    ours, reference = models
    inputs = decoder_inputs(2, 4, 4, 4, 500.0, seed=6)
    text_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    for mode in ("write", "skip"):
        caches = ConditionKVCache(NUM_LAYERS), GlmImageKVCache(NUM_LAYERS)
        if mode == "write":
            inputs = {k: v[:1] for k, v in inputs.items()}
            text_mask = text_mask[:1]
        outputs = [run(m, c, mode, {**inputs, "attention_mask": text_mask}) for m, c in zip(models, caches)]
        torch.testing.assert_close(outputs[0], outputs[1], **TOL)


@torch.no_grad()
def test_one_model_serves_concurrent_streams(models):
    ours, _ = models
    streams = {0: [[(4, 4)]], 1: [[(2, 8), (4, 4)]]}
    inputs = decoder_inputs(1, 4, 4, 3, 500.0, seed=7)

    def generate(samples):
        cache = ours.make_cache()
        write_references(ours, cache, samples)
        return [run(ours, cache, "read", inputs) for _ in range(3)]

    expected = {k: generate(v) for k, v in streams.items()}
    results = {}
    threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, generate(streams[k]))) for k in streams]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for k in streams:
        for got, want in zip(results[k], expected[k]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_diffusers_checkpoint_loads_unchanged(tmp_path, models):
    ours, reference = models
    reference.save_pretrained(tmp_path)
    loaded = GlmImageCachedTransformer2DModel.from_pretrained(tmp_path).eval()
    assert {k: v for k, v in loaded.config.items() if not k.startswith("_")} == {
        k: v for k, v in reference.config.items() if not k.startswith("_")
    }
    for name, tensor in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    inputs = decoder_inputs(1, 4, 4, 3, 500.0, seed=8)
    with torch.no_grad():
        cache = loaded.make_cache()
        write_references(loaded, cache, [[(4, 4)]])
        theirs = GlmImageKVCache(NUM_LAYERS)
        write_references(reference, theirs, [[(4, 4)]])
        torch.testing.assert_close(run(loaded, cache, "read", inputs), run(reference, theirs, "read", inputs), **TOL)
