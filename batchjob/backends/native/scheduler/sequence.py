"""Mutable per-sequence state shared by the scheduler policies (pure Python + numpy)."""

from __future__ import annotations

import numpy as np

from batchjob.backends.native.kv_cache import BlockHash, hash_block

NEW, WAITING, RUNNING, FINISHED = range(4)

_NO_PATH = np.zeros(0, dtype=np.int32)
_ROOT = np.zeros(1, dtype=np.int64)  # scoring: the prompt's last token reads trie node 0


class Sequence:
    """Mutable state of one sequence: a request, or (batchllm) a group prefix.

    Own tokens are ``prompt[own_start:]`` followed by the sampled outputs; own-KV position
    ``p`` is model position ``own_start + p`` (``own_start`` = the group prefix length).

    Scoring (``steps`` set, see ``backends.scoring``): nothing is sampled; the own tokens are
    the distinct prompt followed by the current label ``path``, and the logits of own
    positions ``score_from ..`` are read, scoring trie nodes ``score_nodes``. Before the
    first step that is the prompt's last position (the root, node 0), read in the same chunk
    as the first step's path; each later step rewinds the KV to ``num_own_prompt + base``
    and feeds the rest of its path.
    """

    __slots__ = (
        "_table",
        "blocks",
        "chunk_group",
        "computed",
        "group",
        "hashes",
        "high_water",
        "max_tokens",
        "num_cached_blocks",
        "num_own_prompt",
        "num_path",
        "outputs",
        "own_start",
        "path",
        "prompt",
        "score_from",
        "score_nodes",
        "seq_id",
        "stamp",
        "state",
        "step",
        "steps",
    )

    def __init__(
        self,
        seq_id: int,
        prompt: np.ndarray,
        max_tokens: int,  # this request's decode limit (the row's, else sampling.max_tokens)
        own_start: int = 0,
        group: int = -1,
        chunk_group: int = -1,
    ) -> None:
        self.seq_id = seq_id
        self.prompt = prompt  # int32 [L]: the full prompt (or the prefix tokens)
        self.own_start = own_start  # tokens of the prompt held by the group prefix
        self.num_own_prompt = len(prompt) - own_start  # distinct prompt tokens
        self.max_tokens = max_tokens
        self.group = group  # plan group (batchllm), -1 otherwise
        self.chunk_group = chunk_group  # ScheduledChunk.group: group if it has a prefix, else -1
        self.outputs: list[int] = []  # sampled tokens
        self.computed = 0  # own KV tokens scheduled (counted as in cache)
        self.blocks: list[int] = []  # own KV blocks
        self._table: np.ndarray | None = None  # int32 copy of blocks, reused while they last
        self.high_water = 0  # most own KV tokens ever computed (recompute accounting)
        self.state = NEW
        self.stamp = -1  # admission order: larger is younger
        self.hashes: list[BlockHash] = []  # block hashes of full blocks (baseline)
        self.num_cached_blocks = 0  # leading blocks registered in the prefix cache (baseline)
        self.steps: tuple[tuple[int, np.ndarray, np.ndarray], ...] | None = None  # scoring
        self.step = -1  # scoring: the step running (-1: the prompt, scoring the root)
        self.path = _NO_PATH  # scoring: int32 label tokens after the prompt
        self.num_path = 0
        self.score_from = 0  # scoring: first own position whose logits are read
        self.score_nodes = _ROOT  # scoring: int64 trie node of each read position

    def start_scoring(self, steps: tuple[tuple[int, np.ndarray, np.ndarray], ...]) -> None:
        """Make this request a scoring one: read the root at the prompt's last token, then
        run ``steps`` ((base, path, nodes) each, ``backends.scoring._Trie.steps``). The first
        step starts at the root (base 0): it runs with the prompt, as one prefill whose
        logits are read from the prompt's last token on (no extra chunk or iteration)."""
        self.steps = steps
        self.score_from = self.num_own_prompt - 1
        if steps:
            _, path, nodes = steps[0]
            self.step = 0
            self.path, self.num_path = path, len(path)
            self.score_nodes = np.concatenate([_ROOT, nodes])

    def next_step(self) -> bool:
        """Scoring: move to the next step (path, read positions); False when none is left.
        The caller rewinds the KV to ``num_own_prompt + base`` (``computed``)."""
        assert self.steps is not None
        self.step += 1
        if self.step == len(self.steps):
            return False
        base, path, nodes = self.steps[self.step]
        self.path, self.num_path = path, len(path)
        self.score_from = self.num_own_prompt + base
        self.score_nodes = nodes
        return True

    @property
    def num_tokens(self) -> int:
        """Own tokens known: distinct prompt part + outputs (scoring: + the label path)."""
        return self.num_own_prompt + len(self.outputs) + self.num_path

    @property
    def in_decode(self) -> bool:
        return bool(self.outputs) and self.computed == self.num_tokens - 1

    def tokens(self, start: int, end: int) -> np.ndarray:
        """int32 own tokens [start, end)."""
        p = self.num_own_prompt
        if end <= p:
            return self.prompt[self.own_start + start : self.own_start + end]
        if self.steps is not None:
            tail = self.path[max(start - p, 0) : end - p]
        else:
            tail = np.asarray(self.outputs[max(start - p, 0) : end - p], dtype=np.int32)
        if start >= p:
            return tail
        return np.concatenate([self.prompt[self.own_start + start :], tail])

    def block_table(self) -> np.ndarray:
        """int32 [len(blocks)], read-only; rebuilt only when the blocks changed."""
        t = self._table
        if t is None or len(t) != len(self.blocks):
            t = np.asarray(self.blocks, dtype=np.int32)
            t.flags.writeable = False
            self._table = t
        return t

    def block_hashes(self, num_blocks: int, block_size: int) -> list[BlockHash]:
        """Hashes of the first ``num_blocks`` full blocks (extended lazily)."""
        while len(self.hashes) < num_blocks:
            i = len(self.hashes)
            parent = self.hashes[-1] if self.hashes else None
            toks = self.tokens(i * block_size, (i + 1) * block_size)
            self.hashes.append(hash_block(parent, toks))
        return self.hashes[:num_blocks]
