"""Library chatter kept off stderr while a command runs: stderr is for our progress bar and errors."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def quiet_libraries() -> Iterator[None]:
    """Keep stderr for our progress bar and errors: no per-component loading bars or library chatter."""
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    saved = [
        (lib, lib.get_verbosity(), lib.is_progress_bar_enabled()) for lib in (diffusers_logging, transformers_logging)
    ]
    for lib, _, _ in saved:
        lib.set_verbosity_error()
        lib.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            # diffusers passes huggingface_hub an argument it deprecated; the user can do nothing about it.
            warnings.filterwarnings("ignore", message=".*local_dir_use_symlinks.*", category=UserWarning)
            yield
    finally:  # `main` may run inside a bigger program (or a test session): leave it as it was
        for lib, verbosity, bars in saved:
            lib.set_verbosity(verbosity)
            if bars:
                lib.enable_progress_bar()
