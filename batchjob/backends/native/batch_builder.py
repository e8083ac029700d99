"""Turn a scheduler's ``SchedulerOutput`` (numpy) into model inputs (torch tensors).

The scheduler never touches torch; this module is the one place that crosses over.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import torch

from batchjob.backends.native.attention.meta import AttentionMetadata
from batchjob.backends.native.scheduler.output import ScheduledChunk, SchedulerOutput


@dataclass(frozen=True)
class ModelBatch:
    """One iteration's flat ragged batch, ready for ``model.forward``."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]: absolute positions (group prefix_len offset included)
    meta: AttentionMetadata
    logits_index: torch.Tensor  # int64 [K + R]: last token of each sampling chunk, then the
    # R scored tokens (scoring chunks' trailing ``len(score_nodes)`` tokens)
    sample_seqs: np.ndarray  # int64 [K]: seq_id of each sampled row, in logits order
    score_seqs: np.ndarray  # int64 [R]: seq_id of each scored logits row (after the K)
    score_nodes: np.ndarray  # int64 [R]: the trie node each scored row scores
    # LoRA (model.adapters): (adapter index, int64 indices of its tokens) per adapter present
    lora_tokens: tuple[tuple[int, torch.Tensor], ...] = ()


@dataclass(frozen=True)
class SeqAdapters:
    """Each sequence's LoRA adapter (index in model.adapters, -1: the base model)."""

    rows: np.ndarray  # int [N]: each prompt position's (TokenizedPrompts.adapter)
    groups: np.ndarray  # int [G]: each plan group's (its members'), for its prefix sequence

    def of(self, seq_id: np.ndarray) -> np.ndarray:
        """int64 [S]: the adapter of each seq_id (a request's, or a group prefix's)."""
        rows = np.asarray(self.rows, dtype=np.int64)
        groups = np.append(np.asarray(self.groups, dtype=np.int64), -1)  # never empty
        request = seq_id >= 0
        return np.where(
            request, rows[np.where(request, seq_id, 0)], groups[np.where(request, 0, -seq_id - 1)]
        )


def lora_tokens(
    adapters: SeqAdapters | None,
    seq_id: np.ndarray,
    seq_of_token: np.ndarray,
    device: torch.device,
) -> tuple[tuple[int, torch.Tensor], ...]:
    """Each adapter's token indices in the batch (tokens of the base model in none)."""
    if adapters is None or not len(seq_id):
        return ()
    per_token = adapters.of(seq_id)[seq_of_token]
    return tuple(
        (int(a), torch.from_numpy(np.flatnonzero(per_token == a)).to(device))
        for a in np.unique(per_token)
        if a >= 0
    )


def _pad_tables(tables: list[np.ndarray]) -> np.ndarray:
    """Stack ragged int32 block tables into [N, max_len], padding with block 0 (one scatter)."""
    n = len(tables)
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=n)
    out = np.zeros((n, max(int(lens.max(initial=0)), 1)), dtype=np.int32)
    if lens.sum():
        flat = np.concatenate(tables)
        row = np.repeat(np.arange(n), lens)
        start = np.cumsum(lens) - lens
        out[row, np.arange(len(flat)) - start[row]] = flat
    return out


_INT32_MAX = int(np.iinfo(np.int32).max)
_NONE = np.zeros(0, dtype=np.int64)


_ALIGN = 64  # bytes: where each packed array starts (Triton specializes on 16-byte alignment)


