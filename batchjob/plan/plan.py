"""The Plan: prefix-sharing groups in execution order. A plain data object.

A group is (prefix_len, members). Its shared prefix is the first ``prefix_len`` tokens of
every member (they are equal by construction); each member's distinct part is the rest of
its prompt. Invariant: every member keeps at least one distinct token
(``prefix_len <= len(member) - 1``), so the engine always has a member token whose logits
start decoding. Groups of one have ``prefix_len == 0``.

The plan refers to prompts by their position in the ``TokenizedPrompts`` it was built from
and by ``row_id``; it does not copy tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PlanStats:
    """Summary numbers of a plan (Eq. 2 saving ratios and sizes)."""

    num_requests: int
    num_groups: int
    logical_prefill_tokens: int  # sum of all prompt lengths
    single_level_prefill_tokens: int  # tokens processed when each group prefix is computed once
    multi_level_prefill_tokens: int  # tokens processed with a perfect multi-level prefix cache
    saving_ratio_single_level: float  # Eq. 2 for this plan
    saving_ratio_multi_level: float  # Eq. 2 for the full multi-level tree (upper bound)


@dataclass(frozen=True)
class Plan:
    """Groups in execution order (Eq. 4 order, larger R_group first)."""

    group_prefix_len: np.ndarray  # int64 [G]: shared prefix length of each group (0: none)
    group_offsets: np.ndarray  # int64 [G + 1]: group g's members are members[off[g]:off[g+1]]
    members: np.ndarray  # int64 [N]: prompt positions (into TokenizedPrompts), grouped
    row_ids: np.ndarray  # int64 [N]: row_id of each entry of `members`
    decode_estimate: np.ndarray  # int32 [N]: decode length estimate of each entry of `members`
    stats: PlanStats

    @property
    def num_groups(self) -> int:
        return len(self.group_prefix_len)

    def group_members(self, g: int) -> np.ndarray:
        return self.members[self.group_offsets[g] : self.group_offsets[g + 1]]
