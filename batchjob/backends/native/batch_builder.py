"""Turn a scheduler's ``SchedulerOutput`` (numpy) into model inputs (torch tensors).

The scheduler never touches torch; this module is the one place that crosses over.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchjob.backends.native.attention.meta import AttentionMetadata
from batchjob.backends.native.scheduler.output import SchedulerOutput


@dataclass(frozen=True)
class ModelBatch:
    """One iteration's flat ragged batch, ready for ``model.forward``."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]: absolute positions (group prefix_len offset included)
    meta: AttentionMetadata
    logits_index: torch.Tensor  # int64 [K]: token index of the last token of sampling chunks
    sample_seq_ids: tuple[int, ...]  # [K]: seq_id of each sampled row, in logits order


def _pad_tables(tables: list[np.ndarray]) -> np.ndarray:
    """Stack ragged int32 block tables into [N, max_len], padding with block 0."""
    width = max((len(t) for t in tables), default=0)
    out = np.zeros((len(tables), max(width, 1)), dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return out


def build_batch(out: SchedulerOutput, block_size: int, device: torch.device) -> ModelBatch:
    chunks = out.chunks
    lens = np.fromiter((c.num_tokens for c in chunks), dtype=np.int64, count=len(chunks))
    cu_q = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu_q[1:])
    kv_start = np.fromiter((c.kv_start for c in chunks), dtype=np.int64, count=len(chunks))
    pos_start = np.fromiter((c.position_start for c in chunks), dtype=np.int64, count=len(chunks))

    input_ids = np.concatenate([c.token_ids for c in chunks]).astype(np.int64)
    # per token: offset within its chunk, then own-KV and absolute positions
    seq_of_token = np.repeat(np.arange(len(chunks)), lens)
    within = np.arange(len(input_ids)) - cu_q[:-1][seq_of_token]
    own_pos = kv_start[seq_of_token] + within
    positions = pos_start[seq_of_token] + within

    block_table = _pad_tables([c.block_table for c in chunks])
    slot_mapping = (
        block_table[seq_of_token, own_pos // block_size].astype(np.int64) * block_size
        + own_pos % block_size
    )

    group_index = {p.group: i for i, p in enumerate(out.prefixes)}
    seq_group = np.array([group_index.get(c.group, -1) for c in chunks], dtype=np.int32)
    num_groups = len(out.prefixes)
    group_q_start = np.full(num_groups, np.iinfo(np.int32).max, dtype=np.int64)
    group_q_end = np.zeros(num_groups, dtype=np.int64)
    member = seq_group >= 0
    if member.any():
        np.minimum.at(group_q_start, seq_group[member], cu_q[:-1][member])
        np.maximum.at(group_q_end, seq_group[member], cu_q[1:][member])
    group_q_start = np.minimum(group_q_start, group_q_end)  # groups with no query (not expected)
    prefix_len = np.array([p.prefix_len for p in out.prefixes], dtype=np.int32)

    kv_len = kv_start + lens
    sampling = [i for i, c in enumerate(chunks) if c.samples]

    def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

    meta = AttentionMetadata(
        cu_q=t(cu_q, torch.int32),
        kv_len=t(kv_len, torch.int32),
        block_table=t(block_table, torch.int32),
        slot_mapping=t(slot_mapping, torch.int64),
        seq_group=t(seq_group, torch.int32),
        prefix_len=t(prefix_len, torch.int32),
        prefix_block_table=t(_pad_tables([p.block_table for p in out.prefixes]), torch.int32)[
            :num_groups
        ],
        group_q_start=t(group_q_start, torch.int32),
        group_q_end=t(group_q_end, torch.int32),
        max_q_len=int(lens.max(initial=0)),
        max_kv_len=int(kv_len.max(initial=0)),
        max_prefix_len=int(prefix_len.max(initial=0)),
    )
    return ModelBatch(
        input_ids=t(input_ids, torch.int64),
        positions=t(positions, torch.int64),
        meta=meta,
        logits_index=t(cu_q[1:][sampling] - 1, torch.int64),
        sample_seq_ids=tuple(chunks[i].seq_id for i in sampling),
    )
