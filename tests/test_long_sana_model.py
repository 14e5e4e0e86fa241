"""LongSanaTransformer3DModel: diffusers' SANA-Video without a cache; block-causal LongSANA with one.

The reference for the cached path is written here, independently of the model's code: diffusers' own
`SanaVideoTransformer3DModel` on the same weights, with its linear self-attention given an explicit
`(tokens, tokens)` block-causal mask (quadratic, no state, no cumulative sums) and its temporal
convolution written frame by frame (a chunk's first frame sees the previous chunk's last frame).
Tolerance: 1e-5 absolute on outputs of order 1 (fp32; the cached path sums states in another order).
"""

import gc
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from concurrency import assert_same_as_alone, run_together
from diffusers import SanaVideoTransformer3DModel

from rolldiff.caching import ConvStateLayer, CrossAttentionLayer, LinearAttentionLayer
from rolldiff.models.long_sana import LongSanaTransformer3DModel, sana_layout

TOL = 1e-5
TINY_SANA = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=12,
    num_layers=2,
    num_cross_attention_heads=2,
    cross_attention_head_dim=12,
    cross_attention_dim=24,
    caption_channels=16,
    mlp_ratio=2.5,
    sample_size=8,
    patch_size=(1, 2, 2),
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=64,
)
TOKENS_PER_FRAME = 4  # 4x4 latents, patch 2x2


def build_models(seed: int = 0):
    """diffusers' model with random weights, and ours loaded from the folder diffusers saved."""
    torch.manual_seed(seed)
    reference = SanaVideoTransformer3DModel(**TINY_SANA).eval()
    with torch.no_grad():  # non-zero conv_temp (diffusers initialises it randomly already; make it count)
        for block in reference.transformer_blocks:
            block.ff.conv_temp.weight.normal_(0, 0.2)
    with tempfile.TemporaryDirectory() as folder:
        reference.save_pretrained(folder)
        ours = LongSanaTransformer3DModel.from_pretrained(folder).eval()
    return reference, ours


@pytest.fixture(scope="module")
def models():
    return build_models()


def inputs(frames: int, batch: int = 1, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, 4, frames, 4, 4, generator=generator)
    text = torch.randn(batch, 5, 16, generator=generator)
    return latents, text


# ----------------------------------------------------------------------------------------- independent reference
def masked_linear_attention(query, key, value, rotary_emb, frame_of_token, chunk_frames, context_chunks):
    """Quadratic ReLU linear attention under the block-causal mask; `(B, L, H, D)` in, `(B, L, H, D)` out."""
    cos, sin = rotary_emb

    def rotate(x):
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
        c, s = cos[..., 0::2], sin[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), -1).flatten(-2)

    query, key = F.relu(query).double(), F.relu(key).double()
    value = value.double()
    chunk = frame_of_token // chunk_frames
    visible = chunk[None, :] <= chunk[:, None]  # (query, key): earlier chunks and the own chunk
    if context_chunks is not None:
        visible &= chunk[None, :] >= chunk[:, None] - context_chunks
    mask = visible.double()[None, None]  # (1, 1, L, L)
    q_rot, k_rot = rotate(query).transpose(1, 2), rotate(key).transpose(1, 2)  # (B, H, L, D)
    scores = (q_rot @ k_rot.transpose(-1, -2)) * mask
    normaliser = (query.transpose(1, 2) @ key.transpose(1, 2).transpose(-1, -2)) * mask
    out = (scores @ value.transpose(1, 2)) / (normaliser.sum(-1, keepdim=True) + 1e-15)
    return out.transpose(1, 2).float()


class MaskedLinearAttnProcessor:
    def __init__(self, chunk_frames, context_chunks):
        self.chunk_frames, self.context_chunks = chunk_frames, context_chunks

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        frame_of_token = torch.arange(hidden_states.shape[1]) // TOKENS_PER_FRAME
        out = masked_linear_attention(
            query, key, value, rotary_emb, frame_of_token, self.chunk_frames, self.context_chunks
        )
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3)))


