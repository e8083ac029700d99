"""Airflow DAG example: a nightly batch LLM job over one day's partition.

Copy into the Airflow dags/ folder; only Airflow imports this file (the batchjob tests do
not). Two tasks:

- ``plan`` validates the job file, the input data and the model folder and prints the
  plan summary as JSON (saving ratio, group sizes). A bad job file, bad data or a bad
  model folder exits 3, 4 or 5: retrying cannot help, so this task has no retries.
- ``run`` executes the job. A runtime failure exits 1 and is retried; a retried run resumes
  from the results already written (writes are incremental and atomic), so nothing is
  lost or duplicated. SIGTERM from Airflow (timeout, mark-failed) exits 130 cleanly. A run
  whose every row is rejected exits 6; one that finds another run writing the same output
  exits 75 at once, having done nothing (batchjob's own lock). Results land in the output
  folder (results-*.parquet + _SUCCESS only: a plain dataset); the report, plan and
  manifest in the sibling ``<output>.meta/`` folder.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow import DAG
from airflow.operators.bash import BashOperator

BATCHJOB = "/opt/batchjob/.venv/bin/batchjob"
JOB = "/opt/batchjob/jobs/case1.toml"
# Airflow templates: one input and one output directory per logical date
PARTITION = (
    " --set input.path=/data/snippets/{{ ds }}/ --set output.path=/results/snippets/{{ ds }}/"
)

with DAG(
    dag_id="batchjob_snippets",
    start_date=datetime(2024, 1, 1),
    schedule="0 2 * * *",
    catchup=False,
    max_active_runs=1,
    default_args={"owner": "search-llm", "retry_delay": timedelta(minutes=10)},
    tags=["llm", "batch"],
) as dag:
    plan = BashOperator(
        task_id="plan",
        bash_command=f"{BATCHJOB} plan {JOB}{PARTITION} --json",
        retries=0,
        execution_timeout=timedelta(minutes=30),
    )
    run = BashOperator(
        task_id="run",
        bash_command=f"{BATCHJOB} run {JOB}{PARTITION}",
        retries=3,
        execution_timeout=timedelta(hours=12),
    )
    plan >> run
