#!/usr/bin/env bash
# GPU check: one script, one GPU, well under 8 minutes (a 420 s pytest timeout).
#   bash scripts/gpu_check.sh            after: pip install -e '.[dev]' with a CUDA torch
#                                        (+ 'drmas[vllm]' / 'drmas[sglang]' for those engines)
#   bash scripts/gpu_check.sh --dry-run  on any machine: plans the checks, runs nothing on a GPU
#
# On one GPU (tests/gpu, marker `gpu`):
# - colocated: drmas train places a shared-model team's FSDP2 learner (bf16-mixed: fp32
#   masters, bf16 compute) and its vLLM engine (hf without vllm) on GPU 0; 4 real steps;
#   engine vs learner log-probs (importance weights ~1); weights back over gloo, digests
#   checked (test_gpu_colocated.py);
# - experiment=search end to end with tiny search models and an HTTP retriever
#   (test_gpu_search.py); the hf engine on CUDA (test_gpu_paths.py); SGLang, if it
#   installs, taking a publish (test_gpu_sglang.py).
# With 2 or more GPUs also: NCCL FSDP ranks (2 = 1), a bit-identical NCCL weight broadcast,
# and vLLM receiving an NCCL publish across GPUs; on one GPU they report themselves skipped.
# Prints one summary line per check (PASSED / FAILED / SKIPPED with the reason).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}

if [ "${1:-}" = "--dry-run" ]; then
  shift
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  # The colocated check's own overrides, planned for a one-GPU node.
  mapfile -t overrides < <("$PY" -c "
from tests.gpu.test_gpu_colocated import colocated_overrides
print('\n'.join(colocated_overrides('vllm')))")
  "$PY" -m drmas.launch.cli prepare "${overrides[@]}" placement.gpus=1 \
    "run.dir=$work/run" "run.cache_dir=$work/cache" "models.policy.warmstart.steps=0" \
    2> "$work/plan.txt" > /dev/null || { cat "$work/plan.txt"; echo "FAILED plan"; exit 1; }
  grep -v " INFO " "$work/plan.txt" | grep -E "placement|learner|actor|shared|weights"
  grep -q "shared GPUs: 0" "$work/plan.txt" && grep -q "weights: gloo" "$work/plan.txt" \
    && echo "PASSED plan: learner and vLLM engine share GPU 0, weights over gloo" \
    || { echo "FAILED plan: expected one shared GPU and gloo weights"; exit 1; }
  "$PY" -m pytest tests/gpu -m gpu -q --collect-only -p no:cacheprovider "$@" | tail -n 1
  echo "dry run: nothing ran on a GPU"
  exit 0
fi

"$PY" - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    print(" ", i, torch.cuda.get_device_name(i))
PY
log=$(mktemp)
set +e
timeout 420 "$PY" -m pytest tests/gpu -m gpu -q -s -rA -p no:cacheprovider "$@" > "$log" 2>&1
code=$?
set -e
tail -n 60 "$log"
echo "== summary (exit $code)"
grep -E "^(PASSED|FAILED|SKIPPED|ERROR) " "$log" || echo "no test summary: see the output above"
exit "$code"
