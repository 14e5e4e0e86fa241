"""Condition cache (GLM-Image's reference images): K/V written once, read at every conditional step.

One buffer per block, rows = batch samples, written in place:

    row r:  [ conditions of sample r // rows_per_sample | padding | current tokens ]
             0 ........................................ C ....... C + T

- "write": a batch-1 forward of one reference image; its K/V are appended to the current sample's
  conditions (several images per sample append; `next_sample()` moves on). These are the only
  tokens that ever become conditions: there is no pending/commit step a stray `commit()` could
  misuse, and `commit()` raises.
- "read": a denoising step's K/V (batch N) are written after the longest condition (C tokens) and
  attention reads one view `[conditions; current]` of the buffer: no per-step concatenation, no
  new K/V tensor. One written sample serves the whole batch, S samples serve N = k * S rows
  (sample s -> rows s*k .. s*k + k - 1, diffusers' `num_images_per_prompt` order). The layout is
  spread in place once, at the first read of a batch size; the buffer grows (once) if it is smaller.
- Samples may hold different condition lengths: the gap between a sample's conditions and C is
  masked out (`attention_mask`, True = attend); with equal lengths there is no mask at all.
- "skip" (the unconditional CFG branch) and `None`: the layer is not touched.
`max_tokens` (conditions + current tokens per row) fixes the capacity; a write or read that would
not fit raises before anything changes. Without it the buffer is sized at first use.

Memory: each block's buffer holds its conditions plus room for the current tokens, on every row. With
`shared_workspace=True` the blocks keep only their conditions (one row per sample, never repeated)
and share one `[conditions; current]` buffer into which each block copies its conditions at read
time (layers run one after another): diffusers' peak memory and copy traffic, still no allocation.
"""

from __future__ import annotations

import torch

from .base import CacheLayer, check_allocation_sizes, check_key_value, check_matches_buffer, check_positive
from .container import RollingKVCache
from .workspace import CacheWorkspace

CONDITION_MODES = ("write", "read", "skip")


def check_mode(mode: str | None) -> str | None:
    if mode is not None and mode not in CONDITION_MODES:
        raise ValueError(f"`mode` must be one of {CONDITION_MODES} or None, got {mode!r}.")
    return mode


def fill_key_mask(mask: torch.Tensor, lengths: list[int], rows_per_sample: int) -> None:
    """True everywhere except each row's gap between its sample's conditions and the longest sample's."""
    mask.fill_(True)
    longest = max(lengths)
    for sample, length in enumerate(lengths):
        mask[sample * rows_per_sample : (sample + 1) * rows_per_sample, length:longest] = False


