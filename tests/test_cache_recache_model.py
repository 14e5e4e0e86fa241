"""A prompt switch's re-cache on the real Krea-like model (3 blocks): as if the switched frames were never cached.

The pipeline's `_recache` rewinds the recent window and runs its clean frames again at t = 0 under the new
prompt, chunk by chunk. The first of those context passes runs while the ring still holds the rewound frames'
K/V in slots the window reaches back to; a layer that called its window full then let the chunk attend to
them (no mask). Here the re-cached stream must equal a reference stream that committed the kept frames under
prompt A and the re-cached ones under prompt B directly: the same cache contents in every block and the same
next chunk, to fp32 rounding. With 3 blocks, an error of block 0's attention reaches blocks 1 and 2's K/V.

The ring's window slots hold the last `window` frames at the switch, so the first re-cached chunk's window
cannot reach the frames older than those (frame 1 here: its slot holds the rewound frame 4). The reference
drops them too, with `crop`, before its first frame under B.
"""

import torch
from tiny_components import tiny_transformer

from rolldiff import ChunkLayout

TOKENS_PER_FRAME = 4  # 4x4 latent, patch 2x2
LAYOUT = ChunkLayout(TOKENS_PER_FRAME, chunk_frames=1, sink_frames=1, window_frames=3)  # 4 frames of slots


def _context_pass(model, cache, clean: torch.Tensor, text: torch.Tensor) -> None:
    """Write a clean chunk's K/V at t = 0 and commit (the pipeline's `_context_pass`)."""
    model(clean, torch.tensor([0.0]), text, kv_cache=cache, layout=LAYOUT)
    cache.commit()


def _denoise(model, cache, noisy: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    for sigma in (1.0, 0.5):
        out = model(noisy, torch.tensor([sigma * 1000.0]), text, kv_cache=cache, layout=LAYOUT).sample
    return out


@torch.no_grad()
def test_recache_after_a_prompt_switch_equals_a_stream_that_never_cached_those_frames_under_the_old_prompt():
    model = tiny_transformer(num_layers=3)
    generator = torch.Generator().manual_seed(0)
    frames = torch.randn(1, 4, 5, 4, 4, generator=generator)  # clean latents of frames 0..4
    noisy = torch.randn(1, 4, 1, 4, 4, generator=generator)  # frame 5, to denoise after the switch
    text_a, text_b = torch.randn(2, 1, 7, 16, generator=generator)
    recached_frames = LAYOUT.rewindable_frames(5)
    assert recached_frames == 2  # frames 3, 4 are re-cached; frame 4's slot is where frame 1 was

    switched = model.make_cache(LAYOUT, batch_size=1)
    model.prepare_conditioning(switched, text_a)
    for frame in range(5):
        _context_pass(model, switched, frames[:, :, frame : frame + 1], text_a)
    switched.rewind(recached_frames * TOKENS_PER_FRAME)  # the pipeline's `_recache`: rewind, then context passes
    assert [layer.get_seq_length() for layer in switched] == [2 * TOKENS_PER_FRAME] * 3  # frames 0 and 2
    model.prepare_conditioning(switched, text_b)
    for frame in range(5 - recached_frames, 5):
        _context_pass(model, switched, frames[:, :, frame : frame + 1], text_b)

    reference = model.make_cache(LAYOUT, batch_size=1)
    model.prepare_conditioning(reference, text_a)
    for frame in range(5 - recached_frames):
        _context_pass(model, reference, frames[:, :, frame : frame + 1], text_a)
    reference.crop(2 * TOKENS_PER_FRAME)  # frames 0 and 2: frame 1 is lost to the ring in the switched stream
    model.prepare_conditioning(reference, text_b)
    for frame in range(5 - recached_frames, 5):
        _context_pass(model, reference, frames[:, :, frame : frame + 1], text_b)

    for block, (ours, expected) in enumerate(zip(switched, reference)):
        assert ours.get_seq_length() == expected.get_seq_length() == 3 * TOKENS_PER_FRAME, (
            block
        )  # sink + 2 recent frames
        for held, wanted in zip(ours.get(), expected.get()):
            torch.testing.assert_close(held, wanted, atol=1e-6, rtol=1e-6, msg=f"block {block}")
    torch.testing.assert_close(
        _denoise(model, switched, noisy, text_b), _denoise(model, reference, noisy, text_b), atol=1e-6, rtol=1e-6
    )
