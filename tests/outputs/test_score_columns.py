"""The optional result columns as Arrow: nulls for rows without values, shapes kept."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from batchjob.backends.base import TokenLogprobs
from batchjob.outputs.score_columns import OPTIONAL_COLUMNS, label_logprobs_array, logprobs_array


def test_logprobs_array_mixed_rows():
    lp = TokenLogprobs(
        logprob=np.array([-0.5, -1.5], np.float32),
        top_ids=np.array([[7, 3], [9, 1]], np.int32),
        top_logprobs=np.array([[-0.5, -2.0], [-0.1, -1.5]], np.float32),
    )
    empty = TokenLogprobs(np.zeros(0, np.float32), np.zeros((0, 2), np.int32), np.zeros((0, 2)))
    arr = logprobs_array([None, np.array([7, 1]), np.zeros(0)], [None, lp, empty])
    assert arr.type == OPTIONAL_COLUMNS["output_logprobs"]
    rows = arr.to_pylist()
    assert rows[0] is None and rows[2] == []
    assert [s["token_id"] for s in rows[1]] == [7, 1]
    assert rows[1][1]["top"] == [
        {"token_id": 9, "logprob": np.float32(-0.1)},
        {"token_id": 1, "logprob": -1.5},
    ]


def test_label_logprobs_array():
    arr = label_logprobs_array([np.array([-1.0, -2.0]), None, np.array([-3.0])])
    assert arr.type == pa.list_(pa.float32())
    assert arr.to_pylist() == [[-1.0, -2.0], None, [-3.0]]
