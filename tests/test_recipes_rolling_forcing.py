"""`recipe="rolling-forcing"` against the authors' code, and the two cache views it needs, each on its own.

The goldens (tests/goldens/rolling-forcing/, tools/record_rolling_forcing_goldens.py) are thu-ml/Causal-Forcing@1fc7bbc's
`long_video` Rolling Forcing loop on tiny random weights: `plain` (14 blocks: the buffer rolls, the anchor leaves
the clean pass's view, the last 3 windows empty) and `short` (5 blocks). Each block's clean latents must equal
upstream's within 1e-4 (the fp32-vs-fp64 floor is printed beside it).

The layer tests are scalar traces (1 head, head_dim 1, token p carries the value p + 1) over random walks of window
forwards and context passes, against the views written out by hand from `causal_model.py:247-300`.
"""

from __future__ import annotations

import random

import pytest
import torch
from diffusers.schedulers import scheduling_flow_match_euler_discrete as scheduler_module
from recipe_goldens import Golden, assert_switch_seen, load_golden, switched_stream
from test_recipes_pipeline import krea_golden_pipeline

from rolldiff.caching import RollingKVCache, SlidingWindowLayer
from rolldiff.caching.layout import ChunkLayout, ring_length
from rolldiff.pipelines import pipelined as pipelined_module
from rolldiff.pipelines import stream as stream_module
from rolldiff.recipes import describe_recipe, get_recipe

TOLERANCE = 1e-4
RECIPE = "rolling-forcing"


# ----------------------------------------------------------------------------------------- against upstream
class RecordedOrder:
    """Stands in for `randn_tensor`: upstream's draws in the order its rolling window made them (the entering
    block's noise, then one re-noise per block that goes on, oldest first), each checked for shape."""

    def __init__(self, golden: Golden) -> None:
        self.noise = golden.noise()
        self.names = [name.split(".")[1:] for name in golden.settings["noise_order"]]

    def __call__(self, shape, generator=None, device=None, dtype=None, **kwargs) -> torch.Tensor:
        position = self.noise.position
        assert position < len(self.names), "the loop drew more noise than upstream"
        chunk, step = (int(part) for part in self.names[position])
        drawn = self.noise.draw(chunk, step)
        assert tuple(drawn.shape) == tuple(shape), (chunk, step, drawn.shape, shape)
        return drawn.to(device=device, dtype=dtype)


def _inject(golden: Golden, monkeypatch) -> RecordedOrder:
    noise = RecordedOrder(golden)
    for module in (stream_module, pipelined_module, scheduler_module):
        monkeypatch.setattr(module, "randn_tensor", noise)
    return noise


def _errors(golden: Golden, latents: torch.Tensor) -> list[float]:
    chunks = latents.split(golden.settings["chunk_frames"], dim=2)
    assert len(chunks) == len(golden.clean)
    return [float((made.float() - expected).abs().max()) for made, expected in zip(chunks, golden.clean)]


def _run(golden: Golden, monkeypatch, **extra) -> tuple[list[float], RecordedOrder]:
    pipe = krea_golden_pipeline(golden)
    noise = _inject(golden, monkeypatch)
    frames = golden.settings["latent_frames"]
    latents = pipe(
        num_frames=pipe.latent_to_frames(frames), prompt_embeds=golden.text["a"], output_type="latent",
        recipe=RECIPE, **extra,
    ).frames  # fmt: skip
    return _errors(golden, latents), noise


@pytest.mark.parametrize("scenario", ["plain", "short"])
@torch.no_grad()
def test_rolling_forcing_recipe_matches_upstream(scenario, monkeypatch):
    """`pipe(...)` with the recipe alone: every block's clean latents as the authors' rolling window made them."""
    golden = load_golden(RECIPE, scenario)
    errors, noise = _run(golden, monkeypatch)
    print(f"\nrolling-forcing/{scenario}: max |ours - upstream| {max(errors):.1e}, floor {golden.floor:.1e}")
    assert noise.noise.exhausted
    assert max(errors) <= TOLERANCE, errors


