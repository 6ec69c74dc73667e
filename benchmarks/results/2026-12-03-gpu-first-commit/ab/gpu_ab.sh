#!/bin/bash
# GPU node: the streamed first-commit child, alternating the driver's tokenizer pool on
# (TOKENIZERS_PARALLELISM=true: as before) and the default (one thread once engines start).
cd /tmp/hsx-src
export PYTHONPATH=/tmp/site:$PWD/client:$PWD/workers:$PWD/service:$PWD/benchmarks:/tmp/site-extra
export PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
R=/tmp/hsx-gpu/results/ab; mkdir -p $R
python3 -c "
from hsx_workers.tiny_models import make_chat_dataset, make_tiny_model
make_tiny_model('/tmp/ab/model', 'llama'); make_chat_dataset('/tmp/ab/chat.jsonl', n=999000, seed=0, bad_rows=1000)" > $R/make.log 2>&1
i=0
for cfg in par serial par; do
  i=$((i+1)); cp -r /tmp/ab/model /tmp/ab/model-$i
  if [ $cfg = par ]; then e="TOKENIZERS_PARALLELISM=true"; else e="HSX_AB=1"; fi
  env $e timeout 280 python3 benchmarks/bench_first_commit.py --streamed /tmp/ab/chat.jsonl /tmp/ab/model-$i /tmp/ab/out-$i > $R/$i-$cfg.log 2>&1
  echo "$i $cfg rc=$? $(tail -1 $R/$i-$cfg.log | head -c 400)" >> $R/summary.txt
  ray stop --force > /dev/null 2>&1
done
touch /tmp/hsx-gpu/DONE
