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


ROPE_KEYS = frozenset({"rope_theta", "rope_parameters", "rope_scaling"})


def rope_theta(hf: Mapping[str, Any], default: float) -> float:
    """The RoPE base from `rope_theta` (transformers 4) or `rope_parameters` / `rope_scaling`
    (transformers 5); any RoPE type but the default (YaRN, linear, dynamic, ...) is refused."""
    thetas = set()
    if hf.get("rope_theta") is not None:
        thetas.add(float(hf["rope_theta"]))
    for key in ("rope_parameters", "rope_scaling"):
        params = hf.get(key)
        if params is None:
            continue
        if not isinstance(params, Mapping):
            raise ValueError(f"config.json: {key} = {params!r}: expected an object")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"config.json: {key}.rope_type = {rope_type!r}: only the default RoPE is "
                "supported (no YaRN, linear or dynamic scaling)"
            )
        extra = sorted(set(params) - {"rope_type", "type", "rope_theta"})
        if extra:
            raise ValueError(f"config.json: {key}.{extra[0]} = {params[extra[0]]!r} is not "
                             "supported")
        if params.get("rope_theta") is not None:
            thetas.add(float(params["rope_theta"]))
    if len(thetas) > 1:
        raise ValueError(f"config.json: conflicting rope_theta values {sorted(thetas)}")
    return thetas.pop() if thetas else default
