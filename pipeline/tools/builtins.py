"""Tools voxpipe ships, off by default (``--builtin-tool NAME``, repeatable): ``time``,
``timer``, ``calculator``. Each is a plain function with type hints and a Google-style
docstring, the same shape as a user's own (``--tools module:object``): its spec comes from
:func:`~pipeline.tools.spec.spec_from_callable`."""

from __future__ import annotations

import ast
import datetime as dt
import math
import operator
import re
from collections.abc import Callable
from typing import Any

from pipeline.tools.spec import example

MAX_TIMER_S = 24 * 3600
"""The longest timer ``set_timer`` takes (s)."""
MAX_POWER = 1000
"""The largest exponent ``calculate`` raises to (a bigger one could take the CPU for minutes)."""
PERCENT = re.compile(r"(\d+(?:\.\d+)?)\s*%(?=\s*(?:$|[-+*/)]|of\b))")
"""A percentage: a number and ``%`` followed by an operator, a bracket, "of" or the end
("15% * 80", "15% of 80"); ``%`` between two numbers stays the remainder."""
MAX_RESULT_BITS = 4096
"""A power whose result would need more bits than this is refused ((10**1000)**1000 would take
the CPU for minutes)."""
MAX_EXPRESSION = 200
"""The longest expression ``calculate`` reads (characters)."""


@example("What's the time?")
def get_time() -> dict[str, str]:
    """The current local date and time."""
    now = dt.datetime.now().astimezone()
    return {"time": now.strftime("%H:%M"), "date": now.strftime("%A %d %B %Y"), "timezone": str(now.tzinfo)}


@example("Set a timer for ten seconds.", seconds=10)
def set_timer(minutes: float = 0, seconds: float = 0, label: str = "") -> dict[str, Any]:
    """Set a timer that rings after the given time.

    Args:
        minutes: minutes until it rings.
        seconds: seconds until it rings (added to the minutes).
        label: what the timer is for.
    """
    total = minutes * 60 + seconds
    if not (0 < total <= MAX_TIMER_S):
        raise ValueError(f"a timer must last between 1 second and {MAX_TIMER_S // 3600} hours")
    ends = dt.datetime.now().astimezone() + dt.timedelta(seconds=total)
    what = f"A timer for {duration_words(round(total))}" + (f" ({label})" if label else "")
    return {"summary": f"{what} is set. It rings at {ends.strftime('%H:%M')}.", "status": "set",
            "seconds": round(total), "label": label, "rings_at": ends.strftime("%H:%M:%S")}


def duration_words(seconds: int) -> str:
    """``seconds`` as a speakable duration: 300 → "5 minutes", 90 → "1 minute and 30 seconds",
    3600 → "1 hour"."""
    parts = [(seconds // 3600, "hour"), (seconds % 3600 // 60, "minute"), (seconds % 60, "second")]
    said = [f"{n} {unit}{'' if n == 1 else 's'}" for n, unit in parts if n]
    return " and ".join([", ".join(said[:-1]), said[-1]]) if len(said) > 1 else (said[0] if said else "0 seconds")


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


@example("What is three plus four?", expression="3 + 4")
def calculate(expression: str) -> dict[str, float | int]:
    """Work out an arithmetic expression.

    Args:
        expression: the arithmetic to do, in numbers, + - * / % ** and brackets.
    """
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"expression over {MAX_EXPRESSION} characters")
    expression = re.sub(r"\bof\b", "*", expression)
    text = PERCENT.sub(r"(\1/100)", expression.replace("×", "*").replace("÷", "/").replace("^", "**"))
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is not a finite number")
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return {"result": value}


def _evaluate(node: ast.AST) -> Any:
    """An arithmetic AST's value: numbers and the operators of :data:`_BINARY`/:data:`_UNARY`
    only (no names, calls or attributes: nothing else can run)."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_POWER
                                             or math.log2(abs(left) + 1) * abs(right) > MAX_RESULT_BITS):
            raise ValueError("the result is too large")
        try:
            return _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large") from None
    raise ValueError("only numbers, + - * / // % ** and brackets are allowed")


BUILTINS: dict[str, Callable[..., Any]] = {"time": get_time, "timer": set_timer, "calculator": calculate}
"""``--builtin-tool`` names → functions."""
