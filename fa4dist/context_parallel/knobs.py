"""The context-parallel engine's environment knobs (``FA4DIST_RING_STEPS_PER_LAUNCH``,
``FA4DIST_ULYSSES_CHUNKS``): read and checked here; each is part of a call's agreed signature, so that ranks that
read different values fail the agreement check together instead of posting different messages."""

from __future__ import annotations

import os
from typing import Optional


def env_int(name: str, default: int, minimum: int, maximum: Optional[int], meaning: str) -> int:
    """The int in environment variable ``name`` (``default`` when unset), in [minimum, maximum] (no maximum: None);
    anything else raises naming the variable, the range and ``meaning``."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum or maximum is not None and value > maximum:
        span = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an int {span} ({meaning}), got {text!r}")
    return value
