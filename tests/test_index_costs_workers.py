"""``--num-workers -1`` (issue 33): the CPUs of the rank minus one, no fixed cap of 4 any more, and no
more workers than /dev/shm holds the prefetched micro-batches of (2 per worker, every rank of the
node), at least one where a core is free (``shm_warning`` then says so). The reference is the
arithmetic itself, brute-forced: the largest worker count whose micro-batches fit."""

from __future__ import annotations

import pytest


def _fit(cpus: int, ranks: int, mb: int, free: int) -> int:
    """Brute force: the most workers, within the cores, whose prefetched micro-batches fit in ``free``."""
    cores = max(0, cpus // ranks - 1)
    best = 0
    for w in range(cores + 1):
        if w * 2 * ranks * mb <= free:
            best = w
    return max(best, 1) if cores else 0


@pytest.mark.parametrize("cpus,ranks", [(96, 8), (128, 8), (16, 8), (2, 4), (64, 1)])
@pytest.mark.parametrize("mb_mib,free_gib", [(8, 64), (64, 3), (330, 32), (1024, 1)])
def test_workers_follow_the_cores_and_shared_memory(cpus, ranks, mb_mib, free_gib):
    from mimo_sft.data.loader import resolve_num_workers, shm_warning

    mb, free = mb_mib * 2**20, free_gib * 2**30
    got = resolve_num_workers(-1, cpus=cpus, local_ranks=ranks, micro_batch_bytes=mb, free_bytes=free)
    assert got == _fit(cpus, ranks, mb, free)
    # no micro-batch size given (evaluation's caller): the cores alone, beyond the old cap of 4
    assert resolve_num_workers(-1, cpus=cpus, local_ranks=ranks) == max(0, cpus // ranks - 1)
    warned = shm_warning(got, micro_batch_bytes=mb, local_ranks=ranks, free_bytes=free) is not None
    assert warned == (got * 2 * ranks * mb > free)  # only the one-worker floor can overflow, and it says so
    assert resolve_num_workers(3, cpus=cpus, local_ranks=ranks, micro_batch_bytes=mb, free_bytes=free) == 3
