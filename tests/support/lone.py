"""The offload hybrid's lone rows, by brute force: the reference its split is tested against."""

from __future__ import annotations


def lone_positions(rows: list[int], row_bytes: int, block_bytes: int) -> list[int]:
    """Positions of the rows that share no ``block_bytes``-aligned block of the table with another row."""
    blocks = [r * row_bytes // block_bytes for r in rows]
    return [i for i, b in enumerate(blocks) if blocks.count(b) == 1]
