#!/usr/bin/env bash
# The GPU check, fitted to the GPU machine this project gets: one H200 for 15 minutes in all,
# its own python3 3.12 with torch 2.11 (CUDA), transformers, peft, safetensors, msgpack,
# scipy, matplotlib; no network; only the working tree and the ignored folders named at the
# start travel (64 MiB in all). docs/gpu.md ("The GPU check") says what it covers.
#
#   bash scripts/gpu_check.sh --prepare   here (network, no GPU): the cp312 manylinux wheels
#                                         of what drmas needs beyond the image, into .whl/
#                                         (scripts/gpu_wheels.py decides; under 60 MiB), and
#                                         prints the command to run there
#   bash scripts/gpu_check.sh OUT_DIR     on the GPU machine: installs the carried wheels the
#                                         image lacks into a temp site (pip --no-index
#                                         --target), drmas from the working tree on
#                                         PYTHONPATH, the machine's own python3 and torch;
#                                         pytest tests/gpu -m gpu within 8 minutes; the log,
#                                         versions and a line per check land in OUT_DIR as
#                                         they happen, so a stopped run still leaves them
#   bash scripts/gpu_check.sh --dry-run   anywhere (CI): plans the colocated check, checks
#                                         the prepared wheel set, imports drmas the way the
#                                         GPU machine will, collects tests/gpu
#   bash scripts/gpu_check.sh --torch-api anywhere (network): type-checks drmas against
#                                         torch 2.11's sources (about 3 minutes of mypy; not
#                                         in CI, whose torch 2.11 stage runs the learner's
#                                         tests on 2.11 itself): before changing torch calls
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
BUDGET_S=480 # the whole GPU-machine run, install included
PLATFORM=(--only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --python-version 3.12 --implementation cp)
# tests/gpu in order of what matters most if the budget runs out
CHECKS=(tests/gpu/test_gpu_colocated.py tests/gpu/test_gpu_learner.py tests/gpu/test_gpu_probe.py
  tests/gpu/test_gpu_lora.py tests/gpu/test_gpu_search.py tests/gpu/test_gpu_paths.py tests/gpu/test_gpu_sglang.py
  tests/gpu/test_gpu_vllm.py)

prepare() {
  local py=${PYTHON:-.venv/bin/python}
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  rm -rf .whl && mkdir .whl
  # hydra-core 1.3 and omegaconf 2.3 pin antlr4-python3-runtime 4.9.*, published only as an
  # sdist: its wheel (pure Python) is built here.
  "$py" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-binary antlr4-python3-runtime \
    -w .whl antlr4-python3-runtime==4.9.3 2> "$work/pip.log" || { cat "$work/pip.log"; exit 1; }
  "$py" scripts/gpu_wheels.py needs > "$work/needs.txt"
  sed -n 's/^\([^#]*==[^ ]*\).*/\1/p' scripts/gpu_image.txt > "$work/image.txt"
  # What pip resolves for cp312 manylinux, the image's packages held at their versions.
  "$py" -m pip install --dry-run --quiet --disable-pip-version-check --ignore-installed \
    --target "$work/site" "${PLATFORM[@]}" --find-links .whl -c "$work/image.txt" \
    -r "$work/needs.txt" --report "$work/report.json" 2> "$work/pip.log" \
    || { cat "$work/pip.log"; exit 1; }
  "$py" scripts/gpu_wheels.py carry "$work/report.json" | grep -v '^antlr4-python3-runtime==' \
    > "$work/carry.txt"
  "$py" -m pip download --quiet --disable-pip-version-check --no-deps "${PLATFORM[@]}" -d .whl \
    -r "$work/carry.txt" 2> "$work/pip.log" || { cat "$work/pip.log"; exit 1; }
  ls .whl
  "$py" scripts/gpu_wheels.py check .whl
  echo "On the GPU machine (carry the ignored folder .whl; nothing else is needed):"
  echo "  bash scripts/gpu_check.sh \$OUT/gpu_check"
  echo "with the run tool: command 'bash scripts/gpu_check.sh \$OUT/gpu_check', carry ['.whl'], timeout_s 560"
}

