#!/usr/bin/env bash
# GPU check (issue #3): NCCL FSDP learner ranks, an NCCL weight broadcast compared bit for
# bit, the hf engine on CUDA; bounded by a 540 s timeout on one GPU machine (never run yet); the two-rank
# checks need 2 GPUs and report themselves skipped on one. Timings are printed.
#   bash scripts/gpu_check.sh            (after: pip install -e '.[dev]' with a CUDA torch)
# With pip install 'drmas[sglang]' it also starts a tiny SGLang server and publishes weights
# into it through the sglang engine (tests/gpu/test_gpu_sglang.py; skipped without sglang).
# With pip install 'drmas[vllm]' and 2 GPUs it starts the vllm engine on GPU 1 and publishes
# into it over NCCL from GPU 0 (tests/gpu/test_gpu_vllm.py).
# experiment=search runs end to end on one GPU with tiny search models, vLLM actors (hf
# when vllm is missing), bf16 CUDA learners and `drmas retriever` over HTTP
# (tests/gpu/test_gpu_search.py; the same command passed on CPU with hf and cpu learners).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    print(" ", i, torch.cuda.get_device_name(i))
PY
timeout 540 "$PY" -m pytest tests/gpu -m gpu -q -s -rs -p no:cacheprovider "$@"
