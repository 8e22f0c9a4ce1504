"""Redundancy-free training of trees larger than memory (DESIGN.md section 5)."""