@torch.no_grad()
def test_a_prompt_switch_matches_upstream_switched_alike(monkeypatch):
    """`switch_prompt` before block 4 with 3 blocks in flight: the committed blocks after the anchor re-cached under
    the new prompt, every later forward (the in-flight blocks' too) under it. The tree has no switch: its loop was
    switched as `switch_prompt` defines it (`tools/_wan_upstream.py` `SwitchingGenerator`, the anchor kept).
    Control: after the switch the blocks differ from the unswitched run's."""
    golden = load_golden(RECIPE, "prompt_switch")
    switch = golden.settings["switch"]["before_block"]
    pipe = krea_golden_pipeline(golden)
    noise = _inject(golden, monkeypatch)
    made = switched_stream(pipe, golden, RECIPE, golden.settings["latent_frames"], switch)
    errors = _errors(golden, torch.cat(made, dim=2))
    print(f"\nrolling-forcing/prompt_switch: max |ours - upstream| {max(errors):.1e}, floor {golden.floor:.1e}")
    assert noise.noise.exhausted
    assert max(errors) <= TOLERANCE, errors
    assert_switch_seen(golden, load_golden(RECIPE, "plain"), switch, TOLERANCE)


@torch.no_grad()
def test_the_goldens_see_both_views(monkeypatch):
    """Without the elastic window the emptying windows at the end differ; with a clean pass that sees the whole
    video (a span longer than it) the blocks after the anchor leaves upstream's 21 frames differ; the blocks before
    either matters still match."""
    golden = load_golden(RECIPE, "plain")
    rigid, _ = _run(golden, monkeypatch, elastic_window=False)
    assert max(rigid[:11]) <= TOLERANCE, rigid  # 4 blocks in flight: the elastic window sees what a rigid one does
    assert min(rigid[11:]) > 100 * TOLERANCE, rigid  # the last 3 windows empty and see further back
    whole, _ = _run(golden, monkeypatch, context_window_frames=golden.settings["latent_frames"])
    assert max(whole[:8]) <= TOLERANCE, whole  # block 7's clean pass is the first without the anchor; its K/V
    assert min(whole[8:]) > 10 * TOLERANCE, whole  # reach the blocks after it


def test_the_recipe_names_its_upstream_and_settings():
    recipe = get_recipe(RECIPE, "KreaRealtimeVideoPipeline")
    assert "thu-ml/Causal-Forcing@1fc7bbc" in recipe.upstream and "rolling_forcing_inference.py" in recipe.upstream
    settings = recipe.settings
    assert settings["denoising"] == "pipelined" and settings["elastic_window"] is True
    assert settings["context_window_frames"] == 21 and settings["sink_frames"] == 3
    assert "context_window_frames = 21" in describe_recipe(RECIPE)


@torch.no_grad()
def test_a_rolling_forcing_stream_resumes_exactly():
    golden = load_golden(RECIPE, "plain")
    pipe = krea_golden_pipeline(golden)
    call = dict(num_frames=pipe.latent_to_frames(30), prompt_embeds=golden.text["a"], output_type="latent")

    def stream(seed=0):
        return pipe.stream(**call, recipe=RECIPE, generator=torch.Generator().manual_seed(seed))

    whole = list(stream())
    first = stream()
    head = [next(first) for _ in range(8)]  # the anchor has left the clean pass's span (chunk 7)
    state = first.state_dict()
    resumed = stream(seed=99)
    resumed.load_state_dict(state)
    for made, expected in zip(head + list(resumed), whole, strict=True):
        torch.testing.assert_close(made, expected, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"context_window_frames": 3}, "must be larger than `chunk_frames`=3"),
        ({"context_window_frames": 0}, "`context_window_frames`"),
        ({"elastic_window": "yes"}, "`elastic_window`"),
        ({"elastic_window": True, "window_frames": "all", "denoising": "sequential"}, "an integer `window_frames`"),
        ({"window_frames": 9}, r"Pass window_frames=18 .* 13 at least\.$"),  # no 'all': the views need a bound
    ],
    ids=["span_of_one_chunk", "zero", "not_a_bool", "unbounded", "window_under_the_chunks_in_flight"],
)
def test_bad_views_are_refused_naming_the_argument(extra, match):
    golden = load_golden(RECIPE, "short")
    pipe = krea_golden_pipeline(golden)
    with pytest.raises(ValueError, match=match):
        pipe.stream(num_frames=pipe.latent_to_frames(15), prompt_embeds=golden.text["a"], recipe=RECIPE, **extra)


