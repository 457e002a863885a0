#!/usr/bin/env bash
# The CUDA path on a real GPU in one run of about 8 minutes (docs/gpu.md): the GPU tests, throughput against HF
# transformers, eager vs CUDA-graph decode steps against the HBM floor, a tile sweep of the attention kernels. Each
# stage runs under its own time limit and goes on after a failure; logs go to $OUT/<stage>.log, every number to
# $OUT/gpu_check.json (7 files in all), and a summary is printed last.
#
#   bash benchmarks/gpu_check.sh                       # on the GPU machine: python3, wheels in .whl/ (gguf, llguidance)
#   GPU_CHECK_DRY=1 PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh   # a dry run on the CPU, tiny shapes
#   GPU_CHECK_STAGES="env pytest models throughput_smollm2-135m decode sweep" GPU_CHECK_SWEEP=short \
#       GPU_CHECK_BUDGET=300 bash benchmarks/gpu_check.sh   # a rerun: some stages, the sweep around the defaults
# $OUT/RESULTS.md: benchmarks/RESULTS.md with its gpu-check section from this run (gpu_check.py results-md).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check_out}
export GPU_CHECK_WORK=${GPU_CHECK_WORK:-/tmp/gpu_check} PYTHONUNBUFFERED=1
WORK=$GPU_CHECK_WORK MODELS=$GPU_CHECK_WORK/models
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then
    DEVICE=cpu PROMPTS=4 TESTS=(-k "write_kv or silu" tests/test_cuda.py tests/test_triton_fused.py
                                 tests/test_triton_attention.py)
    export TRITON_INTERPRET=1
else
    DEVICE=cuda PROMPTS=64 TESTS=(tests/test_cuda.py tests/test_triton_fused.py tests/test_triton_attention.py)
    unset TRITON_INTERPRET  # the kernels compiled for the GPU, not interpreted
fi

BUDGET=${GPU_CHECK_BUDGET:-480}  # seconds for all stages: a late stage gets what is left of it
STAGES=" ${GPU_CHECK_STAGES:-env pytest models throughput_smollm2-135m throughput_llama-1b decode sweep} "
stage() {  # stage NAME LOG SECONDS COMMAND...: run it under its limit, log it, record its exit status and time
    local name=$1 log=$OUT/$2.log limit=$(($3 < BUDGET - SECONDS ? $3 : BUDGET - SECONDS)) start=$SECONDS
    shift 3
    if [ "$name" != wheels ] && [[ $STAGES != *" $name "* ]]; then
        return  # not asked for (GPU_CHECK_STAGES)
    fi
    if [ "$limit" -lt 10 ]; then
        echo "== $name: skipped, the budget of $BUDGET s is spent" | tee -a "$log"
        echo "$name skipped 0" >>"$WORK/stages.txt"
        return
    fi
    echo "== $name (limit $limit s) at $(date -u +%T)" | tee -a "$log"
    timeout -k 5 "$limit" "$@" >>"$log" 2>&1
    local rc=$?
    echo "$name $rc $((SECONDS - start))" >>"$WORK/stages.txt"
    echo "== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$log"
}

# 1. environment: the GPU, the wheels of what the image lacks, versions, copy bandwidth and matmul rate
{ nvidia-smi || echo "no nvidia-smi"; } >>"$OUT/env.log" 2>&1
stage wheels env 30 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$WORK/site" .whl/*.whl
export PYTHONPATH=$PWD:$WORK/site
stage env env 40 "$PY" benchmarks/gpu_check.py env
# 2. the GPU tests (on CUDA: TRITON_INTERPRET unset, and tests/conftest.py sets it only where no GPU is)
stage pytest pytest 150 "$PY" -m pytest -v --tb=short -p no:cacheprovider --junitxml="$WORK/pytest.xml" "${TESTS[@]}"
# 3. random bf16 models of SmolLM2-135M's and a 1B llama's shapes, and the throughput of each against HF
stage models models 45 "$PY" benchmarks/gpu_check.py models "$MODELS"
for model in smollm2-135m llama-1b; do
    stage "throughput_$model" throughput 75 "$PY" benchmarks/throughput.py --model "$MODELS/$model" \
        --device "$DEVICE" --compare-hf --dtype bfloat16 --num-prompts "$PROMPTS" --output '' \
        --json "$WORK/throughput_$model.json"
done
# 4. decode steps of the 1B model: eager vs CUDA graphs, against the HBM floor
stage decode decode 75 "$PY" benchmarks/gpu_check.py decode "$MODELS/llama-1b"
# 5. tile sizes of the attention kernels
stage sweep sweep 50 "$PY" benchmarks/gpu_check.py sweep "${GPU_CHECK_SWEEP:-full}"
"$PY" benchmarks/gpu_check.py summary "$OUT/gpu_check.json" 2>&1 | tee -a "$OUT/env.log"
cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
"$PY" benchmarks/gpu_check.py results-md "$OUT/gpu_check.json" "$OUT/RESULTS.md" 2>&1 | tee -a "$OUT/env.log"
