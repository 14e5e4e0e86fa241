"""Training of the tiny toy-world pipeline: components, teacher-forcing batches, a few optimizer steps."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rolldiff.models.krea_realtime import teacher_forcing_frame_mask
from rolldiff.pipelines.request.text_encoding import encode_prompts
from rolldiff.toyworld import all_prompts
from rolldiff.training.tiny_components import (
    TinyConfig,
    build_text_encoder,
    build_tokenizer,
    build_transformer,
    build_vae,
)
from rolldiff.training.train_transformer import (
    LatentVideos,
    held_start,
    sample_chunk_sigmas,
    sample_clips,
    teacher_forcing_inputs,
    teacher_forcing_loss,
    train_transformer,
)
from rolldiff.training.train_vae import train_vae

# Smaller than the shipped model so a few optimizer steps take well under a second each.
CONFIG = dataclasses.replace(TinyConfig(), num_heads=2, head_dim=12, ffn_dim=48, num_layers=1)


@pytest.fixture(scope="module")
def text():
    tokenizer = build_tokenizer()
    return tokenizer, build_text_encoder(CONFIG, len(tokenizer))


def random_videos(prompt_embeds: torch.Tensor, num_videos: int = 4, frames: int = 30) -> LatentVideos:
    latents = torch.randn(
        num_videos, CONFIG.z_dim, frames, *CONFIG.latent_size, generator=torch.Generator().manual_seed(0)
    )
    return LatentVideos(latents, torch.arange(num_videos) % len(prompt_embeds), prompt_embeds)


def test_tokenizer_round_trips_through_save_pretrained(tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(loaded, PreTrainedTokenizerFast)
    for prompt in all_prompts():
        assert loaded(prompt).input_ids == tokenizer(prompt).input_ids
    ids = loaded("a red circle moving left", padding="max_length", max_length=8).input_ids
    assert ids[-3:] == [loaded.eos_token_id, loaded.pad_token_id, loaded.pad_token_id]
    assert loaded.unk_token_id not in ids


def test_every_prompt_gets_a_distinct_embedding(text):
    tokenizer, text_encoder = text
    embeds = encode_prompts(tokenizer, text_encoder, all_prompts(), CONFIG.max_sequence_length)
    flat = embeds.flatten(1)
    distances = torch.cdist(flat, flat) + torch.eye(len(flat)) * 1e9
    assert embeds.shape == (48, CONFIG.max_sequence_length, CONFIG.text_dim)
    assert distances.min() > 1.0


def test_sana_text_encoder_keeps_each_word_in_its_own_token():
    """The prompt's last word ("left") must dominate its token: with Gemma's 0.02 embeddings the earlier words
    ("red") moved that token more than the direction did, and the model trained on it ignored the direction."""
    from rolldiff.training.sana_components import SanaTinyConfig, build_gemma_text_encoder, build_gemma_tokenizer

    config = SanaTinyConfig()
    tokenizer = build_gemma_tokenizer()
    encoder = build_gemma_text_encoder(config, len(tokenizer))
    prompts = ["a red circle moving left", "a red circle moving up", "a blue circle moving left"]
    last = encode_prompts(tokenizer, encoder, prompts, config.max_sequence_length)[:, 5]
    direction, colour = (last[0] - last[1]).norm(), (last[0] - last[2]).norm()
    assert direction > 3 * colour, (direction, colour)


def test_clips_start_with_the_sink_and_mask_the_chunk_after_a_gap(text):
    layout = CONFIG.layout()
    data = random_videos(torch.zeros(4, CONFIG.max_sequence_length, CONFIG.text_dim))
    clips, embeds, loss_mask = sample_clips(data, 6, 12, layout, np.random.default_rng(0), gap_prob=1.0)
    assert clips.shape == (6, CONFIG.z_dim, 12, *CONFIG.latent_size)
    assert embeds.shape == (6, CONFIG.max_sequence_length, CONFIG.text_dim)
    assert loss_mask.tolist() == [[1.0, 0.0, 1.0, 1.0]] * 6
    sinks = clips[:, :, : layout.sink_frames]
    assert any(torch.equal(sinks[0], data.latents[v, :, : layout.sink_frames]) for v in range(4))


@pytest.mark.parametrize("sink_frames, gap_prob, first_weight", [(0, 0.0, 3.0), (0, 1.0, 0.0), (3, 1.0, 3.0)])
def test_the_videos_first_chunk_gets_its_own_weight(sink_frames, gap_prob, first_weight):
    """Only a chunk that holds the video's first frames is weighted (with no sink: clips without a gap)."""
    layout = dataclasses.replace(CONFIG.layout(), sink_frames=sink_frames)
    data = random_videos(torch.zeros(4, CONFIG.max_sequence_length, CONFIG.text_dim))
    clips, _, weights = sample_clips(data, 6, 12, layout, np.random.default_rng(0), gap_prob, first_chunk_weight=3.0)
    assert weights[:, 0].tolist() == [first_weight] * 6
    if gap_prob == 0.0:  # clips from frame 0
        assert all(any(torch.equal(clip, data.latents[v, :, :12]) for v in range(4)) for clip in clips)


