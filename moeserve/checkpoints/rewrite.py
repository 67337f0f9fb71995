"""Rewriting a checkpoint folder's tensors in place: what the FP8, MXFP4 and DeepSeek-V4 quantizers share.

Each safetensors file keeps its metadata and is rewritten with what `rewrite` makes of each of its
tensors (the same name, or new names such as a weight and its scales); the index of a sharded
checkpoint, if there is one, then lists the new names in the files that hold them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"  # the index of a sharded Hugging Face checkpoint
Rewrite = Callable[[str, torch.Tensor], dict[str, torch.Tensor]]
"""(name, tensor) -> the tensors to save in its place, by name."""


def rewrite_tensors(folder: Path, rewrite: Rewrite) -> None:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {folder}")
    renamed: dict[str, dict[str, str]] = {}  # old name -> {new name: file}
    for file in files:
        with safe_open(file, framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
            metadata = f.metadata()
        out: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            new = rewrite(name, tensor)
            out.update(new)
            renamed[name] = {n: file.name for n in new}
        save_file(out, file, metadata=metadata)
    index = folder / INDEX_FILE
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {new: f for old in data["weight_map"] for new, f in renamed[old].items()}
        index.write_text(json.dumps(data, indent=2) + "\n")


def rewrite_checkpoint(
    folder: Path, architecture: str, fmt: str, rewrite: Rewrite, config_fields: dict[str, object]
) -> None:
    """Rewrite `folder`, which must hold `architecture` (the one `fmt` is published for), with
    `rewrite`, and add `config_fields` to its config.json (the release's declaration)."""
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    if config.get("architectures") != [architecture]:
        raise ValueError(f"{fmt} is {architecture}'s format; {folder} holds {config.get('architectures')}")
    rewrite_tensors(folder, rewrite)
    config.update(config_fields)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
