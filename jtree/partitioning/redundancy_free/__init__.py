"""Redundancy-free training of trees larger than memory (docs/design.md section 5)."""
