"""Invariants of `SlidingWindowLayer` as properties: random walks over its public operations.

Each walk draws a geometry (sink, window, chunk) and then a few dozen operations among `update` (chunks of
1 .. chunk_tokens tokens, several denoising steps, or an aborted chunk followed by a smaller one), `commit`,
`rewind`, `crop` and `reset`. After every operation the layer is compared with `NaiveWindow`, a dictionary of
the tokens a ring of `window` slots still stores (a write displaces the token of its slot) and the rule of
which of them a chunk sees. The promises checked:
- the mask selects exactly the reference's visible tokens, with their values (never a stale or rewound one);
- `window_full` => the mask of a full chunk is all True (the model then drops the mask);
- `visible_prefix(n)` = k => the visible keys are exactly slots 0 .. k-1;
- without rewinds or crops, `window_full` and `visible_prefix` are on exactly when the arithmetic says so.
"""

import random

import pytest
import torch

from rolldiff.caching import SlidingWindowLayer

NUM_WALKS = 800
STEPS_PER_WALK = 60


class NaiveWindow:
    """Tokens a sink + ring cache still stores, by position, and which of them a chunk attends to."""

    def __init__(self, sink: int, window: int, chunk: int) -> None:
        self.sink, self.window, self.chunk = sink, window, chunk
        self.committed = 0
        self.stored: dict[int, float] = {}  # position -> value of every token still in its slot

    def _same_slot(self, p: int, q: int) -> bool:
        if p < self.sink or q < self.sink:
            return p == q
        return (p - q) % self.window == 0

    def write(self, positions: range, values: list[float]) -> None:
        for position, value in zip(positions, values):
            self.stored = {q: v for q, v in self.stored.items() if not self._same_slot(q, position)}
            self.stored[position] = value

    def window_start(self) -> int:
        return max(self.sink, self.committed - (self.window - self.chunk))

    def visible(self, num_pending: int) -> dict[int, float]:
        """Tokens a chunk of `num_pending` tokens at `committed` attends to (the sink, the window, itself)."""
        end = self.committed + num_pending
        return {p: v for p, v in self.stored.items() if p < end and (p < self.sink or p >= self.window_start())}

    def rewindable(self) -> int:
        return max(self.committed - self.window_start(), 0)

    def crop(self, max_tokens: int) -> None:
        """Evict the oldest visible window tokens down to `max_tokens` held, and every older stored one."""
        held = sorted(self.visible(0))
        window = [p for p in held if p >= self.sink]
        evicted = window[: max(len(held) - max_tokens, 0)]
        if evicted:
            self.stored = {p: v for p, v in self.stored.items() if p < self.sink or p > evicted[-1]}


def _check_update(layer: SlidingWindowLayer, naive: NaiveWindow, num_pending: int, key: torch.Tensor) -> None:
    keys, _ = layer.update(key, -key)
    mask = layer.attention_mask
    seen = dict(zip(layer.key_positions()[mask].tolist(), keys[0, mask, 0, 0].tolist()))
    assert seen == naive.visible(num_pending)  # exactly the visible tokens, each with its own value
    if layer.window_full and num_pending == layer.chunk_tokens:
        assert bool(mask.all())  # the promise the model relies on when it drops the mask
    prefix = layer.visible_prefix(num_pending)
    if prefix is not None:
        assert prefix == naive.committed + num_pending
        assert bool(mask[:prefix].all()) and not bool(mask[prefix:].any())
        assert layer.key_positions()[:prefix].tolist() == list(range(prefix))


def _check_committed(layer: SlidingWindowLayer, naive: NaiveWindow) -> None:
    visible = naive.visible(0)
    held = layer.get()
    values = [] if held is None else held[0][0, :, 0, 0].tolist()
    assert values == [visible[p] for p in sorted(visible)]
    assert layer.get_seq_length() == len(visible)


def _walk(seed: int) -> None:
    rng = random.Random(seed)
    chunk = rng.randint(1, 4)
    sink, window = rng.randint(0, 4), rng.randint(chunk, chunk + 6)
    layer = SlidingWindowLayer(sink, window, chunk if rng.random() < 0.7 else None)
    naive = NaiveWindow(sink, window, chunk)
    pending, clean, next_value = 0, True, 1.0  # clean: no rewind or crop since the last reset
    for _ in range(STEPS_PER_WALK):
        op = rng.choices(["update", "commit", "rewind", "crop", "reset"], weights=[8, 6, 4, 1, 1])[0]
        if layer.chunk_tokens is None and op != "update":
            continue
        if op == "update":
            first = layer.chunk_tokens is None
            if first or rng.random() < 0.6:  # mostly full chunks, some shorter ones and aborted chunks
                num_pending = pending or chunk
            else:
                num_pending = rng.randint(1, chunk)
            values = [next_value + i for i in range(num_pending)]
            next_value += num_pending
            naive.write(range(naive.committed, naive.committed + num_pending), values)
            _check_update(layer, naive, num_pending, torch.tensor(values).view(1, num_pending, 1, 1))
            pending = num_pending
        elif op == "commit" and pending:
            layer.commit()
            naive.committed += pending
            pending = 0
        elif op == "rewind" and not pending and naive.rewindable():
            num_tokens = rng.randint(1, naive.rewindable())
            layer.rewind(num_tokens)
            naive.committed -= num_tokens
            clean = False
        elif op == "crop" and not pending and naive.committed:
            held = len(naive.visible(0))
            max_tokens = rng.randint(min(naive.committed, sink), held)
            layer.crop(max_tokens)
            naive.crop(max_tokens)
            clean = clean and max_tokens == held
        elif op == "reset":
            layer.reset()
            naive.stored, naive.committed, pending, clean = {}, 0, 0, True
        if not pending:
            _check_committed(layer, naive)
        if clean and not pending:  # the flags are not merely conservative: on whenever the arithmetic allows
            assert layer.window_full == (naive.committed >= sink + window - chunk)
            assert (layer.visible_prefix(1) is not None) == (naive.committed + chunk <= sink + window)


@pytest.mark.parametrize("first_seed", range(0, NUM_WALKS, NUM_WALKS // 4))
def test_random_walks_keep_the_mask_exact_and_the_window_full_promise(first_seed):
    for seed in range(first_seed, first_seed + NUM_WALKS // 4):
        _walk(seed)


def test_the_first_chunk_after_a_rewind_reads_no_stale_slot():
    """sink 3, window 9, chunk 3: 5 chunks, rewind 6; slots 3..5 still hold the rewound tokens 12..14."""
    layer = SlidingWindowLayer(sink_tokens=3, window_tokens=9, chunk_tokens=3)
    for i in range(5):
        chunk = torch.arange(3 * i, 3 * i + 3, dtype=torch.float32).view(1, 3, 1, 1)
        layer.update(chunk, chunk)
        layer.commit()
    assert layer.window_full
    layer.rewind(6)
    layer.update(torch.zeros(1, 3, 1, 1), torch.zeros(1, 3, 1, 1))
    assert layer.attention_mask.tolist() == [True] * 3 + [False] * 3 + [True] * 6
    assert not layer.window_full  # so the model keeps the mask
    layer.commit()
    layer.update(torch.zeros(1, 3, 1, 1), torch.zeros(1, 3, 1, 1))  # the re-cache writes the stale slots again
    layer.commit()
    assert layer.window_full
