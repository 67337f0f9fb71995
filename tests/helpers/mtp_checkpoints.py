"""Tiny checkpoints with multi-token prediction layers, made by `make-model`'s builder.

`aligned`: a one-layer target (its layer MoE) whose MTP layer is built to agree with it often
(`checkpoints/mtp.py`), so drafts are kept; random: the builder's default two-layer target with
random MTP layers (drafts rarely kept, but every MTP path runs)."""

from __future__ import annotations

from pathlib import Path

from moeserve.checkpoints import MakeModelSpec, make_model


def mtp_checkpoint(root: Path, arch: str, mtp_layers: int = 1, aligned: bool = True) -> Path:
    """Built once under `root` (a module's temporary folder), then reused."""
    folder = root / f"{arch}-mtp{mtp_layers}-{'aligned' if aligned else 'random'}"
    if (folder / "config.json").exists():
        return folder
    if aligned:
        spec = MakeModelSpec(arch, layers=1, first_k_dense_replace=0, mtp_layers=mtp_layers, mtp_init="aligned")
    else:
        spec = MakeModelSpec(arch, mtp_layers=mtp_layers)
    return make_model(spec, folder)