class FrameByFrameCausalConv(torch.nn.Module):
    """y[f] = w0 x[f-1] + w1 x[f] + w2 x[f+1] on `(B, C, F, T)`, x[f+1] = 0 past a chunk's end, x[-1] = 0."""

    def __init__(self, conv: torch.nn.Conv2d, chunk_frames: int):
        super().__init__()
        self.weight = conv.weight  # (C_out, C_in, 3, 1)
        self.chunk_frames = chunk_frames

    def forward(self, x):
        w = self.weight[..., 0]  # (C_out, C_in, 3)
        outputs = []
        for f in range(x.shape[2]):
            y = torch.einsum("oc,bct->bot", w[:, :, 1], x[:, :, f])
            if f > 0:  # the previous frame: in this chunk, or the previous chunk's last frame
                y = y + torch.einsum("oc,bct->bot", w[:, :, 0], x[:, :, f - 1])
            if (f + 1) % self.chunk_frames and f + 1 < x.shape[2]:  # the next frame, inside the chunk only
                y = y + torch.einsum("oc,bct->bot", w[:, :, 2], x[:, :, f + 1])
            outputs.append(y)
        return torch.stack(outputs, dim=2)


def block_causal_reference(reference: SanaVideoTransformer3DModel, chunk_frames: int, context_chunks=None):
    """A copy of diffusers' model whose self-attention and temporal conv are the masked, block-causal ones."""
    model = SanaVideoTransformer3DModel(**TINY_SANA).eval()
    model.load_state_dict(reference.state_dict())
    for block in model.transformer_blocks:
        block.attn1.set_processor(MaskedLinearAttnProcessor(chunk_frames, context_chunks))
        block.ff.conv_temp = FrameByFrameCausalConv(block.ff.conv_temp, chunk_frames)
    return model


def run_chunked(model, latents, text, timestep, layout, batch_size=None):
    """Denoise every chunk at `timestep`, then commit it with a clean t = 0 pass on the same latents."""
    cache = model.make_cache(layout, batch_size=batch_size)
    outputs = []
    chunk = layout.chunk_frames
    for start in range(0, latents.shape[2], chunk):
        piece = latents[:, :, start : start + chunk]
        outputs.append(model(piece, text, timestep, kv_cache=cache, layout=layout).sample)
        model(piece, text, torch.zeros_like(timestep), kv_cache=cache, layout=layout)
        cache.commit()
    return torch.cat(outputs, dim=2), cache


