"""Number and kind checks for arguments, in one place: every module of rolldiff checks its arguments here.

One rule for errors: a value of the wrong kind (a float, a string or a bool where an int is wanted) raises
`ArgumentKindError`, a value of the right kind outside what is allowed raises `ValueError`; both messages name
the argument, the value received and what is allowed. `ArgumentKindError` is a `TypeError` that is also a
`ValueError`, so callers that catch `ValueError` for "a bad argument" (the CLI, the demo) see every refusal.

`bool` is never a number here: `True` is an int in Python, but never a frame count, a step or a scale.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any


class ArgumentKindError(TypeError, ValueError):
    """An argument of the wrong kind (type), named in the message."""


class ModelNotFoundError(ValueError):
    """`--model` names neither a pipeline folder nor a loadable Hugging Face Hub repository (raised by
    `rolldiff.defaults`; here, in a module that imports nothing heavy, so the command line catches it without
    importing torch)."""


def is_number(value: Any) -> bool:
    """A real number that is not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int(value: Any) -> bool:
    """An integer (Python or numpy) that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _hint(hint: str) -> str:
    return f" ({hint})" if hint else ""


def check_int(name: str, value: Any, lowest: int | None = 1, highest: int | None = None, hint: str = "") -> int:
    """`value` as an int in [`lowest`, `highest`] (either bound may be None); `hint` says what the value means."""
    allowed = _int_range(lowest, highest)
    if not is_int(value):
        raise ArgumentKindError(f"`{name}` must be {allowed}{_hint(hint)}, got {value!r} ({type(value).__name__}).")
    if (lowest is not None and value < lowest) or (highest is not None and value > highest):
        raise ValueError(f"`{name}` must be {allowed}{_hint(hint)}, got {value!r}.")
    return int(value)


def _int_range(lowest: int | None, highest: int | None) -> str:
    if highest is not None:
        return f"an int from {lowest} to {highest}" if lowest is not None else f"an int <= {highest}"
    if lowest == 1:
        return "a positive int"
    return "an int" if lowest is None else f"an int >= {lowest}"


def check_number(
    name: str,
    value: Any,
    lowest: float | None = None,
    highest: float | None = None,
    *,
    above: bool = False,
    below: bool = False,
    hint: str = "",
) -> float:
    """`value` as a finite float in the range [`lowest`, `highest`]; `above` / `below` make the bound open
    (`lowest < value`, `value < highest`)."""
    allowed = _number_range(lowest, highest, above, below)
    if not is_number(value):
        raise ArgumentKindError(f"`{name}` must be {allowed}{_hint(hint)}, got {value!r} ({type(value).__name__}).")
    too_low = lowest is not None and (value <= lowest if above else value < lowest)
    too_high = highest is not None and (value >= highest if below else value > highest)
    if not math.isfinite(value) or too_low or too_high:
        raise ValueError(f"`{name}` must be {allowed}{_hint(hint)}, got {value!r}.")
    return float(value)


def _number_range(lowest: float | None, highest: float | None, above: bool, below: bool) -> str:
    if lowest is not None and highest is not None:
        return f"a number in {'(' if above else '['}{lowest:g}, {highest:g}{')' if below else ']'}"
    if lowest is not None:
        return f"a finite number {'>' if above else '>='} {lowest:g}"
    if highest is not None:
        return f"a finite number {'<' if below else '<='} {highest:g}"
    return "a finite number"


def check_flag(name: str, value: Any) -> bool:
    """`value` as a bool (1 and "yes" are not flags)."""
    if not isinstance(value, bool):
        raise ArgumentKindError(f"`{name}` must be True or False, got {value!r}.")
    return value


def check_choice(name: str, value: Any, allowed: Collection, hint: str = "") -> Any:
    """`value` if it is one of `allowed`; the message lists them."""
    try:
        known = value in allowed
    except TypeError:  # an unhashable value asked of a set or dict
        known = False
    if not known:
        raise ValueError(f"`{name}` must be one of {tuple(allowed)}{_hint(hint)}, got {value!r}.")
    return value


def check_lora_source(source: str | os.PathLike) -> None:
    """A LoRA given as a path exists and is a safetensors file or a folder (a pickle is never read); a Hub id passes.
    Raises ValueError naming the source."""
    text = str(source)
    path = Path(text).expanduser()
    is_file_name = path.suffix in (".safetensors", ".pt", ".pth", ".bin", ".ckpt")
    if (looks_like_a_path(text) or is_file_name) and not path.exists():
        raise ValueError(f"no such file or folder {text!r}")
    if path.is_file() and path.suffix != ".safetensors":
        raise ValueError(
            f"{text!r}: only .safetensors files are read (a {path.suffix or 'suffix-less'} file may be a pickle, "
            "which can run code); save the LoRA as safetensors"
        )


def looks_like_a_path(text: str) -> bool:
    """A string meant as a local path rather than a Hub id ("name" or "org/name"): it starts with ".", "/" or "~",
    has more than one "/", or a backslash. A missing path of that form is "no such folder", not a bad repo id."""
    return text.startswith((".", "/", "~")) or text.count("/") > 1 or "\\" in text
