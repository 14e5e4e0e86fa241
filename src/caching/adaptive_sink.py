"""StreamDiffusionV2's adaptive sink: a KV cache whose sink frames are refreshed when the new frame no longer
resembles them, written by every denoising step in place (chenfengxu714/StreamDiffusionV2@c5a0f20,
`models/wan/causal_model.py:268-342`, `models/wan/causal_stream_inference.py:87-105`).

The buffer holds `sink + window` frames, as upstream's `num_kv_cache` (6 = a sink of `num_sink_tokens` 3 + 3):

    [ sink: frame slots 0 .. S-1 | ring: slots S .. S+W-1 ]          attention reads every filled slot

Per forward (each denoising step, `update`), for one batch row, exactly as upstream's per-block code:
1. decide (one-frame chunks only, `:284-299`): the cosine similarity of the new frame's mean key and mean value to
   each sink slot's (the buffer's first S frames as they are now, unwritten zeros included), averaged over K and V;
   if the lowest is below `threshold`, that sink slot's token end is put at the FRONT of the eviction queue;
2. while the buffer is filling (`:326-337`): the chunk goes right after what is written, and the end of the slot
   after it joins the BACK of the queue (once past the sink); once full (`:302-322`): the chunk goes into the slot
   ending at the queue's front, and every `forwards_per_chunk`-th such write pops the front (a ring slot goes to the
   back again, a sink slot leaves: the sink refreshed). Upstream counts those writes from the first one that finds
   the buffer full, which is the second step of the chunk that fills it: from then on each chunk's FIRST step pops,
   so its later steps write the next slot of the queue and the following chunk's first step overwrites them.
3. attention reads every filled slot (`:339-348`), the chunk's own included: no mask once full.

Pipelined denoising (`policy.in_flight_frames`, rolldiff's: upstream pipelines by its stream batch instead): the
chunks in flight live in a region after the written slots, `[filled, filled + n)` while the buffer fills,
`[capacity, capacity + n)` once full, written by every forward outside a context pass with no decision and no queue
move; attention reads the written slots and that region. `commit(num_tokens)` (`context_policy="last_step"`) then
writes the leaving chunk as ONE write of a sequential layer whose every write pops (`forwards_per_chunk=1`):
decided, and moved to the slot the queue picks. A context pass (`"rolling"`) writes its chunk that way itself. So
the committed slots are always what a sequential layer fed each committed chunk once would hold.

Compiled (pipelined only): a forward into the in-flight region decides nothing, so it traces whole. It reads the
fill from a device counter (`_filled_tokens`) and attends through the mask `slot < filled + n` over the whole buffer,
so its graph depends on the window's size and on one stored bool (`window_full`), never on how far the buffer has
filled; the decisions move to `commit(num_tokens)`, which runs outside the forward, eager. An update that decides (a
context pass, or any sequential write) sets `decides_on_host`, and a compiled step (`compile_cached_step`) runs that
one forward eager.

Sequentially there is no context pass: what the steps wrote stays (the stream's `context_policy="last_step"`). Keys
are stored after RoPE at their absolute positions (the model's `position_mode="absolute"`), as upstream compares
them.

The buffers are preallocated and written in place (`index_copy_` into slots; nothing is concatenated); the
decisions are host-side (one read of the device per block and step, as upstream's `.item()`), so a sequential layer
is eager only (`is_compileable` is False; pipelined, True for the in-flight writes). Not a transaction: a step writes
where upstream writes, a sink slot included once a refresh is decided, so an aborted chunk cannot be re-run (more
writes than `forwards_per_chunk` since the last commit are refused); `reset()` or loading a saved state starts over.
Batch 1 (upstream keeps one queue per row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_int, check_number
from .base import check_key_value, check_matches_buffer, check_positive
from .sliding_window import SlidingWindowLayer


@dataclass(frozen=True)
class AdaptiveSinkPolicy:
    """How an `AdaptiveSinkLayer` decides.

    `threshold`: upstream's `adapt_sink_threshold`, a cosine similarity in [-1, 1] (-1 never refreshes, as upstream's
    -1 turns the decision off). `forwards_per_chunk`: the cache writes of one chunk, its denoising steps plus one if a
    context pass runs (upstream's per-block `kv_cache["total_steps"]`, the count between two pops of the queue)."""

    threshold: float = 0.2
    forwards_per_chunk: int = 4
    in_flight_frames: int = 0  # `denoising="pipelined"`: the latent frames in flight, in a region after the slots

    def __post_init__(self) -> None:
        check_number("adaptive_sink_threshold", self.threshold, -1, 1, hint="a cosine similarity; -1 never refreshes")
        check_int("forwards_per_chunk", self.forwards_per_chunk, 1)
        check_int("in_flight_frames", self.in_flight_frames, 0, hint="0: not pipelined")


class AdaptiveSinkLayer(SlidingWindowLayer):
    """StreamDiffusionV2's cache of one block (see the module docstring).

    Args:
        sink_tokens: the sink (`num_sink_tokens` frames), whole frames, at least one.
        window_tokens: the slots after the sink; `sink_tokens + window_tokens` is upstream's `kv_cache_length`.
        chunk_tokens: the largest chunk (the first may be larger than the rest).
        frame_tokens: tokens per latent frame (the unit of the decision and of the slots).
        policy: the threshold and the writes per chunk; a plain attribute the loop may replace between chunks
            (upstream's stream batch denoises block 0 in 4 writes, then copies its cache into caches written once a
            chunk: `tests/test_recipes_streamdiffusionv2.py` spells it out).
    """

    can_rewind = False

    def __init__(
        self,
        sink_tokens: int,
        window_tokens: int,
        chunk_tokens: int,
        *,
        frame_tokens: int,
        policy: AdaptiveSinkPolicy,
    ) -> None:
        if not isinstance(policy, AdaptiveSinkPolicy):
            raise TypeError(f"`policy` must be an AdaptiveSinkPolicy, got {type(policy).__name__}.")
        in_flight = policy.in_flight_frames * check_positive("frame_tokens", frame_tokens)
        object.__setattr__(self, "_in_flight_tokens", in_flight)  # read by `_set_chunk_tokens` below
        super().__init__(sink_tokens, window_tokens, chunk_tokens)
        self.frame_tokens = check_positive("frame_tokens", frame_tokens)
        if sink_tokens < frame_tokens or sink_tokens % frame_tokens or window_tokens % frame_tokens:
            raise ValueError(
                f"The adaptive sink refreshes whole frames of {frame_tokens} tokens: `sink_tokens`={sink_tokens} and "
                f"`window_tokens`={window_tokens} must be whole frames, the sink at least one."
            )
        self.policy = policy
        self.is_compileable = self._in_flight_region  # the in-flight writes trace; the decided ones run eager
        self._reset_queue()

    def _set_chunk_tokens(self, chunk_tokens: int) -> None:
        """The largest chunk, inside the window; pipelined, an update may be the in-flight region (every chunk in
        flight), which may exceed the window: it lies after the slots."""
        super()._set_chunk_tokens(chunk_tokens)
        self.chunk_tokens = max(chunk_tokens, self._in_flight_tokens)

    @property
    def _in_flight_region(self) -> bool:
        return self._in_flight_tokens > 0

    @property
    def buffer_tokens(self) -> int:
        """The slots, and after them the in-flight region when pipelined."""
        return self.capacity + self._in_flight_tokens

    def _reset_queue(self) -> None:
        self.queue: list[int] = []  # token ends of the slots to write next, front first (upstream's `evict_idx[0]`)
        self.steps_left = self.policy.forwards_per_chunk  # upstream's `kv_cache["current_step"]`
        self._set_filled(0)
        self.written_end = 0  # the stream position after the last write (upstream's `global_end_index`)
        self.chunk_writes = 0  # writes since the last commit
        self.refreshes = 0  # sink slots rewritten by a newer frame since the last reset

    def _set_filled(self, tokens: int) -> None:
        """The one place the fill changes: `filled`, tokens written from slot 0 (upstream's `local_end_index`, at
        most the capacity; attention reads them, and pipelined the in-flight region starts there), its device twin
        (what a compiled in-flight write reads) and the stored `window_full` bool."""
        self.filled = tokens
        self._full = tokens >= self.capacity
        if getattr(self, "_filled_tokens", None) is not None:
            self._filled_tokens.fill_(tokens)

    def _allocate(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """The slots' buffers; pipelined, also the fill's device twin and a mask over the in-flight region too."""
        super()._allocate(batch, heads, head_dim, dtype, device)
        if self._in_flight_region:
            scratch = {
                "_filled_tokens": torch.tensor(self.filled, dtype=torch.long, device=device),
                "_slot_index": torch.arange(self.buffer_tokens, dtype=torch.long, device=device),
                "_mask": torch.zeros(self.buffer_tokens, dtype=torch.bool, device=device),
            }
            for name, tensor in scratch.items():
                self.register_buffer(name, tensor, persistent=False)

    # ----------------------------------------------------------------------------------------- the decision
    def _refresh_index(self, key: torch.Tensor, value: torch.Tensor) -> int | None:
        """The sink frame the new one-frame chunk should replace (upstream's `argmin` when the lowest mean
        similarity is below the threshold), else None. Reads the sink slots as they are, zeros included."""
        sink_frames = self.sink_tokens // self.frame_tokens
        written = self.filled // self.frame_tokens  # sink frames past it are unwritten: zeros, as upstream reads them
        similarities = []
        for new, stored in ((key, self.keys), (value, self.values)):
            sink_mean = stored[:1, : self.sink_tokens].reshape(sink_frames, self.frame_tokens, -1).mean(1)
            sink_mean[written:] = 0.0  # (pipelined, the in-flight chunks sit in those slots)
            new_mean = new.reshape(1, self.frame_tokens, -1).mean(1)
            similarities.append(torch.cosine_similarity(sink_mean, new_mean, dim=-1))  # (sink_frames,)
        average = (similarities[0] + similarities[1]) / 2
        if float(average.min()) < self.policy.threshold:
            return int(torch.argmin(average))
        return None

    def _target_end(self, num_pending: int) -> int:
        """Where this forward writes (the token end of its slots), moving the queue and counters as upstream."""
        chunk_end = self.committed_count + num_pending  # upstream's `current_end` (absolute tokens)
        written_end, self.written_end = self.written_end, chunk_end
        if chunk_end > self.capacity or self.filled >= self.capacity:  # the buffer is full: the queue decides
            self._set_filled(self.capacity)
            if not self.queue:
                raise RuntimeError(
                    "The adaptive sink's eviction queue is empty: no slot to write (a window too small)."
                )
            target = self.queue[0]
            if min(self.steps_left, self.policy.forwards_per_chunk) > 1:  # one write a chunk: every write pops
                self.steps_left -= 1
            else:
                popped = self.queue.pop(0)
                if popped > self.sink_tokens:  # a ring slot comes round again; a refreshed sink slot leaves
                    self.queue.append(popped)
                else:
                    self.refreshes += 1
                self.steps_left = self.policy.forwards_per_chunk
            return target
        self._set_filled(self.filled + chunk_end - written_end)  # a new chunk after what is written; a step: in place
        rolling_end = chunk_end + num_pending  # the end of the slot after this chunk's
        if self.sink_tokens < rolling_end <= self.capacity and (not self.queue or self.queue[-1] != rolling_end):
            self.queue.append(rolling_end)
        return self.filled

    # ----------------------------------------------------------------------------------------- the contract
    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decide, write the chunk `(1, tokens, heads, head_dim)` (keys after RoPE) where upstream writes it, and
        return the whole buffers `(1, buffer_tokens, heads, head_dim)`; attention reads `visible_prefix` of them.
        Pipelined, outside a context pass: the in-flight chunks, into their region (no decision)."""
        if key.ndim == 4 and key.shape[0] != 1:
            raise ValueError(
                f"The adaptive sink keeps one eviction queue per stream and takes batch 1, got batch {key.shape[0]}; "
                "run the rows as streams of their own."
            )
        if self._in_flight_region and not self._context_pass:
            return self._write_in_flight(key, value)
        if self.chunk_writes >= self.policy.forwards_per_chunk:
            raise RuntimeError(
                f"The adaptive sink took {self.chunk_writes} writes since the last commit, its chunk's "
                f"`forwards_per_chunk`={self.policy.forwards_per_chunk}: an aborted chunk cannot be re-run (its steps "
                "wrote in place, as upstream's); reset() the cache or load a saved state."
            )
        num_pending = self._check_write(key, value)
        keys, values = self._write_decided(key, value)
        self.pending_tokens, self.chunk_writes = num_pending, self.chunk_writes + 1
        self._stream_batch = 1
        return keys, values

    def _check_write(self, key: torch.Tensor, value: torch.Tensor) -> int:
        """A write's checks (the buffers allocated at the first); its tokens."""
        check_key_value(key, value)
        num_pending = key.shape[1]
        self._check_chunk(num_pending)
        if self.keys is None:
            _, _, heads, head_dim = key.shape
            self._allocate(1, heads, head_dim, key.dtype, key.device)
        check_matches_buffer("key", key, self.keys, dtype=self.compute_dtype, device=self.slot_positions.device)
        return num_pending

    def _write_decided(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One write as upstream's: decided (a one-frame chunk), into the slots the queue picks; the whole buffers."""
        num_pending = key.shape[1]
        if num_pending == self.frame_tokens:
            refresh = self._refresh_index(key, value)
            if refresh is not None:
                self.queue.insert(0, (refresh + 1) * self.frame_tokens)
        end = self._target_end(num_pending)
        offsets = self._offsets[:num_pending]  # preallocated scratch: the step allocates nothing
        slots = torch.add(offsets, end - num_pending, out=self._pending_slots[:num_pending])
        positions = torch.add(offsets, self.committed_count, out=self._pending_positions[:num_pending])
        self.slot_positions.index_copy_(0, slots, positions)
        self._mask[: self.filled].fill_(True)
        return self.storage.write(slots, key, value)

    def _write_in_flight(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunks in flight `(1, n, heads, head_dim)`, right after the written slots: no decision, no queue. Reads
        the fill from its device twin only (no host int a compiled step would guard on)."""
        num_pending = self._check_write(key, value)
        slots = torch.add(self._offsets[:num_pending], self._filled_tokens, out=self._pending_slots[:num_pending])
        region_end = torch.add(self._filled_tokens, num_pending, out=self._pending_end)
        torch.lt(self._slot_index, region_end, out=self._mask)  # the written slots and this region
        keys, values = self.storage.write(slots, key, value)
        self.pending_tokens, self._stream_batch = num_pending, 1
        return keys, values

    def check_partial_commit(self, num_tokens: int) -> None:
        if not self._in_flight_region:
            raise TypeError(
                "AdaptiveSinkLayer commits whole chunks: its eviction queue is popped once per chunk's writes "
                "(pipelined denoising commits the leaving chunk of its in-flight region: `policy.in_flight_frames`)."
            )
        super().check_partial_commit(num_tokens)
        if num_tokens % self.frame_tokens or num_tokens > self.window_tokens:
            raise ValueError(
                f"`num_tokens`={num_tokens} must be whole frames of {self.frame_tokens} tokens, at most the window's "
                f"{self.window_tokens}: the leaving chunk goes into the slots the queue picks."
            )

    def commit(self, num_tokens: int | None = None) -> None:
        """Make the pending chunk permanent. `num_tokens` (pipelined): the leaving chunk, the first `num_tokens` of
        the in-flight region, written as one write of a sequential layer (decided, into the slots the queue picks)."""
        if num_tokens is not None:
            self.check_partial_commit(num_tokens)
            self._commit_leaving(num_tokens)
        self._require_pending()
        committed = self.committed_count + self.pending_tokens
        self.pending_tokens, self.chunk_writes = 0, 0
        self._set_counters(committed, committed)

    def _commit_leaving(self, num_tokens: int) -> None:
        start = self.filled  # where the in-flight region starts
        key = self.keys[:1, start : start + num_tokens].clone()  # the region may be written over below
        value = self.values[:1, start : start + num_tokens].clone()
        self._write_decided(key, value)
        self.pending_tokens = num_tokens

    def reset(self) -> None:
        super().reset()
        self._reset_queue()

    # ----------------------------------------------------------------------------------------- for attention
    def visible_prefix(self, num_pending: int) -> int | None:
        """Attention reads slots `0 .. filled - 1`: the written prefix while filling, every slot once full (pipelined,
        outside a context pass: and the in-flight region right after them; compiled, through `attention_mask`
        instead, so the graph does not depend on the fill)."""
        if self._in_flight_region and not self._context_pass:
            return None if torch.compiler.is_compiling() else self.filled + num_pending
        return self.filled or None

    @property
    def window_full(self) -> bool:
        """Every slot written (a stored bool: a compiled step guards on it, not on the fill)."""
        return self._full

    @property
    def decides_on_host(self) -> bool:
        """The next update reads the device to decide where it writes (every write but a pipelined in-flight one):
        a compiled step runs that forward eager."""
        return not (self._in_flight_region and not self._context_pass)

    def get(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The K/V of every slot holding a committed token, ordered by position (a copy). A refresh leaves a frame's
        earlier step in the slot it was written to first: that slot is returned too, as attention reads it."""
        if self.keys is None:
            return None
        held = self.slot_positions[: self.filled]
        slots = torch.nonzero((held >= 0) & (held < self.committed_count)).flatten()
        if slots.numel() == 0:
            return None
        slots = slots[torch.argsort(held[slots], stable=True)]
        return self.storage.read(slots, 1)

    def get_seq_length(self) -> int:
        """Slots holding a committed token (a host read of the slot map)."""
        if self.keys is None:
            return 0
        held = self.slot_positions[: self.filled]
        return int(((held >= 0) & (held < self.committed_count)).sum())

    def advance(self, num_tokens: int) -> None:
        raise TypeError("The adaptive sink's slots follow its eviction queue: it cannot advance past a gap.")

    def check_crop(self, max_tokens: int) -> list[int]:
        raise TypeError("The adaptive sink evicts by its queue only: it cannot crop.")

    # ----------------------------------------------------------------------------------------- saving, loading
    def state_config(self) -> dict:
        # `forwards_per_chunk` is the loop's (a stream batch copies one chunk's cache into caches of one write each)
        return {**super().state_config(), "adaptive_threshold": self.policy.threshold}

    def host_state(self) -> dict:
        queue = {"queue": list(self.queue), "steps_left": self.steps_left, "filled": self.filled}
        queue["written_end"] = self.written_end
        return {**super().host_state(), **queue, "chunk_writes": self.chunk_writes, "refreshes": self.refreshes}

    def load_host_state(self, state) -> None:
        self.queue = [int(end) for end in state["queue"]]
        self.steps_left, self.chunk_writes = state["steps_left"], state["chunk_writes"]
        self._set_filled(state["filled"])
        self.refreshes, self.written_end = state["refreshes"], state["written_end"]
        super().load_host_state(state)

    def _refresh_mask(self, num_pending: int) -> None:
        """The mask after loading a state: the written slots (a forward writes its own)."""
        self._mask.zero_()
        self._mask[: self.filled].fill_(True)
