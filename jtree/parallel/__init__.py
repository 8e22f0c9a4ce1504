"""Parallelism: the mesh's sharding rules, the device-side parts of context parallelism, the scanned-layer stack and multi-host start-up."""
