"""The built-in demo models: a trained one that ships with the package, and a random one for tests.

`moeserve launch` with no model serves the trained demo (`demo_model_path`): a Qwen3-MoE of
about 1M parameters trained on the Python standard library by `train_demo.py`, whose weights,
tokenizer and config lie in the package (``demo_model/``, about 2 MB), so the first launch serves
at once and answers with recognisable text.

The random demo (`random_demo_model_path`) is what tests build: it is made on first use, then
reused from a user cache folder. Why Qwen3-MoE: it is the plainest of the supported MoE families
(GQA attention, every layer MoE, softmax top-k, no shared expert), so it is the first path every
other part of moeserve can run. Its sizes are chosen so that no weight is square (hidden 128,
attention 4x16 = 64 wide, KV 2x16 = 32, experts 64), so a transposed weight fails loudly instead of
running; head size 16 and the other powers of two suit Triton block shapes. It is saved in
bfloat16, as real checkpoints are (`--dtype auto` serves it in float32 on a CPU without bf16
instructions, see `EngineConfig.dtype`), in shards of at most 512 KiB (about 1.2 MB in all), so the
sharded-index path is always exercised.

The random demo's folder name carries a hash of everything that decides the files (the spec, a
format version, and the Python, torch and transformers versions, since the tokenizer is trained on
the stdlib and the init follows torch's RNG and HF's init order), so a change builds a fresh model
beside the old one rather than serving a stale one. The model is built in a temporary folder next
to its final place and renamed into it, an atomic step: a crash never leaves half a model under the
final name, and of two processes racing, the first rename wins and the second uses its result.
"""

import dataclasses
import hashlib
import json
import logging
import os
import platform
import shutil
import tempfile
from pathlib import Path

from moeserve.checkpoints.spec import MakeModelSpec

logger = logging.getLogger("moeserve.checkpoints")

DEMO_SPEC = MakeModelSpec(
    arch="qwen3_moe",
    layers=2,
    hidden=128,
    experts=8,
    top_k=2,
    vocab=512,
    heads=4,
    kv_heads=2,
    head_dim=16,
    moe_intermediate=64,
    dtype="bfloat16",
    max_shard_bytes=512 * 1024,
)

_FORMAT_VERSION = 1  # bump when make_model changes what it writes for the same spec

TRAINED_DEMO_DIR = Path(__file__).parent / "demo_model"


def demo_model_path() -> Path:
    """The folder of the trained demo model that ships with the package."""
    if not (TRAINED_DEMO_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the trained demo model is missing from {TRAINED_DEMO_DIR}; "
            "make it with: python -m moeserve.checkpoints.train_demo --out " + str(TRAINED_DEMO_DIR)
        )
    return TRAINED_DEMO_DIR


def random_demo_model_path(cache_dir: Path | None = None) -> Path:
    """The folder of the random-weight demo model, built on first use (about a second on a CPU).

    ``cache_dir`` defaults to ``default_cache_dir()``.
    """
    from moeserve.checkpoints.builder import make_model  # seconds of imports `demo_model_path` never needs

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"demo-{DEMO_SPEC.arch}-{_demo_key()}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    logger.info("building the demo model in %s (once; later runs reuse it)", final)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        make_model(DEMO_SPEC, staging)
        os.rename(staging, final)
    except OSError:
        if not final.is_dir():
            raise
        logger.info("another process built %s first; using that one", final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def default_cache_dir() -> Path:
    """``$MOESERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/moeserve``, else ``~/.cache/moeserve``."""
    if explicit := os.environ.get("MOESERVE_CACHE_DIR"):
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "moeserve"


def _demo_key() -> str:
    """A short hash of everything that decides the demo model's files."""
    import torch
    import transformers

    inputs = {
        "spec": dataclasses.asdict(DEMO_SPEC),
        "format": _FORMAT_VERSION,
        "python": platform.python_version_tuple()[:2],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:12]
