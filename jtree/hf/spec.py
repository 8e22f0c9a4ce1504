"""How a Hugging Face architecture maps onto a jtree model, as data.

Each supported architecture is one `Architecture` entry: how its `config.json` becomes a jtree
config (and back), which HF tensor every jtree parameter is stored as and in which layout
(transposed, permuted, ...) and which HF tensors are tied to others. (Placement on a device mesh
follows the train step's rules for `model_key`, `jtree.sharding`.) Loader, saver and the PyTorch comparison only read these tables, so adding an
architecture (or a per-architecture permutation such as a grouped projection) is a new entry, not
a new code path.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Array = Any  # numpy or jax array: layouts use only array methods, so both work (and eval_shape)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a jtree array is stored in the HF checkpoint.

    `to_hf(array, config)` gives the HF tensor, `from_hf(tensor, config)` its inverse. Both must
    use array methods only (`.T`, `.reshape`, `.transpose`) so they run on numpy arrays, jax
    arrays and abstract shapes alike.
    """

    name: str
    to_hf: Callable[[Array, Any], Array]
    from_hf: Callable[[Array, Any], Array]


SAME = Layout("same", lambda a, cfg: a, lambda a, cfg: a)
# nnx.Linear stores kernel [in, out]; torch.nn.Linear stores weight [out, in].
TRANSPOSED = Layout("transposed", lambda a, cfg: a.T, lambda a, cfg: a.T)


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """jtree parameters whose dotted path fully matches `pattern` are stored as the HF tensor
    `re.sub(pattern, hf_name, path)` in `layout`. The first matching rule of a table wins."""

    pattern: str
    hf_name: str
    layout: Layout = SAME


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One HF architecture (the `architectures[0]` of config.json) and its jtree counterpart.

    - `model_key`: key of `jtree.models.registry.ARCHITECTURES` (config and model classes).
    - `config_from_hf(hf_config, runtime)`: the jtree config; refuses fields it cannot honour.
      `runtime` holds jtree-only fields (attention_impl, dtypes) that config.json does not carry.
    - `config_to_hf(config)`: the config.json dict (without `architectures`/`torch_dtype`).
    - `tensors`: parameter name and layout table.
    - `tied(config)`: HF tensors that the HF model ties to another one (alias -> source), which a
      checkpoint may omit or contain as an exact copy.
    - `layer_types(config)`: the type of each decoder layer `model.layers.N`, for reports.
    """

    hf_name: str
    model_type: str
    model_key: str
    config_from_hf: Callable[[Mapping[str, Any], Mapping[str, Any]], Any]
    config_to_hf: Callable[[Any], dict[str, Any]]
    tensors: tuple[TensorRule, ...]
    tied: Callable[[Any], Mapping[str, str]]
    layer_types: Callable[[Any], Sequence[str]]

    def tensor_rule(self, path: str) -> tuple[str, Layout]:
        """HF tensor name and layout of the jtree parameter at dotted `path`."""
        for rule in self.tensors:
            if re.fullmatch(rule.pattern, path):
                return re.sub(rule.pattern, rule.hf_name, path), rule.layout
        raise ValueError(f"{self.hf_name}: jtree parameter {path!r} matches no tensor rule")


def dotted(path: Sequence[Any]) -> str:
    """('model', 'layers', 0, 'mlp') -> 'model.layers.0.mlp' (nnx state paths to names)."""
    return ".".join(str(p) for p in path)


# The Flax NNX layers' names and layouts against their torch.nn counterparts: nnx.Linear `kernel`
# [in, out] is torch `weight` [out, in]; nnx.Embed `embedding` is torch `weight` as is; norm
# weights and biases keep name and layout. Models with HF parameter names need nothing more.
NNX_TO_TORCH = (
    TensorRule(r"(.*)\.kernel", r"\1.weight", TRANSPOSED),
    TensorRule(r"(.*)\.embedding", r"\1.weight"),
    TensorRule(r".*\.(weight|bias)", r"\g<0>"),
)
