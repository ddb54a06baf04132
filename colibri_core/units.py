"""Parsing and printing byte sizes (``--ram 2G``)."""

import re

from colibri_core.errors import UsageError

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """'2G', '512M', '1.5GiB', '1000' (bytes) -> bytes. Binary units (G = 2**30)."""
    if isinstance(text, int):
        if text < 0:
            raise UsageError(f"size must not be negative: {text}")
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise UsageError(f"cannot read size {text!r}: use a number with an optional K, M, G or T suffix, e.g. 2G")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit.upper()])


def format_bytes(n: float) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
