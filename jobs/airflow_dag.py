"""Airflow DAG: a nightly batch LLM job over one day's partition (Airflow 3).

Copy (or link) into the Airflow dags/ folder; only Airflow imports this file (the batchjob
tests run it in a real Airflow: ``make test-integration``). Two tasks, each one call of the
batchjob CLI:

- ``plan`` validates the job file, the input data and the model folder and prints the
  plan summary as JSON (saving ratio, group sizes).
- ``run`` executes the job. A runtime failure exits 1 and is retried; a retried run resumes
  from the results already written (writes are incremental and atomic), so nothing is
  lost or duplicated. SIGTERM from Airflow (timeout, mark-failed) exits 130 cleanly.

Retries happen on exit 1 only. Any other non-zero exit fails the task at once, without
retry: a bad job file, data or model folder (3, 4, 5) or every row rejected (6) cannot be
fixed by retrying; a run that finds another run writing the same output (75) has done
nothing and waits for the next schedule or a manual clear. The second run of the same date
is a no-op: batchjob answers "already complete" (exit 0) when the output holds the results
of the same job, and rewrites nothing.

Results land in ``<output_root>/<ds>/`` (results-*.parquet + _SUCCESS only: a plain
dataset); the report, plan and manifest in the sibling ``<ds>.meta/`` folder.

Settings, as Airflow Variables (an ``AIRFLOW_VAR_<NAME>`` environment variable sets one too),
read when the task runs:

- ``batchjob_bin``: the batchjob command (default ``/opt/batchjob/.venv/bin/batchjob``)
- ``batchjob_job``: the job file (default ``/opt/batchjob/jobs/case1.toml``)
- ``batchjob_input_root``: the input is ``<root>/<ds>/`` (default ``/data/snippets``)
- ``batchjob_output_root``: the output is ``<root>/<ds>/`` (default ``/results/snippets``)

Read when Airflow parses this file (environment variables of the DAG processor):
``BATCHJOB_RETRIES`` (default 3) and ``BATCHJOB_RETRY_DELAY_S`` (default 600).
"""

from __future__ import annotations

import os
import shutil
from datetime import datetime, timedelta
from typing import Any

from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import DAG
from airflow.sdk.exceptions import AirflowException, AirflowFailException

RETRY_EXIT_CODES = frozenset({1})  # runtime failure: a rerun resumes (README, exit codes)


def _var(name: str, default: str) -> str:
    """A Jinja expression for Variable ``name``, rendered when the task runs."""
    return f"{{{{ var.value.get('{name}', '{default}') }}}}"


BATCHJOB = _var("batchjob_bin", "/opt/batchjob/.venv/bin/batchjob")
JOB = _var("batchjob_job", "/opt/batchjob/jobs/case1.toml")
# one input and one output directory per logical date
PARTITION = (
    f" --set 'input.path={_var('batchjob_input_root', '/data/snippets')}/{{{{ ds }}}}/'"
    f" --set 'output.path={_var('batchjob_output_root', '/results/snippets')}/{{{{ ds }}}}/'"
)


class BatchjobOperator(BashOperator):
    """A BashOperator whose non-zero exits other than 1 fail the task without retry."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(skip_on_exit_code=None, **kwargs)

    def execute(self, context: Any) -> Any:
        result = self.subprocess_hook.run_command(
            command=[shutil.which("bash") or "bash", "-c", self.bash_command],
            env=self.get_env(context),
            output_encoding=self.output_encoding,
            cwd=self.cwd,
        )
        code = result.exit_code
        if code == 0:
            return result.output
        if code in RETRY_EXIT_CODES:
            raise AirflowException(
                f"batchjob exited {code} (runtime failure): retried if tries remain"
            )
        raise AirflowFailException(f"batchjob exited {code}: not retried (see README, exit codes)")


with DAG(
    dag_id="batchjob_snippets",
    start_date=datetime(2024, 1, 1),
    schedule="0 2 * * *",
    catchup=False,
    max_active_runs=1,
    default_args={
        "owner": "search-llm",
        "retry_delay": timedelta(seconds=float(os.environ.get("BATCHJOB_RETRY_DELAY_S", "600"))),
    },
    tags=["llm", "batch"],
) as dag:
    plan = BatchjobOperator(
        task_id="plan",
        bash_command=f"{BATCHJOB} plan '{JOB}'{PARTITION} --json",
        retries=int(os.environ.get("BATCHJOB_RETRIES", "3")),
        execution_timeout=timedelta(minutes=30),
    )
    run = BatchjobOperator(
        task_id="run",
        bash_command=f"{BATCHJOB} run '{JOB}'{PARTITION} --no-progress",
        retries=int(os.environ.get("BATCHJOB_RETRIES", "3")),
        execution_timeout=timedelta(hours=12),
    )
    plan >> run
