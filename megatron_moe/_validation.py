"""Checks shared by every config dataclass: one error form, ``<key>=<value> is invalid: <what is
valid>``, naming the key as the user wrote it (``MoEConfig.top_k``, ``model.moe.top_k``,
``train.lr``)."""
from __future__ import annotations

import math
from typing import Any, NoReturn


def invalid(key: str, value: Any, valid: str) -> NoReturn:
    raise ValueError(f"{key}={value!r} is invalid: {valid}")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_int(key: str, v: Any, minimum: int) -> None:
    if not is_int(v) or v < minimum:
        invalid(key, v, "expected a positive int" if minimum == 1 else f"expected an int >= {minimum}")


def check_number(key: str, v: Any, minimum: float, *, exclusive: bool = False) -> None:
    if not is_number(v) or v < minimum or (exclusive and v == minimum):
        invalid(key, v, f"expected a finite number {'>' if exclusive else '>='} {minimum:g}")


def check_bool(key: str, v: Any) -> None:
    if not isinstance(v, bool):
        invalid(key, v, "expected true or false")


def check_choice(key: str, v: Any, choices: tuple) -> None:
    if v not in choices:
        invalid(key, v, f"expected one of {', '.join(map(str, choices))}")
