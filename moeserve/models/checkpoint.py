"""Reading a Hugging Face checkpoint folder lazily: config.json and (sharded) safetensors.

Tensors are read one at a time through `safe_open`, which memory-maps the file: bytes of
tensors nobody asks for (another EP rank's experts) are never read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MODELOPT_FILE = "hf_quant_config.json"
"""Where ModelOpt's releases (NVFP4) state their quantization when config.json does not."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: unsupported, incomplete or inconsistent."""


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path.name} not found in {path.parent}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def read_config(folder: Path) -> dict[str, Any]:
    """config.json, with ModelOpt's `hf_quant_config.json` as its quantization_config where it
    has none (as vLLM reads it: the file's `quantization` section under quant_method modelopt)."""
    config = read_json(folder / "config.json")
    if not config.get("quantization_config") and (folder / MODELOPT_FILE).is_file():
        config["quantization_config"] = {"quant_method": "modelopt", **read_json(folder / MODELOPT_FILE)}
    return config


class CheckpointReader:
    """Tensor name -> file map of a checkpoint folder; reads single tensors on demand."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise CheckpointError(f"checkpoint folder {self.folder} does not exist")
        self.config = read_config(self.folder)
        self.weight_map = self._weight_map()
        self._handles: dict[str, Any] = {}

    def _weight_map(self) -> dict[str, str]:
        index = self.folder / INDEX_FILE
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no weight_map")
            missing_files = sorted({f for f in weight_map.values() if not (self.folder / f).exists()})
            if missing_files:
                raise CheckpointError(f"shard files listed in {INDEX_FILE} are missing: {missing_files}")
            return dict(weight_map)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no safetensors weights in {self.folder}")
        weight_map = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                weight_map.update({name: file.name for name in f.keys()})
        return weight_map

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            self._handles[file] = safe_open(self.folder / file, framework="pt")
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.weight_map[name]).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype of a tensor (`F8_E4M3`, `F32`, `BF16`, ...), without reading it."""
        return self._handle(self.weight_map[name]).get_slice(name).get_dtype()

    def get(self, name: str) -> torch.Tensor:
        return self._handle(self.weight_map[name]).get_tensor(name)

    def get_part(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        """Entries [start, start + length) of dim `dim`, reading only those bytes (a tensor-
        parallel rank's heads)."""
        view = self._handle(self.weight_map[name]).get_slice(name)
        index = tuple(slice(start, start + length) if d == dim else slice(None) for d in range(len(view.get_shape())))
        return view[index]

    def close(self) -> None:
        self._handles.clear()
