"""Compact prefix tree (radix tree) of token sequences, as arrays.

Built from the sequences in lexicographic order and the LCP of sorted neighbours (see
``seqsort``): the internal nodes are the *LCP intervals* (Abouelhoda et al.): a node of
string depth ``h`` covers a maximal run of sorted rows whose neighbour LCPs are all >= h with
at least one == h. Its bounds are the previous and next neighbour boundary with a smaller
LCP (all nearest smaller values, found by vectorised pointer jumping: O(N log N) worst case,
a few rounds in practice); its parent is the node of whichever bound has the larger LCP.
This is the classic stack construction, done without a per-row Python loop.

Layout: node 0 is the root (depth 0). Internal nodes ``[0, num_internal)`` are numbered in
pre-order (parent id < child id); then one leaf per prompt that ends strictly below every
branching point. A prompt that ends exactly at an internal node (a duplicate, or a prefix of
another prompt) is a *terminal* of that node, not a leaf. Each node's prompts occupy the
slots ``[lo, hi)`` of ``order``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class PrefixTree:
    """Compact prefix tree over N prompts (M nodes)."""

    order: np.ndarray  # int64 [N]: prompt positions in sorted order ("slots")
    depth: np.ndarray  # int64 [M]: tokens from the root to the end of the node
    parent: np.ndarray  # int64 [M]: parent node; -1 for the root
    lo: np.ndarray  # int64 [M]: first slot of the node's prompts
    hi: np.ndarray  # int64 [M]: one past the last slot of the node's prompts
    end_node: np.ndarray  # int64 [N]: node at which each prompt (by position) ends
    num_internal: int  # nodes [0, num_internal) are internal (root included)
    child_offsets: np.ndarray  # int64 [M + 1]: CSR over `children`
    children: np.ndarray  # int64 [M - 1]: child ids of each node, in slot order

    @property
    def num_nodes(self) -> int:
        return len(self.depth)

    @cached_property
    def tokens(self) -> np.ndarray:
        """int64 [M]: tokens of each node's own edge (0 for the root)."""
        t = self.depth.copy()
        t[1:] -= self.depth[self.parent[1:]]
        return t

    @property
    def num_prompts(self) -> np.ndarray:
        """int64 [M]: prompts under each node (the paper's leaves(node))."""
        return self.hi - self.lo

    @cached_property
    def num_ending(self) -> np.ndarray:
        """int64 [M]: prompts ending exactly at each node (1 for a leaf)."""
        return np.bincount(self.end_node, minlength=self.num_nodes).astype(np.int64)

    @cached_property
    def level(self) -> np.ndarray:
        """int64 [M]: edges from the root."""
        return _levels(self.parent)

    def node_children(self, v: int) -> np.ndarray:
        return self.children[self.child_offsets[v] : self.child_offsets[v + 1]]

    @property
    def total_tokens(self) -> int:
        """Tokens stored in the tree: each distinct prefix once (multi-level prefill work)."""
        return int(self.tokens.sum())


def _prev_smaller(v: np.ndarray) -> np.ndarray:
    """p[i] = max j < i with v[j] < v[i]. v[0] must be smaller than every other entry."""
    p = np.arange(len(v), dtype=np.int64) - 1
    p[:1] = 0
    # shortcut: an entry <= everything before it (v[0] aside) has p = 0; in a prefix tree
    # these are the many boundaries at the shallowest branching depth (long jump chains)
    floor = np.zeros(len(v), dtype=bool)
    floor[2:] = v[2:] <= np.minimum.accumulate(v[1:-1])
    p[floor] = 0
    act = np.arange(1, len(v), dtype=np.int64)
    act = act[v[p[act]] >= v[act]]
    while act.size:  # invariant: everything strictly between p[i] and i is >= v[i]
        p[act] = p[p[act]]
        act = act[v[p[act]] >= v[act]]
    return p


