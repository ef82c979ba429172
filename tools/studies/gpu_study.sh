#!/usr/bin/env bash
# Issue 29.6 on a lent GPU machine: the fine-tuning study at its larger shape.
#
# The machines have no network and their own torch (../shared/gpu/README.md), and one call carries at
# most 64 MiB of git-ignored files beside the tree. The study needs the pinned stack (the kit's wheels,
# 27 MiB, plus `gguf` to read the model), the dm_math corpus (4 MB) and SmolLM2-135M-Instruct (98 MB
# GGUF), so the model travels in 24 MiB parts over three calls while the machine is held (it goes back
# after 30 s idle: make the calls back to back). Files under the project that git ignores stay on a
# held machine between calls.
#
#   On the CPU machine, from the project root, once (the kit's bundle in .gpu/whl first, as its README says):
#       bash tools/studies/gpu_study.sh pack                   # -> .g1/ (wheels, corpus, part 1), .g2/ (parts 2-3), .g3/ (part 4)
#   Then `run` calls, back to back, each `bash tools/studies/gpu_study.sh stage` with carry:
#       [".gpu", ".g1"]   installs the stack into /tmp/site, puts the corpus in ../shared/data, keeps part 1
#       [".g2"]           keeps parts 2-3
#       [".g3"]           keeps part 4, joins the model and checks its sha256
#   and then (no carry):
#       OUT=$OUT bash tools/studies/gpu_study.sh run [study_finetune.py options]
#   `run` runs `python tools/studies/study_finetune.py --gpu --out runs/finetune_gpu --parts setup,floor,study,report`
#   with the options given (default: --profile quick --seeds 1,2,3,4,5), under GPU_STUDY_S seconds
#   (default 540); runs/finetune_gpu stays on the held machine, so a later `run` resumes it. The report
#   and the log are copied to $OUT.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
SRC="$ROOT/../shared/data"                        # where `pack` reads (this machine's copy)
DATA="${GPU_STUDY_DATA:-$ROOT/../shared/data}"    # where `stage` puts them: where tools/studies/study_finetune.py reads
MODEL_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
MODEL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
SITE="${GPU_STUDY_SITE:-/tmp/site}"
PY=${PYTHON:-python3}

die() { echo "gpu_study.sh: $*" >&2; exit 2; }

ignored() {  # the folder is git-ignored (or add it to .git/info/exclude)
  git check-ignore -q "$1/x" 2>/dev/null || { mkdir -p .git/info; echo "/$1/" >> .git/info/exclude; }
}

pack() {
  [ -d .gpu/whl ] || die ".gpu/whl is missing: build the kit's wheel bundle first (../shared/gpu/README.md)"
  local model="$SRC/smollm2/$MODEL_NAME"
  [ -f "$model" ] || die "the model is not at $model"
  [ -f "$SRC/dm_math/train.json" ] || die "the dm_math corpus is not at $SRC/dm_math"
  echo "$MODEL_SHA  $model" | sha256sum -c --quiet - || die "$model: sha256 differs from ../shared/data/README.md's"
  rm -rf .g1 .g2 .g3
  mkdir -p .g1/whl .g1/dm_math .g1/model .g2/model .g3/model
  ignored .g1; ignored .g2; ignored .g3
  # gguf reads the model (pyproject's pin); tqdm is its one requirement the GPU machines may lack.
  "$PY" -m pip download -q --no-deps -d .g1/whl "gguf==0.19.0" "tqdm"
  cp "$SRC/dm_math/"*.json .g1/dm_math/
  split -b 24M -d -a 2 "$model" .g1/model/part.
  mv .g1/model/part.01 .g1/model/part.02 .g2/model/
  mv .g1/model/part.03 .g3/model/
  ls .g1/model/part.* .g2/model/part.* .g3/model/part.* | wc -l | grep -qx 4 || die "expected 4 parts of the model"
  du -sh .gpu .g1 .g2 .g3
}

stage() {
  local parts="$DATA/smollm2/parts"
  mkdir -p "$parts" "$DATA/dm_math"
  if [ -d .gpu/whl ] && [ -d .g1/whl ] && [ ! -f "$SITE/.installed" ]; then
    rm -rf "$SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .gpu/whl/*.whl .g1/whl/*.whl
    touch "$SITE/.installed"
    echo "stage: the stack in $SITE"
  fi
  if [ -d .g1/dm_math ]; then
    cp -f .g1/dm_math/*.json "$DATA/dm_math/"
    echo "stage: dm_math in $DATA/dm_math"
  fi
  for g in .g1 .g2 .g3; do
    [ -d "$g/model" ] && cp -n "$g"/model/part.* "$parts/" 2>/dev/null || true
  done
  local have
  have=$(ls "$parts" | wc -l)
  if [ "$have" -lt 4 ]; then
    echo "stage: $have of the model's 4 parts here; carry the next .gN"
    return 0
  fi
  cat "$parts"/part.* > "$DATA/smollm2/$MODEL_NAME"
  echo "$MODEL_SHA  $DATA/smollm2/$MODEL_NAME" | sha256sum -c --quiet - || die "the joined model's sha256 differs"
  echo "stage: $DATA/smollm2/$MODEL_NAME joined and checked; next: OUT=\$OUT bash tools/studies/gpu_study.sh run"
}

run() {
  [ -n "${OUT:-}" ] || die "OUT is not set"
  mkdir -p "$OUT"
  [ -f "$SITE/.installed" ] || die "no stack in $SITE: run the stage calls first, on this held machine"
  [ -f "$DATA/smollm2/$MODEL_NAME" ] || die "no model at $DATA/smollm2: run the stage calls first, on this held machine"
  export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
  local args=("$@")
  [ ${#args[@]} -gt 0 ] || args=(--profile quick --seeds 1,2,3,4,5)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
  local rc=0
  timeout -s INT -k 15 "${GPU_STUDY_S:-540}" "$PY" tools/studies/study_finetune.py --gpu --out runs/finetune_gpu \
    --parts setup,floor,study,report "${args[@]}" 2>&1 | tee "$OUT/study_gpu.log" || rc=$?
  cp runs/finetune_gpu/study.md runs/finetune_gpu/floor.json "$OUT/" 2>/dev/null || true
  echo "gpu_study.sh run: rc=$rc (124: the time ran out; a later run resumes from the finished runs)"
  return "$rc"
}

case "${1:-}" in
  pack) pack ;;
  stage) stage ;;
  run) shift; run "$@" ;;
  *) die "usage: bash tools/studies/gpu_study.sh pack|stage|run [study_finetune.py options] (see its header)" ;;
esac
