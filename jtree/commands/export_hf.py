"""`jtree export-hf --config CFG --checkpoint DIR --out OUT`: a trained model as a Hugging Face
directory.

Restores the parameters of an Orbax training checkpoint (`jtree.training.checkpoint`, the latest step or
`--step`) onto this host, rebuilds the model of the run's config (same `key=value` overrides as
the run) and writes it with `jtree.hf.save`, which transformers' `from_pretrained` loads. The
checkpoint of a `model.lora` run holds the frozen base and the adapters: `--merge-lora` writes the
merged model W + (alpha / r) A B, the very parameters the run trained (`jtree.models.lora`);
`--peft-adapters` writes the adapters unmerged, as peft saves them (`jtree.hf.peft_adapters`), for
`peft.PeftModel.from_pretrained` or a server to apply to the base model. The multi-token-prediction
modules of an `objective.mtp_weight` run are written as the `mtp.*` tensors where the
architecture's checkpoints have them (Qwen3-Next, Qwen3.5), else left out, which is printed.
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jtree.config import TrainConfig, load_config
from jtree.models import create_model
from jtree.models.lora import model_params, trainable, with_lora
from jtree.parallel.layer_stack import layer_groups
from jtree.step.optimizer import TrainState, make_optimizer
from jtree.training.checkpoint import Checkpointer, abstract_like


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export-hf", help="write a training checkpoint as a Hugging Face directory")
    p.add_argument("--config", required=True, help="the run's YAML config")
    p.add_argument("--checkpoint", required=True, help="the run's checkpoint.dir")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dtype", default=None, help="stored dtype (default: the parameter dtype)")
    p.add_argument("--copy-from", default=None,
                   help="HF directory the run started from (tokenizer files, token ids; with "
                        "--peft-adapters: the base model recorded, default model.init_from)")
    lora = p.add_mutually_exclusive_group()
    lora.add_argument("--merge-lora", action="store_true",
                      help="merge the LoRA adapters of a model.lora run into its base weights")
    lora.add_argument("--peft-adapters", action="store_true",
                      help="write only the LoRA adapters of a model.lora run, unmerged, in peft's "
                           "format (adapter_config.json, adapter_model.safetensors)")
    p.add_argument("overrides", nargs="*", help="the run's key.path=value overrides")
    p.set_defaults(func=run)


def restored_params(cfg: TrainConfig, checkpoint: str, step: int | None = None
                    ) -> tuple[Any, int]:
    """(parameters, step) of a checkpoint of the run `cfg` (its latest step or `step`), on the
    default device: the model's own, or a `model.lora` run's `LoraParams` (base and adapters). A
    step the directory does not hold is refused, listing the steps it does."""
    arch, mcfg, lora = cfg.model.architecture, cfg.model.config, cfg.model.lora
    critic, model_kw = cfg.objective.critic, cfg.model_args
    optimizer = make_optimizer(cfg.optim, None if critic is None else critic.learning_rate)

    def init() -> TrainState:
        params = nnx.split(create_model(arch, mcfg, cfg.runtime, **model_kw))[1]
        params = with_lora(params, lora, cfg.run.seed)
        return TrainState(params, optimizer.init(trainable(params)), jnp.zeros((), jnp.int32))

    ckpt = Checkpointer(checkpoint, async_save=False)
    try:
        steps = ckpt.steps()
        if not steps:
            raise ValueError(f"--checkpoint: no checkpoint in {ckpt.directory}")
        if step is not None and step not in steps:
            raise ValueError(f"--step {step}: {ckpt.directory} holds no checkpoint of step "
                             f"{step} (its steps: {', '.join(map(str, steps))})")
        step = steps[-1] if step is None else step
        shapes = jax.eval_shape(init)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        state = ckpt.restore(step, abstract_like(shapes, jax.tree.map(lambda _: device, shapes)),
                             layer_groups=layer_groups(mcfg.decoder().layers)).state
    finally:
        ckpt.close()
    return state.params, step


def trained_model(config_path: str, overrides: list[str], checkpoint: str,
                  step: int | None = None, *, merge_lora: bool = False
                  ) -> tuple[nnx.Module, object, int]:
    """(model with the checkpoint's parameters, model config, the step) on the default device; a
    `model.lora` run's adapters merged into the base (which `merge_lora` must ask for). A run
    with a critic has a value head or a separate critic, which the checkpoint holds and the HF
    export leaves out."""
    cfg = load_config(config_path, overrides)
    if merge_lora != (cfg.model.lora is not None):
        raise ValueError("--merge-lora: the run's config has no model.lora" if merge_lora else
                         "--merge-lora: the checkpoint of a model.lora run holds adapters beside "
                         "the frozen base; pass --merge-lora to write the merged model, or "
                         "--peft-adapters to write the adapters alone")
    params, step = restored_params(cfg, checkpoint, step)
    arch, mcfg = cfg.model.architecture, cfg.model.config
    graphdef = nnx.split(nnx.eval_shape(
        lambda: create_model(arch, mcfg, cfg.runtime, **cfg.model_args)))[0]
    return nnx.merge(graphdef, model_params(params)), mcfg, step


def export_peft_adapters(config_path: str, overrides: list[str], checkpoint: str, out: str, *,
                         step: int | None = None, dtype: str | None = None,
                         base_model: str | None = None) -> int:
    """Write the adapters of a `model.lora` run's checkpoint to `out` in peft's format
    (`jtree.hf.peft_adapters`); `base_model` (default: the run's `model.init_from`) is recorded
    as the model they apply to."""
    from jtree.hf.peft_adapters import save_peft_adapters

    cfg = load_config(config_path, overrides)
    if cfg.model.lora is None:
        raise ValueError(f"--peft-adapters: {config_path} has no model.lora, so its checkpoint "
                         "holds no adapters (export the model without --peft-adapters)")
    params, step = restored_params(cfg, checkpoint, step)
    save_peft_adapters(params, cfg.model.lora, cfg.model.config, out, dtype=dtype,
                       base_model=base_model or cfg.model.init_from)
    return step


def run(args: argparse.Namespace) -> int:
    from jtree.hf import carries_mtp, save

    if args.peft_adapters:
        step = export_peft_adapters(args.config, args.overrides, args.checkpoint, args.out,
                                    step=args.step, dtype=args.dtype, base_model=args.copy_from)
        print(f"wrote peft adapters to {args.out} from {args.checkpoint}, step {step}")
        return 0
    model, mcfg, step = trained_model(args.config, args.overrides, args.checkpoint, args.step,
                                      merge_lora=args.merge_lora)
    model.value_head = model.critic = None  # the policy only: HF's *ForCausalLM has no critic
    if model.mtp is not None and not carries_mtp(mcfg):
        model.mtp = None
        print(f"{type(mcfg).__name__} checkpoints have no multi-token-prediction tensors: the "
              "run's MTP modules are not written")
    save(model, mcfg, args.out, dtype=args.dtype, copy_from=args.copy_from)
    print(f"wrote {args.out} from {args.checkpoint}, step {step}")
    return 0
