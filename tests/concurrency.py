"""Shared by the "one model, many streams" tests: run calls on threads at once, compare with running alone."""

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch


def run_together(call: Callable[..., Any], arguments: Sequence[tuple]) -> list[Any]:
    """`call(*args)` for every `args`, each on its own thread, all released at once; results in order."""
    results: list[Any] = [None] * len(arguments)
    barrier = threading.Barrier(len(arguments))

    def run(index: int) -> None:
        barrier.wait()
        with torch.no_grad():  # grad mode is per thread
            results[index] = call(*arguments[index])

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(arguments))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(result is not None for result in results), "a thread failed; see its traceback above"
    return results


def assert_same_as_alone(together: Any, alone: Any) -> None:
    """Equal to fp32 rounding. Threads change no arithmetic, but MKL's GEMM may round differently with its
    buffers' memory alignment (bitwise reproducible only under MKL_CBWR), which concurrent allocation changes; a
    stream reading another's state differs at O(1), a million times this tolerance."""
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)
