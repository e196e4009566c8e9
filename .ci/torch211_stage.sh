#!/usr/bin/env bash
# The torch 2.11 stage of .ci/run: drmas on the oldest torch it supports (pyproject says
# torch>=2.11,<2.14; 2.11 is the GPU machine's torch), in its own venv, .venv-torch211.
#
#   bash .ci/torch211_stage.sh install   the venv: torch 2.11.0, drmas's core requirements
#                                        (from pip's cache) and pytest; drmas itself is
#                                        imported from the working tree (PYTHONPATH), as
#                                        an editable install would rewrite drmas.egg-info
#                                        while the vLLM stage installs it too
#   bash .ci/torch211_stage.sh test      the unit tests of the learner, the loss, FSDP2
#                                        precision, checkpoints and the weight broadcast
#
# PyPI's only x86_64 torch 2.11.0 is the CUDA build (about 0.5 GiB, plus about 2.1 GiB of
# NVIDIA libraries it depends on); the CPU build lives on download.pytorch.org, which CI
# cannot reach. The CUDA build runs on a machine without a GPU, on the same CPU code paths
# as the CPU build, so the tests below exercise torch 2.11's CPU kernels, FSDP2, DCP and
# gloo. .ci/run starts `install` in the background while the vLLM stage installs (both
# mostly download), then runs `test` after it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-torch211
TESTS=(
  tests/unit/test_loss.py
  tests/unit/test_precision_config.py
  tests/unit/test_checkpoints.py
  tests/unit/test_lora_learner.py
  tests/integration/test_fsdp_learner.py
  tests/integration/test_weight_sync.py
)
PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check)

install() {
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  if ! "$VENV/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '2.11.0')" 2> /dev/null; then
    timeout 900 "${PIP[@]}" torch==2.11.0
  fi
  # Core requirements and the test tools only (not .[dev]: trackers, retrieval, Slurm are
  # not tested here).
  "$VENV/bin/python" -c "import tomllib
print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
    > "$VENV/requirements.txt"
  timeout 600 "${PIP[@]}" -r "$VENV/requirements.txt" pytest pytest-timeout hypothesis
  "$VENV/bin/python" -c "import torch; print('torch', torch.__version__, 'in', '$VENV')"
}

test_() {
  local version code
  version=$("$VENV/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
  if [ "$version" != "2.11.0" ]; then
    echo "$VENV has torch $version, not 2.11.0: run bash .ci/torch211_stage.sh install" >&2
    exit 1
  fi
  set +e
  PYTHONPATH="$(pwd)" "$VENV/bin/python" -m pytest -q -p no:cacheprovider --timeout=300 -m "not gpu and not vllm and not slurm" \
    --durations=5 "${TESTS[@]}"
  code=$?
  set -e
  if [ "$code" -eq 5 ]; then
    echo "the torch 2.11 stage collected no tests: failing (drmas went untested on 2.11)" >&2
    exit 1
  fi
  exit "$code"
}

case "${1:-}" in
  install) install ;;
  test) test_ ;;
  *) sed -n '5,9p' "$0" >&2 && exit 2 ;;
esac
