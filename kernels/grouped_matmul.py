"""The MoE experts' grouped matmul as a loop over row tiles, for backends that expand `ragged_dot`.

`jtree.models.moe.Experts` multiplies the (token, expert) assignments, sorted by expert, by their
expert's weights. `jax.lax.ragged_dot` does that in one op, and XLA:TPU compiles it as a grouped
matmul. XLA:GPU (jax-cuda12-plugin 0.10.2) does not: its `RaggedDotRewriter` expands the ragged
operand to [groups, rows, features] (every row copied for every group, masked) and multiplies
that densely, so memory and FLOPs grow with the number of local experts. Compiled for an H200,
the forward and backward of one `ragged_dot` of 16384 x 2048 rows into 16 experts of 1536 assign
1 and 2 GiB of temporaries (a `bf16[16,16384,2048]` buffer), and Nemotron 3 Nano's step, 64
experts per device, 120 GiB (docs/memory.md); XLA's `xla_gpu_experimental_use_ragged_dot_*`
flags leave that compile unchanged.

`tiled_matmul` computes the same products without the expansion (the "megablox" layout): each
expert's rows are padded to a multiple of `tile` rows (`tile_layout`), so every tile of `tile`
rows belongs to one expert, and a `lax.scan` over the tiles multiplies each by its expert's
weights. Its buffers are the rows' own (plus at most `tile - 1` padding rows per expert) and its
FLOPs the grouped matmul's plus that padding; tiles past the last expert's rows (the worst-case
bound, and under expert parallelism the rows other devices' experts take) are skipped with a
`lax.cond`. Its backward (`custom_vjp`) is two more tile loops: the input's gradient (each tile
times its expert's transposed weights) and the weights' (each tile's outer product added into
its expert's slot of one float32 accumulator). The price is one loop step per tile, where a
fused grouped-GEMM kernel would be one launch: fewer padding FLOPs with a smaller tile, fewer
steps with a larger one (`TILE`). `pick_grouped_matmul` says which form runs where.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jtree.kernels.varying_axes import summed_like, varying_like

GROUPED_MATMULS = ("auto", "ragged_dot", "tiled")
# Rows per tile: the padding per expert is below one tile, the loop has one step per tile.
TILE = 128


def pick_grouped_matmul(impl: str, platform: str) -> str:
    """The expert matmul `jtree.models.moe.Experts` runs for `impl` (one of `GROUPED_MATMULS`) on
    `platform` (`jax.default_backend()` when traced, or a compile target's): "auto" is "tiled" on
    GPUs, where XLA expands `ragged_dot` densely (module docstring), and `ragged_dot` elsewhere
    (XLA:TPU's grouped matmul; on CPU, jax's own lowering)."""
    if impl not in GROUPED_MATMULS:
        raise ValueError(f"expert_matmul: {impl!r} is not one of {GROUPED_MATMULS}")
    if impl != "auto":
        return impl
    return "tiled" if platform in ("gpu", "cuda", "rocm") else "ragged_dot"


class TileLayout(NamedTuple):
    """Where the sorted rows sit once each group is padded to whole tiles.

    `source` [tiles * tile]: the sorted row each padded row holds (`rows`, one past the last,
    for padding); `expert` [tiles]: each tile's group; `used` [tiles]: whether it holds a row."""

    source: jax.Array
    expert: jax.Array
    used: jax.Array


def tile_layout(group_sizes: jax.Array, rows: int, tile: int = TILE) -> TileLayout:
    """The layout of `rows` rows sorted by group, group g holding the `group_sizes[g]` rows after
    the groups before it (rows past the last group belong to none and are left out). Static
    shape: sum_g ceil(s_g / tile) <= (rows + groups * (tile - 1)) / tile tiles whatever the sizes."""
    groups = group_sizes.shape[0]
    tiles = (rows + groups * (tile - 1)) // tile
    sizes = group_sizes.astype(jnp.int32)
    padded = -(-sizes // tile) * tile
    padded_end = jnp.cumsum(padded)
    padded_start = padded_end - padded
    start = jnp.cumsum(sizes) - sizes
    row = jnp.arange(rows, dtype=jnp.int32)
    group = jnp.searchsorted(jnp.cumsum(sizes), row, side="right")  # == groups past the last
    in_group = group < groups
    g = jnp.minimum(group, groups - 1)
    position = jnp.where(in_group, padded_start[g] + row - start[g], tiles * tile)
    source = jnp.full((tiles * tile,), rows, jnp.int32).at[position].set(row, mode="drop")
    first_row = jnp.arange(tiles, dtype=jnp.int32) * tile
    expert = jnp.minimum(jnp.searchsorted(padded_end, first_row, side="right"), groups - 1)
    return TileLayout(source, expert.astype(jnp.int32), first_row < padded_end[-1])


def _product(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [T, K] times w [N, K] transposed, accumulated in float32 at least."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=acc)


def _tiles(a: jax.Array, count: int) -> jax.Array:
    return a.reshape(count, -1, a.shape[-1])


@jax.custom_vjp
def tiled_matmul(x: jax.Array, w: jax.Array, expert: jax.Array, used: jax.Array) -> jax.Array:
    """y[r] = x[r] @ w[expert[r // tile]].T for every row of a used tile, 0 in unused tiles:
    x [tiles * tile, K] in `tile_layout`'s order, w [groups, N, K] (the experts' HF layout),
    `expert` and `used` [tiles] from that layout. Returns [tiles * tile, N] in x's dtype."""
    return _forward(x, w, expert, used)


def _forward(x: jax.Array, w: jax.Array, expert: jax.Array, used: jax.Array) -> jax.Array:
    count = expert.shape[0]
    zero = varying_like(jnp.zeros((x.shape[0] // count, w.shape[1]), x.dtype), x, w)

    def step(_: None, t: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        xt, e, u = t
        return None, jax.lax.cond(u, lambda: _product(xt, w[e]).astype(x.dtype), lambda: zero)

    _, y = jax.lax.scan(step, None, (_tiles(x, count), expert, used))
    return y.reshape(x.shape[0], w.shape[1])


def _fwd(x: jax.Array, w: jax.Array, expert: jax.Array, used: jax.Array
         ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    return _forward(x, w, expert, used), (x, w, expert, used)


def _bwd(res: tuple[jax.Array, ...], dy: jax.Array) -> tuple[jax.Array | None, ...]:
    x, w, expert, used = res
    count = expert.shape[0]
    acc = jnp.promote_types(w.dtype, jnp.float32)
    dw0 = varying_like(jnp.zeros(w.shape, acc), x, w, dy)
    zero = varying_like(jnp.zeros((x.shape[0] // count, x.shape[1]), x.dtype), x, w, dy)

    def step(dw: jax.Array, t: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        xt, dyt, e, u = t

        def run(dw: jax.Array) -> tuple[jax.Array, jax.Array]:
            dx = jax.lax.dot_general(dyt, w[e].astype(dyt.dtype), (((1,), (0,)), ((), ())),
                                     preferred_element_type=acc).astype(x.dtype)
            dwe = jax.lax.dot_general(dyt, xt, (((0,), (0,)), ((), ())),
                                      preferred_element_type=acc)
            return jax.lax.dynamic_update_index_in_dim(dw, dw[e] + dwe, e, 0), dx

        return jax.lax.cond(u, run, lambda dw: (dw, zero), dw)

    dw, dx = jax.lax.scan(step, dw0, (_tiles(x, count), _tiles(dy, count), expert, used))
    dx = varying_like(summed_like(dx.reshape(x.shape), x), x)
    dw = varying_like(summed_like(dw.astype(w.dtype), w), w)
    return dx, dw, None, None


tiled_matmul.defvjp(_fwd, _bwd)
