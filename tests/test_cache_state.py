"""Saving and loading a cache (resume): `state_dict()` / `load_state_dict()`, tensors plus JSON extra states.

Random walks over every layer kind (sliding window plain / int8 / offloaded / both, linear attention with and
without a window, rewindable linear attention, conv state, static, condition) are saved at a random point,
the tensors through safetensors' `save_file` / `load_file` and the extra states through `json.dumps` /
`json.loads`, loaded into a fresh cache built the same way (lazy, as resume builds it, or allocated ahead),
and the walk continues on both: every output and every `get()` must be bit-identical.
"""

import json
import random

import pytest
import torch
from cache_helpers import sdpa
from safetensors.torch import load_file, save_file

from rolldiff.caching import (
    ConditionKVCache,
    ConvStateLayer,
    CrossAttentionLayer,
    LinearAttentionLayer,
    RewindableLinearAttentionLayer,
    RollingKVCache,
    SlidingWindowLayer,
    StaticLayer,
    merge_extra_state,
    split_extra_state,
)

HEADS, HEAD_DIM, TOKENS_PER_FRAME = 2, 4, 2


def _sliding_cache(early: bool) -> RollingKVCache:
    options = [{}, {"quantization": "int8"}, {"offload": True}, {"quantization": "int8", "offload": True}]
    layers = [SlidingWindowLayer(2, 6, 2, **option) for option in options]
    cache = RollingKVCache(layers, [CrossAttentionLayer(), None, CrossAttentionLayer(), None])
    if early:
        cache.early_initialization(2, HEADS, HEAD_DIM, torch.float32, "cpu")
    return cache


def _linear_cache(early: bool) -> RollingKVCache:
    cache = RollingKVCache([LinearAttentionLayer(), LinearAttentionLayer(window_chunks=2)])
    if early:
        cache.early_initialization(2, HEADS, HEAD_DIM, torch.float32, "cpu")
    return cache


def _rewindable_cache(early: bool) -> RollingKVCache:
    layers = [RewindableLinearAttentionLayer(), RewindableLinearAttentionLayer(window_chunks=2)]
    cache = RollingKVCache(layers, slots={"conv_state": [ConvStateLayer(TOKENS_PER_FRAME) for _ in layers]})
    if early:
        cache.early_initialization(2, HEADS, HEAD_DIM, torch.float32, "cpu")
    return cache


def _static_cache(early: bool) -> RollingKVCache:
    cache = RollingKVCache([StaticLayer(max_tokens=10), StaticLayer(max_tokens=10)])
    if early:
        cache.early_initialization(2, HEADS, HEAD_DIM, torch.float32, "cpu")
    return cache


def _condition_cache(early: bool) -> ConditionKVCache:
    return ConditionKVCache(2, max_tokens=None)  # sized at first use, so "early" means nothing here