def _levels(parent: np.ndarray) -> np.ndarray:
    """Edges to the root by pointer jumping (O(log height) rounds)."""
    lvl = np.ones(len(parent), dtype=np.int64)
    lvl[0] = 0
    up = parent.copy()
    up[0] = 0
    act = np.flatnonzero(up != 0)
    while act.size:
        lvl[act] += lvl[up[act]]
        up[act] = up[up[act]]
        act = act[up[act] != 0]
    return lvl


def build_prefix_tree(order: np.ndarray, lengths: np.ndarray, lcp: np.ndarray) -> PrefixTree:
    """Compact prefix tree from a lexicographic ``order`` of prompts.

    lengths: int64 [N] by prompt position; lcp: int64 [N] with lcp[i] the LCP of the prompts
    in slots i-1 and i (lcp[0] ignored). Any sequence family works (e.g. prompts without
    their last token) as long as ``order`` is a lexicographic order of it.
    """
    n = len(order)
    length = np.asarray(lengths, dtype=np.int64)[order]  # [N] by slot
    # hv[b] for boundary b (between slots b-1 and b), with -1 sentinels at 0 and n
    hv = np.full(n + 1, -1, dtype=np.int64)
    hv[1:n] = lcp[1:n]
    psv = _prev_smaller(hv[:n])  # [n]: meaningful for boundaries 1..n-1
    nsv = n - _prev_smaller(hv[1:][::-1].copy())[::-1]  # [n]: nsv[b-1] for boundary b
    b = np.arange(1, n, dtype=np.int64)
    b_psv, b_nsv, b_h = psv[1:], nsv[:-1], hv[1:n]
    # internal nodes: one per distinct (psv, h) with h > 0, in pre-order (lo, then depth)
    pos = b[b_h > 0]
    srt = np.lexsort((b_h[pos - 1], b_psv[pos - 1]))
    pos = pos[srt]
    kp, kh = b_psv[pos - 1], b_h[pos - 1]
    new = np.ones(len(pos), dtype=bool)
    new[1:] = (kp[1:] != kp[:-1]) | (kh[1:] != kh[:-1])
    node_of_b = np.zeros(n + 1, dtype=np.int64)  # boundary -> node (root for h == 0/sentinel)
    node_of_b[pos] = np.cumsum(new)
    first = pos[new]
    num_internal = 1 + len(first)
    i_depth = np.concatenate([[0], hv[first]])
    i_lo = np.concatenate([[0], b_psv[first - 1]])
    i_hi = np.concatenate([[n], b_nsv[first - 1]])
    up = np.where(hv[i_lo] >= hv[i_hi], i_lo, i_hi)  # bounding boundary with the larger LCP
    i_parent = node_of_b[up]
    i_parent[0] = -1
    # each slot hangs below the node of its adjacent boundary with the larger LCP
    k = np.arange(n, dtype=np.int64)
    deep = np.where(hv[k] >= hv[k + 1], k, k + 1)
    host = node_of_b[deep]
    is_leaf = length > np.maximum(hv[deep], 0)
    leaf_slots = np.flatnonzero(is_leaf)
    end_by_slot = host.copy()
    end_by_slot[leaf_slots] = num_internal + np.arange(len(leaf_slots))
    end_node = np.empty(n, dtype=np.int64)
    end_node[order] = end_by_slot
    depth = np.concatenate([i_depth, length[leaf_slots]])
    parent = np.concatenate([i_parent, host[leaf_slots]])
    lo = np.concatenate([i_lo, leaf_slots])
    hi = np.concatenate([i_hi, leaf_slots + 1])
    kids = np.lexsort((lo[1:], parent[1:])) + 1
    child_offsets = np.zeros(len(depth) + 1, dtype=np.int64)
    np.cumsum(np.bincount(parent[1:], minlength=len(depth)), out=child_offsets[1:])
    return PrefixTree(
        order=np.asarray(order, dtype=np.int64),
        depth=depth,
        parent=parent,
        lo=lo,
        hi=hi,
        end_node=end_node,
        num_internal=num_internal,
        child_offsets=child_offsets,
        children=kids,
    )