def test_the_layer_refuses_views_it_cannot_size():
    with pytest.raises(ValueError, match="pass `chunk_tokens`"):
        SlidingWindowLayer(3, 18, elastic_window=True)
    with pytest.raises(ValueError, match="`context_window_tokens`"):
        SlidingWindowLayer(3, 18, 12, context_window_tokens=0)
    layer = SlidingWindowLayer(3, 18, 12, frame_tokens=3, elastic_window=True, context_window_tokens=21)
    with pytest.raises(ValueError, match="fewer than one frame"):
        layer.update(torch.ones(1, 2, 1, 1), torch.ones(1, 2, 1, 1))
    with pytest.raises(ValueError, match="elastic_window"):
        ChunkLayout(tokens_per_frame=1, chunk_frames=3, sink_frames=0, window_frames=6, elastic_window=1)


# ----------------------------------------------------------------------------------------- the layer, scalar traces
def reference_view(committed: int, pending: int, sink: int, window: int, chunk: int, elastic: bool, span, context):
    """Positions an update of `pending` tokens starting at `committed` attends to, by hand: a window forward sees
    the sink, the `window - pending` (elastic) or `window - chunk` latest committed tokens and itself; a context
    pass with a span sees the last `span` tokens ending with itself, the sink only inside them."""
    end = committed + pending
    if context and span is not None:
        return list(range(max(0, end - span), end))
    recent = window - (pending if elastic else chunk)
    return [p for p in range(end) if p < sink or p >= committed - recent]


def _seen(layer: SlidingWindowLayer, keys: torch.Tensor) -> list[int]:
    """Visible positions, each checked to hold its own token's value (a slot overwritten would not)."""
    mask = layer.attention_mask
    positions = layer.key_positions()[mask]
    torch.testing.assert_close(keys[0, mask, 0, 0], positions.float() + 1, rtol=0, atol=0)
    return sorted(positions.tolist())


def _write(layer: SlidingWindowLayer, start: int, count: int) -> torch.Tensor:
    values = torch.arange(start + 1, start + count + 1, dtype=torch.float32).view(1, count, 1, 1)
    keys, _ = layer.update(values, -values)
    return keys


GEOMETRIES = {  # sink, window, chunk (the most in flight), frame, elastic, span
    "rolling_forcing": (3, 18, 12, 3, True, 21),  # the recipe in frames of one token: 4 blocks of 3 in flight
    "elastic_only": (2, 10, 6, 2, True, None),
    "span_only": (3, 9, 3, 1, False, 8),
    "no_sink": (0, 12, 6, 2, True, 10),
}


