"""argparse types shared by the command-line tools: a bad value is a usage error naming it (exit 2), not a traceback
from deep inside a run."""

from __future__ import annotations

import argparse
from typing import Callable


def _number(text: str, kind: type) -> int | float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") \
            from None


def positive_int(text: str) -> int:
    """An integer >= 1 (raises ``argparse.ArgumentTypeError``)."""
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (raises ``argparse.ArgumentTypeError``)."""
    value = _number(text, float)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0, e.g. a temperature (raises ``argparse.ArgumentTypeError``)."""
    value = _number(text, float)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def fraction(most: float) -> Callable[[str], float]:
    """The type of a fraction in (0, ``most``] (raises ``argparse.ArgumentTypeError``)."""

    def parse(text: str) -> float:
        value = _number(text, float)
        if not 0 < value <= most:
            raise argparse.ArgumentTypeError(f"expected a fraction in (0, {most}], got {text}")
        return value

    return parse


def port_number(text: str) -> int:
    """A TCP port, 0-65535 (raises ``argparse.ArgumentTypeError``)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text}")
    return value


def base_url(text: str) -> str:
    """A server's base URL as ``--url`` takes it: ``http://host:port``, also given with a trailing ``/`` or ``/v1``
    (the OpenAI base URL a server's ready line prints); the paths ``/health`` and ``/v1/...`` are added to it."""
    url = text.strip().rstrip("/")
    return url.removesuffix("/v1").rstrip("/")


def int_list(text: str) -> list[int]:
    """Comma-separated distinct integers >= 1 (raises ``argparse.ArgumentTypeError``)."""
    values = [positive_int(v) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return no_repeats(values)


def float_list(text: str) -> list[float]:
    """Comma-separated distinct finite numbers > 0 (raises ``argparse.ArgumentTypeError``)."""
    values = [positive_float(v) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"need positive numbers, got {text!r}")
    return no_repeats(values)


def name_list(text: str) -> list[str]:
    """Comma-separated distinct names (raises ``argparse.ArgumentTypeError``)."""
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError("need at least one name")
    return no_repeats(values)


def no_repeats(values: list) -> list:
    """``values`` when none repeats (a repeated level or policy would overwrite the other's records)."""
    if repeated := sorted({str(v) for v in values if values.count(v) > 1}):
        raise argparse.ArgumentTypeError(f"{', '.join(repeated)} given more than once")
    return values