@pytest.mark.parametrize("share, expected", [(0.0, {12}), (1.0, {3}), (0.5, {3, 12})])
def test_first_chunk_batches_train_on_the_videos_first_chunks_alone(share, expected):
    """A share of the steps sees one chunk, the video's first (`sample_clips` with no gap: frames 0-2)."""
    data = random_videos(torch.zeros(4, CONFIG.max_sequence_length, CONFIG.text_dim))
    frames_seen = []

    class Spy(torch.nn.Module):  # the training call: `[clean; noisy]` frames in, a velocity out
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(()))

        def forward(self, hidden_states, timestep, text, layout, frame_indices=None, frame_mask=None):
            frames_seen.append(hidden_states.shape[2] // 2)
            return SimpleNamespace(sample=self.scale * hidden_states)

    train_transformer(
        Spy(), data, CONFIG, seconds=60, max_steps=16, batch_size=2, clip_frames=12, first_chunk_batches=share
    )
    assert set(frames_seen) == expected, frames_seen


def test_held_start_holds_frame_0_over_the_first_chunk_then_plays_the_video_from_frame_1():
    video = np.arange(10)[:, None, None, None] * np.ones((1, 2, 2, 3), dtype=np.uint8)
    held = held_start(video, 3)
    assert held.shape == video.shape
    assert held[:, 0, 0, 0].tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 6, 7]
    assert held_start(video, 1) is video


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_start_image_batches_draw_their_clips_from_the_start_image_videos_without_loss_on_the_start(share):
    """A share of the steps sees the held-start videos; their first chunk (the given image) has no loss."""
    embeds = torch.zeros(4, CONFIG.max_sequence_length, CONFIG.text_dim)
    data, held = random_videos(embeds), random_videos(embeds)
    held.latents = held.latents + 100.0  # tells the two sets apart inside the model call
    steps = []

    class Spy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(()))

        def forward(self, hidden_states, timestep, text, layout, frame_indices=None, frame_mask=None):
            steps.append(bool(hidden_states[:, :, :3].mean() > 50))
            return SimpleNamespace(sample=self.scale * hidden_states)

    train_transformer(
        Spy(), data, CONFIG, seconds=60, max_steps=40, batch_size=2, clip_frames=12,
        start_image_data=held, start_image_batches=share,
    )  # fmt: skip
    assert 0.0 < sum(steps) / len(steps) < 1.0 if share == 0.5 else sum(steps) / len(steps) == share, steps
    _, _, weights = sample_clips(held, 6, 12, CONFIG.layout(), np.random.default_rng(0), 0.5, first_chunk_weight=0.0)
    assert weights[:, 0].tolist() == [0.0] * 6


def test_start_image_batches_without_start_image_videos_are_refused():
    data = random_videos(torch.zeros(4, CONFIG.max_sequence_length, CONFIG.text_dim))
    with pytest.raises(ValueError, match="start_image_data"):
        train_transformer(torch.nn.Linear(1, 1), data, CONFIG, seconds=60, max_steps=1, start_image_batches=0.5)


def test_teacher_forcing_inputs_shapes_and_timesteps():
    layout = CONFIG.layout()
    clean = torch.randn(2, CONFIG.z_dim, 12, *CONFIG.latent_size)
    sigmas = torch.tensor([[1.0, 0.5, 0.25, 0.75], [0.1, 0.2, 0.3, 0.4]])
    hidden, timestep, sigma_5d, frame_indices, frame_mask = teacher_forcing_inputs(
        clean, torch.zeros_like(clean), sigmas, layout
    )
    assert hidden.shape == (2, CONFIG.z_dim, 24, *CONFIG.latent_size)
    assert timestep.shape == (2, 24)
    assert timestep[:, :12].eq(0).all()
    assert timestep[0, 12:].tolist() == [1000.0] * 3 + [500.0] * 3 + [250.0] * 3 + [750.0] * 3
    assert sigma_5d.shape == (2, 1, 12, 1, 1)
    torch.testing.assert_close(hidden[:, :, :12], clean)
    torch.testing.assert_close(hidden[0, :, 15:18], 0.5 * clean[0, :, 3:6])  # zero noise at sigma 0.5
    expected_indices, expected_mask = teacher_forcing_frame_mask(12, layout)
    assert torch.equal(frame_indices, expected_indices) and torch.equal(frame_mask, expected_mask)


