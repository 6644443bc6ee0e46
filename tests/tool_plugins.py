"""Server-side tools for the tests (``--tools tests.tool_plugins:TOOLS``): one that answers,
one that raises, one that hangs, one whose result JSON cannot hold, one that is slow."""

from __future__ import annotations

import threading
import time
from typing import Literal

HANG = threading.Event()
"""Set to let :func:`hang` return (tests set it when they are done with it)."""


def switch_light(room: str, state: Literal["on", "off"]) -> dict[str, str]:
    """Switch the light in a room on or off.

    Args:
        room: the room, e.g. "kitchen".
        state: "on" or "off".
    """
    return {"room": room, "state": state}


def explode(reason: str = "") -> str:
    """A tool that always fails.

    Args:
        reason: why it fails.
    """
    raise RuntimeError(f"exploded {reason}".strip())


def hang() -> str:
    """A tool that never answers (until the test lets it go)."""
    HANG.wait(120)
    return "let go"


def weird() -> object:
    """A tool whose result is not JSON."""
    return object()


def slow(seconds: float) -> str:
    """A tool that answers after a while.

    Args:
        seconds: how long it takes.
    """
    time.sleep(seconds)
    return "done"


TOOLS = [switch_light, explode, hang, weird, slow]
