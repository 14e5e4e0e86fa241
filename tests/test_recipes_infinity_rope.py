"""`recipe="infinity-rope"` against the authors' code, and its two scene controls on their own: scene cuts
(`scene_cuts=`, `switch_prompt(scene_cut=True)`) and the KV flush (`recache="flush"`).

The goldens (tests/goldens/infinity-rope/, tools/record_infinity_rope_goldens.py) are yesiltepe-hidir/infinity-rope
@63d7b84's `CausalInferencePipeline` on tiny random weights, 8 chunks each: `plain`; `switch` and `scene_cut` (to
prompt b before chunk 3, upstream's prompt syntax `a[2.25s] | b` / `a[2.25s#] | b`); `wide_scene_cut` (a window of 8,
the cut before chunk 4, where the flush really drops frames). Each chunk's clean latents must equal
upstream's within 1e-4 (the fp32-vs-fp64 floor is printed); each switch scenario has a control that fails without
the behaviour it checks.
"""

from __future__ import annotations

import pytest
import torch
from recipe_goldens import Golden, call_errors, chunk_errors, inject_noise, load_golden, switched_stream
from test_recipes_pipeline import krea_golden_pipeline

from rolldiff import KreaRealtimeVideoPipeline
from rolldiff.caching import RollingKVCache, SlidingWindowLayer
from rolldiff.caching.layout import SCENE_CUT_FRAME
from rolldiff.recipes import describe_recipe, get_recipe

TOLERANCE = 1e-4
RECIPE = "infinity-rope"


def _replayed(golden: Golden, monkeypatch, **extra) -> list[torch.Tensor]:
    """The golden's run through the stream under the recipe: prompt a, `switch_prompt` to b (a cut when the
    scenario has one) before its chunk; every chunk's latents, with upstream's noise."""
    settings = golden.settings
    noise = inject_noise(golden, monkeypatch)
    made = switched_stream(
        krea_golden_pipeline(golden), golden, RECIPE, 3 * settings["num_chunks"], settings["switch_before_block"],
        settings["scene_cut"], window_frames=settings["window_frames"], **extra,
    )  # fmt: skip
    assert noise.noise.exhausted
    return made


# ----------------------------------------------------------------------------------------- against upstream
@torch.no_grad()
def test_the_recipe_through_the_call_matches_upstream(monkeypatch):
    """`pipe(...)` with the recipe: a one-frame sink, a window of 5 re-indexed from the sink on, rolling from chunk 2."""
    golden = load_golden(RECIPE, "plain")
    errors = call_errors(krea_golden_pipeline(golden), golden, RECIPE, monkeypatch)
    assert max(errors) <= TOLERANCE, errors


@pytest.mark.parametrize("scenario", ["switch", "scene_cut", "wide_scene_cut"])
@torch.no_grad()
def test_switches_flushes_and_cuts_match_upstream(scenario, monkeypatch):
    golden = load_golden(RECIPE, scenario)
    errors = chunk_errors(golden, _replayed(golden, monkeypatch))
    print(f"\ninfinity-rope/{scenario} through the stream: max {max(errors):.1e}, floor {golden.floor:.1e}")
    assert max(errors) <= TOLERANCE, errors


@pytest.mark.parametrize(
    ("scenario", "control", "extra"),
    [
        ("scene_cut", "switch", {}),  # the cut moves the chunk in RoPE: without it, the chunk after the switch differs
        ("wide_scene_cut", "wide_scene_cut", {"recache": "causal"}),  # the window kept (re-run under b): no flush
    ],
    ids=["cut", "flush"],
)
@torch.no_grad()
def test_each_control_is_seen_by_its_golden(scenario, control, extra, monkeypatch):
    """Run the control's settings (the same switch without the cut, or with the window kept): from the switch on,
    upstream's chunks are far from them, and before it equal."""
    golden, switch = load_golden(RECIPE, scenario), load_golden(RECIPE, scenario).settings["switch_before_block"]
    other = load_golden(RECIPE, control)
    made = _replayed(other, monkeypatch, **extra)
    errors = chunk_errors(golden, made)
    assert max(errors[:switch]) <= TOLERANCE, errors
    assert errors[switch] > 100 * TOLERANCE, errors