def test_chunk_sigmas_lie_in_the_trained_range():
    sigmas = sample_chunk_sigmas(64, 4, CONFIG, torch.Generator().manual_seed(0))
    assert sigmas.shape == (64, 4)
    assert sigmas.min() >= 0.02 and sigmas.max() <= 1.0
    assert (sigmas == 1.0).any() and (sigmas == 0.625).any()


def test_loss_is_finite_and_decreases_on_a_fixed_batch(text):
    tokenizer, text_encoder = text
    layout = CONFIG.layout()
    torch.manual_seed(0)
    model = build_transformer(CONFIG).train()
    embeds = encode_prompts(tokenizer, text_encoder, all_prompts()[:2], CONFIG.max_sequence_length)
    clean = torch.randn(2, CONFIG.z_dim, 6, *CONFIG.latent_size)
    noise = torch.randn_like(clean)
    sigmas = torch.tensor([[1.0, 0.625], [0.833, 0.9375]])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        loss = teacher_forcing_loss(model, clean, embeds, sigmas, noise, layout)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.7 * losses[0]


def test_decoder_only_vae_steps_keep_the_latent_space():
    vae = build_vae(dataclasses.replace(CONFIG, vae_base_dim=8), seed=0)
    encoder = {k: v.clone() for k, v in vae.encoder.state_dict().items()}
    decoder = {k: v.clone() for k, v in vae.decoder.state_dict().items()}
    losses = train_vae(vae, CONFIG, seconds=60, max_steps=2, batch_size=1, decoder_only=True, log=lambda _: None)
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert all(torch.equal(encoder[k], v) for k, v in vae.encoder.state_dict().items())
    assert any(not torch.equal(decoder[k], v) for k, v in vae.decoder.state_dict().items())


@pytest.mark.parametrize(
    "module, flag, value",
    [
        ("train_sana", "--first-chunk-batches", "1.5"),
        ("train_sana", "--gap-prob", "-0.1"),
        ("train_sana", "--start-image-batches", "2"),
        ("__main__", "--start-image-batches", "-0.5"),
    ],
)
def test_training_refuses_a_share_outside_0_1_before_any_work(module, flag, value, tmp_path, capsys):
    import importlib

    main = importlib.import_module(f"rolldiff.training.{module}").main
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "out"), flag, value])
    assert f"{flag} must be in [0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_both_training_runs_share_one_command_line_with_their_own_defaults():
    from rolldiff.training import __main__ as krea
    from rolldiff.training import train_sana

    krea_args = vars(krea.argument_parser().parse_args(["--out", "x"]))
    sana_args = vars(train_sana.argument_parser().parse_args(["--out", "x"]))
    assert (krea_args["clip_frames"], krea_args["vae_from"]) == (12, None)
    assert (sana_args["clip_frames"], sana_args["vae_from"]) == (15, train_sana.DEFAULT_VAE)
    own = {"gap_prob": 0.6, "first_chunk_weight": 1.0, "first_chunk_batches": 0.0, "package": None}
    assert {k: v for k, v in sana_args.items() if k not in krea_args} == own
    shared = set(krea_args) - {"clip_frames", "vae_from"}
    assert {k: krea_args[k] for k in shared} == {k: sana_args[k] for k in shared}


def test_the_direction_swap_gives_each_prompt_its_opposite_direction_and_keeps_the_rest():
    from rolldiff.training.prompt_check import opposite_direction_ids

    prompts = all_prompts()
    ids = torch.arange(len(prompts))
    swapped = opposite_direction_ids(ids)
    assert prompts[int(swapped[0])] == prompts[0].replace("left", "right")
    assert torch.equal(opposite_direction_ids(swapped), ids)  # an involution
    assert all(prompts[a].rsplit(" ", 1)[0] == prompts[b].rsplit(" ", 1)[0] for a, b in zip(ids, swapped))


def test_the_direction_swap_check_scores_the_first_chunk_under_both_prompts(text):
    from rolldiff.training.prompt_check import direction_swap_check

    tokenizer, encoder = text
    embeds = encode_prompts(tokenizer, encoder, all_prompts(), CONFIG.max_sequence_length)
    model = build_transformer(CONFIG).eval()
    errors = direction_swap_check(model, random_videos(embeds, num_videos=48), CONFIG, num_clips=8)
    assert set(errors) == {"first chunk, own prompt", "first chunk, opposite direction"}
    assert errors["first chunk, own prompt"] != errors["first chunk, opposite direction"]  # the text reaches x0