torch_api() {
  # drmas type-checked against torch 2.11's own Python sources and stubs, the GPU machine's
  # torch: the Python files are the same in every wheel, and the macOS one is 77 MiB. It
  # catches a removed or changed API anywhere in the package, not a behaviour (CI's torch
  # 2.11 stage, .ci/torch211_stage.sh, runs the learner's tests on 2.11 for that).
  local py=${PYTHON:-.venv/bin/python}
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$py" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --platform macosx_11_0_arm64 --python-version 3.11 --implementation cp -d "$work/torch" \
    torch==2.11.0 2> "$work/pip.log" || { cat "$work/pip.log"; exit 1; }
  "$py" -c "import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith('torch/') and n.endswith(('.py', '.pyi', 'py.typed'))])" \
    "$work"/torch/torch-2.11.0-*.whl "$work/torch211"
  MYPYPATH="$work/torch211" "$py" -m mypy --no-warn-unused-ignores --cache-dir "$work/mypy-cache" \
    drmas > "$work/mypy.txt" 2>&1 || true
  grep -q "^$work/torch211/torch/" "$work/mypy.txt" \
    || { tail -n 5 "$work/mypy.txt"; echo "FAILED torch 2.11 API: mypy did not read torch 2.11"; exit 1; }
  if grep "^drmas/" "$work/mypy.txt"; then
    echo "FAILED torch 2.11 API: drmas uses what torch 2.11 lacks (above)"
    exit 1
  fi
  echo "PASSED torch 2.11 API: drmas type-checks against torch 2.11.0's sources"
}

dry_run() {
  local py=${PYTHON:-.venv/bin/python} site overrides
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  [ -d .whl ] || { echo "FAILED wheel set: no .whl/: run bash scripts/gpu_check.sh --prepare"; exit 1; }
  "$py" scripts/gpu_wheels.py check .whl
  site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  # The colocated check's own overrides, planned for a one-GPU node by drmas imported as the
  # GPU machine imports it: from the working tree, no installed drmas.
  mapfile -t overrides < <("$py" -c "
from tests.gpu.test_gpu_colocated import colocated_overrides
print('\n'.join(colocated_overrides('hf')))")
  TMPDIR="$work" "$py" -S scripts/gpu_wheels.py isolated "$site" drmas.launch.cli prepare "${overrides[@]}" \
    placement.gpus=1 "run.dir=$work/run" "run.cache_dir=$work/cache" "models.policy.warmstart.steps=0" \
    2> "$work/plan.txt" > /dev/null || { cat "$work/plan.txt"; echo "FAILED plan"; exit 1; }
  grep -v " INFO " "$work/plan.txt" | grep -E "placement|learner|actor|shared|weights"
  grep -q "shared GPUs: 0" "$work/plan.txt" && grep -q "weights: gloo" "$work/plan.txt" \
    && echo "PASSED plan: learner and hf engine share GPU 0, weights over gloo (drmas from PYTHONPATH)" \
    || { echo "FAILED plan: expected one shared GPU and gloo weights"; exit 1; }
  PYTHONPATH="$repo" "$py" -m pytest "${CHECKS[@]}" -m gpu -q --collect-only -p no:cacheprovider "$@" \
    | tail -n 1
  echo "dry run: nothing ran on a GPU"
}

gpu_run() {
  local out=$1 py=${PYTHON:-python3} site code
  shift
  mkdir -p "$out" && out=$(cd "$out" && pwd)
  exec > >(tee -a "$out/gpu_check.log") 2>&1
  echo "== gpu_check $(date -u +%FT%TZ) in $repo, budget ${BUDGET_S} s"
  [ -d .whl ] || { echo "FAILED: no .whl/ here: run --prepare on the CPU machine and carry .whl"; exit 1; }
  site=$(mktemp -d)/site
  env -u PYTHONPATH "$py" scripts/gpu_wheels.py install .whl "$site"
  export PYTHONPATH="$repo:$site" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
  export DRMAS_GPU_OUT="$out" # tests/gpu/conftest.py appends a line per check to summary.txt
  "$py" scripts/gpu_wheels.py versions | tee "$out/versions.txt"
  "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "FAILED: torch sees no CUDA GPU here, so every check would only skip"; exit 1; }
  : > "$out/summary.txt"
  set +e
  timeout --kill-after=15 "$((BUDGET_S - SECONDS))" "$py" -m pytest "${CHECKS[@]}" -m gpu -v -s -rA \
    -p no:cacheprovider --junitxml="$out/junit.xml" "$@" 2>&1 | tee "$out/pytest.log"
  code=${PIPESTATUS[0]}
  set -e
  [ "$code" -eq 124 ] || [ "$code" -eq 137 ] && echo "the checks ran past the ${BUDGET_S} s budget: stopped"
  echo "== summary (pytest exit $code, $SECONDS s)"
  cat "$out/summary.txt"
  exit "$code"
}

case "${1:-}" in
  --prepare) prepare ;;
  --dry-run) shift && dry_run "$@" ;;
  --torch-api) torch_api ;;
  "" | -*) sed -n '7,24p' "$0" >&2 && exit 2 ;;
  *) gpu_run "$@" ;;
esac
