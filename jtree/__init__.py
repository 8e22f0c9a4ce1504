"""jtree: exact training of LLMs on tree-shaped token data in JAX.

The public API: build trees (`TrajectoryTree`), lay them out (`linearize`, `unlinearize`,
`linearize_baseline`; a layout's device arrays are a `DeviceBatch`), split trees larger than
memory (`partition`), score them (`token_logprobs`), turn rewards into advantages
(`with_advantages`) and train on them (`sft_loss`, `ppo_loss`, `gspo_loss`, on `path_sum`).
"""

from jtree.layout.baseline import linearize_baseline, unlinearize_baseline
from jtree.layout.batch import DeviceBatch
from jtree.layout.coefficients import batch_normalizer, token_coefficients
from jtree.layout.linearize import TreeBatch, linearize, unlinearize
from jtree.objectives.advantages import with_advantages
from jtree.objectives.logprobs import token_logprobs
from jtree.objectives.losses import gspo_loss, ppo_loss, sft_loss
from jtree.objectives.path_sum import path_sum
from jtree.partitioning.partition import PartitionResult, partition
from jtree.trees.jsonl import read_sequence_groups, read_trees, write_sequence_groups, write_trees
from jtree.trees.part import TreePart
from jtree.trees.tree import TrajectoryTree, TreeStats

__all__ = [
    "DeviceBatch",
    "PartitionResult",
    "TrajectoryTree",
    "TreeBatch",
    "TreePart",
    "TreeStats",
    "batch_normalizer",
    "gspo_loss",
    "linearize",
    "linearize_baseline",
    "partition",
    "path_sum",
    "ppo_loss",
    "read_sequence_groups",
    "read_trees",
    "sft_loss",
    "token_coefficients",
    "token_logprobs",
    "unlinearize",
    "unlinearize_baseline",
    "with_advantages",
    "write_sequence_groups",
    "write_trees",
]
