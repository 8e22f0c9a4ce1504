"""Hugging Face checkpoints in and out: `load(path) -> (config, model)`, `save(model, config,
path)`, driven by the Hugging Face mapping of each architecture record
(`jtree.models.architectures`).

torch and transformers are never imported here (only by `jtree.hf.torch_reference`, used by
`jtree compare-torch` and the tests).
"""

from jtree.hf.load_save import (
    carries_mtp,
    load,
    mtp_depth_in,
    read_hf_config,
    read_model_config,
    save,
    to_hf_tensors,
)

__all__ = ["carries_mtp", "load", "mtp_depth_in", "read_hf_config", "read_model_config", "save",
           "to_hf_tensors"]
