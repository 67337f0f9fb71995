"""What a prefill and a decode instance must agree on before KV moves between them: the model,
the block size, the tensor-parallel size. Each instance shows its identity at GET /kv/info; the
router reads both sides' and passes the prefill's with each request, and the decode instance
refuses a request whose prefill side does not match it (a clear 400, never wrong tokens)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path


def model_fingerprint(model_dir: str) -> str:
    """The checkpoint's config.json, canonical, hashed: two instances serve the same model
    architecture and shapes exactly when these agree (weights are the operator's to match)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config.pop("_name_or_path", None)
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class KvIdentity:
    role: str
    model: str
    """`model_fingerprint` of the served checkpoint."""
    block_size: int
    tp: int
    ep: int
    kv_address: str
    """host:port of the instance's KV side channel."""

    def to_json(self) -> dict:
        return asdict(self)

    def mismatches(self, model: object, block_size: object, tp: object) -> list[str]:
        """Why a prefill instance claiming these values cannot hand KV to this one (empty: it can)."""
        problems = []
        if model != self.model:
            problems.append(f"a different model (config fingerprint {model}, here {self.model})")
        if block_size != self.block_size:
            problems.append(f"a different block size ({block_size}, here {self.block_size})")
        if tp != self.tp:
            problems.append(f"a different --tp ({tp}, here {self.tp}): mixed tensor parallelism is refused")
        return problems
