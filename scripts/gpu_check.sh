#!/usr/bin/env bash
# The one prepared check for a machine with GPUs (about 6 minutes on one GPU). First what a GPU user
# runs first: the README's own commands (the default job, trainer.device=cuda, a model override,
# torchrun DDP, self-launched DDP (parallel.nproc_per_node), a sweep and its report, predict.py). Then
# the test suite's CUDA-only tests, bf16 training of resnet18 on fake data and of the GPT, torch's SyncBN
# and FSDP under torchrun (two GPUs or more), trainkit's overhead against the plain loop, peak memory
# with and without activation checkpointing, and bench_accumulation on the GPUs present. Prints one
# table at the end.
#
#   bash scripts/gpu_check.sh            (after `make`; PY=... to use another interpreter)
#
# Each check's full output is kept in $OUT (printed first). A failed check is a row and the checks
# go on; the exit status is 1 when any failed, 2 when there is nothing to check (no GPU, bad PY).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if ! GPUS=$($PY -c "import torch; print(torch.cuda.device_count())" 2>&1); then
    echo "error: PY=$PY cannot run python with torch: $(tail -1 <<< "$GPUS")" >&2
    exit 2
fi
if [[ $GPUS -lt 1 ]]; then
    echo "error: no CUDA device visible (torch.cuda.device_count() = 0)" >&2
    exit 2
fi
OUT=${OUT:-$(mktemp -d /tmp/gpu_check.XXXX)}  # only now: a machine without a GPU keeps no empty dir
mkdir -p "$OUT"
NAME=$($PY -c "import torch; print(torch.cuda.get_device_name(0))")
echo "logs in $OUT; $GPUS x $NAME"
FAILED=0
TABLE="$OUT/table.md"
printf '| check | result |\n|---|---|\n' > "$TABLE"
slug() { printf '%s' "${1//[^A-Za-z0-9]/_}"; }  # a check's name as a file name (Hydra parses = and :)

row() {  # row <check> <result>; a result starting with FAILED counts as a failure
    [[ $2 == FAILED* ]] && FAILED=$((FAILED + 1))
    printf '| %s | %s |\n' "$1" "${2//|/\\|}" | tee -a "$TABLE"  # a log line's | would split the cell
}

# on_gpu <name> <log> <command...>: true when the command succeeded and ran on the GPU (its startup
# line says "on cuda:0"); else a FAILED row with the log's first error line.
on_gpu() {
    local name=$1 log=$2 status
    shift 2
    "$@" > "$log" 2>&1
    status=$?
    if [[ $status -ne 0 ]]; then
        row "$name" "FAILED (exit $status): $(grep -m1 -E '^error|Error' "$log" || tail -1 "$log")"
    elif ! grep -qE " on cuda:0[ ,]" "$log"; then
        row "$name" "FAILED: not on a GPU: $(grep -m1 -E ' on [a-z]+[:0-9]*[ ,]' "$log")"
    else
        return 0
    fi
    return 1
}

# check <name> <command...>: ok, or FAILED (log: $OUT/<name>.log).
check() {
    local name=$1
    shift
    on_gpu "$name" "$OUT/$(slug "$name").log" "$@" && row "$name" ok
}

# last <run dir> <key>...: the last metrics.jsonl value of each key, "key=value" joined by spaces.
last() {
    $PY - "$@" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl")]
print(" ".join(f"{k}={next((r[k] for r in reversed(rows) if k in r), float('nan')):.4g}" for k in sys.argv[2:]))
EOF
}

