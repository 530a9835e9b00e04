"""Which rows of a layer table each tensor-parallel rank holds: one contiguous row range
(`shard_range`) or a list of row ranges, the layout's columns dealt round-robin or split
evenly (`column_shards`). Pure Python (the planner sizes shards with it, the stores hold them)."""

from __future__ import annotations

from .errors import EngramError


def shard_range(rows: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """Row range [lo, hi) that rank `tp_rank` of `tp_size` holds: contiguous, sizes differ by <= 1."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise EngramError(f"tensor-parallel rank {tp_rank} is not in [0, {tp_size})")
    base, extra = divmod(rows, tp_size)
    lo = tp_rank * base + min(tp_rank, extra)
    return lo, lo + base + (1 if tp_rank < extra else 0)


def column_shards(bounds, tp_rank: int, tp_size: int) -> list[tuple[int, int]]:
    """Row ranges [(lo, hi), ...] (sorted, disjoint, adjacent ones merged) that rank `tp_rank`
    of `tp_size` holds of a layer whose columns are `bounds` (`EngramLayout.column_bounds`:
    column c owns rows [b[c], b[c+1])), so that every rank holds the same share of each n-gram
    order (the layout is order-major) and reads about as many distinct rows per step as any
    other. Contiguous row ranges (`shard_range`) give the rank holding the 4-gram columns the
    most distinct rows. Where `tp_size` divides the column count, whole columns are dealt
    round-robin (column c to rank c % tp_size: the fewest ranges); otherwise (DeepSeek-V4.1's
    24 columns at TP 16, or fewer columns than ranks) whole columns would leave some ranks a
    column more than others (1.33x the mean at TP 16), so each column is split in `tp_size`
    contiguous pieces and rank r holds piece r of every column."""
    columns = len(bounds) - 1
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise EngramError(f"tensor-parallel rank {tp_rank} is not in [0, {tp_size})")
    if columns % tp_size == 0:
        pieces = [(int(bounds[c]), int(bounds[c + 1])) for c in range(tp_rank, columns, tp_size)]
    else:
        pieces = []
        for c in range(columns):
            lo, hi = shard_range(int(bounds[c + 1]) - int(bounds[c]), tp_rank, tp_size)
            pieces.append((int(bounds[c]) + lo, int(bounds[c]) + hi))
    ranges: list[tuple[int, int]] = []
    for lo, hi in pieces:
        if lo == hi:
            continue
        if ranges and ranges[-1][1] == lo:
            ranges[-1] = (ranges[-1][0], hi)
        else:
            ranges.append((lo, hi))
    return ranges


def as_ranges(row_range) -> list[tuple[int, int]]:
    """One (lo, hi) or a list of ranges, as a list of ranges (what stores and replays take)."""
    if len(row_range) and not hasattr(row_range[0], "__len__"):
        return [(int(row_range[0]), int(row_range[1]))]
    return [(int(lo), int(hi)) for lo, hi in row_range]


def ranges_rows(ranges) -> int:
    """Rows held by a list of row ranges."""
    return sum(hi - lo for lo, hi in ranges)
