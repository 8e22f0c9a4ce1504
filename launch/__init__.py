"""What a user runs to train on a pod, as `python -m jtree.launch.NAME`: training, memory plans,
lowering a step, the device check, sample data; the pod and cluster scripts sit beside them. The
benchmarks have a room of their own, `jtree.launch.bench`."""
