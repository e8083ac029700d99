"""What the scheduler hands the runner each iteration, and its run counters.

Plain numpy (no torch): the runner turns a ``SchedulerOutput`` into ``AttentionMetadata``.
A sequence is either a request (``seq_id >= 0``, its position in ``TokenizedPrompts``) or a
group prefix being prefilled (``seq_id == -(g + 1)`` for plan group ``g``); a request of a
shared-prefix group attends to its group's prefix KV (``ScheduledPrefix``) before its own KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


def prefix_seq_id(group: int) -> int:
    """seq_id of the prefix sequence of plan group ``group``."""
    return -(group + 1)


def prefix_group(seq_id: int) -> int:
    """Plan group of a prefix sequence id (inverse of ``prefix_seq_id``)."""
    return -seq_id - 1


class ScheduledChunk(NamedTuple):
    """One sequence's tokens in this iteration's ragged batch (a NamedTuple, immutable like
    the frozen dataclasses around it: built once per sequence per iteration, it constructs
    in half their time)."""

    seq_id: int  # request: its position in TokenizedPrompts (>= 0); group prefix g: -(g + 1)
    token_ids: np.ndarray  # int32 [n]: a prompt chunk, a recompute chunk, or the last sampled token
    kv_start: int  # own-KV position of token_ids[0] (own KV tokens already in cache)
    position_start: int  # absolute model position of token_ids[0] (kv_start + group prefix_len)
    block_table: np.ndarray  # int32 [cdiv(kv_start + n, block_size)]: own KV blocks
    group: int  # plan group whose prefix KV precedes the own KV; -1: none (prefix seqs, singles)
    is_decode: bool  # exactly the request's latest sampled token (not a prompt/recompute chunk)
    samples: bool  # the runner samples from the logits of this chunk's last token
    # scoring (never samples): the runner reads the logits of the chunk's last
    # len(score_nodes) tokens; int64 trie node each scores (``batchjob.backends.scoring``)
    score_nodes: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class ScheduledPrefix:
    """The complete prefix KV of a group whose members are in this batch."""

    group: int  # plan group index
    prefix_len: int  # shared prefix tokens (all computed: a prefix completes before its members)
    block_table: np.ndarray  # int32 [cdiv(prefix_len, block_size)]: blocks holding the prefix KV


@dataclass(frozen=True)
class SchedulerOutput:
    """One iteration's batch. Build it, run it, then call ``Scheduler.update`` with it."""

    chunks: tuple[ScheduledChunk, ...]  # sequences of the same group (>= 0) are contiguous
    prefixes: tuple[ScheduledPrefix, ...]  # every group referenced by a chunk with group >= 0
    num_decode_tokens: int  # tokens of chunks with is_decode
    num_prefill_tokens: int  # all other tokens: prompt, group prefix and recompute chunks
    kv_blocks_used: int  # blocks referenced by live sequences after this schedule() call
    kv_blocks_total: int  # the KV budget (num_blocks)
    preempted: tuple[int, ...]  # seq_ids preempted (recompute) in this call; -(g+1): group g
    iteration: int  # 0-based index of this schedule() call
    threshold_lifted: bool  # nothing fit under kv_threshold, so this batch used all blocks
    # KV blocks to copy before the forward (src, dst; int32 each): a row's further samples
    # take its first sample's own prompt KV (``sampling.n``)
    kv_copies: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens


@dataclass(frozen=True)
class SchedulerStats:
    """Counters over a whole run (a snapshot; ``Scheduler.stats`` makes a fresh one)."""

    iterations: int  # schedule() calls
    prefill_tokens: int  # non-decode tokens computed (prompt, prefix and recompute tokens)
    decode_tokens: int  # decode tokens computed
    prefix_tokens: int  # group-prefix tokens computed (batchllm), recomputes included
    recomputed_tokens: int  # tokens computed again after a preemption (prefixes included)
    cache_hit_tokens: int  # prompt tokens served from the LRU prefix cache (baseline)
    preemptions: int  # requests preempted by recompute
    group_preemptions: int  # group prefixes dropped to make progress (batchllm, last resort)
    prefixes_computed: int  # group prefixes completed (batchllm)
    peak_blocks: int  # most KV blocks in use after any schedule() call
    threshold_lifted_iterations: int  # iterations that had to ignore kv_threshold to progress
    copied_tokens: int  # own prompt KV tokens a sample copied from its row's first (batchllm)
