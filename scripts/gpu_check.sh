#!/usr/bin/env bash
# The one prepared check for a machine with GPUs, in two sizes:
#
#   bash scripts/gpu_check.sh --quick    at most 4 minutes on one GPU, start-up included (a GPU lent for minutes)
#   bash scripts/gpu_check.sh            the full check: about 7 minutes on one GPU (6 measured before the fp16
#                                        and compile rows): the quick rows at full length, then the benchmarks
#
# Both run what a GPU user runs first: the README's own commands on CUDA (the default job, trainer.device=cuda, a
# model override, predict.py, a sweep and its report; with two GPUs or more torchrun DDP and self-launched DDP
# (parallel.nproc_per_node)), fp32, bf16 and fp16 training, torch.compile (the model; the optimizer step),
# optim=muon, two trainer.deterministic runs and an async checkpoint's resume compared bit for bit, the CUDA-only tests
# (pytest -k cuda: tests/test_device_clean.py's host-sync counts among them), trainkit's overhead against the plain loop,
# and with two GPUs or more torch's SyncBN under DDP and FSDP over NCCL. --quick runs short runs
# (trainer.max_steps), one overhead row, and stops starting rows when its budget is spent (each row is then
# "skipped: --quick's budget spent"; a row that would outlive the budget is stopped). The full check adds the overhead of four
# models, the fixed cost per step, CUDA graphs, peak memory with activation checkpointing and bench_accumulation.
#
#   after `make`; PY=... to use another interpreter (an air-gapped node: docs/gpu.md), OUT=<dir> for the logs.
#
# $OUT (printed first) holds each check's log and the table, no model or checkpoint (runs go to a temporary dir,
# removed at the end); the table is printed last. A failed check is a row and the checks go on; the exit status
# is 1 when any failed, 2 when there is nothing to check (no GPU, bad PY).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
QUICK=0
case ${1:-} in
    --quick) QUICK=1 ;;
    -h | --help) sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    "") ;;
    *) echo "error: unknown argument $1 (--quick, --help)" >&2; exit 2 ;;
esac
PY=${PY:-.venv/bin/python}
if ! GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>&1); then
    echo "error: PY=$PY cannot run python with torch: $(tail -1 <<< "$GPUS")" >&2
    exit 2
fi
if [[ $GPUS -lt 1 ]]; then
    echo "error: no CUDA device visible (torch.cuda.device_count() = 0)" >&2
    exit 2
fi
OUT=${OUT:-$(mktemp -d /tmp/gpu_check.XXXX)}  # only now: a machine without a GPU keeps no empty dir
mkdir -p "$OUT"
RUNS=$(mktemp -d /tmp/gpu_check_runs.XXXX)  # run dirs (weights, checkpoints): their figures are read, then removed
trap 'rm -rf "$RUNS"' EXIT
NAME=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0))")
SIZE=$( ((QUICK)) && echo "quick" || echo "full")
echo "logs in $OUT; $GPUS x $NAME; $SIZE check"
# --quick: 240 s in all, the start-up above (seconds) included; rows start until BUDGET s from the script's start,
# each under `timeout` to the end of it, so one that hangs (a NCCL peer) cannot take the rest.
BUDGET=${BUDGET:-225}
steps() { if ((QUICK)); then echo "$1"; else echo "$2"; fi; }  # steps <quick> <full>
left() {  # the seconds this row may run: the budget's rest in --quick (0: none), unbounded (a day) in full
    if ((QUICK)); then echo $((BUDGET - SECONDS > 0 ? BUDGET - SECONDS : 0)); else echo 86400; fi
}
FAILED=0 SKIPPED=0
TABLE="$OUT/table.md"
printf '| check | result |\n|---|---|\n' > "$TABLE"
slug() { printf '%s' "${1//[^A-Za-z0-9]/_}"; }  # a check's name as a file name (Hydra parses = and :)

