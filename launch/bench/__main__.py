"""`python -m jtree.launch.bench`: the end-to-end bench (`jtree.launch.bench.step`)."""

from jtree.launch.bench.step import main

if __name__ == "__main__":
    raise SystemExit(main())
