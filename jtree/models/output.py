"""What every model of the family returns."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax


class ModelOutput(NamedTuple):
    """Final hidden states [rows, S, hidden] and an auxiliary loss (a scalar already weighted so
    that it adds to the objective as is; zero for dense models, the router load-balancing term
    for mixture-of-experts models). `exports`: per decoder layer, what later parts of a
    partitioned tree read from these tokens (`jtree.models.prefix`; unused values cost nothing
    under jit). `router_load`: (counts [E], total) of the router load-balancing loss when it is on
    (`jtree.models.moe.router_load`), None otherwise. `mtp`: per depth, the multi-token-prediction
    states [rows, S, hidden] (`jtree.models.mtp`; None without MTP modules)."""

    hidden: jax.Array
    aux_loss: jax.Array
    exports: tuple[Any, ...] | None = None
    router_load: tuple[jax.Array, jax.Array] | None = None
    mtp: tuple[jax.Array, ...] | None = None
