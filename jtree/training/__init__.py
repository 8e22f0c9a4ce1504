"""The training run: the trainer, its data pipeline, checkpoints, metrics, compile log, reports and the tree == baseline check."""
