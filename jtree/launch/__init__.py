"""Entry points, run as `python -m jtree.launch.NAME`: training, lowering, memory plans, sample data,
the Mosaic GPU interpreter and the benchmarks with their shared harness."""
