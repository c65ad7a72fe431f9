#!/usr/bin/env bash
# Deploy tinypaged on a fresh Ubuntu GPU VM in one step, as a systemd service:
#
#   sudo deploy/gpu-vm.sh                          # the default model, on 127.0.0.1:8000
#   sudo deploy/gpu-vm.sh --model /models/llama-3.1-8b --host 0.0.0.0 --api-key "$KEY"
#   sudo deploy/gpu-vm.sh --uninstall              # removes everything it added
#
# It checks the NVIDIA driver, makes a venv with a CUDA build of torch that suits the driver (or reuses the CUDA
# torch of --python), installs tinypaged from this checkout (or --source: another checkout or a wheel), fetches
# the default model into the model cache (or serves --model DIR), writes an environment file with the server's
# flags and a systemd unit (restart on failure, logs to the journal), starts it, waits for /health, sends one
# streamed request and says how to reach it. Run again to upgrade in place (same settings: the venv is kept,
# tinypaged reinstalled, the unit and the environment file rewritten, the service restarted).
# Where systemd is not running (a container), the service's own command is started in the background instead,
# its log in the state directory (no restart on failure there). Loopback only unless --host says otherwise; a
# host beyond loopback needs --api-key, or --allow-unauthenticated to say you mean it.
set -euo pipefail
unset PYTHONPATH PYTHONHOME # the caller's Python paths are no part of the service (systemd would not pass them)

# ---- settings: each can be set here, in the environment (the name in brackets) or by its flag ---------------
PREFIX="${TINYPAGED_PREFIX:-/opt/tinypaged}"           # --prefix: the venv is $PREFIX/venv
CONFIG_DIR="${TINYPAGED_CONFIG_DIR:-/etc/tinypaged}"   # --config-dir: tinypaged.env and the install record
STATE_DIR="${TINYPAGED_STATE_DIR:-/var/lib/tinypaged}" # --state-dir: the service's home, model cache, caches, logs
UNIT_DIR="${TINYPAGED_UNIT_DIR:-/etc/systemd/system}"  # --unit-dir
SERVICE="${TINYPAGED_SERVICE:-tinypaged}"              # --service: the unit's name
SERVICE_USER="${TINYPAGED_USER:-tinypaged}"            # --user: made as a system user when missing
HOST="${TINYPAGED_HOST:-127.0.0.1}"                    # --host
PORT="${TINYPAGED_PORT:-8000}"                         # --port
API_KEY="${TINYPAGED_API_KEY:-}"                       # --api-key: clients send `Authorization: Bearer KEY`
MODEL="${TINYPAGED_MODEL:-}"                           # --model DIR; empty: the default model, fetched
SERVE_ARGS="${TINYPAGED_SERVE_ARGS:-}"                 # --serve-args "...": more flags of `tinypaged serve`
SOURCE="${TINYPAGED_SOURCE:-}"                         # --source: a checkout or a wheel; empty: this checkout
PYTHON="${TINYPAGED_PYTHON:-python3}"                  # --python: makes the venv (>= 3.11)
TORCH="${TINYPAGED_TORCH:-auto}"                       # --torch: auto | reuse | cu130 | cu128 | cu126 | cpu
TORCH_VERSION="${TINYPAGED_TORCH_VERSION:-2.11.0}"     # the build the H200 figures were measured with (triton 3.6)
TORCH_INDEX="${TINYPAGED_TORCH_INDEX:-https://download.pytorch.org/whl}"
CUDA_BUILDS="${TINYPAGED_CUDA_BUILDS:-130 128 126}"    # torch's CUDA builds, newest first
PIP_ARGS="${TINYPAGED_PIP_ARGS:-}"                     # --pip-args: e.g. "--no-index --find-links /wheels"
HEALTH_TIMEOUT="${TINYPAGED_HEALTH_TIMEOUT:-900}"      # seconds to wait for /health (a first start compiles)
ALLOW_UNAUTHENTICATED=0                                # --allow-unauthenticated
USE_SYSTEMD=auto                                       # --no-systemd: start the command directly
ALLOW_NO_GPU="${TINYPAGED_CPU:-0}"                     # --cpu: no NVIDIA driver needed (CPU torch)
ACTION=install                                         # --uninstall

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; grep -o '# --[a-z-]*.*' "$0" | sed 's/^# /  /'; }
say() { printf '%s\n' "tinypaged-deploy: $*"; }
die() { printf '%s\n' "tinypaged-deploy: error: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --prefix) PREFIX="$2"; shift ;;
        --config-dir) CONFIG_DIR="$2"; shift ;;
        --state-dir) STATE_DIR="$2"; shift ;;
        --unit-dir) UNIT_DIR="$2"; shift ;;
        --service) SERVICE="$2"; shift ;;
        --user) SERVICE_USER="$2"; shift ;;
        --host) HOST="$2"; shift ;;
        --port) PORT="$2"; shift ;;
        --api-key) API_KEY="$2"; shift ;;
        --model) MODEL="$2"; shift ;;
        --serve-args) SERVE_ARGS="$2"; shift ;;
        --source) SOURCE="$2"; shift ;;
        --python) PYTHON="$2"; shift ;;
        --torch) TORCH="$2"; shift ;;
        --pip-args) PIP_ARGS="$2"; shift ;;
        --allow-unauthenticated) ALLOW_UNAUTHENTICATED=1 ;;
        --no-systemd) USE_SYSTEMD=0 ;;
        --cpu) ALLOW_NO_GPU=1 ;;
        --uninstall) ACTION=uninstall ;;
        -h | --help) usage; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
    shift
