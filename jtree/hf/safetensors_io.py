"""The safetensors files of a checkpoint directory: one `model.safetensors`, or shards listed by
`model.safetensors.index.json`. Read and written through safetensors' numpy API (no torch, no
pickle), one tensor at a time so a checkpoint never has to fit in host memory twice."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jtree.hf import mxfp4

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_PATTERN = "model-{:05d}-of-{:05d}.safetensors"


class CheckpointTensors(contextlib.AbstractContextManager):
    """Names, shapes and dtypes of every tensor in a checkpoint directory; `read(name)` loads one.

    An MXFP4-quantized tensor (a uint8 pair `NAME_blocks`, `NAME_scales`, as gpt-oss's released
    experts) is listed as the float32 tensor NAME that transformers dequantizes it to, and read
    dequantized (`jtree.hf.mxfp4`); the pair itself is not listed.

    Use as a context manager (files stay open, memory-mapped, while reading).
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, object] = {}
        self.file_of: dict[str, str] = {}
        index = self.directory / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
        elif (self.directory / SINGLE_FILE).exists():
            weight_map, files = None, [SINGLE_FILE]
        else:
            raise ValueError(f"{self.directory}: no {SINGLE_FILE} or {INDEX_FILE}")
        for file in files:
            path = self.directory / file
            if not path.exists():
                raise ValueError(f"{index}: lists {file}, which does not exist")
            handle = self._stack.enter_context(safe_open(str(path), framework="numpy"))
            self._handles[file] = handle
            for name in handle.keys():
                if weight_map is not None and weight_map.get(name) != file:
                    raise ValueError(
                        f"{path}: tensor {name!r} is not listed for this file in {INDEX_FILE}"
                    )
                self.file_of[name] = file
        if weight_map is not None:
            for name, file in weight_map.items():
                if name not in self.file_of:
                    raise ValueError(f"{INDEX_FILE}: tensor {name!r} is missing from {file}")
        self.quantized: dict[str, tuple[str, str]] = {}
        for name in list(self.file_of):
            base = name.removesuffix(mxfp4.BLOCKS_SUFFIX)
            scales = base + mxfp4.SCALES_SUFFIX
            if (base == name or scales not in self.file_of or base in self.file_of
                    or {self._stored_dtype(name), self._stored_dtype(scales)} != {"U8"}):
                continue
            self.quantized[base] = (name, scales)
        self._pair_file = {n: self.file_of.pop(n) for pair in self.quantized.values()
                           for n in pair}

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def names(self) -> list[str]:
        return sorted([*self.file_of, *self.quantized])

    def where(self, name: str) -> str:
        """The file holding tensor `name` (its blocks, for an MXFP4 tensor)."""
        return self._file(self.quantized[name][0] if name in self.quantized else name)

    def _stored_dtype(self, name: str) -> str:
        return self._handles[self.file_of[name]].get_slice(name).get_dtype()

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.quantized:
            blocks = self.quantized[name][0]
            return mxfp4.hf_shape(tuple(self._raw(blocks).get_shape()))
        return tuple(self._raw(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype code of a tensor ("F32", "BF16", "I8", ...); "F32" for an MXFP4
        tensor (what it is read as)."""
        return "F32" if name in self.quantized else self._raw(name).get_dtype()

    def read(self, name: str) -> np.ndarray:
        if name in self.quantized:
            blocks, scales = self.quantized[name]
            return mxfp4.hf_tensor(self._read_raw(blocks), self._read_raw(scales))
        return self._read_raw(name)

    def _raw(self, name: str):
        return self._handles[self._file(name)].get_slice(name)

    def _read_raw(self, name: str) -> np.ndarray:
        return self._handles[self._file(name)].get_tensor(name)

    def _file(self, name: str) -> str:
        return self.file_of[name] if name in self.file_of else self._pair_file[name]


def write_checkpoint(
    directory: str | Path,
    tensors: Sequence[tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]],
    *,
    max_shard_size: int,
) -> list[str]:
    """Write `(name, shape, dtype, produce)` tensors as safetensors files; returns the file names.

    Tensors are grouped in order into shards of at most `max_shard_size` bytes (a tensor larger
    than that gets a shard of its own); one shard is written as `model.safetensors`, several as
    `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`, as transformers does.
    Only one shard's arrays are materialized at a time.
    """
    shards: list[list[int]] = []
    size = 0
    for i, (_, shape, dtype, _) in enumerate(tensors):
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        if not shards or (size + nbytes > max_shard_size and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    names = (
        [SINGLE_FILE] if len(shards) == 1
        else [SHARD_PATTERN.format(k + 1, len(shards)) for k in range(len(shards))]
    )
    directory = Path(directory)
    weight_map, total = {}, 0
    for file, members in zip(names, shards):
        arrays = {}
        for i in members:
            name, shape, dtype, produce = tensors[i]
            arr = np.ascontiguousarray(produce())
            if arr.shape != tuple(shape) or arr.dtype != np.dtype(dtype):
                raise ValueError(f"tensor {name!r}: produced {arr.shape} {arr.dtype}, "
                                 f"expected {tuple(shape)} {np.dtype(dtype)}")
            arrays[name] = arr
            weight_map[name] = file
            total += arr.nbytes
        save_file(arrays, str(directory / file), metadata={"format": "pt"})
        # safetensors creates its files owner-only (0600); a checkpoint to share or serve is
        # read by other users and processes, as the config and index files beside it are.
        (directory / file).chmod(0o644)
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return names
