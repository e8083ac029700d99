"""First-level prefix enlargement (BatchLLM Sec. 4.2, Algorithm 1) on a ``PrefixTree``.

Objective. A plan is a partition of the prompts into groups; a group of ``n`` prompts whose
shared prefix has ``p`` tokens saves ``(n - 1) * p`` prefill tokens (its prefix is computed
once instead of ``n`` times): the *first-level token reuse*, summed over groups. The plan
invariant (every member keeps >= 1 distinct token) is built into the tree: the planner builds
it over the prompts *without their last token*, so a group's LCP there is
``min(LCP, shortest member - 1)``.

The paper's Algorithm 1, read literally (``paper_groups``). Node D's first-level prefixes are
its children; the root is a dummy node, so the root's children are the final groups. Post
order: for node D, for each child c (after solving c), for each current child g of c
(a *grandchild* of D): gain = (leaves(g) - 1) * tokens(g), penalty = tokens(c), with
leaves(g) = prompts under g and tokens(x) = tokens of x's own edge. If gain > penalty,
"fork c and merge it with g": a copy of c's tokens is prepended to g, and the merged node
(tokens(c) + tokens(g) tokens, g's prompts, g's children) becomes a child of D; c keeps its
other children and its terminals with its original tokens (the check of the next grandchild
still uses penalty tokens(c)); a c left with no prompt disappears. Grandchildren that are
not forked are folded into c's group (their own structure is no longer seen from above).
Each fork changes D's reuse by exactly gain - penalty while c keeps >= 1 prompt, hence the
test. A group's prefix is the accumulated token count of its node.

That greedy is *not* optimal: each fork is judged alone, with c's sub-structure frozen by
the level below. Smallest counterexample (4 prompts, 12 tokens; tests/plan/test_reuse.py):
[1,2,5], [1,2,6], [1,3,5], [1,3,6]. Algorithm 1 keeps one group of 4 sharing [1] (reuse 3:
each fork gains 1, not > penalty 1); the optimum is two pairs sharing [1,2] and [1,3] (reuse
4): the two forks pay off together, because the last one empties c and so pays no penalty.

``optimal_groups`` is the exact DP of the same objective. In an optimal partition every
group is "all prompts whose deepest chosen ancestor is node v" for a set S of chosen nodes
(the root is always chosen; its prompts run alone), with prefix depth(v). F_v(d) = best
reuse inside v's subtree when the nearest chosen ancestor is at depth d (a prompt released
up to it gains d):
    F_v(d) = max(K_v, m_v * d + sum_c F_c(d)),   K_v = (m_v - 1) * depth(v) + sum_c F_c(depth(v))
where m_v counts the prompts hanging directly at v (terminals and leaf children) and c ranges
over v's internal children; v is chosen iff K_v > the release value (ties: larger groups).
F_v is only needed at the depths of v's ancestors, so it is a vector of length level(v),
computed level by level with numpy; sum over internal nodes of level(v) <= total tokens.

``first_level_groups`` is the plain first level (no enlargement): each child of the root
with >= 2 prompts is one group. Everywhere, prompts that share nothing with others (the
root's leaf children, and prompts of length <= 1) and any group of one become groups of one
with prefix 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchjob.plan.prefix_tree import PrefixTree


@dataclass(frozen=True)
class Grouping:
    """A partition of prompts into prefix-sharing groups (not yet ordered)."""

    group_of: np.ndarray  # int64 [N]: group id of each prompt position (ids 0..G-1)
    prefix_len: np.ndarray  # int64 [G]: shared prefix tokens per group (0 for groups of one)

    @property
    def num_groups(self) -> int:
        return len(self.prefix_len)

    @property
    def sizes(self) -> np.ndarray:
        return np.bincount(self.group_of, minlength=self.num_groups)

    @property
    def reuse(self) -> int:
        """First-level token reuse: sum over groups of (members - 1) * prefix_len."""
        return int(((self.sizes - 1) * self.prefix_len).sum())


def _from_owner(owner: np.ndarray, prefix_of: np.ndarray) -> Grouping:
    """Groups from an owner node per prompt (node 0: alone); prefix_of: [nodes] prefix."""
    n = len(owner)
    size = np.bincount(owner, minlength=len(prefix_of))
    alone = (owner == 0) | (size[owner] == 1)
    shared_nodes, shared_id = np.unique(owner[~alone], return_inverse=True)
    group_of = np.empty(n, dtype=np.int64)
    group_of[~alone] = shared_id
    group_of[alone] = len(shared_nodes) + np.arange(int(alone.sum()))
    prefix = np.concatenate([prefix_of[shared_nodes], np.zeros(int(alone.sum()), np.int64)])
    return Grouping(group_of=group_of, prefix_len=prefix.astype(np.int64))


def _attach(tree: PrefixTree) -> np.ndarray:
    """int64 [N]: internal node each prompt hangs at (its end node, or a leaf's parent)."""
    a = tree.end_node.copy()
    leaf = a >= tree.num_internal
    a[leaf] = tree.parent[a[leaf]]
    return a


def _nearest_marked(parent: np.ndarray, marked: np.ndarray) -> np.ndarray:
    """Nearest marked ancestor-or-self of each node (node 0 is treated as marked)."""
    marked = marked.copy()
    marked[0] = True
    near = np.where(marked, np.arange(len(parent)), parent)
    act = np.flatnonzero(~marked[near])
    while act.size:  # invariant: nodes from v up to (excluding) near[v] are unmarked
        near[act] = near[near[act]]
        act = act[~marked[near[act]]]
    return near


def first_level_groups(tree: PrefixTree) -> Grouping:
    """One group per child of the root (no enlargement)."""
    ni = tree.num_internal
    near = _nearest_marked(tree.parent[:ni], tree.parent[:ni] == 0)
    return _from_owner(near[_attach(tree)], tree.depth)


def paper_groups(tree: PrefixTree) -> Grouping:
    """Algorithm 1 exactly as written (greedy per grandchild); see the module docstring."""
    ni = tree.num_internal
    tok, n_prompts = tree.tokens.tolist(), tree.num_prompts.tolist()
    co, ch = tree.child_offsets.tolist(), tree.children.tolist()
    container = np.full(tree.num_nodes, -1, dtype=np.int64)  # group a node was folded into
    kids: list[list[tuple[int, int, int]]] = [[] for _ in range(ni)]  # (tokens, leaves, node)
    for d in range(ni - 1, -1, -1):  # children before parents (pre-order ids)
        out = []
        for c in ch[co[d] : co[d + 1]]:
            if c >= ni:  # a leaf: one prompt, no grandchildren
                out.append((tok[c], 1, c))
                continue
            t_c, left = tok[c], n_prompts[c]
            for t_g, l_g, g in kids[c]:
                if (l_g - 1) * t_g > t_c:  # fork c and merge it with g
                    out.append((t_c + t_g, l_g, g))
                    left -= l_g
                else:
                    container[g] = c
            kids[c] = []
            if left > 0:
                out.append((t_c, left, c))
        kids[d] = out
    prefix_of = np.zeros(tree.num_nodes, dtype=np.int64)
    for t, _, g in kids[0]:
        prefix_of[g] = t
    # group of a node: follow `container` up to a child of the root (pointer jumping)
    top = np.where(container < 0, np.arange(tree.num_nodes), container)
    act = np.flatnonzero(container[top] >= 0)
    while act.size:
        top[act] = top[top[act]]
        act = act[container[top[act]] >= 0]
    return _from_owner(top[tree.end_node], prefix_of)


def optimal_groups(tree: PrefixTree) -> Grouping:
    """Exact maximum first-level reuse (DP over chosen nodes); see the module docstring."""
    ni = tree.num_internal
    par, dep, lvl = tree.parent[:ni], tree.depth[:ni], tree.level[:ni]
    attach = _attach(tree)
    m = np.bincount(attach, minlength=ni).astype(np.int64)
    top = int(lvl.max())
    by_level = np.argsort(lvl, kind="stable")  # ids ascend in a level: grouped by parent
    bounds = np.searchsorted(lvl[by_level], np.arange(top + 2))
    nodes = [by_level[bounds[k] : bounds[k + 1]] for k in range(top + 1)]
    pos = np.empty(ni, dtype=np.int64)
    for v in nodes:
        pos[v] = np.arange(len(v))
    # anc[k]: [n_k, k] depths of the ancestors (levels 0..k-1) of each level-k node
    anc = [np.zeros((1, 0), dtype=np.int64)]
    for k in range(1, top + 1):
        p = par[nodes[k]]
        anc.append(np.hstack([anc[k - 1][pos[p]], dep[p][:, None]]))
    form: list[np.ndarray] = [np.zeros((1, 0), dtype=bool)] * (top + 1)
    f_below = np.zeros((0, top + 1), dtype=np.int64)  # F of level k+1 nodes: [n_{k+1}, k+1]
    for k in range(top, 0, -1):
        v = nodes[k]
        s = np.zeros((len(v), k + 1), dtype=np.int64)  # sum of children's F at each depth
        if k < top:
            pp = pos[par[nodes[k + 1]]]
            st = np.flatnonzero(np.concatenate([[True], pp[1:] != pp[:-1]]))
            s[pp[st]] = np.add.reduceat(f_below, st, axis=0)
        keep = s[:, k] + (m[v] - 1) * dep[v]  # K_v: v is chosen
        release = s[:, :k] + m[v][:, None] * anc[k]  # v's prompts go up to depth anc
        form[k] = keep[:, None] > release
        f_below = np.maximum(keep[:, None], release)
    # top-down: chosen iff forming beats releasing to the nearest chosen ancestor
    near_lvl = np.zeros(ni, dtype=np.int64)
    near_node = np.zeros(ni, dtype=np.int64)
    for k in range(1, top + 1):
        v = nodes[k]
        p = par[v]
        chosen = form[k][np.arange(len(v)), near_lvl[p]]
        near_lvl[v] = np.where(chosen, k, near_lvl[p])
        near_node[v] = np.where(chosen, v, near_node[p])
    return _from_owner(near_node[attach], dep)
