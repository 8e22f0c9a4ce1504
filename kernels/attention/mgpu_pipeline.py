"""Shared pieces of the Mosaic GPU (Hopper) tree-attention kernels: the block-table-driven TMA
pipeline between one producer warpgroup and two consumer warpgroups, SMEM tile types, and the
in-kernel element mask from `end`.

Every kernel is warp-specialized in the FlashAttention-3 way: warpgroups 0 and 1 compute (wgmma +
softmax), warpgroup 2 only issues TMA copies. The producer walks the CTA's compacted block list
(`jtree.kernels.block_tables`): block n goes to pipeline slot n % stages, one TMA per streamed operand,
each completing its own `ready` barrier; before reusing a slot it waits on that slot's `free`
barrier, which both consumers arrive on once they are done with it. Blocks that are not in the list
(EMPTY) are never fetched; the `end` tile needed for the element mask is fetched only for PARTIAL
blocks.

Only primitives the Mosaic GPU interpreter executes are used (see README, "Mosaic GPU kernel"):
wgmma reads both operands from plain tiled+swizzled SMEM tiles (no transposed views, no register
LHS) and each product goes into a fresh zeroed accumulator whose value is added in registers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jtree.kernels.block_tables import PARTIAL
from jtree.kernels.varying_axes import varying_like

WG_ROWS = 64  # rows of one wgmma tile per warpgroup (the M dimension of wgmma)
CONSUMERS = 2  # compute warpgroups per CTA
PRODUCER = CONSUMERS  # index of the TMA warpgroup
SMEM_LIMIT = 227 * 1024  # usable dynamic shared memory per CTA on H100
LOG2E = 1.4426950408889634
# Block lists are stored as [2, chunks, LIST_CHUNK]: a TMA box has at most 256 elements per
# dimension, and 64 int32 make 16-byte aligned rows.
LIST_CHUNK = 64
# Initial running max: finite, so a row whose first blocks are all masked gives exp2(-inf - NEG) = 0
# instead of exp2(-inf + inf) = NaN.
NEG = -1e30


def tiled_smem(shape: Sequence[int], dtype: Any) -> Any:
    """SMEM tile type that wgmma reads: (8, 64) tiles with a 128-byte swizzle (16-bit dtypes)."""
    return plgpu.SMEM(
        tuple(shape), dtype,
        transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)),
    )


def smem_bytes(shape: Sequence[int], dtype: Any) -> int:
    n = jnp.dtype(dtype).itemsize
    for d in shape:
        n *= d
    return n


@dataclasses.dataclass(frozen=True)
class Stream:
    """One operand streamed through the pipeline.

    `src(*coords)` is the GMEM tile of a list entry with coordinates `coords`; `smem` has a leading
    `stages` axis; `ready` holds one barrier per slot. `partial_only` streams are fetched for
    PARTIAL blocks only.
    """

    src: Callable[..., Any]
    smem: Any
    ready: Any
    partial_only: bool = False


Entry = Callable[[jax.Array], tuple[tuple[jax.Array, ...], jax.Array]]
"""Step n of a CTA's work list -> (coordinates of its tiles, block kind)."""


def produce(steps: jax.Array, entry: Entry, streams: Sequence[Stream], free: Any, stages: int,
            max_registers: int | None = 40):
    """Producer warpgroup: TMA every stream's tile of work-list steps 0..steps-1 into the ring.

    It only issues copies, so it gives its registers up to `max_registers` per thread for the
    consumers to take (None: keep them; a CTA of two warpgroups has nothing to redistribute, and
    ptxas then spills the producer's code into local memory)."""
    if max_registers is not None:
        plgpu.set_max_registers(max_registers, action="decrease")

    @pl.loop(0, steps)
    def _(n):
        slot = lax.rem(n, stages)

        @pl.when(n >= stages)
        def _():
            plgpu.barrier_wait(free.at[slot])  # consumers finished step n - stages

        coords, kind = entry(n)
        for s in streams:
            def issue(s=s):
                plgpu.copy_gmem_to_smem(s.src(*coords), s.smem.at[slot], s.ready.at[slot])

            if s.partial_only:
                pl.when(kind == PARTIAL)(issue)
            else:
                issue()

    # Observe the releases of the last steps too: a barrier phase nobody waits for would be
    # a protocol hole (the interpreter rejects it), and the producer is idle here anyway.
    @pl.loop(jnp.maximum(steps - stages, 0), steps)
    def _(n):
        plgpu.barrier_wait(free.at[lax.rem(n, stages)])


