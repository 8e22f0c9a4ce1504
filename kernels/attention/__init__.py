"""The tree-attention implementations, one module per backend, that `jtree.kernels.tree_attention`
dispatches to; with `auto`'s calibration on CPU and what the flash-style kernels share. Call them
through `tree_attention`, which checks the mask and refuses what an implementation cannot honour."""