done

VENV="$PREFIX/venv"
ENV_FILE="$CONFIG_DIR/tinypaged.env"
RECORD="$CONFIG_DIR/install.record"
UNIT_FILE="$UNIT_DIR/$SERVICE.service"
PID_FILE="$STATE_DIR/$SERVICE.pid"
LOG_FILE="$STATE_DIR/log/$SERVICE.log"

# ---- what this script added, so that --uninstall removes exactly that ----------------------------------------
record() { # record KIND VALUE: once each
    mkdir -p "$CONFIG_DIR"
    grep -qxF "$1 $2" "$RECORD" 2>/dev/null || printf '%s %s\n' "$1" "$2" >>"$RECORD"
}
make_dir() { # make_dir DIR: made and recorded when missing
    if [[ ! -d "$1" ]]; then
        mkdir -p "$1"
        record dir "$1"
    fi
}

systemd_running() {
    [[ "$USE_SYSTEMD" != 0 ]] && command -v systemctl >/dev/null && [[ -d /run/systemd/system ]]
}

stop_direct() { # the background server of a run without systemd, if any
    if [[ -f "$PID_FILE" ]]; then
        local pid
        pid="$(cat "$PID_FILE")"
        if kill -0 "$pid" 2>/dev/null; then
            say "stopping the running server (pid $pid)"
            kill -TERM "$pid"
            for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
            kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
        fi
        rm -f "$PID_FILE"
    fi
}

uninstall() {
    [[ -f "$RECORD" ]] || die "no install record at $RECORD: nothing to uninstall (give the --config-dir used)"
    if grep -qx 'mode systemd' "$RECORD" && command -v systemctl >/dev/null; then
        systemctl disable --now "$SERVICE.service" 2>/dev/null || true
    fi
    STATE_DIR="$(sed -n 's/^state //p' "$RECORD" | tail -1)"
    if [[ -n "$STATE_DIR" ]]; then
        PID_FILE="$STATE_DIR/$SERVICE.pid"
        stop_direct
    fi
    # Files first, then directories, deepest first; only what the record lists.
    sed -n 's/^file //p' "$RECORD" | while read -r f; do rm -f -- "$f"; done
    if grep -qx 'mode systemd' "$RECORD" && command -v systemctl >/dev/null; then
        systemctl daemon-reload 2>/dev/null || true
    fi
    local user
    user="$(sed -n 's/^user //p' "$RECORD")"
    sed -n 's/^dir //p' "$RECORD" | sort -r | while read -r d; do rm -rf -- "$d"; done
    if [[ -n "$user" ]] && id "$user" >/dev/null 2>&1; then
        userdel "$user" || say "could not remove the user $user"
    fi
    rm -f -- "$RECORD"
    rmdir -- "$CONFIG_DIR" 2>/dev/null || true
    say "uninstalled: the service, its unit, venv, configuration and state (model cache, logs) are gone"
}

if [[ "$ACTION" == uninstall ]]; then
    uninstall
    exit 0
fi

# ---- check the settings before touching anything ----------------------------------------------------------------
case "$HOST" in
    127.* | localhost | ::1) ;;
    *)
        if [[ -z "$API_KEY" && "$ALLOW_UNAUTHENTICATED" != 1 ]]; then
            die "--host $HOST listens beyond loopback without an API key: give --api-key KEY (or --allow-unauthenticated)"
        fi
        ;;
