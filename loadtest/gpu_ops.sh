#!/usr/bin/env bash
# The operations figures of BENCHMARKS.md on one GPU machine, in one go: deploy with deploy/gpu-vm.sh (without
# systemd where it does not run), a headless locust run, a bench_serving sweep and the fault soak against that
# server, then uninstall. Figures print as they come; JSON, CSV, logs and PNGs go to OUT.
#
#   loadtest/gpu_ops.sh MODEL_DIR OUT [SOAK_SECONDS]     (deploy/gpu-vm.sh's TINYPAGED_* settings apply)
#
# OUT keeps bench.json, soak.json, the three plots, locust_stats.csv and extras.tgz (the other CSVs and logs).
set -euo pipefail
MODEL="$1"
OUT="$2"
SOAK_S="${3:-300}"
PORT=8000
KEY="ops-$$-$RANDOM"
URL="http://127.0.0.1:$PORT"
QUEUE=64
IDLE=10
STATE="$OUT/state"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "[$(($(date +%s) - T0)) s] $*"; }

deploy=(bash "$HERE/deploy/gpu-vm.sh" --no-systemd --model "$MODEL" --port "$PORT" --api-key "$KEY"
    --prefix "$OUT/opt" --config-dir "$OUT/etc" --state-dir "$STATE" --unit-dir "$OUT/units"
    --serve-args "--max-model-len 2048 --max-num-batched-tokens 8192 --max-queue-len $QUEUE --idle-timeout $IDLE")
stamp "deploy"
if ! "${deploy[@]}" 2>&1 | tee "$OUT/deploy.log"; then
    stamp "deploy as the service user failed; again as root (the log above says why)"
    cp "$STATE/log/tinypaged.log" "$OUT/server-first.log" 2>/dev/null || true
    "${deploy[@]}" --user root 2>&1 | tee -a "$OUT/deploy.log"
fi
if command -v systemd-analyze >/dev/null; then systemd-analyze verify "$OUT/units/tinypaged.service" || true; fi

stamp "locust"
python3 -m locust -f "$HERE/loadtest/locustfile.py" --headless --users 32 --spawn-rate 32 --run-time 20s --host "$URL" \
    --api-key "$KEY" --vocab 128000 --prompt-len 16-128 --output-len 32-128 --chat-turns 1-2 \
    --csv "$OUT/locust" --only-summary 2>&1 | tail -30 || true

stamp "bench_serving"
python3 "$HERE/loadtest/bench_serving.py" --url "$URL" --api-key "$KEY" --num-prompts 64 --prompt-len 64-1024 \
    --output-len 32-512 --vocab 128000 --request-rate 4 16 inf --goodput ttft:100 tpot:25 \
    --out "$OUT/bench.json" --plot-dir "$OUT" || true

stamp "soak ($SOAK_S s)"
python3 "$HERE/loadtest/soak.py" --url "$URL" --api-key "$KEY" --duration "$SOAK_S" --concurrency 24 \
    --max-queue-len "$QUEUE" --idle-timeout "$IDLE" --burst-n 4 --prompt-len 8-120 --output-len 8-64 \
    --long-output 128 --tie-tolerance 0.1 --out "$OUT/soak.json" || true

stamp "uninstall"
cp "$STATE/log/tinypaged.log" "$OUT/server.log" 2>/dev/null || true
bash "$HERE/deploy/gpu-vm.sh" --uninstall --config-dir "$OUT/etc"
(cd "$OUT" && tar -czf extras.tgz --remove-files deploy.log server*.log locust_*history.csv locust_failures.csv locust_exceptions.csv 2>/dev/null) || true
stamp "done"