# train <name> <python|torchrun[:N]> <overrides...>: a run into $OUT/<name> on the GPU, then its figures.
train() {
    local name=$1 launcher=$2 dir
    dir="$OUT/$(slug "$1")"
    shift 2
    local cmd=($PY src/train.py) nproc=${launcher#torchrun:}
    [[ $launcher == torchrun ]] && nproc=$GPUS
    [[ $launcher == torchrun* ]] && cmd=($PY -m torch.distributed.run --standalone --nproc_per_node="$nproc" src/train.py)
    on_gpu "$name" "$dir.log" "${cmd[@]}" "hydra.run.dir=$dir" "$@" &&
        row "$name" "$(last "$dir" loss val/acc samples_per_s time/data_wait)"
}

# The README's commands, as a GPU user runs them first (README: Launching; docs/predict.md; docs/launching.md: Sweeps).
train "README: python src/train.py" python
train "README: trainer.device=cuda" python trainer.device=cuda trainer.max_steps=200
train "README: model=cnn optim=sgd sched=constant" python model=cnn optim=sgd sched=constant
check "README: predict.py run_dir=<default run>" $PY src/predict.py "run_dir=$OUT/$(slug "README: python src/train.py")" \
    "hydra.run.dir=$OUT/predict"
check "README: sweep -m accumulation.steps=1,2 + report.py" bash -c \
    "$PY src/train.py -m accumulation.steps=1,2 trainer.max_steps=100 hydra.sweep.dir=$OUT/sweep &&
     $PY scripts/report.py $OUT/sweep"
if [[ $GPUS -ge 2 ]]; then
    train "README: torchrun x2 accumulation.steps=4" torchrun:2 accumulation.steps=4
    train "README: torchrun x2 +experiment=digits_cnn_ddp" torchrun:2 +experiment=digits_cnn_ddp
    # Self-launched workers, forked: CUDA must first be initialised in them, not in train.py's process.
    train "README: parallel.nproc_per_node=auto (x$GPUS, fork)" python parallel.nproc_per_node=auto trainer.max_steps=200
else
    row "README: torchrun x2, parallel.nproc_per_node=auto" "skipped: one GPU"
fi

if tests=$($PY -m pytest -q -k "cuda" -p no:cacheprovider tests 2>&1 | tail -1); then
    row "CUDA-only tests (pytest -k cuda)" "$tests"
else
    row "CUDA-only tests (pytest -k cuda)" "FAILED: $tests"
fi

train "resnet18 fake bf16" python data=fake model=resnet18 trainer.precision=bf16 trainer.max_steps=300 \
    data.batch_size=128 data.num_workers=4 trainer.log_every=100 trainer.eval_every=300
train "gpt addition bf16" python +experiment=addition_gpt trainer.precision=bf16 trainer.max_steps=1000
if [[ $GPUS -ge 2 ]]; then
    train "cnn DDP x$GPUS torch SyncBN" torchrun parallel=ddp parallel.sync_bn=true model=cnn trainer.max_steps=200
    train "resnet18 FSDP x$GPUS bf16" torchrun +experiment=fsdp_resnet18_fake trainer.max_steps=100
else
    row "SyncBN / FSDP under torchrun" "skipped: one GPU"
fi

for setup in "data=fake model=resnet18 data.batch_size=128" "data=fake model=cnn" "+experiment=pydoc_gpt" ""; do
    # shellcheck disable=SC2086  # the overrides are words
    ratio=$($PY scripts/bench_train.py --steps 1200 trainer.device=cuda trainer.precision=bf16 $setup 2>&1 |
        grep -E "^(tensor|dataloader|trainkit) +[0-9]|^ratio" | tr -s ' ' | paste -sd ';')
    row "overhead vs plain loops, bf16 ${setup:-default mlp}" "${ratio:-FAILED}"
done
# The fixed cost per step where it is the step (issue 36): trainkit against the fastest plain loop (tensors on
# the GPU, slices) on the three small models at K=1 and K=4, eager, then with CUDA graphs (reduce-overhead).
suite=$($PY scripts/bench_train.py --suite --seconds 10 trainer.device=cuda 2>&1 | grep -E "^\| [a-z]")
row "fixed cost: trainkit / tensor-slicing loop, mlp cnn conv1d x K=1,4 (eager)" "$(paste -sd ';' <<< "${suite:-FAILED}")"
graphs=$($PY scripts/bench_train.py --steps 1200 trainer.device=cuda trainer.compile=reduce-overhead 2>&1 |
    grep -E "^(tensor|trainkit) +[0-9]|^ratio trainkit / tensor" | tr -s ' ' | paste -sd ';')
row "trainkit trainer.compile=reduce-overhead vs the eager tensor loop, mlp" "${graphs:-FAILED}"

memory=$($PY scripts/bench_memory.py --activation-checkpointing 2>/dev/null | grep -E '^\| (gpt|resnet18)' |
    awk -F'|' '{printf "%s %s: %s MiB; ", $2, $3, $5}')
row "peak memory, activation checkpointing off/on" "${memory:-FAILED}"

$PY scripts/bench_accumulation.py --out "$OUT/bench_accumulation.json" > "$OUT/bench_accumulation.md" 2>&1
accumulation=$(grep -E '^\| (mlp|resnet18|gpt) \|' "$OUT/bench_accumulation.md" | head -3 | tr -s ' ' | paste -sd ';')
row "bench_accumulation ($GPUS GPU(s))" "${accumulation:-FAILED}"

echo
echo "## gpu_check: $GPUS x $NAME, $(date -u +%Y-%m-%d)"
cat "$TABLE"
if [[ $FAILED -gt 0 ]]; then
    echo "error: $FAILED check(s) failed; logs in $OUT" >&2
    exit 1
fi
