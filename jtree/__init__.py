"""jtree: exact training of LLMs on tree-shaped token data in JAX.

The public API: build trees (`TrajectoryTree`), lay them out (`linearize`, `unlinearize`,
`linearize_baseline`; a layout's device arrays are a `DeviceBatch`), split trees larger than
memory (`partition`), score them (`token_logprobs`) and train on them (`sft_loss`, `ppo_loss`).
"""

from jtree.baseline import linearize_baseline, unlinearize_baseline
from jtree.batch import DeviceBatch
from jtree.linearize import TreeBatch, linearize, unlinearize
from jtree.logprobs import token_logprobs
from jtree.loss import batch_normalizer, ppo_loss, sft_loss, token_coefficients
from jtree.partition import PartitionResult, TreePart, partition
from jtree.tree import TrajectoryTree, TreeStats
from jtree.tree_jsonl import read_sequence_groups, read_trees, write_sequence_groups, write_trees

__all__ = [
    "DeviceBatch",
    "PartitionResult",
    "TrajectoryTree",
    "TreeBatch",
    "TreePart",
    "TreeStats",
    "batch_normalizer",
    "linearize",
    "linearize_baseline",
    "partition",
    "ppo_loss",
    "read_sequence_groups",
    "read_trees",
    "sft_loss",
    "token_coefficients",
    "token_logprobs",
    "unlinearize",
    "unlinearize_baseline",
    "write_sequence_groups",
    "write_trees",
]
