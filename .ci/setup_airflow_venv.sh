#!/usr/bin/env bash
# Create .venv-airflow: a real Apache Airflow (3.3.2) in its own venv, apart from .venv, for
# tests/integration (jobs/airflow_dag.py under `airflow dags test`). Airflow only calls the
# batchjob CLI of .venv, so the two never share packages.
#
# Versions: apache-airflow==3.3.2 with every dependency pinned by .ci/airflow-constraints.txt.
# Idempotent: an existing venv whose airflow is 3.3.2 is left as is.
# Usage: bash .ci/setup_airflow_venv.sh [VENV_DIR]   (default: <repo>/.venv-airflow)
set -euo pipefail

AIRFLOW_VERSION="3.3.2"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-airflow}"
PY="$VENV/bin/python"
CONSTRAINTS="$ROOT/.ci/airflow-constraints.txt"
PYTHON="${PYTHON:-python3}"

die() {
    echo "setup_airflow_venv: ERROR: $*" >&2
    exit 1
}

check() {
    # Prints the versions; fails unless airflow and the standard provider (BashOperator) import.
    "$PY" - "$AIRFLOW_VERSION" <<'EOF'
import sys

import airflow
from airflow.providers.standard.operators.bash import BashOperator  # noqa: F401
from airflow.sdk import DAG  # noqa: F401

print(f"python {sys.version.split()[0]}, airflow {airflow.__version__}")
if airflow.__version__ != sys.argv[1]:
    sys.exit(f"airflow {airflow.__version__} is not {sys.argv[1]}")
EOF
}

if [[ -x "$PY" ]] && versions="$(check 2>/dev/null)"; then
    echo "setup_airflow_venv: $VENV already set up ($versions)"
    exit 0
fi

command -v "$PYTHON" >/dev/null || die "$PYTHON not found"
if [[ ! -x "$PY" ]]; then
    echo "setup_airflow_venv: creating $VENV"
    "$PYTHON" -m venv "$VENV" || die "$PYTHON -m venv $VENV failed"
fi

echo "setup_airflow_venv: installing apache-airflow==$AIRFLOW_VERSION (constraints: $CONSTRAINTS)"
"$PY" -m pip install --quiet --upgrade pip || die "pip upgrade failed"
"$PY" -m pip install --quiet "apache-airflow==$AIRFLOW_VERSION" -c "$CONSTRAINTS" \
    || die "pip install of apache-airflow==$AIRFLOW_VERSION failed (see pip output above)"

versions="$(check)" || die "airflow does not import in $VENV (see the traceback above)"
echo "setup_airflow_venv: done ($VENV: $versions)"