def upload(
    arrays: dict[str, tuple[np.ndarray, torch.dtype]], device: torch.device, packed: bool
) -> dict[str, torch.Tensor]:
    """Each array as a tensor of its dtype on ``device``, same shape.

    ``packed`` (on a GPU): all arrays of one dtype go into one pinned host buffer, each at a
    64-byte-aligned offset, and cross in one asynchronous copy; the tensors are views of the
    device buffer. A step's batch is a dozen small arrays, and one pinned allocation and one
    copy per array cost the host ~50 us each (measured on an H200) while the GPU waits for
    the step. The host buffer comes from torch's pinned caching allocator, which keeps it
    until the copy has completed, so the next step cannot overwrite it in flight.
    """
    if not packed:
        return {
            k: torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dt)
            for k, (a, dt) in arrays.items()
        }
    out: dict[str, torch.Tensor] = {}
    for dt in dict.fromkeys(dt for _, dt in arrays.values()):
        step = _ALIGN // torch.empty(0, dtype=dt).element_size()
        placed, at = [], 0  # (name, array, its offset in the buffer)
        for k, (a, d) in arrays.items():
            if d == dt:
                placed.append((k, a, at))
                at += -(-a.size // step) * step
        host = torch.empty(max(at, 1), dtype=dt, pin_memory=device.type == "cuda")
        view = host.numpy()
        for _, a, start in placed:
            view[start : start + a.size] = a.reshape(-1)
        dev = host.to(device=device, non_blocking=True)
        for k, a, start in placed:
            out[k] = dev[start : start + a.size].view(a.shape)
    return out


def _field(chunks: tuple[ScheduledChunk, ...], name: str) -> np.ndarray:
    """int64 [S]: one scalar field of every chunk (a C-level loop)."""
    return np.fromiter(map(attrgetter(name), chunks), dtype=np.int64, count=len(chunks))


def build_batch(
    out: SchedulerOutput,
    block_size: int,
    device: torch.device,
    packed: bool | None = None,
    adapters: SeqAdapters | None = None,
) -> ModelBatch:
    """The batch's tensors: one pass over the chunks to gather their fields, then numpy.
    ``packed`` (default: on a GPU) uploads them as one buffer per dtype (``upload``).
    ``adapters``: each sequence's LoRA adapter, its tokens in ``ModelBatch.lora_tokens``."""
    chunks = out.chunks
    s = len(chunks)
    tokens = [c.token_ids for c in chunks]
    lens = np.fromiter(map(len, tokens), dtype=np.int64, count=s)
    kv_start, pos_start = _field(chunks, "kv_start"), _field(chunks, "position_start")
    group, samples, seq_id = (_field(chunks, n) for n in ("group", "samples", "seq_id"))
    cu_q = np.zeros(s + 1, dtype=np.int64)
    np.cumsum(lens, out=cu_q[1:])

    input_ids = np.concatenate(tokens).astype(np.int64)
    # per token: offset within its chunk, then own-KV and absolute positions
    seq_of_token = np.repeat(np.arange(s), lens)
    within = np.arange(len(input_ids)) - cu_q[:-1][seq_of_token]
    own_pos = kv_start[seq_of_token] + within
    positions = pos_start[seq_of_token] + within

    block_table = _pad_tables([c.block_table for c in chunks])
    slot_mapping = (
        block_table[seq_of_token, own_pos // block_size].astype(np.int64) * block_size
        + own_pos % block_size
    )

    # group index of each chunk in this batch's prefixes (-1: none)
    num_groups = len(out.prefixes)
    prefix_group = np.fromiter((p.group for p in out.prefixes), dtype=np.int64, count=num_groups)
    seq_group = np.full(s, -1, dtype=np.int32)
    member = group >= 0
    if num_groups and member.any():
        order = np.argsort(prefix_group, kind="stable")
        at = np.minimum(np.searchsorted(prefix_group[order], group[member]), num_groups - 1)
        found = prefix_group[order][at] == group[member]
        seq_group[member] = np.where(found, order[at], -1)
    group_q_start = np.full(num_groups, _INT32_MAX, dtype=np.int64)
    group_q_end = np.zeros(num_groups, dtype=np.int64)
    member = seq_group >= 0
    if member.any():
        np.minimum.at(group_q_start, seq_group[member], cu_q[:-1][member])
        np.maximum.at(group_q_end, seq_group[member], cu_q[1:][member])
    group_q_start = np.minimum(group_q_start, group_q_end)  # groups with no query (not expected)
    prefix_len = np.fromiter((p.prefix_len for p in out.prefixes), np.int32, count=num_groups)

    kv_len = kv_start + lens
    sampling = np.flatnonzero(samples)
    logits_index = cu_q[1:][sampling] - 1
    score_seqs = score_nodes = _NONE
    scored = [(i, c.score_nodes) for i, c in enumerate(chunks) if c.score_nodes is not None]
    if scored:  # scoring: the trailing len(score_nodes) tokens of each such chunk
        at = np.fromiter((i for i, _ in scored), dtype=np.int64, count=len(scored))
        nodes = [x for _, x in scored]
        k = np.fromiter(map(len, nodes), dtype=np.int64, count=len(scored))
        first = np.repeat(cu_q[1:][at] - k, k)
        rows = first + np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)
        logits_index = np.concatenate([logits_index, rows])
        score_seqs = np.repeat(seq_id[at], k)
        score_nodes = np.concatenate(nodes).astype(np.int64)

    max_kv, max_prefix = int(kv_len.max(initial=0)), int(prefix_len.max(initial=0))
    if positions.size and positions.max() >= max_prefix + max_kv:  # the model's RoPE bound
        raise AssertionError("a position beyond its prefix + own KV: scheduler state is broken")
    prefix_tables = _pad_tables([p.block_table for p in out.prefixes])
    i32, i64 = torch.int32, torch.int64
    up = upload(
        {
            "cu_q": (cu_q, i32),
            "kv_len": (kv_len, i32),
            "block_table": (block_table, i32),
            "slot_mapping": (slot_mapping, i64),
            "seq_group": (seq_group, i32),
            "prefix_len": (prefix_len, i32),
            "prefix_block_table": (prefix_tables, i32),
            "group_q_start": (group_q_start, i32),
            "group_q_end": (group_q_end, i32),
            "input_ids": (input_ids, i64),
            "positions": (positions, i64),
            "logits_index": (logits_index, i64),
        },
        device,
        packed=device.type == "cuda" if packed is None else packed,
    )
    meta = AttentionMetadata(
        cu_q=up["cu_q"],
        kv_len=up["kv_len"],
        block_table=up["block_table"],
        slot_mapping=up["slot_mapping"],
        seq_group=up["seq_group"],
        prefix_len=up["prefix_len"],
        prefix_block_table=up["prefix_block_table"][:num_groups],
        group_q_start=up["group_q_start"],
        group_q_end=up["group_q_end"],
        max_q_len=int(lens.max(initial=0)),
        max_kv_len=max_kv,
        max_prefix_len=max_prefix,
    )
    return ModelBatch(
        input_ids=up["input_ids"],
        positions=up["positions"],
        meta=meta,
        logits_index=up["logits_index"],
        sample_seqs=seq_id[sampling],
        score_seqs=score_seqs,
        score_nodes=score_nodes,
        lora_tokens=lora_tokens(adapters, seq_id, seq_of_token, device),
    )