def consume(
    steps: jax.Array,
    entry: Entry,
    body: Callable[[jax.Array, tuple[jax.Array, ...], jax.Array, Any], Any],
    init: Any,
    free: Any,
    stages: int,
) -> Any:
    """Consumer loop over the work list: `body(slot, coords, kind, carry)`, then free the slot."""

    def step(n, carry):
        slot = lax.rem(n, stages)
        coords, kind = entry(n)
        carry = body(slot, coords, kind, carry)
        plgpu.barrier_arrive(free.at[slot])
        return carry

    return lax.fori_loop(0, steps, step, init)


def matmul(a: Any, b: Any, shape: tuple[int, int]) -> jax.Array:
    """a @ b for two SMEM tiles, through wgmma into a fresh f32 accumulator (waited on)."""

    def run(acc):
        plgpu.wgmma(acc, a, b)
        return acc[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def tree_mask_tile(
    q_pos: jax.Array, k_start: jax.Array, end: jax.Array, shape: tuple[int, int], key_axis: int
) -> jax.Array:
    """Element mask of a score tile: query i sees key j iff j <= q_pos[i] < end[j].

    `q_pos` holds the key positions of the tile's queries and `end` end[j] of its keys (1-D each;
    keys along `key_axis`, queries along the other axis); the keys are k_start, k_start + 1, ...
    """
    query_axis = 1 - key_axis
    qi = lax.broadcast_in_dim(q_pos, shape, [query_axis])
    kj = k_start + lax.broadcasted_iota(jnp.int32, shape, key_axis)
    ends = lax.broadcast_in_dim(end, shape, [key_axis])
    return (kj <= qi) & (qi < ends)


def positions_smem(lead: tuple[int, ...], n: int, window: int | None) -> Any:
    """SMEM of `end` / `q_pos` tiles of n positions: [*lead, n], or with a window [*lead, 2, n]
    (the values, then the path positions: `attention.mgpu` stacks them in GMEM likewise)."""
    return plgpu.SMEM((*lead, n) if window is None else (*lead, 2, n), jnp.int32)


def positions_tile(ref: Any, row: jax.Array, sl: Any, window: int | None) -> Any:
    """The GMEM tile of positions `sl` of row `row` of an `end` / `q_pos` array ([rows, S], or
    [rows, 2, S] with a window)."""
    return ref.at[row, sl] if window is None else ref.at[row, :, sl]


def read_positions(smem: Any, index: jax.Array, window: int | None) -> tuple[Any, Any]:
    """(values, path positions or None) of SMEM positions tile `index` (see `positions_smem`)."""
    if window is None:
        return smem[index], None
    return smem[index, 0], smem[index, 1]


def window_mask_tile(mask: jax.Array, q_path: Any, k_path: Any, shape: tuple[int, int],
                     key_axis: int, window: int | None) -> jax.Array:
    """`mask` and, with a window, q_path[i] - k_path[j] < W (1-D path positions of the tile's
    queries and keys, keys along `key_axis`)."""
    if window is None:
        return mask
    qp = lax.broadcast_in_dim(q_path, shape, [1 - key_axis])
    kp = lax.broadcast_in_dim(k_path, shape, [key_axis])
    return mask & (qp - kp < window)


def online_softmax_block(t: jax.Array, kind: jax.Array, m: jax.Array, l: jax.Array, *,
                         end_ready: Any, end_smem: Any, slot: jax.Array, q_pos: jax.Array,
                         q_path: Any, k_start: jax.Array, window: int | None
                         ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One kv-block of the base-2 online softmax over the rows of logits `t` [rows, keys]: on a
    PARTIAL block the element mask (after waiting for its `end` tile, slot `slot` of `end_smem`)
    sets hidden pairs to -inf; then (p, alpha, m_new, l_new) with p = exp2(t - m_new), alpha =
    exp2(m - m_new) the factor that rescales what was accumulated, l_new = l alpha + sum p."""
    shape = t.shape

    def masked(t):
        plgpu.barrier_wait(end_ready)
        ends, k_path = read_positions(end_smem, slot, window)
        mask = tree_mask_tile(q_pos, k_start, ends, shape, key_axis=1)
        mask = window_mask_tile(mask, q_path, k_path, shape, 1, window)
        return jnp.where(mask, t, -jnp.inf)

    t = lax.cond(kind == PARTIAL, masked, lambda t: t, t)
    m_new = jnp.maximum(m, t.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(t - lax.broadcast_in_dim(m_new, shape, [0]))
    return p, alpha, m_new, l * alpha + p.sum(axis=1)


def logits_base2(s: jax.Array, scale: float, softcap: float | None) -> jax.Array:
    """Raw q.k scores -> logits in base-2 units (scale, optional soft-cap, times log2 e)."""
    if softcap is None:
        return s * (scale * LOG2E)
    return jnp.tanh(s * (scale / softcap)) * (softcap * LOG2E)


def logits_grad_factor(t: jax.Array, scale: float, softcap: float | None) -> jax.Array | float:
    """d logit / d raw score at base-2 logits `t` (the chain rule through scale and soft-cap)."""
    if softcap is None:
        return scale
    tanh = t * (1.0 / (softcap * LOG2E))
    return scale * (1.0 - tanh * tanh)


def list_buffer(num_blocks: int) -> Any:
    """SMEM type of a CTA's block list over `num_blocks` candidate blocks."""
    return plgpu.SMEM((2, -(-num_blocks // LIST_CHUNK), LIST_CHUNK), jnp.int32)


def list_entry(table: Any, n: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(block, kind) of entry n of a block list held as [2, chunks, LIST_CHUNK] in SMEM."""
    chunk, i = lax.div(n, LIST_CHUNK), lax.rem(n, LIST_CHUNK)
    return table[0, chunk, i], table[1, chunk, i]


def fetch_table(src: Any, dst: Any, ready: Any, wg: jax.Array, producer: int = PRODUCER) -> None:
    """The producer warpgroup (index `producer`) TMAs the CTA's block list into SMEM; every
    warpgroup waits for it."""

    @pl.when(wg == producer)
    def _():
        plgpu.copy_gmem_to_smem(src, dst, ready.at[0])

    plgpu.barrier_wait(ready.at[0])


def fetch_tiles(pairs: Sequence[tuple[Any, Any]], ready: Any, first: jax.Array) -> None:
    """TMA (GMEM src, SMEM dst) pairs with barriers ready[first + i] and wait for all of them."""
    for i, (src, dst) in enumerate(pairs):
        plgpu.copy_gmem_to_smem(src, dst, ready.at[first + i])
    for i in range(len(pairs)):
        plgpu.barrier_wait(ready.at[first + i])


def store_tiles(pairs: Sequence[tuple[Any, Any]]) -> None:
    """Write (SMEM src, GMEM dst) pairs after making register stores visible to the TMA unit."""
    plgpu.commit_smem()
    for src, dst in pairs:
        plgpu.copy_smem_to_gmem(src, dst)
    plgpu.wait_smem_to_gmem(0)


def launch(kernel: Callable[..., None], out_type: Any, scratch: Sequence[Any],
           grid: tuple[int, int, int], grid_names: tuple[str, str, str], interpret: Any,
           warpgroups: int = CONSUMERS + 1) -> Any:
    """A warp-specialized plgpu.kernel of `warpgroups` warpgroups: the compute warpgroups plus
    one TMA warpgroup (Hopper: CONSUMERS + 1; the Blackwell forward: 1 + 1).

    `plgpu.kernel` types its outputs as invariant across mesh axes whatever its inputs are; inside
    `shard_map` they are cast to vary like the inputs (`jtree.kernels.varying_axes`), which the custom_vjp
    needs of its cotangents."""

    def call(*args: jax.Array) -> Any:
        outs = plgpu.kernel(
            kernel,
            out_type=out_type,
            scratch_types=list(scratch),
            grid=grid,
            grid_names=grid_names,
            num_threads=warpgroups,
            thread_name="wg",
            compiler_params=plgpu.CompilerParams(
                approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
            interpret=interpret,
        )(*args)
        return varying_like(outs, *args)

    return call
