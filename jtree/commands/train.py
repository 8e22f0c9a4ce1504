"""`jtree train --config CFG [--resume] [key.path=value ...]`: train on trees from JSONL.

One process or many (`jtree.parallel.distributed`: `launch/local_multihost.sh`, TPU pod and SLURM recipes
in launch/). The step runs over the ('data', 'fsdp', 'context', 'model') mesh of the config: data
parallel over rows, parameters and optimizer state sharded over `fsdp`, rows' tokens over
`context`, tensor parallel inside shard_map. Prints one line per step (loss, baseline-equivalent and tree
tokens/s, POR, ERR, grad norm, host/device time; with `run.mode=auto` the mode each step
chose and why), writes metrics as JSONL (and TensorBoard),
checkpoints with Orbax (`--resume` continues from the latest one, data order included, after
listing the config keys that changed and refusing those that change the model or the data order),
announces and times every compile of the step (kept out of tokens/s), and ends with a summary. With `run.compare_baseline` it checks tree-vs-baseline log-prob equivalence with
the trained parameters and times the tree step against the per-path baseline step on the same
trees (alternating, medians). `python -m jtree.launch.train` takes the same arguments. Errors:
`jtree.cli`.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of a training run, shared by `jtree train` and `jtree.launch.train`."""
    parser.add_argument("--config", default=None, help="YAML config file")
    # `--resume=auto` is an option string of its own (argparse matches whole strings first), so
    # `--resume` takes no value and overrides may follow it.
    parser.add_argument("--resume", action="store_const", const="required", default="no",
                        help="continue from the latest checkpoint in checkpoint.dir (an error "
                             "without one)")
    parser.add_argument("--resume=auto", action="store_const", const="auto", dest="resume",
                        help="continue when checkpoint.dir holds a checkpoint, else start from "
                             "scratch (what a launcher that restarts preempted jobs passes)")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train on trees from JSONL (a YAML config + overrides)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Imported here so other commands start without building models and train steps.
    from jtree.config import load_config
    from jtree.parallel.distributed import initialize_from_env
    from jtree.training.run import train

    initialize_from_env()  # before anything touches a device
    if args.config is None:
        print("no --config: training with the built-in defaults (jtree.config.TrainConfig) and "
              "the overrides given", flush=True)
    train(load_config(args.config, args.overrides), resume=args.resume)
    return 0
