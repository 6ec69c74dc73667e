#!/usr/bin/env bash
# A job with `train: {method: dspark}` and no other option, on the learnable target, on
# one GPU: `hsx extract` captures the method's layers, trains a DSpark draft with its
# defaults, and vLLM measures it with `method: dspark` (vLLM's CPU build cannot).
# Usage (GPU machine, PYTHONPATH as in benchmarks/gpu/README.md): bash dspark_job.sh WORK
# DSPARK_TRAIN adds options to the train section, e.g. DSPARK_TRAIN=", max_steps: 400".
set -euo pipefail
work=${1:?a working folder}
mkdir -p "$work"
python3 - "$work" <<'PY'
import sys
from pathlib import Path

from hsx_workers.learnable import TaskLanguage, make_learnable_model, write_language_dataset

work = Path(sys.argv[1])
language = TaskLanguage(seed=0)
make_learnable_model(work / "target", language=language, steps=500)
write_language_dataset(work / "tasks.jsonl", 3000, language=language)
PY
cat > "$work/job.yaml" <<YAML
model: $work/target
dataset: $work/tasks.jsonl
output: $work/out
train: {method: dspark${DSPARK_TRAIN:-}}
YAML
start=$(date +%s)
python3 -m hsx.cli extract "$work/job.yaml"
echo "job seconds: $(( $(date +%s) - start ))"