esac
[[ "$PORT" =~ ^[0-9]+$ ]] || die "--port must be a number, got $PORT"
[[ "$API_KEY" =~ ^[A-Za-z0-9._~+/=-]*$ ]] || die "--api-key may hold letters, digits and . _ ~ + / = - only"
for path in "$PREFIX" "$CONFIG_DIR" "$STATE_DIR" "$MODEL"; do
    [[ "$path" != *[[:space:]]* ]] || die "paths must not contain spaces: '$path'"
done
if [[ -n "$MODEL" ]]; then
    [[ -f "$MODEL/config.json" ]] || die "--model $MODEL is not a model directory (no config.json)"
    MODEL="$(cd "$MODEL" && pwd)"
fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SOURCE="${SOURCE:-$HERE}"
[[ -e "$SOURCE" ]] || die "--source $SOURCE does not exist"
[[ -d "$SOURCE" && ! -f "$SOURCE/pyproject.toml" ]] && die "--source $SOURCE is not a tinypaged checkout"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null ||
    die "$PYTHON is not a Python >= 3.11 (give --python)"

# ---- the NVIDIA driver and the torch that suits it --------------------------------------------------------------
DRIVER_CUDA=""
if command -v nvidia-smi >/dev/null && nvidia-smi >/dev/null 2>&1; then
    DRIVER_CUDA="$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9]*\.[0-9]*\).*/\1/p' | head -1)"
    say "driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1), CUDA ${DRIVER_CUDA:-?}; GPU: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)"
elif [[ "$ALLOW_NO_GPU" == 1 ]]; then
    say "no NVIDIA driver: installing for the CPU (--cpu)"
else
    die "no working NVIDIA driver (nvidia-smi failed): install one (ubuntu-drivers install), reboot, run again; --cpu to deploy without a GPU"
fi

torch_of() { # torch_of PYTHON: "VERSION CUDA_AVAILABLE SITE_DIR" of its torch, or nothing
    "$1" - 2>/dev/null <<'EOF' || true
import os, torch
print(torch.__version__, int(torch.cuda.is_available()), os.path.dirname(os.path.dirname(torch.__file__)))
EOF
}

REUSE_SITE=""
TORCH_BUILD=""
if [[ "$TORCH" == auto || "$TORCH" == reuse ]]; then
    read -r have_version have_cuda have_site <<<"$(torch_of "$PYTHON")" || true
    if [[ -n "${have_version:-}" && ("${have_cuda:-0}" == 1 || "$ALLOW_NO_GPU" == 1) ]]; then
        REUSE_SITE="$have_site"
        say "reusing torch $have_version of $PYTHON (from $have_site)"
    elif [[ "$TORCH" == reuse ]]; then
        die "--torch reuse: $PYTHON has no torch that sees a GPU"
    fi
