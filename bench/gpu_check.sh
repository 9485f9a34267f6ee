#!/usr/bin/env bash
# The GPU checks, in one run on a CUDA machine (CI never has one): tests/gpu, then the offload benchmark over
# the native link (pinned host store, copy stream, events) with transfer-only and hybrid policies side by side.
# Usage: bash bench/gpu_check.sh [out_dir]   (default bench/results/gpu; each step has its own time limit)
set -u -o pipefail
out=${1:-bench/results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
py=${PYTHON:-python3}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/machine.txt"
$py -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" \
    | tee -a "$out/machine.txt"
nproc | tee -a "$out/machine.txt"

HINTSERVE_LOGITS_REPORT="$out/logits" timeout "${TESTS_TIMEOUT:-240}" $py -m pytest tests/gpu -q -rfEs -p no:cacheprovider --timeout 120 2>&1 \
    | tee "$out/tests_gpu.log"
echo "tests/gpu exit: $?" | tee -a "$out/machine.txt"

# offload_bench TIMEOUT MODEL POLICIES CACHE BATCH JSON [FLAGS...]: the native-link offload benchmark, its log
# beside JSON.
offload_bench() {
    timeout "$1" $py -m services.cli bench offload --model "$2" --device cuda --link native --policies "$3" \
        --cache "$4" --batch "$5" --new-tokens 16 --json "$6" "${@:7}" 2>&1 | grep -v "it/s\]\|s/it\]" \
        | tee "${6%.json}.log"
}

offload_bench "${BENCH_TIMEOUT:-240}" models/demo-moe \
    "${POLICIES:-lru,hintserve-transfer,cpu-experts,ktransformers,fiddler,hintserve}" 25% "${BATCH:-1,4}" \
    "$out/offload_cuda.json"
echo "bench offload exit: $?" | tee -a "$out/machine.txt"

# Real shapes (REAL_SHAPE=1): a random Qwen3-30B-A3B-shape checkpoint (4 layers, 9.4 MB bf16 experts) built
# there, then the same policies: what the link and the host cores give when experts are not tiny.
if [ "${REAL_SHAPE:-0}" = 1 ]; then
    mkdir -p "$out/real"
    model=${REAL_MODEL_DIR:-/tmp/hintserve-qwen3-4l}
    [ -f "$model/config.json" ] || $py -m services.cli demo-model build --shape qwen3-30b-a3b --layers 4 --random \
        --out "$model" 2>&1 | grep -v "it/s\]\|s/it\]" | tail -3
    # bf16 hybrid logits against the resident engine's, teacher-forced (tests/gpu/test_cuda_hybrid_logits.py)
    HINTSERVE_REAL_MODEL=$model HINTSERVE_LOGITS_REPORT="$out/real/logits" timeout "${REAL_TIMEOUT:-240}" \
        $py -m pytest tests/gpu/test_cuda_hybrid_logits.py -q -rfEs -p no:cacheprovider -k real 2>&1 \
        | grep -v "it/s\]\|s/it\]" | tee "$out/real/logits.log"
    echo "real-shape logits exit: $?" | tee -a "$out/machine.txt"
    offload_bench "${REAL_TIMEOUT:-240}" "$model" "${REAL_POLICIES:-lru,hintserve-transfer,fiddler,hintserve}" \
        "${REAL_CACHE:-25%}" "${REAL_BATCH:-1,4}" "$out/real/offload_cuda_qwen3.json"
    echo "real-shape bench offload exit: $?" | tee -a "$out/machine.txt"
    # int4 experts: the host computes from the CPU kernels' layout, the slots get theirs repacked on the copy
    # stream (offload/transcode.py); lru keeps the CUDA layout in the store, the control.
    offload_bench "${REAL_TIMEOUT:-240}" "$model" "${REAL_INT4_POLICIES:-lru,fiddler,hintserve}" \
        "${REAL_CACHE:-25%}" "${REAL_BATCH:-1,4}" "$out/real/offload_cuda_qwen3_int4.json" --expert-dtypes int4
    echo "real-shape int4 bench offload exit: $?" | tee -a "$out/machine.txt"
fi

# The host's kernels at this box's thread counts (HOST_KERNELS=0 skips): a CUDA engine's host pool defaults to
# cores - 2; one expert a call against a layer's 8 in one call (moe8, the cost of the executor's HostGroup).
if [ "${HOST_KERNELS:-1}" = 1 ]; then
    host_threads=$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))
    timeout "${HOST_TIMEOUT:-150}" $py -m services.cli bench host-kernels --formats "${HOST_FORMATS:-bf16,int4}" \
        --rows 1,16 --threads "1,$host_threads" --min-seconds 0.1 --cycle-mb 1024 \
        --json "$out/host_kernels.json" 2>&1 | grep -v "it/s\]\|s/it\]" | tail -3
    echo "host-kernels exit: $?" | tee -a "$out/machine.txt"
fi
