"""Benchmarks and their harness: scripts a person runs on a workstation or a lent device to
measure speed and memory, apart from what a user runs to train on a pod (`jtree.launch`). Each
prints a table and writes JSON (and a PNG where a picture reads better) under `bench_out/`.

    python -m jtree.launch.bench            # the end-to-end tree-vs-baseline bench (`step`)
    python -m jtree.launch.bench.peer       # jtree against transformers training every path
"""