row() {  # row <check> <result>; a result starting with FAILED counts as a failure
    [[ $2 == FAILED* ]] && FAILED=$((FAILED + 1))
    [[ $2 == skipped:\ --quick* ]] && SKIPPED=$((SKIPPED + 1))
    printf '| %s | %s |\n' "$1" "${2//|/\\|}" | tee -a "$TABLE"  # a log line's | would split the cell
}

# on_gpu <name> <log> <command...>: true when the command succeeded and ran on the GPU (its startup
# line says "on cuda:0"); else a FAILED row with the log's first error line, or a skipped one when --quick's
# budget is spent.
on_gpu() {
    local name=$1 log=$2 status limit
    shift 2
    limit=$(left)
    if [[ $limit -lt 5 ]]; then
        row "$name" "skipped: --quick's budget spent"
        return 1
    fi
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
    status=$?
    if [[ $status -eq 124 || $status -eq 137 ]] && ((QUICK)); then
        row "$name" "FAILED: stopped at the end of --quick's budget ($limit s left when it started)"
    elif [[ $status -ne 0 ]]; then
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
    "$PY" - "$@" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl")]
print(" ".join(f"{k}={next((r[k] for r in reversed(rows) if k in r), float('nan')):.4g}" for k in sys.argv[2:]))
EOF
}

