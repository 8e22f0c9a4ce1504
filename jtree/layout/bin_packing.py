"""First-fit-decreasing bin packing, the one packer of the library.

Rows of a step (`jtree.layout.planner`), parts of a capacity partition (`jtree.partitioning.partition`, at each
branching node), redundancy-free parts (`jtree.partitioning.redundancy_free.plan`) and the MULTIFIT probes of the
data-parallel balance (`jtree.layout.balance`) all pack items into bins of a capacity this way: items in
decreasing size (ties in input order), each into the first bin with room. Callers differ only in
what an item is and what its bin becomes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def first_fit_decreasing(sizes: Sequence[float], capacity: float) -> list[list[int]]:
    """Bins of total size at most `capacity`: items in decreasing size (ties in input order), each
    into the first bin with room, a new bin when none has. Returns the item indices of each bin,
    in the order they joined it."""
    sizes = np.asarray(sizes, dtype=np.result_type(np.asarray(sizes).dtype, np.int64))
    order = np.argsort(-sizes, kind="stable")
    free = np.empty(len(sizes), sizes.dtype)  # room left in each open bin (at most one per item)
    bins: list[list[int]] = []
    for i in order:
        size = sizes[i]
        fits = np.flatnonzero(free[: len(bins)] >= size)
        if fits.size:
            b = int(fits[0])
            bins[b].append(int(i))
            free[b] -= size
        else:
            free[len(bins)] = capacity - size
            bins.append([int(i)])
    return bins
