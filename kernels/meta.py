"""Ragged-batch metadata for prefix-shared paged attention.

The contract between the engine (which builds it) and every attention backend and kernel
(``batchjob.backends.native.attention``; ``kernels/triton``, ``kernels/cpu``).

Paged KV layout, per layer: ``k_cache, v_cache: [num_blocks, block_size, Hkv, D]``.
A token's cache slot is ``block * block_size + offset``.

A batch holds T query tokens from S sequences; each sequence's tokens are contiguous in
token order (``cu_q``). A sequence is one of:
  * a group prefix being prefilled (possibly one chunk of it): it owns the prefix blocks,
    ``seq_group == -1``;
  * a request: its own KV (distinct prompt + generated tokens) lives in its own blocks; if
    it belongs to a shared-prefix group, ``seq_group`` indexes this batch's groups and the
    group's prefix KV (``prefix_len`` tokens in ``prefix_block_table``) logically precedes
    its own KV.
Sequences of the same group are contiguous, so group g's queries are the token range
``group_q_start[g]:group_q_end[g]``: the prefix part is one matrix-matrix product per group.

Query token j of sequence s is own-KV position ``kv_len[s] - q_len[s] + j``; it attends to
the whole group prefix (no mask) and to own KV positions ``<=`` its own (causal).
The K/V of the batch's tokens are written to the cache (``slot_mapping``) before attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def cdiv(a: int, b: int) -> int:
    """Ceiling of ``a / b`` (kernels/' own: batchjob.plan.intmath is out of reach from here)."""
    return -(-a // b)


@dataclass(frozen=True)
class AttentionMetadata:
    cu_q: torch.Tensor  # int32 [S + 1]: query token offsets of each sequence
    kv_len: torch.Tensor  # int32 [S]: own KV length of each sequence, this step's tokens included
    block_table: torch.Tensor  # int32 [S, max_blocks]: own KV blocks (padding: any valid id)
    slot_mapping: torch.Tensor  # int64 [T]: cache slot each new token's K/V is written to
    seq_group: torch.Tensor  # int32 [S]: group index in this batch, -1 for none
    prefix_len: torch.Tensor  # int32 [G]: shared prefix length of each group in this batch
    prefix_block_table: torch.Tensor  # int32 [G, max_prefix_blocks]: prefix KV blocks
    group_q_start: torch.Tensor  # int32 [G]: first query token of the group's members
    group_q_end: torch.Tensor  # int32 [G]: one past the last query token of the group
    max_q_len: int  # max over sequences of q_len (host int, for tiling/padding)
    max_kv_len: int  # max over sequences of kv_len
    max_prefix_len: int  # max over groups of prefix_len (0 when G == 0)

    @property
    def num_seqs(self) -> int:
        return self.kv_len.shape[0]

    @property
    def num_groups(self) -> int:
        return self.prefix_len.shape[0]

    @property
    def q_len(self) -> torch.Tensor:
        """int32 [S]: query tokens of each sequence in this batch."""
        return self.cu_q[1:] - self.cu_q[:-1]
