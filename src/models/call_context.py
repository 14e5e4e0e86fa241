"""Per-call state for attention processors, bound for one forward and never stored on the shared model.

A model owns one `CallContextSlot` (a `threading.local`), and its processors hold a reference to it.
`forward` binds the call's context (cache layers, positions, masks) with `bind_call_context`, runs
diffusers' own forward, and unbinds in `finally`. Each thread sees only its own binding, so one
model instance serves concurrent streams; `torch.compile(fullgraph=True)` traces the attribute reads
(unlike `contextvars`, which dynamo cannot trace).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class CallContextSlot(threading.local):
    """Holds the context of the forward running in this thread (`None` outside a call)."""

    def __init__(self) -> None:
        # threading.local runs __init__ again in every thread that touches the slot: each starts unbound,
        # and the attribute always exists (dynamo guards on the instance dict, not on a class default).
        self.context: Any = None


def bind_call_context(slot: CallContextSlot, context: Any, function: Callable[..., T], *args, **kwargs) -> T:
    """Run `function(*args, **kwargs)` with `slot.context = context`, restoring the previous binding after."""
    previous = slot.context
    slot.context = context
    try:
        return function(*args, **kwargs)
    finally:
        slot.context = previous