# train <name> <python|torchrun[:N]> <overrides...>: a run into $RUNS/<name> on the GPU (its log in $OUT), then its
# figures.
train() {
    local name=$1 launcher=$2 dir
    dir="$RUNS/$(slug "$1")"
    shift 2
    local cmd=("$PY" src/train.py) nproc=${launcher#torchrun:}
    [[ $launcher == torchrun ]] && nproc=$GPUS
    [[ $launcher == torchrun* ]] && cmd=("$PY" -m torch.distributed.run --standalone --nproc_per_node="$nproc" src/train.py)
    on_gpu "$name" "$OUT/$(slug "$1").log" "${cmd[@]}" "hydra.run.dir=$dir" "$@" &&
        row "$name" "$(last "$dir" loss val/acc samples_per_s time/data_wait)"
}

# The README's commands, as a GPU user runs them first (README: Launching; docs/predict.md; docs/launching.md: Sweeps).
train "README: python src/train.py" python
train "README: trainer.device=cuda" python trainer.device=cuda trainer.max_steps="$(steps 100 200)"
train "README: model=cnn optim=sgd sched=constant (fp32)" python model=cnn optim=sgd sched=constant \
    trainer.max_steps="$(steps 100 null)"
check "README: predict.py run_dir=<default run>" "$PY" src/predict.py "run_dir=$RUNS/$(slug "README: python src/train.py")" \
    "hydra.run.dir=$RUNS/predict"
if [[ $GPUS -ge 2 ]]; then
    train "README: torchrun x2 accumulation.steps=4" torchrun:2 accumulation.steps=4 trainer.max_steps="$(steps 100 null)"
    train "README: torchrun x2 +experiment=digits_cnn_ddp" torchrun:2 +experiment=digits_cnn_ddp \
        trainer.max_steps="$(steps 100 null)"
    # Self-launched workers, forked: CUDA must first be initialised in them, not in train.py's process.
    train "README: parallel.nproc_per_node=auto (x$GPUS, fork)" python parallel.nproc_per_node=auto \
        trainer.max_steps="$(steps 100 200)"
else
    row "README: torchrun x2, parallel.nproc_per_node=auto" "skipped: one GPU"
fi

# Precision and compilation: bf16 and fp16 (a GradScaler) beside the fp32 rows above; torch.compile's first steps
# compile (tens of seconds).
train "resnet18 fake bf16" python data=fake model=resnet18 trainer.precision=bf16 trainer.max_steps="$(steps 60 300)" \
    data.batch_size=128 data.num_workers=4 trainer.log_every="$(steps 20 100)" trainer.eval_every="$(steps 60 300)"
train "gpt addition bf16" python +experiment=addition_gpt trainer.precision=bf16 trainer.max_steps="$(steps 200 1000)"
train "cnn fp16" python model=cnn trainer.precision=fp16 trainer.max_steps="$(steps 100 300)"
train "mlp trainer.compile=true" python trainer.compile=true trainer.max_steps="$(steps 100 300)"
train "mlp optim.compile=true" python optim.compile=true trainer.max_steps="$(steps 100 300)"
train "gpt addition optim=muon bf16" python +experiment=addition_gpt optim=muon trainer.precision=bf16 \
    trainer.max_steps="$(steps 200 1000)"

# trainer.deterministic=true: the same seed twice, the weights bit-equal (the GPT: its embedding's backward adds
# with atomics without the switch); a failed run is its own FAILED row.
same_weights() {
    "$PY" - "$@" <<'EOF'
import sys, torch
a, b = (torch.load(path, weights_only=True) for path in sys.argv[1:])
differ = [k for k in a if not torch.equal(a[k], b[k])]
print("bit-equal" if not differ else f"FAILED: {len(differ)} tensors differ, e.g. {differ[0]}")
EOF
}
deterministic=()
for i in 1 2; do
    dir="$RUNS/deterministic$i"
    on_gpu "trainer.deterministic=true: two GPT runs" "$OUT/deterministic$i.log" "$PY" src/train.py \
        +experiment=addition_gpt trainer.deterministic=true trainer.max_steps="$(steps 100 300)" "hydra.run.dir=$dir" ||
        break
    deterministic+=("$dir/model.pt")
done
[[ ${#deterministic[@]} -eq 2 ]] && row "trainer.deterministic=true: two GPT runs" "$(same_weights "${deterministic[@]}")"
# checkpoint.async=true: DCP's async_save stages the state from the GPU to host memory and a thread writes it; a
# resume from step 40's checkpoint ends bit-equal to the run it came from (deterministic: comparable bit for bit).
async_run=(trainer.max_steps=60 checkpoint.every=20 checkpoint.async=true trainer.deterministic=true)
if on_gpu "checkpoint.async=true: resumed bit-equal" "$OUT/async_run.log" "$PY" src/train.py "${async_run[@]}" \
    "hydra.run.dir=$RUNS/async_run" &&
    on_gpu "checkpoint.async=true: resumed bit-equal" "$OUT/async_resumed.log" "$PY" src/train.py "${async_run[@]}" \
        "checkpoint.resume=$RUNS/async_run/checkpoints/step_00000040" "hydra.run.dir=$RUNS/async_resumed"; then
    row "checkpoint.async=true: resumed bit-equal" "$(same_weights "$RUNS/async_run/model.pt" "$RUNS/async_resumed/model.pt")"
fi

if [[ $GPUS -ge 2 ]]; then
    train "cnn DDP x$GPUS torch SyncBN" torchrun parallel=ddp parallel.sync_bn=true model=cnn \
        trainer.max_steps="$(steps 100 200)"
    train "resnet18 FSDP x$GPUS bf16" torchrun +experiment=fsdp_resnet18_fake trainer.max_steps="$(steps 40 100)"
else
    row "SyncBN / FSDP under torchrun" "skipped: one GPU"
fi

# The tests that skip without CUDA (named so: -k cuda), tests/test_device_clean.py's host-sync counts on the GPU
# among them (its emulated-device tests need no GPU: the CPU suite runs them).
name="CUDA-only tests (pytest -k cuda)"
if [[ $(left) -lt 5 ]]; then
    row "$name" "skipped: --quick's budget spent"
elif timeout --kill-after=10 "$(left)" "$PY" -m pytest -q -k cuda -p no:cacheprovider \
    --basetemp "$RUNS/pytest" tests > "$OUT/$(slug "$name").log" 2>&1; then
    row "$name" "$(tail -1 "$OUT/$(slug "$name").log")"
else
    row "$name" "FAILED: $(tail -1 "$OUT/$(slug "$name").log")"
fi

check "README: sweep -m accumulation.steps=1,2 + report.py" bash -c \
    "$PY src/train.py -m accumulation.steps=1,2 trainer.max_steps=$(steps 50 100) hydra.sweep.dir=$RUNS/sweep &&
     $PY scripts/report.py $RUNS/sweep && cp $RUNS/sweep/report.md $OUT/sweep_report.md"

# overhead <setup>: trainkit against the plain loops (bench_train.py), bf16.
overhead() {
    local ratio limit
    limit=$(left)
    if [[ $limit -lt 5 ]]; then
        row "overhead vs plain loops, bf16 ${1:-default mlp}" "skipped: --quick's budget spent"
        return
    fi
    # shellcheck disable=SC2086  # the overrides are words
    ratio=$(timeout --kill-after=10 "$limit" "$PY" scripts/bench_train.py --steps "$(steps 400 1200)" trainer.device=cuda \
        trainer.precision=bf16 $1 2>&1 | tee "$OUT/$(slug "overhead ${1:-mlp}").log" |
        grep -E "^(tensor|dataloader|trainkit) +[0-9]|^ratio" | tr -s ' ' | paste -sd ';')
    row "overhead vs plain loops, bf16 ${1:-default mlp}" "${ratio:-FAILED}"
}
overhead ""

if ((!QUICK)); then  # the benchmarks
    for setup in "data=fake model=resnet18 data.batch_size=128" "data=fake model=cnn" "+experiment=pydoc_gpt"; do
        overhead "$setup"
    done
    # The fixed cost per step where it is the step (issue 36): trainkit against the fastest plain loop (tensors on
    # the GPU, slices) on the three small models at K=1 and K=4, eager, then with CUDA graphs (reduce-overhead).
    suite=$("$PY" scripts/bench_train.py --suite --seconds 10 trainer.device=cuda 2>&1 | grep -E "^\| [a-z]")
    row "fixed cost: trainkit / tensor-slicing loop, mlp cnn conv1d x K=1,4 (eager)" "$(paste -sd ';' <<< "${suite:-FAILED}")"
    graphs=$("$PY" scripts/bench_train.py --steps 1200 trainer.device=cuda trainer.compile=reduce-overhead 2>&1 |
        grep -E "^(tensor|trainkit) +[0-9]|^ratio trainkit / tensor" | tr -s ' ' | paste -sd ';')
    row "trainkit trainer.compile=reduce-overhead vs the eager tensor loop, mlp" "${graphs:-FAILED}"

    memory=$("$PY" scripts/bench_memory.py --activation-checkpointing 2>/dev/null | grep -E '^\| (gpt|resnet18)' |
        awk -F'|' '{printf "%s %s: %s MiB; ", $2, $3, $5}')
    row "peak memory, activation checkpointing off/on" "${memory:-FAILED}"

    "$PY" scripts/bench_accumulation.py --out "$OUT/bench_accumulation.json" > "$OUT/bench_accumulation.md" 2>&1
    accumulation=$(grep -E '^\| (mlp|resnet18|gpt) \|' "$OUT/bench_accumulation.md" | head -3 | tr -s ' ' | paste -sd ';')
    row "bench_accumulation ($GPUS GPU(s))" "${accumulation:-FAILED}"
fi

rm -rf "$RUNS"
[[ $SKIPPED -gt 0 ]] && echo "note: $SKIPPED row(s) skipped when --quick's budget ($BUDGET s) was spent"
[[ $FAILED -gt 0 ]] && echo "error: $FAILED check(s) failed; logs in $OUT" >&2
echo
echo "## gpu_check ($SIZE, ${SECONDS} s): $GPUS x $NAME, $(date -u +%Y-%m-%d)"
cat "$TABLE"
[[ $FAILED -eq 0 ]] || exit 1