def test_the_recipe_names_its_upstream_and_settings():
    recipe = get_recipe(RECIPE, "KreaRealtimeVideoPipeline")
    assert "yesiltepe-hidir/infinity-rope@63d7b84" in recipe.upstream
    settings = recipe.settings
    assert (settings["sink_frames"], settings["window_frames"], settings["position_mode"]) == (1, 5, "relative")
    assert settings["recache"] == "flush"
    assert "scene_cuts" in describe_recipe(RECIPE)
    assert SCENE_CUT_FRAME == load_golden(RECIPE, "plain").meta["settings"]["scene_cut_position"]


# ----------------------------------------------------------------------------------------- scene_cuts= and schedules
CALL = dict(prompt="a red circle moving left", recipe=RECIPE, output_type="latent")


def _schedule_run(pipe: KreaRealtimeVideoPipeline, switch_frame: int, **extra) -> torch.Tensor:
    schedule = [(switch_frame, "a blue square moving up")]
    frames = pipe.latent_to_frames(18)
    generator = torch.Generator().manual_seed(3)
    return pipe(**CALL, num_frames=frames, prompt_schedule=schedule, generator=generator, **extra).frames


@torch.no_grad()
def test_scene_cuts_in_a_schedule_equal_a_cut_switch_in_the_stream():
    """`scene_cuts=[frame]` on a `prompt_schedule` switch is `switch_prompt(..., scene_cut=True)` before the chunk it
    applies at, bit for bit; and a cut changes that chunk and the ones after it, never the ones before."""
    pipe = krea_golden_pipeline(load_golden(RECIPE, "plain"))
    frame = pipe.latent_to_pixel_start(9)  # chunk 3
    cut = _schedule_run(pipe, frame, scene_cuts=[frame])
    plain = _schedule_run(pipe, frame)
    stream = pipe.stream(**CALL, num_frames=pipe.latent_to_frames(18), generator=torch.Generator().manual_seed(3))
    made = []
    for index in range(stream.num_chunks):
        if index == 3:
            stream.switch_prompt("a blue square moving up", scene_cut=True)
        made.append(next(stream))
    torch.testing.assert_close(torch.cat(made, 2), cut, rtol=0, atol=0)
    torch.testing.assert_close(cut[:, :, :9], plain[:, :, :9], rtol=0, atol=0)
    assert float((cut[:, :, 9:12] - plain[:, :, 9:12]).abs().max()) > 1e-3
    assert all(cache[0].cut_position is None for cache in stream.caches)  # the cut lasted its chunk only


@torch.no_grad()
def test_a_pending_cut_survives_a_saved_state():
    """`switch_prompt(scene_cut=True)`, then the stream saved before the chunk it applies to: the resumed stream cuts
    there as the uninterrupted one does."""
    pipe = krea_golden_pipeline(load_golden(RECIPE, "plain"))

    def stream():
        return pipe.stream(**CALL, num_frames=pipe.latent_to_frames(12), generator=torch.Generator().manual_seed(5))

    whole, first = stream(), stream()
    expected = [next(whole) for _ in range(2)]
    whole.switch_prompt("a blue square moving up", scene_cut=True)
    expected += list(whole)
    made = [next(first) for _ in range(2)]
    first.switch_prompt("a blue square moving up", scene_cut=True)
    resumed = stream()
    resumed.load_state_dict(first.state_dict())
    made += list(resumed)
    torch.testing.assert_close(torch.cat(made, 2), torch.cat(expected, 2), rtol=0, atol=0)


