"""A DeepSeek step (which upstream's forward never ends) is ended before the stores'
between-steps maintenance, not after it: a prefetch no layer waited on (a layer the forward
did not reach in Python) would otherwise still be in flight while a hot-row cache admits
and evicts, on a GPU a side-stream gather not ordered before the admission's writes."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_model_dsv4_hook import CFG, batch, embeddings, open_runtime, parallel, table, upstream_hasher  # noqa: F401


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(99)


def test_no_prefetch_of_the_step_is_in_flight_when_stores_maintain(parallel, table, rng):
    from engram_sglang.core.stores import maintenance

    table_dir, _, layout = table
    runtime = open_runtime(table_dir, "host", cache_mib=1)
    open_at_maintenance = []
    for store in runtime.stores.values():
        store.maintain_every = 1
        real = store.maintain

        def maintain(real=real):
            step = runtime._open_step
            open_at_maintenance.append(sorted(step.handles) if step is not None else [])
            return real()

        store.maintain = maintain
    try:
        embeds = embeddings(runtime, layout)
        hasher, _ = upstream_hasher(rng)
        tokens = torch.randint(0, CFG.vocab_size, (8,), generator=rng)
        fb = batch("extend", [2], [8], list(range(8)), tokens)
        hash_ids = hasher(tokens, fb)  # begin_step: both layers' prefetches in flight
        early, late = CFG.layer_ids
        embeds[early](hash_ids[:, runtime.layer_index[early]], fb)
        # The late layer's lookup never reached the runtime: its handle is never waited.
        maintenance.between_steps()
        assert open_at_maintenance and all(h == [] for h in open_at_maintenance), (
            f"handles still in flight while the stores maintained: {open_at_maintenance}")
    finally:
        runtime.close()

