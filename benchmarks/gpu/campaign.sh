#!/usr/bin/env bash
# The GPU campaign on a lent H200 machine (one or two GPUs), after the recipe's install
# (benchmarks/gpu/README.md). Started in the background with setsid, so it outlives the
# device call that starts it; later calls wait for it and collect its results:
#
#   setsid nohup bash benchmarks/gpu/campaign.sh STEPS... > /tmp/hsx-gpu/campaign.log 2>&1 &
#   bash benchmarks/gpu/campaign.sh --collect SECONDS   # wait up to SECONDS, tar into $OUT
#
# What comes back is committed as one campaign folder, benchmarks/results/YYYY-MM-DD-<what>/.
#
# Steps, in the order given: smoke, bench (capture path on one GPU), tests (tests/gpu, or
# the files and test ids in GPU_TESTS, each under GPU_TEST_TIMEOUT seconds, default 600),
# product (the whole product at real size: bench_product.py), online (the same job
# offline and online on one GPU: bench_product.py --online), multi (2 engines vs 1,
# TP=2 vs 1), train (trainer scaling, 2 GPUs vs 1), peer (hsx against speculators'
# prepare-data + generate-offline-data on `vllm serve`: bench_peer.py; carry .gpu-peer,
# see below; ~15 minutes), ingest (ingestion on 2 and 8 processes against 1:
# bench_ingest.py), first-commit (submit → first committed shard on a million chats:
# bench_first_commit.py), dspark (a DSpark job, trained and measured by vLLM:
# dspark_job.sh), methods (the draft methods on one capture, each measured by vLLM:
# bench_methods.py), dflash-loss (DFlash with each loss on the dspark step's capture,
# measured by vLLM), ways (each methods draft measured as served and the former way:
# measure_ways.py), online-ab (the online job on this tree and on .gpu/baseline's:
# bench_product.py --online --baseline), selfcheck (the self-check's cost on the 8B shape and its faults:
# bench_selfcheck.py --model 8b --faults, then --head-product). Each step writes into
# /tmp/hsx-gpu/results; one failing step does not stop the next.
set -uo pipefail
RES=/tmp/hsx-gpu/results
mkdir -p "$RES"
export PYTHONPATH=/tmp/site:$PWD/client:$PWD/workers:$PWD/service:$PWD:/tmp/site-extra
# Test tools the GPU image lacks (pytest, rich...), compressed-tensors (vLLM's
# kimi_k25 module imports it) and mistral_common with what it needs (vLLM 0.25.1's llava
# module imports it: without it a Llava job is refused), carried as wheels in .gpu/extra:
#   pip download -d .gpu/extra --only-binary=:all: --python-version 3.12 --no-deps \
#     --platform manylinux2014_x86_64 pytest pluggy iniconfig pytest-timeout rich \
#     markdown-it-py mdurl pygments ml_dtypes compressed-tensors
#   pip download -d .gpu/extra --only-binary=:all: --python-version 3.12 --no-deps \
#     --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux_2_28_x86_64 mistral-common==1.13.1 pydantic-extra-types==2.11.1 \
#     tiktoken==0.14.0 regex==2026.12.2 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
#     referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0
# last on the path, so nothing the image or the bundle has is replaced.
if [ -d .gpu/extra ] && [ ! -d /tmp/site-extra ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site-extra .gpu/extra/*.whl
fi
export PATH=/tmp/site/bin:$PATH  # py-spy comes in the bundle
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0 HSX_GPU_RESULTS=$RES
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

if [ "${1:-}" = "--collect" ]; then
  deadline=$(( $(date +%s) + ${2:-500} ))
  while [ ! -f /tmp/hsx-gpu/DONE ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
  cp /tmp/hsx-gpu/campaign.log "$RES/" 2>/dev/null
  tar -czf "$OUT/results.tgz" -C /tmp/hsx-gpu results
  tail -c 6000 /tmp/hsx-gpu/campaign.log
  [ -f /tmp/hsx-gpu/DONE ] && echo "campaign: done" || echo "campaign: still running"
  exit 0
fi

step() { echo "=== $1 $(date +%T)"; }
# keep FROM DEST [DEPTH]: the small files of a draft folder (configs, JSON, logs; not the
# weights) copied into the results.
keep() { mkdir -p "$2"; find "$1" -maxdepth "${3:-1}" -type f -size -4M -exec cp {} "$2/" \; ; }
rm -f /tmp/hsx-gpu/DONE
for s in "$@"; do
  case $s in
    smoke)
      step smoke
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$RES/gpus.txt"
      python3 -V
      python3 -c "import vllm, ray, torch; print('vllm', vllm.__version__, 'ray', ray.__version__, 'torch', torch.__version__)"
      python3 -c "import pytest, rich, blake3, prometheus_client, psutil, speculators; print('test and hsx imports: ok')"
      python3 -m hsx.cli doctor | tee "$RES/doctor.txt"
      df -h /dev/shm /tmp | tee "$RES/df.txt" ;;
    bench)
      step bench
      # BENCH_PHASES / BENCH_FLAGS choose what runs, e.g. BENCH_PHASES="disk drop hsx tp2"
      # puts TP=2 against TP=1 and the capture ceiling into one results file, and
      # BENCH_FLAGS="--layers dflash" captures a draft method's layers instead of EAGLE-3's.
      timeout 1200 python3 -m benchmarks.gpu.bench_vllm --phases ${BENCH_PHASES:-disk drop hsx} \
        ${BENCH_FLAGS:---profile} --reps 1 --child-timeout 420 \
        --out "$RES/vllm-single.json" 2> "$RES/vllm-single.log"
      cp /tmp/hsx-bench-vllm/*.log /tmp/hsx-bench-vllm/*-stacks.txt \
        /tmp/hsx-bench-vllm/profile-*.txt "$RES/" 2>/dev/null
      # py-spy's collapsed stacks run to hundreds of KB; results keep them compressed
      gzip -9nf "$RES"/profile-*.txt 2>/dev/null ;;
    tests)
      step tests
      # One pytest per file, each under its own limit, verbose: a hung test costs its file,
      # and what passed or failed before it is in the log as it happens.
      # GPU_TESTS picks files or test ids (default: every file of tests/gpu); a test
      # marked slow (the architectures beyond `make test`'s) needs PYTEST_ADDOPTS="-m slow".
      for f in ${GPU_TESTS:-tests/gpu/test_*.py}; do
        name=$(echo "$f" | sed 's|.*/||; s|\.py||; s|::|-|g')
        timeout $(( ${GPU_TEST_TIMEOUT:-600} + 300 )) python3 -m pytest "$f" -p no:cacheprovider \
          -v -rA --timeout "${GPU_TEST_TIMEOUT:-600}" \
          --junitxml "$RES/$name.xml" > "$RES/$name.log" 2>&1
        echo "$name: rc=$? $(tail -1 "$RES/$name.log")"
      done ;;
    product)
      step product
      # vLLM's drop ceiling, then `hsx serve` and one job with train: and the evaluation.
      timeout 1500 python3 -m benchmarks.gpu.bench_product --out "$RES/product.json" \
        > "$RES/product.log" 2>&1
      echo "product: rc=$? $(tail -1 "$RES/product.log")"
      cp /tmp/hsx-bench-product/product-serve-tail.log "$RES/product-serve.log" 2>/dev/null
      cp /tmp/hsx-bench-product/drop.log "$RES/product-drop.log" 2>/dev/null
      rm -rf /tmp/hsx-bench-product/product-out ;;
    online)
      step online
      # The same job with train: offline, then online (the trainer on 0.3 of the GPU).
      timeout 1500 python3 -m benchmarks.gpu.bench_product --online --no-drop \
        --out "$RES/online.json" > "$RES/online.log" 2>&1
      echo "online: rc=$? $(tail -1 "$RES/online.log")"
      cp /tmp/hsx-bench-product/*-serve-tail.log /tmp/hsx-bench-product/*-pmon.log "$RES/" \
        2>/dev/null
      rm -rf /tmp/hsx-bench-product/offline-out /tmp/hsx-bench-product/online-out ;;
    online-ab)
      step online-ab
      # The online job alone on this tree and on .gpu/baseline's (the code before the
      # stream moved into Ray's object store: `git archive ef39bea client workers
      # service`, carried), alternately, ONLINE_AB_ARGS (default: one run each, 150 steps
      # of 256 prompts).
      timeout 1500 python3 -m benchmarks.gpu.bench_product --online --baseline .gpu/baseline \
        --no-drop ${ONLINE_AB_ARGS:---ab-reps 1 --steps 150 --prompts 256} \
        --out "$RES/online-ab.json" > "$RES/online-ab.log" 2>&1
      echo "online-ab: rc=$? $(tail -1 "$RES/online-ab.log")"
      cp /tmp/hsx-bench-product/*-serve-tail.log "$RES/" 2>/dev/null
      rm -rf /tmp/hsx-bench-product/online-*-out ;;
    multi)
      step multi
      timeout 900 python3 -m benchmarks.gpu.bench_vllm --phases hsx replicas2 tp2 --reps 1 \
        --out "$RES/vllm-multi.json" 2> "$RES/vllm-multi.log" ;;
    peer)
      step peer
      # What speculators' CLI and `vllm serve` import that the bundle and the image lack
      # (typer, uvloop, watchfiles, model-hosting-container-standards, prometheus-fastapi-
      # instrumentator, aiohttp, pandas...), carried as wheels in .gpu-peer (~21 MB;
      # benchmarks/gpu/README.md lists the download), installed last on the path.
      if [ -d .gpu-peer ] && [ ! -d /tmp/site-peer ]; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/site-peer .gpu-peer/*.whl
      fi
      # ~500k tokens per tool and workload; engines start 6 times (drop, bare, hsx bf16,
      # hsx fp8, hsx at --inflight-tokens, vllm serve): 21 minutes measured on one H200
      # (PEER_FLAGS: e.g. --phases, --profile).
      PYTHONPATH=$PYTHONPATH:/tmp/site-peer timeout 1380 python3 -m benchmarks.gpu.bench_peer ${PEER_FLAGS:-} \
        --child-timeout 300 --serve-timeout 240 --out "$RES/peer.json" > "$RES/peer.log" 2>&1
      echo "peer: rc=$? $(tail -1 "$RES/peer.log")"
      mkdir -p "$RES/peer-logs"
      cp /tmp/hsx-bench-peer/*.log /tmp/hsx-bench-peer/peer-logs/*.log "$RES/peer-logs/" 2>/dev/null
      cp /tmp/hsx-bench-peer/profile-*.txt "$RES/" 2>/dev/null
      gzip -9nf "$RES"/profile-*.txt 2>/dev/null
      rm -rf /tmp/hsx-bench-peer/out-* /tmp/hsx-bench-peer/peer-*-hs /tmp/hsx-bench-peer/peer-staging \
        /dev/shm/hsx-bench-peer ;;
    ingest)
      step ingest
      # Issue 25 on a node with many cores: ingestion with 2 and with 8 processes against
      # 1 (INGEST_ROWS rows, default 200k, memory baseline a tenth), then submit → first
      # committed shard on a million chats with vLLM's GPU build (the tiny model).
      # INGEST_WORKERS: the pool sizes (default "2 8"); INGEST_FLAGS, e.g. --profile (one
      # more run under py-spy, its stacks in ingest-N.prof.txt).
      for w in ${INGEST_WORKERS:-2 8}; do
        timeout 900 python3 -m benchmarks.bench_ingest --rows ${INGEST_ROWS:-200000} --reps 1 \
          --workers $w --out "$RES/ingest-$w.json" --workdir /tmp ${INGEST_FLAGS:-} \
          --note "GPU node, $(nproc) cores" > "$RES/ingest-$w.log" 2>&1
        echo "ingest $w workers: rc=$? $(tail -1 "$RES/ingest-$w.log")"
      done ;;
    first-commit)
      step first-commit
      timeout 1200 python3 -m benchmarks.bench_first_commit --rows ${FIRST_COMMIT_ROWS:-1000000} \
        --whole-rows 200000 --out "$RES/first_commit.json" --workdir /tmp \
        --note "GPU node: vLLM's GPU build, $(nproc) cores" > "$RES/first_commit.log" 2>&1
      echo "first-commit: rc=$? $(tail -1 "$RES/first_commit.log")"
      # The engine's own log (vLLM's steps, timestamped): where its start went.
      mkdir -p "$RES/first_commit-ray-logs"
      cp /tmp/ray/session_latest/logs/worker-*.err "$RES/first_commit-ray-logs/" 2>/dev/null ;;
    train)
      step train
      if [ -f benchmarks/gpu/bench_train_scaling.py ]; then
        timeout 600 python3 -m benchmarks.gpu.bench_train_scaling --out "$RES/train-scaling.json" \
          > "$RES/train-scaling.log" 2>&1
      fi ;;
    dspark)
      step dspark
      # A job with `train: {method: dspark}` and no other option on the learnable target:
      # extraction, training and vLLM's measurement of the draft (dspark_job.sh).
      timeout 1200 bash benchmarks/gpu/dspark_job.sh /tmp/dspark > "$RES/dspark-log.txt" 2>&1
      echo "dspark: rc=$? $(tail -1 "$RES/dspark-log.txt")"
      keep /tmp/dspark/out/draft "$RES/dspark" ;;
    methods)
      step methods
      # The draft methods on one capture of the learnable target (bench_methods.py), each
      # trained with its GPU defaults and measured by vLLM 0.25.1, DSpark too (vLLM's CPU
      # build cannot serve it). METHODS picks them (default every method of hsx.methods);
      # METHODS_FLAGS, e.g. --side-by-side (the trainings at once on the one GPU).
      timeout 2400 python3 -m benchmarks.bench_methods ${METHODS:+--methods $METHODS} \
        ${METHODS_FLAGS:-} --work /tmp/mwork --out "$RES/methods.json" > "$RES/methods-log.txt" 2>&1
      rc=$?
      cp /tmp/mwork/train-*.log "$RES/" 2>/dev/null && gzip -9nf "$RES"/train-*.log
      echo "methods: rc=$rc $(tail -8 "$RES/methods-log.txt")"
      for d in /tmp/mwork/draft-*; do keep "$d/draft" "$RES/$(basename "$d")"; done ;;
    ways)
      step ways
      # Each draft of the methods step measured by one vLLM engine as served (150
      # held-out prompts, stop at EOS) and the former way (ignore_eos, >= 8 tokens; the
      # first 32 prompts and all): benchmarks/measure_ways.py.
      for d in /tmp/mwork/draft-*; do
        m=$(basename "$d"); m=${m#draft-}
        timeout 600 python3 -m benchmarks.measure_ways /tmp/mwork/out --draft-dir "$d" \
          --prompts 150 --out "$RES/ways-$m.json" > "$RES/ways-$m.log" 2>&1
        echo "ways $m: rc=$? $(tail -1 "$RES/ways-$m.log")"
      done ;;
    dflash-loss)
      step dflash-loss
      # DFlash's two losses on the GPU, on the dspark step's capture (its layers hold
      # DFlash's): `hsx train --method dflash` with the default (ce) and with
      # `--set loss=kl_div`, trained side by side, then each measured by vLLM.
      for loss in ce kl_div; do
        timeout 900 python3 -m hsx.cli train /tmp/dspark/out --method dflash \
          --set loss=$loss --draft-dir /tmp/dflash-$loss > "$RES/dflash-$loss-train.txt" 2>&1 &
      done
      wait
      for loss in ce kl_div; do
        timeout 600 python3 -m hsx.cli eval-draft /tmp/dspark/out --draft-dir /tmp/dflash-$loss \
          --json > "$RES/dflash-$loss-eval.json" 2> "$RES/dflash-$loss-eval.log"
        echo "dflash $loss: rc=$? $(tail -c 300 "$RES/dflash-$loss-eval.json")"
        keep /tmp/dflash-$loss "$RES/dflash-$loss" 2
      done ;;
    selfcheck)
      step selfcheck
      # The self-check's cost on the 8B shape, `checks: on` against `off` in one run, then
      # each injected fault (benchmarks/bench_selfcheck.py; SELFCHECK_FLAGS sets the size).
      timeout 1200 python3 -m benchmarks.bench_selfcheck --model 8b --faults \
        ${SELFCHECK_FLAGS:---reps 3 --prompts 600} --workdir /tmp \
        --out "$RES/selfcheck.json" > "$RES/selfcheck-log.txt" 2>&1
      echo "selfcheck: rc=$? $(tail -3 "$RES/selfcheck-log.txt")"
      # The head check's product alone on the node's cores: bf16 against float32.
      timeout 600 python3 -m benchmarks.bench_selfcheck --head-product \
        --out "$RES/selfcheck.json" > "$RES/head-product-log.txt" 2>&1
      echo "head-product: rc=$? $(tail -2 "$RES/head-product-log.txt")" ;;
    *) echo "unknown step $s" ;;
  esac
done
step done
touch /tmp/hsx-gpu/DONE