# ----------------------------------------------------------------------------------------- proof 1
@torch.no_grad()
def test_without_a_cache_the_model_is_diffusers_sana_video(models):
    reference, ours = models
    latents, text = inputs(frames=5, batch=2)
    timestep = torch.tensor([300.0, 700.0])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    expected = reference(latents, text, timestep, encoder_attention_mask=mask).sample
    received = ours(latents, text, timestep, encoder_attention_mask=mask).sample
    torch.testing.assert_close(received, expected, atol=0, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize(
    "timestep_form",
    ["(batch,)", "(batch, 1)", "(batch, tokens)", "(batch * tokens,)", "scalar", "(batch, frames)"],
)
def test_without_a_cache_every_timestep_form_diffusers_accepts_gives_diffusers_output(models, timestep_form):
    """diffusers embeds any timestep with batch or batch x tokens entries; ours must give the same output for each.

    `(batch, frames)` (one noise level per frame, expanded to its tokens) is ours only; diffusers gets the
    expanded `(batch, tokens)` form.
    """
    reference, ours = models
    batch = 1 if timestep_form == "scalar" else 2
    latents, text = inputs(frames=3, batch=batch)
    tokens = 3 * TOKENS_PER_FRAME
    per_token = torch.rand(batch, tokens, generator=torch.Generator().manual_seed(2)) * 1000
    per_frame = torch.tensor([[100.0, 500.0, 900.0], [200.0, 300.0, 400.0]])
    timestep, diffusers_timestep = {
        "(batch,)": (torch.tensor([300.0, 700.0]), None),
        "(batch, 1)": (torch.tensor([[300.0], [700.0]]), None),
        "(batch, tokens)": (per_token, None),
        "(batch * tokens,)": (per_token.flatten(), None),
        "scalar": (torch.tensor(450.0), None),
        "(batch, frames)": (per_frame, per_frame.repeat_interleave(TOKENS_PER_FRAME, dim=1)),
    }[timestep_form]
    expected = reference(latents, text, timestep if diffusers_timestep is None else diffusers_timestep).sample
    torch.testing.assert_close(ours(latents, text, timestep).sample, expected, atol=0, rtol=0)


def test_seeded_model_is_diffusers_model_and_leaves_the_generator_where_diffusers_does():
    """Same seed -> diffusers' exact weights, and the global generator in the same state afterwards."""
    torch.manual_seed(7)
    reference = SanaVideoTransformer3DModel(**TINY_SANA)
    after_reference = torch.get_rng_state()
    torch.manual_seed(7)
    ours = LongSanaTransformer3DModel(**TINY_SANA)
    assert torch.equal(torch.get_rng_state(), after_reference)
    expected = reference.state_dict()
    received = ours.state_dict()
    assert received.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(received[name], tensor, atol=0, rtol=0, msg=name)


def test_state_dict_keys_are_diffusers(models):
    reference, ours = models
    assert ours.state_dict().keys() == reference.state_dict().keys()


@torch.no_grad()
def test_one_chunk_with_an_empty_cache_equals_diffusers_on_that_chunk(models):
    reference, ours = models
    latents, text = inputs(frames=3)
    timestep = torch.tensor([500.0])
    layout = sana_layout(TOKENS_PER_FRAME, chunk_frames=3)
    cache = ours.make_cache(layout)
    received = ours(latents, text, timestep, kv_cache=cache, layout=layout).sample
    torch.testing.assert_close(received, reference(latents, text, timestep).sample, atol=TOL, rtol=0)


# ----------------------------------------------------------------------------------------- proof 2
@pytest.mark.parametrize("context_chunks", [None, 1, 2])
@torch.no_grad()
def test_chunked_with_the_state_cache_equals_the_masked_reference(models, context_chunks):
    reference, ours = models
    latents, text = inputs(frames=10)
    timestep = torch.tensor([0.0])  # every chunk's output is its own clean pass, as the reference computes
    layout = sana_layout(TOKENS_PER_FRAME, chunk_frames=2, context_chunks=context_chunks)
    expected = block_causal_reference(reference, 2, context_chunks)(latents, text, timestep).sample
    received, _ = run_chunked(ours, latents, text, timestep, layout)
    for start in range(0, 10, 2):  # chunk for chunk
        torch.testing.assert_close(
            received[:, :, start : start + 2], expected[:, :, start : start + 2], atol=TOL, rtol=0
        )


@pytest.mark.parametrize("context_chunks", [None, 2])
@torch.no_grad()
def test_the_models_whole_sequence_path_equals_the_masked_reference(models, context_chunks):
    reference, ours = models
    latents, text = inputs(frames=8)
    timestep = torch.tensor([400.0])
    layout = sana_layout(TOKENS_PER_FRAME, chunk_frames=2, context_chunks=context_chunks)
    expected = block_causal_reference(reference, 2, context_chunks)(latents, text, timestep).sample
    torch.testing.assert_close(ours(latents, text, timestep, layout=layout).sample, expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("context_chunks", [None, 1])
@torch.no_grad()
def test_teacher_forcing_equals_generation_with_clean_commits(models, context_chunks):
    """Noisy chunk i of `[clean; noisy]` sees what chunk i sees when generated after committing clean chunks < i."""
    _, ours = models
    clean, text = inputs(frames=6)
    noisy = torch.randn_like(clean)
    layout = sana_layout(TOKENS_PER_FRAME, chunk_frames=2, context_chunks=context_chunks)
    timestep = torch.cat([torch.zeros(1, 6), torch.full((1, 6), 700.0)], dim=1)
    whole = ours(torch.cat([clean, noisy], 2), text, timestep, layout=layout, teacher_forcing=True).sample
    cache = ours.make_cache(layout)
    for start in range(0, 6, 2):
        out = ours(noisy[:, :, start : start + 2], text, torch.tensor([700.0]), kv_cache=cache, layout=layout).sample
        torch.testing.assert_close(out, whole[:, :, 6 + start : 8 + start], atol=TOL, rtol=0)
        ours(clean[:, :, start : start + 2], text, torch.tensor([0.0]), kv_cache=cache, layout=layout)
        cache.commit()


@torch.no_grad()
def test_temporal_conv_is_causal_across_chunks(models):
    """Changing a later chunk never changes an earlier one; changing a chunk's last frame changes the next chunk."""
    _, ours = models
    latents, text = inputs(frames=6)
    layout = sana_layout(TOKENS_PER_FRAME, chunk_frames=2)
    timestep = torch.tensor([0.0])
    base, _ = run_chunked(ours, latents, text, timestep, layout)
    changed = latents.clone()
    changed[:, :, 3] += 1.0  # last frame of chunk 1
    other, _ = run_chunked(ours, changed, text, timestep, layout)
    torch.testing.assert_close(other[:, :, :2], base[:, :, :2], atol=0, rtol=0)
    assert (other[:, :, 4:] - base[:, :, 4:]).abs().max() > 1e-3


@torch.no_grad()
def test_cache_layers_per_block(models):
    _, ours = models
    cache = ours.make_cache(sana_layout(TOKENS_PER_FRAME, 2, context_chunks=3), batch_size=1)
    assert len(cache) == 2
    assert all(isinstance(layer, LinearAttentionLayer) and layer.window_chunks == 3 for layer in cache)
    assert all(isinstance(layer, CrossAttentionLayer) for layer in cache.cross)
    assert all(isinstance(layer, ConvStateLayer) for layer in cache.slots["conv_state"])


@torch.no_grad()
def test_rewind_then_rewrite_equals_writing_once(models):
    """Re-writing the last chunk (a re-cache) replaces its contribution: state as if written once."""
    _, ours = models
    latents, text = inputs(frames=8)
    layout = sana_layout(TOKENS_PER_FRAME, chunk_frames=2, context_chunks=2)
    timestep = torch.tensor([0.0])
    _, once = run_chunked(ours, latents, text, timestep, layout)
    _, twice = run_chunked(ours, latents[:, :, :6], text, timestep, layout)
    twice.rewind(2 * TOKENS_PER_FRAME)
    ours(torch.randn(1, 4, 2, 4, 4), text, timestep, kv_cache=twice, layout=layout)  # aborted, never committed
    ours(latents[:, :, 4:6], text, timestep, kv_cache=twice, layout=layout)
    twice.commit()
    ours(latents[:, :, 6:8], text, timestep, kv_cache=twice, layout=layout)
    twice.commit()
    for a, b in zip(once, twice):
        torch.testing.assert_close(a.committed_vk, b.committed_vk, atol=1e-6, rtol=0)
    for a, b in zip(once.slots["conv_state"], twice.slots["conv_state"]):
        torch.testing.assert_close(a.committed, b.committed, atol=0, rtol=0)


def test_gradient_checkpointing_gives_the_same_gradients_in_the_reference():
    """Recomputed blocks must see the call's context again (block-causal, not diffusers' bidirectional path)."""
    _, model = build_models()
    clean, text = inputs(frames=4)
    layout = sana_layout(TOKENS_PER_FRAME, chunk_frames=2)
    timestep = torch.cat([torch.zeros(1, 4), torch.full((1, 4), 600.0)], dim=1)
    hidden = torch.cat([clean, torch.randn_like(clean)], dim=2)
    gradients = []
    for checkpointing in (False, True):
        model.zero_grad()
        if checkpointing:
            model.enable_gradient_checkpointing()
        model.train()
        model(hidden, text, timestep, layout=layout, teacher_forcing=True).sample.square().mean().backward()
        gradients.append(model.transformer_blocks[0].attn1.to_q.weight.grad.clone())
    model.disable_gradient_checkpointing()
    torch.testing.assert_close(gradients[1], gradients[0], atol=1e-6, rtol=1e-5)


@torch.no_grad()
def test_one_model_serves_concurrent_streams_as_alone(models):
    """Per-call state is bound per thread, never stored on the model: four streams, one model, same outputs."""
    _, ours = models
    layout = sana_layout(TOKENS_PER_FRAME, chunk_frames=2, context_chunks=2)
    videos = [inputs(frames=8, seed=seed) for seed in range(4)]
    alone = [run_chunked(ours, latents, text, torch.tensor([300.0]), layout)[0] for latents, text in videos]
    together = run_together(lambda seed: run_chunked(ours, *videos[seed], torch.tensor([300.0]), layout)[0],
                            [(seed,) for seed in range(4)])  # fmt: skip
    for seed in range(4):
        assert_same_as_alone(together[seed], alone[seed])
    assert ours._call_slot.context is None


# ----------------------------------------------------------------------------------------- errors
def test_bad_calls_are_refused_before_any_work(models):
    _, ours = models
    latents, text = inputs(frames=4)
    layout = sana_layout(TOKENS_PER_FRAME, chunk_frames=2)
    cache = ours.make_cache(layout)
    with pytest.raises(ValueError, match="`layout`"):
        ours(latents[:, :, :2], text, torch.tensor([1.0]), kv_cache=cache)
    with pytest.raises(ValueError, match="exceeds `chunk_frames`=2"):
        ours(latents, text, torch.tensor([1.0]), kv_cache=cache, layout=layout)
    with pytest.raises(ValueError, match="tokens_per_frame"):
        ours(latents, text, torch.tensor([1.0]), layout=sana_layout(16, 2))
    with pytest.raises(ValueError, match="whole chunks"):
        ours(latents[:, :, :3], text, torch.tensor([1.0]), layout=layout)
    with pytest.raises(ValueError, match=r"`timestep` of shape \(1, 5\) fits neither .* \(1, 4\)"):
        ours(latents, text, torch.ones(1, 5))
    with pytest.raises(ValueError, match="sink"):
        ours.make_cache(sana_layout(4, 2).__class__(4, chunk_frames=2, sink_frames=1, window_frames=4))
    assert cache.get_seq_length() == 0


@torch.no_grad()
def test_positions_past_the_rope_table_are_refused(models):
    _, ours = models
    latents, text = inputs(frames=8)
    layout = sana_layout(TOKENS_PER_FRAME, chunk_frames=8, context_chunks=1)
    cache = ours.make_cache(layout)
    for _ in range(8):  # 64 frames: the whole table
        ours(latents, text, torch.tensor([0.0]), kv_cache=cache, layout=layout)
        cache.commit()
    with pytest.raises(ValueError, match="RoPE table"):
        ours(latents, text, torch.tensor([0.0]), kv_cache=cache, layout=layout)


@pytest.mark.parametrize("context_chunks", [None, 2])
@torch.no_grad()
def test_rebasing_positions_changes_nothing_but_the_table_index(models, context_chunks):
    """RoPE is relative in the numerator: moving every committed frame back keeps every output."""
    _, ours = models
    latents, text = inputs(frames=12)
    layout = sana_layout(TOKENS_PER_FRAME, chunk_frames=2, context_chunks=context_chunks)
    plain, _ = run_chunked(ours, latents, text, torch.tensor([300.0]), layout)
    cache = ours.make_cache(layout)
    rebased = []
    for start in range(0, 12, 2):
        if start in (6, 10):
            ours.rebase_positions(cache, 5 if start == 6 else 3)
        piece = latents[:, :, start : start + 2]
        rebased.append(ours(piece, text, torch.tensor([300.0]), kv_cache=cache, layout=layout).sample)
        ours(piece, text, torch.tensor([0.0]), kv_cache=cache, layout=layout)
        cache.commit()
    torch.testing.assert_close(torch.cat(rebased, dim=2), plain, atol=TOL, rtol=0)
    assert cache.slots["conv_state"][0].frame_count.item() == 12 - 8
    with pytest.raises(ValueError, match="num_frames"):
        ours.rebase_positions(cache, 5)


# ----------------------------------------------------------------------------------------- proof 3
def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@torch.no_grad()
def test_memory_is_the_same_after_5_and_after_500_chunks():
    torch.manual_seed(0)
    model = LongSanaTransformer3DModel(**{**TINY_SANA, "rope_max_seq_len": 1024}).eval()
    layout = sana_layout(TOKENS_PER_FRAME, chunk_frames=2)  # every earlier chunk: LongSANA's default
    cache = model.make_cache(layout, batch_size=1)
    latents, text = inputs(frames=2)
    measured = {}
    for chunk in range(1, 501):
        model(latents, text, torch.tensor([500.0]), kv_cache=cache, layout=layout)
        cache.commit()
        if chunk in (5, 500):
            gc.collect()
            measured[chunk] = (cache.memory_bytes(), _rss_bytes())
    assert cache.get_seq_length() == 500 * 2 * TOKENS_PER_FRAME
    assert measured[5][0] == measured[500][0]
    assert measured[500][1] - measured[5][1] < 2 * 2**20, measured  # allocator noise only, not growth


# ----------------------------------------------------------------------------------------- proof 5
def test_compiled_cached_step_is_one_graph_over_100_chunks():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = LongSanaTransformer3DModel(**{**TINY_SANA, "rope_max_seq_len": 512}).eval()
    layout = sana_layout(TOKENS_PER_FRAME, chunk_frames=2, context_chunks=3)
    counter = CompileCounter()
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    latents, text = inputs(frames=2)
    eager_cache = model.make_cache(layout, batch_size=1)
    cache = model.make_cache(layout, batch_size=1)
    model.prepare_conditioning(cache, text)  # the explicit prompt signal: every step reads the text K/V
    with torch.no_grad():
        for chunk in range(100):
            out = compiled(latents, text, torch.tensor([500.0]), kv_cache=cache, layout=layout).sample
            expected = model(latents, text, torch.tensor([500.0]), kv_cache=eager_cache, layout=layout).sample
            cache.commit()
            eager_cache.commit()
            if chunk % 25 == 0:
                torch.testing.assert_close(out, expected, atol=TOL, rtol=0)
            if chunk == 1:
                graphs_after_warmup = counter.frame_count
    assert graphs_after_warmup == 1  # allocated ahead, text K/V filled ahead: one graph from the start
    assert counter.frame_count == 1
