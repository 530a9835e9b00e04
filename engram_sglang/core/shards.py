"""Which rows of a layer table each tensor-parallel rank holds: one contiguous row range
(`shard_range`) or a list of row ranges, the layout's columns dealt round-robin
(`column_shards`). Pure Python (the planner sizes shards with it, the stores hold them)."""

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
    column c owns rows [b[c], b[c+1])): columns are dealt round-robin, column c to rank
    c % tp_size, so every rank holds the same number of columns of each n-gram order (the
    layout is order-major) and reads about as many distinct rows per step as any other.
    Contiguous row ranges (`shard_range`) give the rank holding the 4-gram columns the most
    distinct rows. With fewer columns than ranks the column split cannot cover every rank:
    the contiguous split is used."""
    columns = len(bounds) - 1
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise EngramError(f"tensor-parallel rank {tp_rank} is not in [0, {tp_size})")
    if columns < tp_size:
        return [shard_range(int(bounds[-1]) - int(bounds[0]), tp_rank, tp_size)]
    ranges: list[tuple[int, int]] = []
    for c in range(tp_rank, columns, tp_size):
        lo, hi = int(bounds[c]), int(bounds[c + 1])
        if ranges and ranges[-1][1] == lo:
            ranges[-1] = (ranges[-1][0], hi)
        else:
            ranges.append((lo, hi))
    return ranges


def ranges_rows(ranges) -> int:
    """Rows held by a list of row ranges."""
    return sum(hi - lo for lo, hi in ranges)