# ----------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"scene_cuts": [7]}, r"`scene_cuts` frames \[7\] are not prompt switches.*switches are at \[36\]"),
        ({"scene_cuts": "36"}, "`scene_cuts` must be a non-empty list of int frames"),
        (
            {"scene_cuts": [36], "position_mode": "absolute", "recache": "causal"},
            r"`scene_cuts` places.*got position_mode='absolute'",
        ),
        (
            {"scene_cuts": [36], "denoising": "pipelined", "window_frames": 14, "recache": "causal"},
            r"`scene_cuts` places.*got denoising='pipelined'",
        ),
        ({"recache": "flush", "position_mode": "absolute"}, r"`recache='flush'`.*got position_mode='absolute'"),
        ({"recache": "flush", "context_policy": "recompute"}, r"`recache='flush'`.*context_policy='recompute'"),
    ],
    ids=["not_a_switch", "not_a_list", "absolute", "pipelined", "flush_absolute", "flush_recompute"],
)
def test_bad_scene_controls_are_refused_naming_the_argument(extra, match):
    pipe = krea_golden_pipeline(load_golden(RECIPE, "plain"))
    with pytest.raises(ValueError, match=match):
        pipe.stream(**CALL, num_frames=pipe.latent_to_frames(18), prompt_schedule=[(36, "a blue square")], **extra)


def test_a_cut_past_the_rope_table_and_a_bad_flag_are_refused_before_any_chunk():
    golden = load_golden(RECIPE, "plain")
    pipe = krea_golden_pipeline(golden)
    pipe.transformer.register_to_config(rope_max_seq_len=40)  # the checks read the config: RoPE frames 45..47 lie past
    with pytest.raises(ValueError, match=r"RoPE frames 45\.\.47, past this model's RoPE table of 40 frames"):
        pipe.stream(**CALL, num_frames=pipe.latent_to_frames(18), prompt_schedule=[(36, "a blue")], scene_cuts=[36])
    stream = pipe.stream(**CALL, num_frames=pipe.latent_to_frames(18))
    with pytest.raises(ValueError, match="past this model's RoPE table"):
        stream.switch_prompt("a blue square", scene_cut=True)
    with pytest.raises(ValueError, match="`scene_cut` must be"):
        stream.switch_prompt("a blue square", scene_cut="yes")
    assert stream.next_chunk == 0 and stream._pending is None  # noqa: SLF001 (nothing was queued)


# ----------------------------------------------------------------------------------------- the layer
def test_a_cut_places_the_pending_tokens_and_leaves_the_committed_ones():
    """Scalar positions: sink 1 + window 5, chunks of 3 (one token a frame). With a cut at 45 the pending chunk's
    queries and keys sit at 45.., the sink and the recent frames where they were; the cut is cleared by None and by
    `reset`."""
    layer = SlidingWindowLayer(1, 5, 3)
    cache = RollingKVCache([layer])
    for start in (0, 3):
        values = torch.arange(start, start + 3, dtype=torch.float32).view(1, 3, 1, 1)
        layer.update(values, values)
        cache.commit()
    plain_queries = layer.pending_positions(3, reindexed=True).tolist()
    cache.set_cut_position(45)
    assert layer.pending_positions(3, reindexed=True).tolist() == [45, 46, 47] != plain_queries
    layer.update(torch.zeros(1, 3, 1, 1), torch.zeros(1, 3, 1, 1))
    held = layer.key_positions(reindexed=True)[layer.attention_mask].tolist()
    assert sorted(held) == [0, 1, 2, 45, 46, 47]  # the sink, frames 4 and 5 at 1 and 2, the cut chunk
    cache.set_cut_position(None)
    assert sorted(layer.key_positions(reindexed=True)[layer.attention_mask].tolist()) == [0, 1, 2, 3, 4, 5]
    cache.set_cut_position(45)
    cache.reset()
    assert layer.cut_position is None
    with pytest.raises(ValueError, match="`position`"):
        layer.set_cut_position(-1)
