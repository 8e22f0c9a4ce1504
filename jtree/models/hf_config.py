"""Reading a Hugging Face `config.json` into jtree config fields, refusing what jtree cannot honour.

transformers silently keeps any key it does not know; a training library must not: a field such as
`rope_scaling` or `use_sliding_window` changes the math, and ignoring it would train a different
model than the checkpoint's. So every key of config.json is either mapped to a jtree field, checked
against the values jtree implements, or listed as metadata without effect on the computation;
anything else is an error naming the field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

REQUIRED = object()

# Generic PretrainedConfig keys that never change a forward or backward pass.
METADATA_KEYS = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "output_attentions",
    "output_hidden_states", "return_dict", "tokenizer_class", "_attn_implementation_autoset",
})

Check = Callable[[Any, Mapping[str, Any]], str | None]  # (value, whole config) -> error or None


def read_config(
    hf: Mapping[str, Any],
    architecture: str,
    *,
    fields: Mapping[str, Any],
    checks: Mapping[str, Check],
    inert: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """Values of `fields` (HF key -> default, or REQUIRED) after validating every key of `hf`.

    `checks` maps keys to functions returning an error message for a value jtree cannot honour
    (they also run when the key is absent, with value None). `inert` lists architecture-specific
    keys accepted without a mapping here: keys irrelevant given the checked ones (`sliding_window`
    when sliding windows are off) and keys the caller reads itself (`ROPE_KEYS`, see
    `rope_theta`). A missing or null optional field takes its default, as transformers does.
    """
    known = set(fields) | set(checks) | inert | METADATA_KEYS
    for key in sorted(hf):
        if key not in known:
            raise ValueError(
                f"config.json: field {key!r} is not supported for {architecture} (jtree refuses "
                "fields it does not implement rather than ignoring them)"
            )
    for key, check in checks.items():
        problem = check(hf.get(key), hf)
        if problem:
            raise ValueError(f"config.json: {key} = {hf.get(key)!r}: {problem}")
    out = {}
    for key, default in fields.items():
        value = hf.get(key)
        if value is None:
            if default is REQUIRED:
                raise ValueError(f"config.json: missing field {key!r} ({architecture})")
            value = default
        out[key] = value
    return out


def equals(expected: Any, *, default_ok: bool = True) -> Check:
    """A check accepting only `expected` (or an absent key when `default_ok`)."""

    def check(value: Any, hf: Mapping[str, Any]) -> str | None:
        if value is None and default_ok:
            return None
        if value != expected:
            return f"only {expected!r} is supported"
        return None

    return check


def renamed(hf: Mapping[str, Any], aliases: Mapping[str, str]) -> dict[str, Any]:
    """`hf` with alias keys renamed to their canonical names (e.g. transformers 5 writes Qwen3-MoE's
    `num_experts` as `num_local_experts`); both present with different values is an error."""
    out = dict(hf)
    for alias, name in aliases.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if out.get(name) is not None and value is not None and out[name] != value:
            raise ValueError(f"config.json: {alias} = {value!r} conflicts with {name} = "
                             f"{out[name]!r}")
        if out.get(name) is None:
            out[name] = value
    return out


ROPE_KEYS = frozenset({"rope_theta", "rope_parameters", "rope_scaling", "partial_rotary_factor"})
# `rope_config`'s `types` of an architecture with plain RoPE only.
DEFAULT_ROPE_ONLY: Mapping[str, frozenset[str]] = {"default": frozenset()}


def rope_config(hf: Mapping[str, Any], default_theta: float, default_partial: float,
                types: Mapping[str, frozenset[str]] = DEFAULT_ROPE_ONLY
                ) -> tuple[float, float, str, dict[str, Any]]:
    """(rope_theta, partial_rotary_factor, rope type, the type's parameters) from the top-level
    keys (transformers 4) and/or `rope_parameters` / `rope_scaling` (transformers 5 writes the
    first, the Hub's Llama 3 the second). `types` maps each RoPE type the caller implements to
    the parameter keys it takes (Llama 3's `factor`, ...); any other type (linear, dynamic, ...)
    is refused naming the field, and so are values that disagree between the places."""
    found: dict[str, set[Any]] = {"rope_theta": set(), "partial_rotary_factor": set()}
    for key in found:
        if hf.get(key) is not None:
            found[key].add(float(hf[key]))
    rope_types: set[str] = set()
    params: dict[str, set[Any]] = {}
    for key in ("rope_parameters", "rope_scaling"):
        given = hf.get(key)
        if given is None:
            continue
        if not isinstance(given, Mapping):
            raise ValueError(f"config.json: {key} = {given!r}: expected an object")
        rope_type = given.get("rope_type", given.get("type", "default"))
        if rope_type not in types:
            raise ValueError(
                f"config.json: {key}.rope_type = {rope_type!r}: only RoPE of type "
                f"{' or '.join(map(repr, types))} is supported for this architecture (other "
                "scalings change the positions' math)")
        rope_types.add(rope_type)
        extra = sorted(set(given) - {"rope_type", "type", *found, *types[rope_type]})
        if extra:
            raise ValueError(f"config.json: {key}.{extra[0]} = {given[extra[0]]!r} is not "
                             "supported")
        for name in found:
            if given.get(name) is not None:
                found[name].add(float(given[name]))
        for name in types[rope_type]:
            if given.get(name) is not None:
                params.setdefault(name, set()).add(given[name])
    if len(rope_types) > 1:
        raise ValueError(f"config.json: conflicting rope_type values {sorted(rope_types)} in "
                         "rope_parameters and rope_scaling")
    for name, values in {**found, **params}.items():
        if len(values) > 1:
            raise ValueError(f"config.json: conflicting {name} values {sorted(values)}")
    theta, partial = found["rope_theta"], found["partial_rotary_factor"]
    return (theta.pop() if theta else default_theta, partial.pop() if partial else default_partial,
            rope_types.pop() if rope_types else "default",
            {name: values.pop() for name, values in params.items()})


def rope_settings(hf: Mapping[str, Any], default_theta: float,
                  default_partial: float) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) of a model with plain RoPE (`rope_config`)."""
    theta, partial, _, _ = rope_config(hf, default_theta, default_partial)
    return theta, partial


def whole_head(partial: float) -> None:
    """Refuse a `partial_rotary_factor` other than 1 (an architecture that rotates whole heads)."""
    if partial != 1.0:
        raise ValueError(f"config.json: partial_rotary_factor = {partial!r}: only 1.0 (RoPE on "
                         "the whole head) is supported for this architecture")


def rope_theta(hf: Mapping[str, Any], default: float) -> float:
    """The RoPE base of a model that rotates whole heads: a `partial_rotary_factor` other than 1
    is refused (Qwen3 and Qwen3-MoE apply RoPE to the full head dimension)."""
    theta, partial = rope_settings(hf, default, 1.0)
    whole_head(partial)
    return theta
