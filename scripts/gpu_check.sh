#!/usr/bin/env bash
# The one prepared check for a machine with GPUs (about 5 minutes on one GPU): the test suite's
# CUDA-only tests, bf16 training of resnet18 on fake data and of the GPT, torch's SyncBN under DDP
# (two GPUs or more), trainkit's overhead against the plain loop, peak memory with and without
# activation checkpointing, and bench_accumulation on the GPUs present. Prints one table at the end.
#
#   bash scripts/gpu_check.sh            (after `make`; PY=... to use another interpreter)
#
# Each check's full output is kept in $OUT (printed first); a failed check is a row, not an exit.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-$(mktemp -d /tmp/gpu_check.XXXX)}
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
if [[ $GPUS -lt 1 ]]; then
    echo "error: no CUDA device visible (torch.cuda.device_count() = 0)" >&2
    exit 2
fi
NAME=$($PY -c "import torch; print(torch.cuda.get_device_name(0))")
echo "logs in $OUT; $GPUS x $NAME"
TABLE="$OUT/table.md"
printf '| check | result |\n|---|---|\n' > "$TABLE"
row() { printf '| %s | %s |\n' "$1" "$2" | tee -a "$TABLE"; }

# last <run dir> <key>...: the last metrics.jsonl value of each key, "key=value" joined by spaces.
last() {
    $PY - "$@" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl")]
print(" ".join(f"{k}={next((r[k] for r in reversed(rows) if k in r), float('nan')):.4g}" for k in sys.argv[2:]))
EOF
}

train() {  # train <name> <python|torchrun> <overrides...>: a run into $OUT/<name>, then its figures
    local name=$1 launcher=$2
    shift 2
    local cmd=($PY src/train.py)
    [[ $launcher == torchrun ]] && cmd=($PY -m torch.distributed.run --standalone --nproc_per_node="$GPUS" src/train.py)
    if "${cmd[@]}" "hydra.run.dir=$OUT/$name" "$@" > "$OUT/$name.log" 2>&1; then
        row "$name" "$(last "$OUT/$name" loss val/acc samples_per_s time/data_wait)"
    else
        row "$name" "FAILED: $(grep -m1 -E '^error|Error' "$OUT/$name.log")"
    fi
}

tests=$($PY -m pytest -q -k "cuda" -p no:cacheprovider tests 2>&1 | tail -1)
row "CUDA-only tests (pytest -k cuda)" "$tests"

train "resnet18 fake bf16" python data=fake model=resnet18 trainer.precision=bf16 trainer.max_steps=300 \
    data.batch_size=128 data.num_workers=4 trainer.log_every=100 trainer.eval_every=300
train "gpt addition bf16" python +experiment=addition_gpt trainer.precision=bf16 trainer.max_steps=1000
if [[ $GPUS -ge 2 ]]; then
    train "cnn DDP x$GPUS torch SyncBN" torchrun parallel=ddp parallel.sync_bn=true model=cnn trainer.max_steps=200
    train "resnet18 FSDP x$GPUS bf16" torchrun +experiment=fsdp_resnet18_fake trainer.max_steps=100
else
    row "SyncBN / FSDP under torchrun" "skipped: one GPU"
fi

for setup in "data=fake model=resnet18 data.batch_size=128" "data=fake model=cnn" ""; do
    # shellcheck disable=SC2086  # the overrides are words
    ratio=$($PY scripts/bench_train.py --repeats 3 trainer.device=cuda trainer.precision=bf16 $setup 2>&1 |
        grep -E "^(plain loop|trainkit|ratio)" | tr -s ' ' | paste -sd ';')
    row "overhead vs plain loop, bf16 ${setup:-default mlp}" "${ratio:-FAILED}"
done

memory=$($PY scripts/bench_memory.py --activation-checkpointing 2>/dev/null | grep -E '^\| (gpt|resnet18)' |
    awk -F'|' '{printf "%s %s: %s MiB; ", $2, $3, $5}')
row "peak memory, activation checkpointing off/on" "${memory:-FAILED}"

$PY scripts/bench_accumulation.py --out "$OUT/bench_accumulation.json" > "$OUT/bench_accumulation.md" 2>&1
row "bench_accumulation ($GPUS GPU(s))" "$(grep -E '^\| (mlp|resnet18|gpt) \|' "$OUT/bench_accumulation.md" |
    head -3 | tr -s ' ' | paste -sd ';')"

echo
echo "## gpu_check: $GPUS x $NAME, $(date -u +%Y-%m-%d)"
cat "$TABLE"
