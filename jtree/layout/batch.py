"""The device batch: the one definition of what the jitted step reads (docs/design.md section 3).

`DeviceBatch` is a registered pytree (frozen dataclass) of the arrays of one micro-batch, each
[rows, S] unless noted, or the same pytree with a leading micro-batch axis [M, rows, S] for a step
(`stack`). The host-side `jtree.layout.linearize.TreeBatch` holds one plus the layout that maps results
back to paths. Fields, dtypes and padding values (what an all-padding row holds: `padding`):

- `tokens` int32 (0), `pos` int32 (0): token ids and RoPE positions (index in the token's path)
- `mask`: the `jtree.kernels.TreeMask` every attention layer reads: `end` int32 (j + 1: a padding
  token attends only to itself) and, for a part of a tree split redundancy-free, `prefix_end`
- `pred` int32 (-1): row-local index of the token whose logits score this token
- `node` int32 (-1): row-local node index
- `valid` bool (False): real tokens; the attention kernels skip the query blocks that hold none
  (`jtree.kernels.TreeMask.real`), so a padding token's attention output is not the mask's
- `path_count` int32 (0): paths through the token (its multiplicity in the per-path baseline)
- `coefficients`: the loss coefficients W, P, N, the sequence-level P/N at the paths' last tokens,
  old (and optional reference and distillation teacher) log-probs, float32 (0)
- `score_index` [rows, K] int32 (-1): the row-local positions the loss reads (None: every token)
- `gdn`: gated-delta-rule chunk tables (`GdnTables`), None for models without linear attention
- `row_norm` [rows] float32 (0): each row's share of the batch normalizer when the coefficients
  arrive raw (`jtree.objectives.objective.normalize_coefficients`); None when they arrive normalized
- `prefix_pred` [rows, P] int32 (-1): the prefix chain of a redundancy-free part (`jtree.partitioning.redundancy_free`)
- `router_load`: (counts [E], total []) of the larger forward this batch is a piece of, for the
  MoE load-balancing loss of a redundancy-free part (`jtree.models.moe`); no row axis (only the
  micro-batch axis of a step)
- `pairs`: the (path, trained token) pairs (`PathPairs`, [rows, Q], `jtree.objectives.pairs`)
  of PPO with a critic and of the off-policy weights, None otherwise
- `halo` [rows, c * H] int32: under context parallelism over c devices, the positions whose
  hidden states device k sends to the others (slots [k H, (k + 1) H), ascending, unused slots
  repeating the last real position: `jtree.parallel.context`); None otherwise
- `routed_experts` [rows, S, L, k] int32 (-1): routing replay (docs/rl.md, "Routing replay"):
  per token and per MoE layer (the model's MoE layers in order), the k experts the rollout
  engine chose; -1 where the token keeps the trainer's own top-k. None: no replay
- `teacher_dist` [rows, S, V] float32 (0): the full-vocabulary distillation estimator's teacher
  log-softmax over the vocabulary V for every token (`objective.distill.estimator: full`,
  `jtree.objectives.logprobs.token_distributions`); None otherwise

Index-valued fields (`mask.end`, `pred`, `score_index`, `halo`, ...) hold positions in the whole
row, also when the row is split over the `context` mesh axis (docs/context_parallel.md).

Construction checks dtypes and shapes whenever every leaf is an array (host arrays, traced
values, `jax.ShapeDtypeStruct`s) and names the offending field; pytrees of other leaves (partition
specs) are not checked. Equality is identity (arrays have no single truth value).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jtree.kernels import TreeMask


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class LossCoefficients:
    """Per-token loss inputs (`jtree.objectives.losses`): W, P, N, the sequence-level `seq_pos` / `seq_neg`
    (each path's summed c*A, at the path's last token: GSPO's P/N) and the old / reference /
    distillation teacher (`objective.distill`) policy log-probs."""

    weight: Any
    adv_pos: Any
    adv_neg: Any
    seq_pos: Any
    seq_neg: Any
    old_logprobs: Any
    ref_logprobs: Any = None
    teacher_logprobs: Any = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class PathPairs:
    """One entry per (path, trained token) of the rows' paths, path after path, each path's
    tokens in order, [rows, Q]: `index` int32 the token's row-local position (-1: padding),
    `coef` float32 its loss coefficient c[p,t], `last` bool the path's last pair (True on
    padding). Per path because what they carry differs between the paths through a shared
    token. PPO's critic (`jtree.objectives.critic`) reads `reward` float32, the path's reward
    at its last pair (0 elsewhere): GAE sums the path's own future. The off-policy weights
    (`jtree.objectives.off_policy`) read `advantage` float32 A[p,t], `behavior` float32 the
    path's behavior log-prob mu_p(t) and `end` int32 the row position of the path's last token
    (where GSPO reads the path's ratio; -1 on padding): each path's weight of a shared token
    is its own. Fields a batch's objective does not read are None."""

    index: Any
    coef: Any
    last: Any
    reward: Any = None
    advantage: Any = None
    behavior: Any = None
    end: Any = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class GdnTables:
    """Chunk tables of the gated delta rule (`jtree.layout.gdn_tables`): `chunk_tokens` [rows, NC, C]
    (-1), `chunk_src` [rows, NC] (0), `token_slot` [rows, S] (-1); `export_slots` [rows, E] lists
    the buffer slots whose states later redundancy-free parts start from (None otherwise);
    `context_exports` [rows, c X] lists, per device of a row split over the context mesh axis,
    the chunks whose final states other devices' chunks enter from, and `conv_halo` [rows, c W]
    the positions whose conv inputs each device sends to later ones (`jtree.layout.context_gdn_tables`;
    None otherwise)."""

    chunk_tokens: Any
    chunk_src: Any
    token_slot: Any
    export_slots: Any = None
    context_exports: Any = None
    conv_halo: Any = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class DeviceBatch:
    """The step's device inputs (see the module docstring)."""

    tokens: Any
    pos: Any
    mask: TreeMask
    pred: Any
    node: Any
    valid: Any
    path_count: Any
    coefficients: LossCoefficients
    score_index: Any = None
    gdn: GdnTables | None = None
    row_norm: Any = None
    prefix_pred: Any = None
    router_load: tuple[Any, Any] | None = None
    pairs: PathPairs | None = None
    halo: Any = None
    routed_experts: Any = None
    teacher_dist: Any = None

    def __post_init__(self) -> None:
        leaves = jax.tree_util.tree_leaves(self)
        if hasattr(self.tokens, "shape") and all(hasattr(x, "shape") and hasattr(x, "dtype")
                                                 for x in leaves):
            _check(self)

    @property
    def shape(self) -> tuple[int, ...]:
        """The leading [..., rows, S] shape."""
        return tuple(self.tokens.shape)

    def with_coefficients(self, **changes: Any) -> DeviceBatch:
        """This batch with some loss coefficients replaced (recomputed old log-probs, a
        reference policy's, normalized W, P, N)."""
        return dataclasses.replace(
            self, coefficients=dataclasses.replace(self.coefficients, **changes))


# Dtype of every field (by its path in the pytree); the row axes each field carries after the
# leading [..., rows] axes: "S" a token axis, other letters free sizes. A float32 field may be
# float64 under jax_enable_x64: in a float64 run (`jtree.config.runtime.DTYPES`) the step computes
# coefficients from its float64 activations (the critic's advantages).
_SCHEMA: dict[str, tuple[Any, str]] = {
    "tokens": (np.int32, "S"), "pos": (np.int32, "S"), "mask.end": (np.int32, "S"),
    "mask.prefix_end": (np.int32, "P"), "pred": (np.int32, "S"), "node": (np.int32, "S"),
    "valid": (np.bool_, "S"), "path_count": (np.int32, "S"),
    "coefficients.weight": (np.float32, "S"), "coefficients.adv_pos": (np.float32, "S"),
    "coefficients.adv_neg": (np.float32, "S"), "coefficients.seq_pos": (np.float32, "S"),
    "coefficients.seq_neg": (np.float32, "S"), "coefficients.old_logprobs": (np.float32, "S"),
    "coefficients.ref_logprobs": (np.float32, "S"),
    "coefficients.teacher_logprobs": (np.float32, "S"), "score_index": (np.int32, "K"),
    "gdn.chunk_tokens": (np.int32, "NC"), "gdn.chunk_src": (np.int32, "N"),
    "gdn.token_slot": (np.int32, "S"), "gdn.export_slots": (np.int32, "E"),
    "gdn.context_exports": (np.int32, "X"), "gdn.conv_halo": (np.int32, "W"),
    "row_norm": (np.float32, ""), "prefix_pred": (np.int32, "P"),
    "pairs.index": (np.int32, "Q"), "pairs.coef": (np.float32, "Q"),
    "pairs.last": (np.bool_, "Q"), "pairs.reward": (np.float32, "Q"),
    "pairs.advantage": (np.float32, "Q"), "pairs.behavior": (np.float32, "Q"),
    "pairs.end": (np.int32, "Q"),
    "halo": (np.int32, "H"), "routed_experts": (np.int32, "SLk"),
    "teacher_dist": (np.float32, "SV"),
}


def field_axes(name: str) -> str:
    """The axes of field `name` (its dotted path, e.g. 'mask.end') after the leading
    [..., rows] axes, one schema letter each: 'S' the token axis, others free sizes."""
    return _SCHEMA[name][1]


def field_name(path: Sequence[Any]) -> str:
    """The dotted field name of a pytree key path into a `DeviceBatch` ('mask.end')."""
    return ".".join(str(getattr(k, "name", getattr(k, "idx", k))) for k in path)


_REQUIRED = ("tokens", "pos", "mask", "mask.end", "pred", "node", "valid", "path_count",
             "coefficients", "coefficients.weight", "coefficients.adv_pos",
             "coefficients.adv_neg", "coefficients.seq_pos", "coefficients.seq_neg",
             "coefficients.old_logprobs")


def _field(batch: DeviceBatch, name: str) -> Any:
    value = batch
    for part in name.split("."):
        value = getattr(value, part)
        if value is None:
            return None
    return value


def _named_leaves(batch: DeviceBatch) -> list[tuple[str, Any]]:
    flat = jax.tree_util.tree_flatten_with_path(batch)[0]
    return [(field_name(path), x) for path, x in flat]


def _check(batch: DeviceBatch) -> None:
    """Dtypes as in `_SCHEMA`; every field's leading axes those of `tokens`, and every named axis
    (S, P, K, ...) one size across fields."""
    if len(batch.tokens.shape) < 2:
        raise ValueError(f"DeviceBatch.tokens: shape {batch.tokens.shape} is not [..., rows, S]")
    lead = tuple(batch.tokens.shape[:-1])
    sizes = {"S": batch.tokens.shape[-1]}
    for name in _REQUIRED:
        if _field(batch, name) is None:
            raise ValueError(f"DeviceBatch.{name}: required (None given)")
    for name, x in _named_leaves(batch):
        if name.startswith("router_load"):
            continue
        dtype, axes = _SCHEMA[name]
        float64_run = (np.dtype(dtype) == np.float32 and np.dtype(x.dtype) == np.float64
                       and jax.config.jax_enable_x64)
        if np.dtype(x.dtype) != np.dtype(dtype) and not float64_run:
            raise ValueError(f"DeviceBatch.{name}: dtype {np.dtype(x.dtype)}, expected "
                             f"{np.dtype(dtype).name}")
        shape = tuple(x.shape)
        ok = len(shape) == len(lead) + len(axes) and shape[:len(lead)] == lead
        for a, n in zip(axes, shape[len(lead):]):
            ok = ok and sizes.setdefault(a, n) == n
        if not ok:
            dims = ", ".join([*map(str, lead), *axes])
            known = ", ".join(f"{a}={sizes[a]}" for a in axes if a in sizes)
            raise ValueError(f"DeviceBatch.{name}: shape {shape}, expected [{dims}]"
                             + (f" with {known}" if known else ""))


def padding(rows: int, seq_len: int, *, score_len: int | None, gdn_chunk_size: int | None = None,
            gdn_chunks: int | None = None, prefix_len: int | None = None) -> DeviceBatch:
    """An all-padding batch [rows, seq_len]: every token attends only to itself, carries zero
    loss weight and sits in no GDN chunk. `score_len` sets the `score_index` width (None: no
    scoring rows); `gdn_chunk_size`, `gdn_chunks` add empty chunk tables; `prefix_len` P adds an
    all-padding prefix layout, with the own tokens' `end` in combined coordinates (P + j + 1).
    Batch builders start from this and write their trees in."""
    shape = (rows, seq_len)
    p = prefix_len or 0
    end = np.broadcast_to(np.arange(p + 1, p + seq_len + 1, dtype=np.int32), shape).copy()
    prefix_end = None
    if prefix_len is not None:
        prefix_end = np.broadcast_to(np.arange(1, p + 1, dtype=np.int32), (rows, p)).copy()
    gdn = None
    if gdn_chunk_size is not None:
        if gdn_chunks is None:
            raise ValueError("gdn_chunks: needed with gdn_chunk_size")
        gdn = GdnTables(np.full((rows, gdn_chunks, gdn_chunk_size), -1, np.int32),
                        np.zeros((rows, gdn_chunks), np.int32), np.full(shape, -1, np.int32))
    zeros = [np.zeros(shape, np.float32) for _ in range(6)]
    return DeviceBatch(
        tokens=np.zeros(shape, np.int32), pos=np.zeros(shape, np.int32),
        mask=TreeMask(end, prefix_end), pred=np.full(shape, -1, np.int32),
        node=np.full(shape, -1, np.int32), valid=np.zeros(shape, bool),
        path_count=np.zeros(shape, np.int32), coefficients=LossCoefficients(*zeros),
        score_index=None if score_len is None else np.full((rows, score_len), -1, np.int32),
        gdn=gdn, prefix_pred=None if prefix_len is None else np.full((rows, p), -1, np.int32),
    )


def token_arrays(batch: DeviceBatch) -> dict[str, Any]:
    """The per-token [..., S] arrays of the batch by name (`end` for `mask.end`, the coefficients
    by their own names; the optional reference log-probs left out): the arrays themselves, so a
    builder that starts from `padding` fills the batch by writing into them."""
    c = batch.coefficients
    return {"tokens": batch.tokens, "pos": batch.pos, "end": batch.mask.end, "pred": batch.pred,
            "node": batch.node, "valid": batch.valid, "path_count": batch.path_count,
            "weight": c.weight, "adv_pos": c.adv_pos, "adv_neg": c.adv_neg,
            "seq_pos": c.seq_pos, "seq_neg": c.seq_neg, "old_logprobs": c.old_logprobs}


def _combine(batches: Sequence[DeviceBatch], how: Callable[[list[Any]], Any], what: str
             ) -> DeviceBatch:
    if not batches:
        raise ValueError(f"{what}: no batches")
    named = [dict(_named_leaves(b)) for b in batches]
    for i, n in enumerate(named[1:], 1):
        if n.keys() != named[0].keys():
            diff = sorted(n.keys() ^ named[0].keys())
            raise ValueError(f"{what}: batch {i} differs from batch 0 in fields {diff}")
    return jax.tree_util.tree_map(lambda *xs: how(list(xs)), *batches)


def stack(batches: Sequence[DeviceBatch]) -> DeviceBatch:
    """Equally shaped micro-batches [rows, ...] -> one step batch [M, rows, ...]."""
    return _combine(batches, np.stack, "stack")


def concatenate_rows(batches: Sequence[DeviceBatch]) -> DeviceBatch:
    """Batches of the same row length -> one batch with all their rows (e.g. the data shards of
    one host), in order."""
    return _combine(batches, np.concatenate, "concatenate_rows")