# ---------------------------------------------------------------------------------------------- the walks
def _kv(rng: random.Random, batch: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    return tuple(torch.randn(2, batch, tokens, HEADS, HEAD_DIM, generator=generator).unbind(0))


def _sliding_ops(rng: random.Random, steps: int) -> list:
    ops, pending = [], 0
    for _ in range(steps):
        name = rng.choices(["step", "commit", "rewind", "crop", "reset"], weights=[8, 5, 2, 1, 1])[0]
        if name == "step":
            pending = pending or rng.choice([2, 2, 1])
            ops.append(("step", _kv(rng, 1, pending), rng.random()))
        elif name == "commit":
            pending = 0
            ops.append(("commit",))
        else:
            ops.append((name, rng.randint(0, 6)))
    return ops


def _run_sliding(cache: RollingKVCache, op) -> list:
    if op[0] == "step":
        (key, value), _ = op[1], op[2]
        return [sdpa(key, *layer.update(key, value), layer.attention_mask) for layer in cache]
    return _container_op(cache, op)


def _container_op(cache: RollingKVCache, op) -> list:
    """commit / rewind / crop / reset on the container; a refusal is an output too (both caches must agree)."""
    try:
        if op[0] == "commit":
            cache.commit()
        elif op[0] == "rewind":
            cache.rewind(op[1])
        elif op[0] == "crop":
            cache.crop(op[1])
        elif op[0] == "reset":
            cache.reset()
    except (ValueError, RuntimeError, TypeError) as error:
        return [type(error).__name__]
    return [layer.get() for layer in cache]


def _linear_ops(rng: random.Random, steps: int) -> list:
    ops, frames = [], 0
    for _ in range(steps):
        name = rng.choices(["step", "commit", "rewind", "reset"], weights=[8, 5, 2, 1])[0]
        if name == "step":
            frames = frames or rng.choice([2, 1])
            key, value = _kv(rng, 2, frames * TOKENS_PER_FRAME)
            conv_input = torch.randn(2, HEADS * HEAD_DIM, frames, TOKENS_PER_FRAME, generator=torch.Generator())
            ops.append(("step", key, value, conv_input))
        elif name == "commit":
            frames = 0
            ops.append(("commit",))
        else:
            ops.append((name, rng.choice([2, 4]) * TOKENS_PER_FRAME // 2))
    return ops


def _run_linear(cache: RollingKVCache, op) -> list:
    if op[0] != "step":
        out = _container_op(cache, op)
        return out + [layer.tail for layer in cache if isinstance(layer, LinearAttentionLayer)]
    _, key, value, conv_input = op
    outputs = []
    for layer in cache:
        outputs.extend(torch.clone(t) for t in layer.update(key, value))
        layer.update_tail(conv_input[:, :, -1:])  # the tail rides along with the commit
    for layer in cache.slots.get("conv_state", []):
        outputs.append(layer.update(conv_input)[0].clone())
    return outputs


def _static_ops(rng: random.Random, steps: int) -> list:
    ops = []
    for _ in range(steps):
        name = rng.choices(["condition", "step", "reset"], weights=[2, 6, 1])[0]
        ops.append((name, _kv(rng, 2, rng.randint(1, 3))) if name != "reset" else ("reset",))
    return ops


def _run_static(cache: RollingKVCache, op) -> list:
    if op[0] == "reset":
        return _container_op(cache, op)
    key, value = op[1]
    try:
        outputs = [torch.cat(layer.update(key, value), dim=-1).clone() for layer in cache]
        if op[0] == "condition":
            cache.commit()
    except ValueError as error:  # full: both caches refuse alike
        return [type(error).__name__]
    return outputs + [layer.get() for layer in cache]


def _condition_ops(rng: random.Random, steps: int) -> list:
    ops = []
    for _ in range(steps):
        name = rng.choices(["write", "next_sample", "read", "reset"], weights=[3, 1, 5, 1])[0]
        if name == "write":
            ops.append((name, _kv(rng, 1, rng.randint(1, 3))))
        elif name == "read":
            ops.append((name, _kv(rng, rng.choice([2, 4]), rng.randint(1, 2))))
        else:
            ops.append((name,))
    return ops


def _run_condition(cache: ConditionKVCache, op) -> list:
    if op[0] in ("next_sample", "reset"):
        getattr(cache, op[0])()
        return [layer.get() for layer in cache]
    cache.set_mode(op[0])
    key, value = op[1]
    try:
        outputs = [torch.cat(layer.update(key, value), dim=-1).clone() for layer in cache]
    except ValueError as error:  # a batch the written samples do not divide: both refuse alike
        return [type(error).__name__]
    return outputs + [layer.attention_mask for layer in cache]


def _same(received, expected) -> None:
    assert type(received) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert received.shape == expected.shape and torch.equal(received, expected)
    elif isinstance(expected, (list, tuple)):
        assert len(received) == len(expected)
        for r, e in zip(received, expected):
            _same(r, e)
    else:
        assert received == expected


def _save_and_load(cache, build, early: bool, tmp_path):
    """The resume path: tensors to safetensors, extra states to JSON, both loaded into a fresh cache."""
    tensors, extras = split_extra_state(cache.state_dict())
    save_file(tensors, tmp_path / "cache.safetensors")
    fresh = build(early)
    before = {name: buffer.data_ptr() for name, buffer in fresh.named_buffers()}
    fresh.load_state_dict(merge_extra_state(load_file(tmp_path / "cache.safetensors"), json.loads(json.dumps(extras))))
    after = {name: buffer.data_ptr() for name, buffer in fresh.named_buffers()}
    held = {name for name, t in fresh.named_buffers() if t is not None}
    for name in set(before) & set(after):
        if name in tensors and fresh.get_buffer(name).shape == tensors[name].shape and "tail" not in name:
            assert after[name] == before[name], name  # allocated buffers are written in place
    assert all(name in held for name in tensors)
    return fresh


KINDS = {
    "sliding": (_sliding_cache, _sliding_ops, _run_sliding),
    "linear": (_linear_cache, _linear_ops, _run_linear),
    "rewindable": (_rewindable_cache, _linear_ops, _run_linear),
    "static": (_static_cache, _static_ops, _run_static),
    "condition": (_condition_cache, _condition_ops, _run_condition),
}


@pytest.mark.parametrize("kind", KINDS)
def test_a_saved_cache_continues_bit_identically_after_loading_into_a_fresh_one(kind, tmp_path):
    build, make_ops, run = KINDS[kind]
    for seed in range(12):
        rng = random.Random(seed)
        ops = make_ops(rng, 36)
        save_at, early = rng.randrange(len(ops)), seed % 2 == 0
        cache = build(early)
        for op in ops[:save_at]:
            run(cache, op)
        fresh = _save_and_load(cache, build, early, tmp_path)
        for op in ops[save_at:]:
            _same(run(fresh, op), run(cache, op))


def _filled_sliding_cache(chunks: int = 4) -> RollingKVCache:
    cache = _sliding_cache(early=False)
    rng = random.Random(0)
    for _ in range(chunks):
        _run_sliding(cache, ("step", _kv(rng, 1, 2), 0.0))
        cache.commit()
    return cache


def test_the_state_holds_no_cross_attention_and_no_workspace_and_loading_empties_cross_attention():
    cache = _filled_sliding_cache()
    for layer in cache.cross:
        if layer is not None:
            layer.update(*_kv(random.Random(1), 1, 3))
    tensors, extras = split_extra_state(cache.state_dict())
    assert not any(key.startswith("_cross_modules") or "workspace" in key for key in [*tensors, *extras])
    assert set(extras) == {"_extra_state", *(f"layers.{i}._extra_state" for i in range(4))}
    json.dumps(extras)  # host values only
    fresh = _sliding_cache(early=False)
    fresh.cross[0].update(*_kv(random.Random(2), 1, 3))
    fresh.load_state_dict(merge_extra_state(tensors, extras))
    assert not any(layer.is_filled for layer in fresh.cross if layer is not None)
    assert [layer.get_seq_length() for layer in fresh] == [layer.get_seq_length() for layer in cache] == [6] * 4


def test_a_lazy_cache_allocates_where_the_loaded_tensors_are_and_an_allocated_one_keeps_its_buffers():
    tensors, extras = split_extra_state(_filled_sliding_cache().state_dict())
    lazy = _sliding_cache(early=False)
    lazy.load_state_dict(merge_extra_state(tensors, extras))
    assert lazy[0].keys.shape == (1, 8, HEADS, HEAD_DIM) and lazy[2].keys.device.type == "cpu"
    allocated = _sliding_cache(early=False)
    _run_sliding(allocated, ("step", _kv(random.Random(3), 1, 2), 0.0))
    pointers = {name: t.data_ptr() for name, t in allocated.named_buffers() if t is not None}
    allocated.load_state_dict(merge_extra_state(tensors, extras))
    assert {name: t.data_ptr() for name, t in allocated.named_buffers() if t is not None} == pointers


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (lambda: RollingKVCache([SlidingWindowLayer(2, 6, 2) for _ in range(3)]), "`layers` are"),
        (lambda: RollingKVCache([SlidingWindowLayer(2, 8, 2) for _ in range(4)], [CrossAttentionLayer(), None, CrossAttentionLayer(), None]),
         "window_tokens"),
        (lambda: _sliding_cache(early=True), "batch_size"),  # allocated for batch 2, the state has batch 1
    ],
)  # fmt: skip
def test_a_state_of_another_layout_is_refused_before_any_layer_changes(other, message):
    tensors, extras = split_extra_state(_filled_sliding_cache().state_dict())
    cache = other()
    before = {name: t.clone() for name, t in cache.state_dict().items() if isinstance(t, torch.Tensor)}
    with pytest.raises(ValueError, match=message):
        cache.load_state_dict(merge_extra_state(tensors, extras))
    after = {name: t for name, t in cache.state_dict().items() if isinstance(t, torch.Tensor)}
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_tensors_without_extra_state_load_only_non_strict_and_stay_correct():
    cache = _filled_sliding_cache()
    tensors, _ = split_extra_state(cache.state_dict())
    fresh = _sliding_cache(early=False)
    _run_sliding(fresh, ("step", _kv(random.Random(5), 1, 2), 0.0))  # allocated for batch 1, as the state
    fresh.reset()
    with pytest.raises(RuntimeError, match="_extra_state"):
        fresh.load_state_dict(tensors)
    fresh.load_state_dict(tensors, strict=False)  # the host counters are re-read from the device counter
    key, value = _kv(random.Random(4), 1, 2)
    for ours, expected in zip(fresh, cache):
        assert ours.get_seq_length() == expected.get_seq_length()
        torch.testing.assert_close(
            sdpa(key, *ours.update(key, value), ours.attention_mask),
            sdpa(key, *expected.update(key, value), expected.attention_mask),
            atol=0,
            rtol=0,
        )


def test_a_compiled_step_keeps_its_graphs_across_a_load():
    from cache_helpers import GraphCounter

    def make():
        return RollingKVCache([SlidingWindowLayer(2, 6, 2) for _ in range(2)])

    def chunk(cache, step, rng):
        key, value = _kv(rng, 1, 2)
        out = [step(layer, key, value) for layer in cache]
        cache.commit()
        return out

    def attend(layer, key, value):
        return sdpa(key, *layer.update(key, value), layer.attention_mask)

    counter = GraphCounter()
    torch._dynamo.reset()
    compiled = torch.compile(attend, backend=counter, fullgraph=True)
    try:
        source, target = make(), make()
        source.early_initialization(1, HEADS, HEAD_DIM, torch.float32, "cpu")
        target.early_initialization(1, HEADS, HEAD_DIM, torch.float32, "cpu")
        for seed in range(5):
            chunk(source, attend, random.Random(seed))
            chunk(target, compiled, random.Random(100 + seed))
        graphs = len(counter.graphs)
        target.load_state_dict(source.state_dict())
        for seed in range(5, 9):
            _same(chunk(target, compiled, random.Random(seed)), chunk(source, attend, random.Random(seed)))
    finally:
        torch._dynamo.reset()
    assert len(counter.graphs) == graphs <= 2  # no recompile: the same buffers, the same host flags


@pytest.mark.parametrize(
    "change",
    [lambda t: t.to(torch.float64), lambda t: t[:, :-1]],  # another dtype, another shape
    ids=["dtype", "shape"],
)
def test_a_bad_storage_tensor_in_a_later_layer_is_refused_before_the_first_layer_changes(change):
    source = _filled_sliding_cache()
    tensors, extras = split_extra_state(source.state_dict())
    tensors["layers.1.storage.keys"] = change(tensors["layers.1.storage.keys"]).contiguous()
    cache = _sliding_cache(early=False)
    _run_sliding(cache, ("step", _kv(random.Random(6), 1, 2), 0.0))  # allocated for batch 1, as the state
    cache.commit()
    before = {name: t.clone() for name, t in cache.state_dict().items() if isinstance(t, torch.Tensor)}
    with pytest.raises(ValueError, match=r"layers\.1.*storage\.keys"):
        cache.check_state_dict(merge_extra_state(tensors, extras))
    with pytest.raises(ValueError, match=r"storage\.keys"):
        cache.load_state_dict(merge_extra_state(tensors, extras))
    after = {name: t for name, t in cache.state_dict().items() if isinstance(t, torch.Tensor)}
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert cache[0].get_seq_length() == 2  # layer 0 kept its own stream, not the saved one (6 tokens)
