"""One job end to end: read -> tokenize -> plan -> execute -> commit.

- ``pipeline.run``: the whole job (lock, resume, commit, report); ``batchjob run`` and
  ``batchjob.run`` call it.
- ``execute``: a plan on one backend into a result sink (one machine, or one Ray worker).
- ``heartbeat``: the operator's progress line when there is no terminal (cron, Airflow).
- ``cluster``: the plan split over the workers of a Ray cluster.
"""