class ConditionLayer(CacheLayer):
    """Args:
    max_tokens: conditions + current tokens one row holds (None: sized at first use).
    shared_workspace: keep only the conditions and read through the container's `CacheWorkspace`
        (shared by all layers of the cache; set by `RollingKVCache` via `share_workspace`).
    """

    def __init__(self, max_tokens: int | None = None, shared_workspace: bool = False) -> None:
        super().__init__()
        self.max_tokens = None if max_tokens is None else check_positive("max_tokens", max_tokens)
        self.shared_workspace = shared_workspace
        self.workspace: CacheWorkspace | None = None  # the container's, when `shared_workspace`
        self.register_buffer("key_mask", None, persistent=False)  # (rows, capacity) bool, True = attend
        self.mode: str | None = None
        self.sample_index = 0  # the sample "write" appends to
        self.condition_lengths: list[int] = []  # tokens per written sample
        self.rows_per_sample = 1  # current layout of the buffer's rows
        self.attention_mask: torch.Tensor | None = None  # (N, C + T) after a read with unequal lengths, else None
        self._mask_lengths: tuple[int, ...] | None = None  # layout the mask was built for
        self._fixed_rows = False  # early_initialization fixes the batch

    # ------------------------------------------------------------------------------------ allocation
    @property
    def fixed_rows(self) -> bool:
        """Whether `early_initialization` fixed the batch rows (a larger batch is then refused)."""
        return self._fixed_rows

    def early_initialization(
        self, batch_size: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        check_allocation_sizes(batch_size, num_heads, head_dim)
        if self.max_tokens is None:
            raise ValueError(
                "`early_initialization` needs `max_tokens` (conditions + current tokens) at construction."
            )
        self._allocate(batch_size, self.max_tokens, num_heads, head_dim, dtype, torch.device(device))
        self._fixed_rows = True
        if self.workspace is not None:
            self._reserve_workspace(batch_size, self.max_tokens, num_heads, head_dim, dtype, torch.device(device))

    def share_workspace(self, workspace: CacheWorkspace, work_parity: int = 0) -> None:
        """The container's scratch, used only by a layer built with `shared_workspace=True`."""
        if self.shared_workspace:
            self.workspace = workspace

    def _reserve_workspace(self, rows: int, tokens: int, heads: int, head_dim: int, dtype, device) -> None:
        """Grow the shared `[conditions; current]` K/V and key-mask buffers if this read needs more."""
        for role in ("condition_keys", "condition_values"):
            self.workspace.reserve(role, (rows, tokens, heads, head_dim), dtype, device)
        self.workspace.reserve("condition_mask", (rows, tokens), torch.bool, device)

    def _allocate(self, rows: int, tokens: int, heads: int, head_dim: int, dtype, device) -> None:
        keys = torch.zeros(rows, tokens, heads, head_dim, dtype=dtype, device=device)  # zeros: padding stays finite
        values = torch.zeros_like(keys)
        if self.keys is not None:  # growing: keep what is written
            old_rows, old_tokens = self.keys.shape[:2]
            keys[:old_rows, :old_tokens] = self.keys
            values[:old_rows, :old_tokens] = self.values
        self.keys, self.values = keys, values
        if not self.shared_workspace:  # the shared workspace holds the mask of a read
            self.key_mask = torch.ones(rows, tokens, dtype=torch.bool, device=device)
        self._mask_lengths = None

    def _check_capacity(self, tokens: int) -> None:
        if self.max_tokens is not None and tokens > self.max_tokens:
            raise ValueError(
                f"the condition cache needs {tokens} tokens per row (conditions + current tokens) but holds "
                f"`max_tokens`={self.max_tokens}; build it with a larger `max_tokens` (or None to size it at first use)."
            )

    def _reserve(self, key: torch.Tensor, rows: int, tokens: int) -> None:
        """Make room for `rows` x `tokens` (growing the buffer), or raise before changing anything."""
        self._check_capacity(tokens)
        if self.keys is None:
            self._allocate(rows, self.max_tokens or tokens, key.shape[2], key.shape[3], key.dtype, key.device)
            return
        check_matches_buffer("key", key[:1], self.keys[:1])  # heads, head_dim, dtype, device; rows grow
        if rows > self.keys.shape[0] and self._fixed_rows:
            raise ValueError(
                f"batch {rows} exceeds the `batch_size`={self.keys.shape[0]} the condition cache was initialised with."
            )
        if rows > self.keys.shape[0] or tokens > self.keys.shape[1]:
            rows, tokens = max(rows, self.keys.shape[0]), max(tokens, self.keys.shape[1])
            self._allocate(rows, tokens, self.keys.shape[2], self.keys.shape[3], self.keys.dtype, self.keys.device)

    def _longest(self) -> int:
        return max(self.condition_lengths, default=0)

    # ------------------------------------------------------------------------------------ the modes
    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Act on `mode`: store conditions ("write"), read `[conditions; current]` ("read"), or pass through."""
        check_key_value(key, value)
        self.attention_mask = None
        if self.mode == "write":
            self._write(key, value)
        elif self.mode == "read" and self._longest() > 0:
            return self._read(key, value)
        return key, value  # write: the reference attends to itself only; skip / None: no conditions

    def _write(self, key: torch.Tensor, value: torch.Tensor) -> None:
        if key.shape[0] != 1:
            raise ValueError(
                f"condition K/V are written one sample at a time (batch 1), got batch {key.shape[0]}; "
                "call `next_sample()` between samples."
            )
        sample, tokens = self.sample_index, key.shape[1]
        lengths = self.condition_lengths + [0] * (sample + 1 - len(self.condition_lengths))
        start = lengths[sample]
        self._reserve(
            key, rows=max(len(lengths), len(self.condition_lengths) * self.rows_per_sample), tokens=start + tokens
        )
        self._spread(1)  # written after a read: samples back to one row each
        self.keys[sample, start : start + tokens] = key[0]
        self.values[sample, start : start + tokens] = value[0]
        lengths[sample] = start + tokens
        self.condition_lengths = lengths

    def _read(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, tokens = key.shape[:2]
        samples, longest = len(self.condition_lengths), self._longest()
        if batch % samples:
            raise ValueError(
                f"Cannot match {samples} cached samples to batch size {batch}: "
                "the batch must be a multiple of the number of samples written."
            )
        if self.shared_workspace:
            return self._read_through_workspace(key, value)
        self._reserve(key, rows=max(batch, samples * self.rows_per_sample), tokens=longest + tokens)
        self._spread(batch // samples)
        end = longest + tokens
        self.keys[:batch, longest:end] = key
        self.values[:batch, longest:end] = value
        if len(set(self.condition_lengths)) > 1:
            self._build_mask()
            self.attention_mask = self.key_mask[:batch, :end]
        return self.keys[:batch, :end], self.values[:batch, :end]

    def _read_through_workspace(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy this layer's conditions (sample s -> rows s*k .. s*k+k-1) and the current K/V into the workspace."""
        batch, tokens, heads, head_dim = key.shape
        samples, longest = len(self.condition_lengths), self._longest()
        end = longest + tokens
        self._check_capacity(end)
        if self.workspace is None:
            raise RuntimeError(
                "a ConditionLayer with `shared_workspace=True` reads through its container's workspace; "
                "build it inside a ConditionKVCache (or call `share_workspace(CacheWorkspace())`)."
            )
        check_matches_buffer("key", key[:1], self.keys[:1])
        self._reserve_workspace(batch, end, heads, head_dim, key.dtype, key.device)
        shape = (batch, end, heads, head_dim)
        keys = self.workspace.view("condition_keys", shape, key.dtype, key.device)  # contiguous prefix views
        values = self.workspace.view("condition_values", shape, key.dtype, key.device)
        for buffer, conditions, current in ((keys, self.keys, key), (values, self.values, value)):
            rows = buffer[:, :longest].unflatten(0, (samples, batch // samples))  # (S, k, C, H, D) view
            rows.copy_(conditions[:samples, None, :longest])  # broadcast over k: no repeated copy is allocated
            buffer[:, longest:] = current
        if len(set(self.condition_lengths)) > 1:
            mask = self.workspace.view("condition_mask", (batch, end), torch.bool, key.device)
            fill_key_mask(mask, self.condition_lengths, batch // samples)
            self.attention_mask = mask
        return keys, values

    def _spread(self, rows_per_sample: int) -> None:
        """Lay sample s on rows s*k .. s*k + k - 1 (k = rows_per_sample), moving rows in place."""
        if rows_per_sample == self.rows_per_sample:
            return
        longest, old = self._longest(), self.rows_per_sample
        for sample in range(1, len(self.condition_lengths)):  # compact: sample s -> row s (ascending is safe)
            self._copy_row(sample * old, sample, longest)
        for sample in reversed(range(len(self.condition_lengths))):  # expand (descending is safe)
            for row in range(sample * rows_per_sample, (sample + 1) * rows_per_sample):
                if row != sample:
                    self._copy_row(sample, row, longest)
        self.rows_per_sample = rows_per_sample
        self._mask_lengths = None

    def _copy_row(self, source: int, target: int, tokens: int) -> None:
        if source != target:
            self.keys[target, :tokens] = self.keys[source, :tokens]
            self.values[target, :tokens] = self.values[source, :tokens]

    def _build_mask(self) -> None:
        """Mask each row's gap between its sample's conditions and the longest; rebuilt only on change."""
        layout = (self.rows_per_sample, *self.condition_lengths)
        if self._mask_lengths == layout:
            return
        fill_key_mask(self.key_mask, self.condition_lengths, self.rows_per_sample)
        self._mask_lengths = layout

    # ------------------------------------------------------------------------------------ the contract
    def next_sample(self) -> None:
        """Later writes go to the next batch sample."""
        self.sample_index += 1

    def commit(self) -> None:
        raise RuntimeError(
            "ConditionLayer.commit(): conditions are committed as they are written in 'write' mode; "
            "tokens read in 'read' mode are the current step's and never become conditions."
        )

    def get(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A copy of the conditions, one row per buffer row of the current layout (padding included)."""
        if self._longest() == 0:
            return None
        rows = len(self.condition_lengths) * self.rows_per_sample
        return self.keys[:rows, : self._longest()].clone(), self.values[:rows, : self._longest()].clone()

    def reset(self) -> None:
        """Forget the conditions and the mode, keeping the buffers (same `data_ptr`)."""
        self.mode = None
        self.sample_index = 0
        self.condition_lengths = []
        self.rows_per_sample = 1
        self.attention_mask = None
        self._mask_lengths = None
        self.pending_tokens = 0

    def get_seq_length(self) -> int:
        """Condition tokens of the longest sample."""
        return self._longest()

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.keys, self.values, self.key_mask) if t is not None]

    # ------------------------------------------------------------------------------------ saving, loading
    buffers_grow = True  # sized at first use and grown by later writes and reads

    def state_config(self) -> dict:
        return {"max_tokens": self.max_tokens, "shared_workspace": self.shared_workspace}

    def host_state(self) -> dict:
        return {
            "pending_tokens": self.pending_tokens,
            "mode": self.mode,
            "sample_index": self.sample_index,
            "condition_lengths": list(self.condition_lengths),
            "rows_per_sample": self.rows_per_sample,
            "fixed_rows": self._fixed_rows,
        }

    def load_host_state(self, state) -> None:
        self.pending_tokens, self.mode, self.sample_index = (
            state["pending_tokens"],
            state["mode"],
            state["sample_index"],
        )
        self.condition_lengths, self.rows_per_sample = list(state["condition_lengths"]), state["rows_per_sample"]
        self._fixed_rows = state["fixed_rows"]
        self.attention_mask, self._mask_lengths = None, None  # rebuilt by the next read

    def allocate_like(self, tensors, extra) -> None:
        rows, tokens, heads, head_dim = tensors["keys"].shape
        keys = tensors["keys"]
        self.keys = self.values = None  # another size: allocated afresh, not grown
        self._allocate(rows, tokens, heads, head_dim, keys.dtype, keys.device)


class ConditionKVCache(RollingKVCache):
    """One `ConditionLayer` per block, with diffusers' `GlmImageKVCache` verbs.

    `set_mode("write" | "read" | "skip" | None)`, `next_sample()`, `clear()`, `cache[i]`; also
    everything `RollingKVCache` offers (`reset`, `early_initialization`, `memory_bytes`, ...).
    """

    def __init__(self, num_layers: int, max_tokens: int | None = None, shared_workspace: bool = False) -> None:
        check_positive("num_layers", num_layers)
        super().__init__([ConditionLayer(max_tokens, shared_workspace) for _ in range(num_layers)])

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def max_tokens(self) -> int | None:
        return self.layers[0].max_tokens

    @property
    def mode(self) -> str | None:
        return self.layers[0].mode

    @property
    def condition_lengths(self) -> list[int]:
        """Condition tokens per written sample (the same in every layer)."""
        return list(self.layers[0].condition_lengths)

    def set_mode(self, mode: str | None) -> None:
        check_mode(mode)
        for layer in self.layers:
            layer.mode = mode

    def next_sample(self) -> None:
        for layer in self.layers:
            layer.next_sample()

    def clear(self) -> None:
        """diffusers' name for `reset()`: forget conditions and mode; the buffers are kept for the next call."""
        self.reset()

    def check_fits(self, condition_tokens: list[int], current_tokens: int, batch_size: int = 1) -> None:
        """Raise (before any work) if conditions of these per-sample lengths plus `current_tokens` exceed
        `max_tokens`, or `batch_size` exceeds the batch the cache was allocated for ahead."""
        layer = self.layers[0]
        if layer.fixed_rows and batch_size > layer.keys.shape[0]:
            raise ValueError(
                f"batch {batch_size} exceeds the `batch_size`={layer.keys.shape[0]} the condition cache was "
                "allocated for; allocate it for the largest batch (prompts x num_images_per_prompt)."
            )
        needed = max(condition_tokens, default=0) + current_tokens
        if self.max_tokens is not None and needed > self.max_tokens:
            raise ValueError(
                f"the condition cache holds `max_tokens`={self.max_tokens} per sample, but the reference images need "
                f"{max(condition_tokens, default=0)} condition tokens + {current_tokens} current tokens = {needed}; "
                "use smaller reference images or a cache with a larger `max_tokens`."
            )
