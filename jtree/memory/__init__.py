"""Memory planning: the step's arguments as sharded abstract shapes, reduced-depth compiles, and the per-device plan drawn from them."""