@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
@pytest.mark.parametrize("seed", range(3))
def test_the_views_follow_the_hand_written_rule_over_a_random_walk(geometry, seed):
    """Forwards of any whole-frame size up to the chunk, a context pass of part of it (inside
    `RollingKVCache.context_pass()`), commit; sometimes an aborted forward (no commit), sometimes a rewind as deep as
    a view reaches (a re-cache): every update sees exactly the reference view less what the ring no longer holds
    (modelled slot by slot; it matters only after a rewind), every visible slot holding its own token, over enough
    chunks to wrap the ring 3 times."""
    sink, window, chunk, frame, elastic, span = geometry
    rng = random.Random(seed)
    layer = SlidingWindowLayer(
        sink, window, chunk, frame_tokens=frame, elastic_window=elastic, context_window_tokens=span
    )
    cache = RollingKVCache([layer])
    assert layer.ring_tokens == ring_length(window, chunk, frame, elastic, span)
    committed, held = 0, {}  # held: slot -> the position last written to it (the ring, modelled by hand)

    def slot(position: int) -> int:
        return position if position < sink else sink + (position - sink) % layer.ring_tokens

    def write(count: int) -> torch.Tensor:
        held.update({slot(p): p for p in range(committed, committed + count)})
        return _write(layer, committed, count)

    def expected(pending: int, context: bool) -> list[int]:
        view = reference_view(committed, pending, sink, window, chunk, elastic, span, context)
        return [p for p in view if held.get(slot(p)) == p]

    while committed < sink + 3 * layer.ring_tokens:
        pending = frame * rng.randint(1, chunk // frame)
        for _ in range(rng.randint(1, 2)):  # the steps of one forward write the same slots
            keys = write(pending)
            assert _seen(layer, keys) == expected(pending, False)
        if rng.random() < 0.2:
            continue  # aborted: the next forward starts over at the same position
        kept = frame * rng.randint(1, pending // frame)
        if span is None or kept <= span:
            with cache.context_pass():
                keys = write(kept)
                assert _seen(layer, keys) == expected(kept, True)
        else:
            keys = write(kept)
        layer.commit()
        committed += kept
        assert layer.committed_count == committed
        if rng.random() < 0.15:  # a re-cache: back as far as any view reaches, then written again as the walk goes
            reach = committed - max(sink, committed - (layer.ring_tokens - chunk))
            with pytest.raises(ValueError, match="can be rewound"):
                layer.rewind(reach + 1)
            if reach:
                rewound = rng.randint(1, reach)
                layer.rewind(rewound)
                committed -= rewound


def test_the_recache_reaches_every_committed_frame_a_view_reads():
    """A prompt switch re-caches what any later update may see: with 4 blocks in flight the window forward reads 6
    committed frames, the clean pass up to 20 (the recipe's layout: sink 3, window 18, chunk 12, span 21)."""
    layout = ChunkLayout(
        1, chunk_frames=12, sink_frames=3, window_frames=18, elastic_window=True, context_window_frames=21
    )  # fmt: skip
    assert [layout.rewindable_frames(n) for n in (3, 12, 23, 40)] == [0, 9, 20, 20]
    plain = ChunkLayout(1, chunk_frames=3, sink_frames=3, window_frames=9)
    assert [plain.rewindable_frames(n) for n in (3, 6, 30)] == [0, 3, 6]


def test_a_context_pass_ends_with_its_block_even_on_an_error():
    layer = SlidingWindowLayer(0, 6, 3, frame_tokens=1, context_window_tokens=4)
    cache = RollingKVCache([layer])
    with pytest.raises(RuntimeError, match="mid-pass"), cache.context_pass():
        assert layer._context_view  # noqa: SLF001
        raise RuntimeError("mid-pass")
    assert not layer._context_view  # noqa: SLF001


@torch.no_grad()
def test_compiled_fullgraph_the_recipe_switches_prompts_and_resumes_as_eager():
    """Under `compile_cached_step` (fullgraph=True) the recipe's stream, a prompt switch (its re-cache: one context
    pass per committed chunk a view reads) and a resume mid-video give the eager stream's chunks within 1e-5, with a
    bounded number of graphs that a video three times as long does not add to."""
    from torch._dynamo.testing import CompileCounter

    from rolldiff.pipelines.acceleration import compile_cached_step

    golden = load_golden(RECIPE, "plain")
    pipe = krea_golden_pipeline(golden)
    call = dict(prompt_embeds=golden.text["a"], output_type="latent", recipe=RECIPE)
    frames = golden.settings["latent_frames"]

    def run(resume_after: int | None = None, latent_frames: int = frames) -> list[torch.Tensor]:
        num_frames = pipe.latent_to_frames(latent_frames)
        stream = pipe.stream(num_frames=num_frames, generator=torch.Generator().manual_seed(0), **call)
        made = []
        for index, chunk in enumerate(stream):
            made.append(chunk.float())
            if index == 2:
                stream.switch_prompt(prompt_embeds=golden.text["a"] * 0.5)
            if index == resume_after:
                resumed = pipe.stream(num_frames=num_frames, generator=torch.Generator().manual_seed(7), **call)
                resumed.load_state_dict(stream.state_dict())
                return made + [chunk.float() for chunk in resumed]
        return made

    eager, eager_resumed = run(), run(resume_after=4)
    counter = CompileCounter()
    torch.compiler.reset()
    try:
        compile_cached_step(pipe.transformer, backend=counter)
        compiled, compiled_resumed = run(), run(resume_after=4)
        graphs = counter.frame_count
        longer = run(latent_frames=3 * frames)
    finally:
        torch.compiler.reset()
    assert 0 < graphs <= 8 and counter.frame_count == graphs and len(longer) == 3 * len(eager)
    for made, expected in zip(compiled + compiled_resumed, eager + eager_resumed, strict=True):
        torch.testing.assert_close(made, expected, rtol=1e-5, atol=1e-5)
    for made, expected in zip(eager_resumed, eager, strict=True):
        torch.testing.assert_close(made, expected, rtol=0, atol=0)  # the resume is exact
