"""Gated DeltaNet on trees: the gated delta rule with its state routed along parent indices
(`delta_rule`), the parallel tree scan of affine state maps (`tree_scan`) and a row split over the
context axis (`context`)."""