fi
if [[ -z "$REUSE_SITE" ]]; then
    if [[ "$TORCH" == auto ]]; then
        if [[ -z "$DRIVER_CUDA" ]]; then
            TORCH_BUILD=cpu
        else
            driver=$((10#${DRIVER_CUDA%%.*} * 100 + 10#${DRIVER_CUDA#*.})) # 13.0 -> 1300
            for build in $CUDA_BUILDS; do # 130 -> 13.0 -> 1300, 126 -> 12.6 -> 1206
                if [[ "$driver" -ge $((10#${build:0:2} * 100 + 10#${build:2})) ]]; then TORCH_BUILD="cu$build"; break; fi
            done
            [[ -n "$TORCH_BUILD" ]] || die "the driver supports CUDA ${DRIVER_CUDA}, older than every build in CUDA_BUILDS ($CUDA_BUILDS): upgrade the driver"
        fi
    else
        TORCH_BUILD="$TORCH"
    fi
fi

# ---- the venv and tinypaged -------------------------------------------------------------------------------------
if [[ ! -x "$VENV/bin/python" ]]; then
    make_dir "$PREFIX"
    say "making the venv $VENV"
    # A reused torch brings its pip along; otherwise the venv needs its own (Ubuntu: apt install python3-venv).
    "$PYTHON" -m venv "$VENV" 2>/dev/null || { [[ -n "$REUSE_SITE" ]] && "$PYTHON" -m venv --without-pip "$VENV"; } ||
        die "could not make a venv with $PYTHON (on Ubuntu: apt install python3-venv)"
    record dir "$VENV"
else
    say "upgrading in place: the venv $VENV exists"
fi
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
PTH="$SITE/tinypaged-reuse-torch.pth"
if [[ -n "$REUSE_SITE" ]]; then
    printf '%s\n' "$REUSE_SITE" >"$PTH" # the venv sees the packages beside that torch, after its own
else
    rm -f "$PTH"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
read -r -a EXTRA <<<"$PIP_ARGS"
if [[ -n "$TORCH_BUILD" ]]; then
    say "installing torch $TORCH_VERSION ($TORCH_BUILD)"
    "${PIP[@]}" install -q "${EXTRA[@]}" --index-url "$TORCH_INDEX/$TORCH_BUILD" "torch==$TORCH_VERSION"
fi
say "installing tinypaged from $SOURCE"
WHEEL="$SOURCE"
if [[ -d "$SOURCE" ]]; then # a checkout: built into a wheel once (a deployment is no editable install)
    BUILD="$(mktemp -d)"
    trap 'rm -rf "$BUILD"' EXIT
    "${PIP[@]}" wheel -q --no-deps "${EXTRA[@]}" -w "$BUILD" "$SOURCE"
    WHEEL="$(ls "$BUILD"/tinypaged-*.whl)"
fi
"${PIP[@]}" install -q "${EXTRA[@]}" "$WHEEL"                              # its dependencies, where missing
"${PIP[@]}" install -q --force-reinstall --no-deps "${EXTRA[@]}" "$WHEEL" # the same version again: upgraded
read -r got_version got_cuda _ <<<"$(torch_of "$VENV/bin/python")"
[[ -n "${got_version:-}" ]] || die "torch does not import in $VENV"
[[ "$got_cuda" == 1 || "$ALLOW_NO_GPU" == 1 ]] || die "torch $got_version in $VENV does not see the GPU"
"$VENV/bin/tinypaged" --help >/dev/null || die "the tinypaged command does not run"

# ---- the service's user, state and model --------------------------------------------------------------------------
if ! id "$SERVICE_USER" >/dev/null 2>&1; then
    say "making the system user $SERVICE_USER"
    useradd --system --home-dir "$STATE_DIR" --no-create-home --shell /usr/sbin/nologin "$SERVICE_USER"
    record user "$SERVICE_USER"
fi
SERVICE_GROUP="$(id -gn "$SERVICE_USER")"
make_dir "$STATE_DIR"
record state "$STATE_DIR"
mkdir -p "$STATE_DIR/cache" "$STATE_DIR/log"
# The compile cache is $STATE_DIR/cache/compile/triton (tinypaged's place for it under TINYPAGED_HOME): kept across
# upgrades with the rest of the state, so a restart loads the kernels the new version did not change. Releases
# before it kept Triton's cache in cache/triton: moved (tinypaged repoints a moved cache's entries).
if [[ -d "$STATE_DIR/cache/triton" && ! -e "$STATE_DIR/cache/compile/triton" ]]; then
    mkdir -p "$STATE_DIR/cache/compile"
    mv -- "$STATE_DIR/cache/triton" "$STATE_DIR/cache/compile/triton"
fi
if [[ -z "$MODEL" ]]; then
    say "fetching the default model into $STATE_DIR/cache (idempotent)"
    MODEL="$(TINYPAGED_HOME="$STATE_DIR/cache" "$VENV/bin/tinypaged" weights fetch | tail -1)"
fi
chown -R "$SERVICE_USER:$SERVICE_GROUP" "$STATE_DIR"
if [[ "$(id -un)" != "$SERVICE_USER" ]]; then
    runuser -u "$SERVICE_USER" -- "$VENV/bin/python" -c 'import tinypaged' 2>/dev/null ||
        die "the user $SERVICE_USER cannot run $VENV/bin/python (an interpreter under a private home?): give --python a system Python, or --user"
fi

# ---- the environment file and the unit ----------------------------------------------------------------------------
make_dir "$CONFIG_DIR"
ARGS="--model $MODEL --host $HOST --port $PORT $SERVE_ARGS"
umask 027
cat >"$ENV_FILE" <<EOF
# tinypaged's service environment, written by deploy/gpu-vm.sh (run it again with new settings to change it).
TINYPAGED_ARGS="$ARGS"
TINYPAGED_API_KEY="$API_KEY"
TINYPAGED_HOME="$STATE_DIR/cache"
HOME="$STATE_DIR"
EOF
umask 022
chgrp "$SERVICE_GROUP" "$ENV_FILE"
record file "$ENV_FILE"
make_dir "$UNIT_DIR"
cat >"$UNIT_FILE" <<EOF
[Unit]
Description=tinypaged: OpenAI-compatible LLM server
After=network-online.target
Wants=network-online.target

[Service]
Type=exec
User=$SERVICE_USER
Group=$SERVICE_GROUP
EnvironmentFile=$ENV_FILE
ExecStart=$VENV/bin/tinypaged serve \$TINYPAGED_ARGS
Restart=on-failure
RestartSec=5
# SIGTERM drains in-flight requests for up to --shutdown-timeout (30 s by default).
KillSignal=SIGTERM
TimeoutStopSec=60
StandardOutput=journal
StandardError=journal
SyslogIdentifier=$SERVICE
NoNewPrivileges=true
PrivateTmp=true
ProtectSystem=full
ReadWritePaths=$STATE_DIR
LimitNOFILE=65536

[Install]
WantedBy=multi-user.target
EOF
record file "$UNIT_FILE"

# ---- start it ------------------------------------------------------------------------------------------------------
if systemd_running; then
    record mode systemd
    systemctl daemon-reload
    systemctl enable "$SERVICE.service" >/dev/null
    systemctl restart "$SERVICE.service"
    LOGS="journalctl -u $SERVICE -f"
else
    record mode direct
    say "systemd is not running here: starting the unit's command directly (no restart on failure)"
    stop_direct
    # The unit's command, user and environment, as systemd would run them.
    (
        set -a
        # shellcheck source=/dev/null
        . "$ENV_FILE"
        set +a
        read -r -a serve_args <<<"$TINYPAGED_ARGS"
        run_as=()
        [[ "$(id -un)" == "$SERVICE_USER" ]] || run_as=(runuser -u "$SERVICE_USER" --)
        setsid "${run_as[@]}" "$VENV/bin/tinypaged" serve "${serve_args[@]}" >>"$LOG_FILE" 2>&1 </dev/null &
        echo $! >"$PID_FILE"
    )
    record file "$PID_FILE"
    LOGS="tail -f $LOG_FILE"
fi

# ---- health, one streamed request, and how to reach it -------------------------------------------------------------
CHECK_HOST="$HOST"
[[ "$HOST" == 0.0.0.0 ]] && CHECK_HOST=127.0.0.1
[[ "$HOST" == "::" ]] && CHECK_HOST="[::1]"
URL="http://$CHECK_HOST:$PORT"
say "waiting for $URL/health (up to $HEALTH_TIMEOUT s: a first start loads the model and compiles kernels)"
if ! TINYPAGED_URL="$URL" TINYPAGED_API_KEY="$API_KEY" TINYPAGED_PID_FILE="$PID_FILE" \
    "$VENV/bin/python" - "$HEALTH_TIMEOUT" <<'EOF'
import json, os, sys, time, urllib.request

url, key, deadline = os.environ["TINYPAGED_URL"], os.environ["TINYPAGED_API_KEY"], time.time() + float(sys.argv[1])
pid_file = os.environ["TINYPAGED_PID_FILE"]
while True:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            if r.status == 200:
                break
    except OSError:
        pass
    if os.path.exists(pid_file):  # started directly: a process that died will not answer
        try:
            os.kill(int(open(pid_file).read()), 0)
        except (OSError, ValueError):
            sys.exit("the server exited")
    if time.time() > deadline:
        sys.exit("no answer from /health")
    time.sleep(1)
body = {"prompt": "The capital of France is", "max_tokens": 8, "stream": True, "temperature": 0}
req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
if key:
    req.add_header("Authorization", f"Bearer {key}")
text, done = "", False
with urllib.request.urlopen(req, timeout=120) as r:
    for line in r:
        if line.startswith(b"data: [DONE]"):
            done = True
        elif line.startswith(b"data: "):
            text += "".join(c.get("text", "") for c in json.loads(line[6:]).get("choices", []))
if not done:
    sys.exit("the streamed request did not end with [DONE]")
print(f"tinypaged-deploy: a streamed completion answered: {body['prompt']!r} -> {text!r}")
EOF
then
    say "the server did not come up; its log:"
    if systemd_running; then journalctl -u "$SERVICE" -n 50 --no-pager || true; else tail -n 50 "$LOG_FILE" || true; fi
    exit 1
fi
AUTH=""
[[ -n "$API_KEY" ]] && AUTH=" -H 'Authorization: Bearer \$TINYPAGED_API_KEY'"
cat <<EOF
tinypaged-deploy: serving $(basename "$MODEL") on http://$HOST:$PORT (OpenAI API under /v1)
  try:       curl -s http://$CHECK_HOST:$PORT/v1/completions -H 'Content-Type: application/json'$AUTH \\
               -d '{"prompt": "Hello", "max_tokens": 16}'
  logs:      $LOGS
  settings:  $ENV_FILE (the server's flags), $UNIT_FILE
  upgrade:   run this script again; uninstall: $0 --uninstall --config-dir $CONFIG_DIR
EOF
