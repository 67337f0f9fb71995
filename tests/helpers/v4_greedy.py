"""DeepSeek-V4 greedy decoding driven by hand (the engine does not hand out per-group block tables
yet): prompts prefilled in chunks, then one decode per step, each layer's cache allocated from its
specs, each sequence's tables from `GroupedBlocks`, whose window pool is too small unless blocks
behind the window go back. Lockstep for expert parallelism: every call runs `num_steps` steps, a
rank whose sequences are done stepping with none (its MoE layers still join the dispatch)."""

from __future__ import annotations

import torch

from moeserve.models.decoder import cache_specs as model_cache_specs
from moeserve.models.v4.cache import SequenceView, allocate
from moeserve.models.v4.model import V4Batch, cache_specs
from moeserve.scheduler.block_groups import GroupedBlocks

NEW_TOKENS, CHUNK, BLOCK = 32, 16, 4


def steps_for(prompt_lengths) -> int:
    """Steps until the longest prompt has its tokens: its chunks, then a decode per later token."""
    return max(-(-n // CHUNK) for n in prompt_lengths) + NEW_TOKENS - 1


def greedy_in_chunks(model, prompts: list[list[int]], num_steps: int) -> tuple[list[list[int]], bool]:
    """Each prompt's NEW_TOKENS greedy tokens, and whether every block was free again at the end."""
    window = model.cfg.compressed_attention.window
    groups = model_cache_specs(model.cfg, torch.float32).groups
    longest = max(map(len, prompts), default=0) + NEW_TOKENS
    dense = max(1, len(prompts) * -(-longest // BLOCK))
    window_pool = max(1, len(prompts) * (-(-(window + CHUNK) // BLOCK) + 1))  # a window and a chunk each
    pools = [window_pool if key[1] else dense for key in groups]
    blocks = GroupedBlocks(groups, pools, BLOCK)
    caches = [
        allocate(layer.layers, dense, BLOCK, max(1, len(prompts))) for layer in cache_specs(model.cfg, torch.float32)
    ]
    sequences = [list(p) for p in prompts]
    done = [0] * len(prompts)  # positions already in the cache
    got: list[list[int]] = [[] for _ in prompts]
    with torch.inference_mode():
        for _ in range(num_steps):
            running = [i for i, out in enumerate(got) if len(out) < NEW_TOKENS]
            step = [min(CHUNK, len(sequences[i]) - done[i]) for i in running]
            if not all(blocks.allocate(str(i), done[i], n) for i, n in zip(running, step)):
                raise RuntimeError("a group's pool ran out")
            views = tuple(
                SequenceView(done[i], {k: torch.tensor(t) for k, t in blocks.tables(str(i)).items()}, i, BLOCK)
                for i in running
            )
            ids = torch.tensor([t for i, n in zip(running, step) for t in sequences[i][done[i] : done[i] + n]])
            hidden = model(ids.long(), V4Batch(tuple(step), views), caches)
            tokens = model.compute_logits(hidden[torch.tensor(step, dtype=torch.long).cumsum(0) - 1]).argmax(-1)
            for i, n, token in zip(running, step, tokens.tolist()):
                done[i] += n
                if done[i] == len(sequences[i]):
                    got[i].append(token)
                    sequences[i].append(token)
    for i in range(len(prompts)):
        blocks.free(str(i))
    return got, [blocks.num_free(k) for k in groups] == pools
