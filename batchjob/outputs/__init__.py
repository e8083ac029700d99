"""What a job writes, and where: results that are exactly once per input row, committed
atomically, and everything else in the sibling metadata folder.

- ``layout.OutputLayout``: every path of one output (results, ``<output>.meta/``, plan,
  report, lock, parts), what in them is batchjob's, and the checks made before any work.
- ``results``: part files as rows finish, the commit that makes them the results, resume.
- ``manifest``: the fingerprint of the job behind the results (what makes a rerun resume).
- ``report``: the per-iteration report, its JSON summary and timeline plot.
- ``plan_summary``: what ``batchjob plan`` prints.
- ``score_columns``: the optional log-prob and score result columns.
- ``openai_batch``: OpenAI Batch output lines written from the committed results.
"""
