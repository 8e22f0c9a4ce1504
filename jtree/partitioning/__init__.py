"""Trees larger than a row: capacity partitioning, the exact DPs and their path skeletons, and redundancy-free training (plan, layout, schedule, executor)."""
