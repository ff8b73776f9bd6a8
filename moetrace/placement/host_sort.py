"""``torch.sort(descending=True)``'s order of a host array, computed without torch.

EPLB takes its loads heaviest first in the order ``torch.sort`` gives; among equal loads that
order is the one the sort torch runs on the host leaves them in, and EPLB's plans depend on it.
That sort is an introsort (Musser, 1997) as the C++ standard library runs it: a quicksort whose
pivot is the median of the second, middle and last items, moved to the front; ranges of 16 items
or fewer are left to one insertion sort over the whole array at the end; a range still longer
after ``2 * floor(log2(n))`` partitions is heap-sorted instead. :func:`descending_order` runs
those steps on a Python list, so planning from a trace (``moetrace analyze``, ``moetrace
placement``) never imports torch. Written from the algorithm's description and checked against
torch's own outputs (tests/placement/test_host_sort.py), including inputs that reach the heap sort.
"""

from __future__ import annotations

import numpy as np

__all__ = ["descending_order"]

#: Ranges of at most this many items are left to the final insertion sort.
_THRESHOLD = 16

#: ``(key, index)``: a load and where it was.
_Item = tuple[float, int]


def descending_order(values: np.ndarray) -> list[int]:
    """Indices of the 1-D ``values`` heaviest first, equal values in ``torch.sort(descending=True)``'s
    host order (the value ``torch.sort(torch.from_numpy(values), descending=True).indices`` has)."""
    values = np.asarray(values)
    if len(values) <= _THRESHOLD or np.unique(values).size == len(values):
        # no ties, or only the (stable) insertion sort runs: a stable sort gives the same order
        return np.argsort(-values, kind="stable").tolist()
    items: list[_Item] = list(zip(values.tolist(), range(len(values)), strict=True))
    _introsort(items, 0, len(items), 2 * (len(items).bit_length() - 1))
    _final_insertion_sort(items)
    return [index for _, index in items]


def _introsort(a: list[_Item], first: int, last: int, depth: int) -> None:
    while last - first > _THRESHOLD:
        if depth == 0:
            _heap_sort(a, first, last)
            return
        depth -= 1
        cut = _partition(a, first, last)
        _introsort(a, cut, last, depth)
        last = cut


def _partition(a: list[_Item], first: int, last: int) -> int:
    """Move the median of ``a[first + 1]``, the middle and the last item to ``first`` and split
    ``[first + 1, last)`` around it; returns where the second part starts."""
    x, y, z = first + 1, first + (last - first) // 2, last - 1
    if a[x][0] > a[y][0]:
        median = y if a[y][0] > a[z][0] else z if a[x][0] > a[z][0] else x
    else:
        median = x if a[x][0] > a[z][0] else z if a[y][0] > a[z][0] else y
    a[first], a[median] = a[median], a[first]
    pivot = a[first][0]
    low, high = first + 1, last
    while True:
        while a[low][0] > pivot:
            low += 1
        high -= 1
        while pivot > a[high][0]:
            high -= 1
        if low >= high:
            return low
        a[low], a[high] = a[high], a[low]
        low += 1


def _final_insertion_sort(a: list[_Item]) -> None:
    """Insertion sort of the whole list; past the first 16 items every item has a smaller or equal one before it."""
    head = min(len(a), _THRESHOLD)
    for i in range(1, head):
        if a[i][0] > a[0][0]:
            a[: i + 1] = [a[i], *a[:i]]
        else:
            _insert(a, i)
    for i in range(head, len(a)):
        _insert(a, i)


def _insert(a: list[_Item], i: int) -> None:
    """Move ``a[i]`` left past every item lighter than it (an item before it is never lighter than all)."""
    item, j = a[i], i - 1
    while item[0] > a[j][0]:
        a[j + 1] = a[j]
        j -= 1
    a[j + 1] = item


def _heap_sort(a: list[_Item], first: int, last: int) -> None:
    """Heap-sort ``a[first:last]``: build the heap (lightest on top), then move the top to the end, repeatedly."""
    length = last - first
    for parent in range((length - 2) // 2, -1, -1):
        _sift(a, first, parent, length, a[first + parent])
    while last - first > 1:
        last -= 1
        item, a[last] = a[last], a[first]
        _sift(a, first, 0, last - first, item)


def _sift(a: list[_Item], first: int, hole: int, length: int, item: _Item) -> None:
    """Fill ``hole`` of the heap ``a[first:first + length]`` with ``item``: the hole goes down along the
    lighter children to a leaf, then ``item`` goes up from there to its place."""
    top, child = hole, hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if a[first + child][0] > a[first + child - 1][0]:
            child -= 1
        a[first + hole] = a[first + child]
        hole = child
    if length % 2 == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        a[first + hole] = a[first + child - 1]
        hole = child - 1
    parent = (hole - 1) // 2
    while hole > top and a[first + parent][0] > item[0]:
        a[first + hole] = a[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    a[first + hole] = item
