"""The requests of ``voxpipe bench tools`` (issue 32): spoken-style text turns, each needing
one of six tools or none, with the arguments a right call carries.

The tools: the built-ins ``get_time``, ``set_timer``, ``calculate``
(:mod:`pipeline.tools.builtins`), and two stubs defined here, ``get_weather`` and
``switch_light`` (the shape docs/TOOLS.md shows; they never run: the bench only reads the
calls). "none" is chit-chat and general questions that must call nothing, some of them with a
tool's word in them ("time", "light", "weather").

Arguments are checked leniently (:func:`args_ok`): a timer by its total duration (``minutes=5``
or ``seconds=300``), a city or room by the expected word in it, case-insensitive, a
calculation by the value of its expression (within 0.01).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.tools.builtins import calculate, get_time, set_timer
from pipeline.tools.spec import spec_from_callable
from pipeline.tools.types import ToolSpec

TOLERANCE = 0.01
"""How far a calculation's value or a timer's length (s) may be from the expected one."""


def get_weather(city: str) -> dict[str, Any]:
    """Get the current weather and today's forecast for a city.

    Args:
        city: the city, e.g. "Paris".
    """
    return {"city": city, "sky": "cloudy", "temperature_c": 14}  # a stub: the bench never runs it


def switch_light(room: str, state: Literal["on", "off"]) -> dict[str, str]:
    """Switch the light in a room on or off.

    Args:
        room: the room, e.g. "kitchen".
        state: "on" or "off".
    """
    return {"room": room, "state": state}  # a stub: the bench never runs it


TOOLS: dict[str, Callable[..., Any]] = {"time": get_time, "timer": set_timer, "calculator": calculate,
                                        "weather": get_weather, "lights": switch_light}
"""The bench's tools by short name → function (offered in this order)."""


def tool_specs() -> tuple[ToolSpec, ...]:
    """The specs offered with every request, as ``voxpipe serve`` builds them
    (:func:`~pipeline.tools.spec.spec_from_callable`)."""
    return tuple(spec_from_callable(fn) for fn in TOOLS.values())


@dataclass(frozen=True, slots=True)
class Case:
    """One request.

    Attributes:
        text: what the person says (as the ASR would write it).
        tool: the tool a right reply calls (``get_time``, ...); None: it must call nothing.
        args: what :func:`args_ok` checks: ``seconds`` (a timer's total, s), ``result`` (a
            calculation's value), ``city``, ``room`` and ``state``; ``{}``: any arguments.
    """

    text: str
    tool: str | None
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """The tool's short name (``time``, ``timer``, ...) or ``none``."""
        return next((k for k, fn in TOOLS.items() if fn.__name__ == self.tool), "none")


def _t(text: str) -> Case:
    return Case(text, "get_time")


def _timer(text: str, seconds: float) -> Case:
    return Case(text, "set_timer", {"seconds": seconds})


def _calc(text: str, result: float) -> Case:
    return Case(text, "calculate", {"result": result})


def _weather(text: str, city: str) -> Case:
    return Case(text, "get_weather", {"city": city})


def _light(text: str, room: str, state: str) -> Case:
    return Case(text, "switch_light", {"room": room, "state": state})


def _none(text: str) -> Case:
    return Case(text, None)


CASES: tuple[Case, ...] = (
    _t("What time is it?"),
    _t("Hey, what's the time right now?"),
    _t("Do you know what time it is?"),
    _t("What's today's date?"),
    _t("Um, what day is it today?"),
    _t("Sorry, could you tell me the time?"),
    _timer("Set a timer for five minutes.", 300),
    _timer("Can you set a timer for ten minutes please?", 600),
    _timer("Start a 30 second timer.", 30),
    _timer("Set a timer for one hour.", 3600),
    _timer("Remind me in 15 minutes, the pasta's on.", 900),
    _timer("Timer for two and a half minutes.", 150),
    _timer("Okay, set a timer for 45 seconds for the eggs.", 45),
    _calc("What's 12 times 7?", 84),
    _calc("How much is 345 plus 789?", 1134),
    _calc("What is 1000 divided by 8?", 125),
    _calc("Can you work out 15 percent of 80?", 12),
    _calc("What's 2 to the power of 10?", 1024),
    _calc("Calculate 19 times 23, please.", 437),
    _calc("What is 250 minus 78?", 172),
    _calc("How much is 3 times 4 plus 5?", 17),
    _weather("What's the weather like in Paris?", "Paris"),
    _weather("Is it going to rain in London today?", "London"),
    _weather("How hot is it in Tokyo right now?", "Tokyo"),
    _weather("What's the forecast for Berlin?", "Berlin"),
    _weather("Tell me the weather in New York.", "New York"),
    _weather("Do I need an umbrella in Seattle today?", "Seattle"),
    _weather("How cold is it in Oslo?", "Oslo"),
    _light("Turn on the kitchen light.", "kitchen", "on"),
    _light("Switch off the lights in the bedroom.", "bedroom", "off"),
    _light("Can you turn the living room light on?", "living room", "on"),
    _light("Lights off in the bathroom, please.", "bathroom", "off"),
    _light("Turn off the hallway light.", "hallway", "off"),
    _light("Could you switch the office light on?", "office", "on"),
    _light("Please turn on the lights in the garage.", "garage", "on"),
    _light("Kill the lights in the kitchen.", "kitchen", "off"),
    _none("Tell me a joke."),
    _none("How are you doing today?"),
    _none("What's the capital of Australia?"),
    _none("Who wrote Pride and Prejudice?"),
    _none("Thanks, that's all for now."),
    _none("I'm feeling a bit tired today."),
    _none("Can you recommend a good book?"),
    _none("What's your favourite time of year?"),
    _none("What does a light year measure?"),
    _none("Do you like rainy weather?"),
    _none("Why is the sky blue?"),
    _none("Good night!"),
)
"""48 requests: 6 time, 7 timer, 8 calculator, 7 weather, 8 lights, 12 none."""


def args_ok(case: Case, arguments: dict[str, Any]) -> bool:
    """Whether a call's ``arguments`` (already valid under the tool's schema) do what ``case``
    asks, leniently (see the module docstring); never raises."""
    want = case.args
    try:
        if case.tool == "set_timer":
            total = float(arguments.get("minutes", 0) or 0) * 60 + float(arguments.get("seconds", 0) or 0)
            return abs(total - want["seconds"]) <= TOLERANCE
        if case.tool == "calculate":
            return abs(float(calculate(str(arguments.get("expression", "")))["result"]) - want["result"]) <= TOLERANCE
        if case.tool == "get_weather":
            return want["city"].lower() in str(arguments.get("city", "")).lower()
        if case.tool == "switch_light":
            return (want["room"].lower() in str(arguments.get("room", "")).lower()
                    and str(arguments.get("state", "")).lower() == want["state"])
    except (ValueError, TypeError, KeyError, OverflowError):
        return False
    return True


def load_cases(limit: int | None = None) -> list[Case]:
    """Every case (``limit`` None), or ``limit`` of them picked across kinds in turn, chit-chat
    first (``none``, ``time``, ``timer``, ...), so a short run sees both sides."""
    if limit is None or limit >= len(CASES):
        return list(CASES)
    by_kind: dict[str, list[Case]] = {"none": []}
    for c in CASES:
        by_kind.setdefault(c.kind, []).append(c)
    picked: list[Case] = []
    while len(picked) < limit:
        for cases in by_kind.values():
            if cases and len(picked) < limit:
                picked.append(cases.pop(0))
    return picked
