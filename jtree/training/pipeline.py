"""The input pipeline: a grain `MapDataset` of tree indices shuffled by seed (reshuffled every
epoch), grouped `trees_per_step` at a time, then mapped by a step builder
(`jtree.training.step_builders`) to this host's arrays, optionally in worker processes. The
iterator state is grain's and is saved with every checkpoint.
"""

from __future__ import annotations

import grain

from jtree.training.step_builders import (
    AutoStepBuilder,
    RfreeStepBuilder,
    StepBuilder,
    step_indices,
)

# ---------------------------------------------------------------------- step batching


def make_pipeline(builder: StepBuilder | AutoStepBuilder | RfreeStepBuilder, *, seed: int,
                  worker_count: int = 0) -> grain.IterDataset:
    """Step inputs for this host, in step order (iterate it, checkpoint its iterator state)."""
    ds = step_indices(len(builder.trees), builder.config.trees_per_step, seed).map(builder)
    it_ds = ds.to_iter_dataset()
    if worker_count > 0:
        from absl import flags  # grain's workers read absl flags, which a script never parses

        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count),
                                  worker_init_fn=_exit_with_parent)
    return it_ds


def _exit_with_parent(worker_index: int, worker_count: int) -> None:
    """Grain worker start-up: exit when the training process is gone (a SIGKILLed trainer gives
    its workers no chance to stop them, and they would hold its output pipes open)."""
    import os
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()
