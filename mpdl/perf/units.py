"""Sizes and counts as people write them: '64M' bytes, '25.6M' parameters."""

from __future__ import annotations

import re

_BYTES = re.compile(r"\s*(\d+)\s*([kKmMgG]?)(?:i?[bB])?\s*")
_BINARY = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kKmMgGbB]?)\s*$")
_DECIMAL = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9}


def parse_size(text: str) -> int:
    """'8', '1K', '64M', '1G' (also 1KB, 1KiB; binary multiples) -> bytes."""
    m = _BYTES.fullmatch(str(text))
    if not m:
        raise ValueError(f"expected a byte count such as 8, 1K, 64M or 1G, got {text!r}")
    return int(m.group(1)) * _BINARY[m.group(2).lower()]


def parse_count(text: str) -> float:
    """'25557032', '25.6M', '1.2k', '3e6' -> a number (decimal multiples)."""
    m = _COUNT.match(str(text))
    if not m:
        raise ValueError(f"expected a count such as 25557032, 25.6M or 1.2k, got {text!r}")
    return float(m.group(1)) * _DECIMAL[m.group(2).lower()]
