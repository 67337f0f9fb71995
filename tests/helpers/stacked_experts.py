"""Qwen3.5's experts as its releases store them, made from a checkpoint transformers saved."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def stack_experts(folder: Path, out: Path) -> Path:
    """`folder`'s checkpoint with each layer's experts stacked as Qwen3.5 releases them
    (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`); transformers saves them
    one tensor per expert."""
    out.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name in [n for n in tensors if _EXPERT.fullmatch(n)]:
        prefix, expert, proj = _EXPERT.fullmatch(name).groups()
        experts.setdefault(prefix, {}).setdefault(int(expert), {})[proj] = tensors.pop(name)
    for prefix, by_expert in experts.items():
        ordered = [by_expert[e] for e in sorted(by_expert)]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([p["gate"], p["up"]]) for p in ordered])
        tensors[f"{prefix}.down_proj"] = torch.stack([p["down"] for p in ordered])
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out
