#!/usr/bin/env bash
# Start a local mesh of N peers on loopback that split a model's layers evenly, ask it one
# question with `meshinfer chat`, and stop the peers again.
#
#   bash deploy/local-mesh.sh [--setup] [--peers N] [--model NAME|PATH] [--dtype D] [--base-port P]
#                             [--metrics-port P] [--keep] [-p PROMPT] [-- extra chat flags]
#
# --setup         install meshinfer first with deploy/install.sh, as deploy/Dockerfile does
# --dtype         the peers' precision (meshinfer join --dtype; default f32 or $MESHINFER_DTYPE)
# --metrics-port  serve peer i's Prometheus metrics on port P+i
# --keep          leave the peers running (their logs are in $LOG_DIR) and print how to chat
#
# It runs the commands the container image runs: deploy/install.sh, `meshinfer pull MODEL`,
# then `meshinfer join` per peer (see deploy/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."

N=2
MODEL=${MESHINFER_MODEL:-qwen2.5-coder-0.5b-instruct-q4_k_m}
BASE_PORT=7700
PROMPT="Write a Python function that checks whether a number is prime."
SETUP=0
KEEP=0
METRICS_PORT=0
CHAT_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --setup) SETUP=1 ;;
    --keep) KEEP=1 ;;
    --peers) N=$2; shift ;;
    --model) MODEL=$2; shift ;;
    --dtype) export MESHINFER_DTYPE=$2; shift ;;
    --base-port) BASE_PORT=$2; shift ;;
    --metrics-port) METRICS_PORT=$2; shift ;;
    -p|--prompt) PROMPT=$2; shift ;;
    --) shift; CHAT_ARGS=("$@"); break ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done

if [ "$SETUP" = 1 ]; then
  bash deploy/install.sh
fi
VENV=${MESHINFER_VENV:-.venv}
if [ -f "$VENV/bin/activate" ]; then
  # shellcheck disable=SC1091
  . "$VENV/bin/activate"
fi
command -v meshinfer >/dev/null || { echo "meshinfer is not installed: run with --setup" >&2; exit 2; }

MODEL_PATH=$(meshinfer pull "$MODEL" | tail -n 1)
LAYERS=$(python -c "
from meshinfer.engine.weights import open_weights
print(open_weights('$MODEL_PATH').config.num_hidden_layers)")
OWN_LOG_DIR=0
if [ -z "${LOG_DIR:-}" ]; then LOG_DIR=$(mktemp -d -t meshinfer-mesh.XXXXXX); OWN_LOG_DIR=1; else mkdir -p "$LOG_DIR"; fi
PIDS=()
cleanup() {
  if [ "$KEEP" = 0 ]; then
    for pid in ${PIDS[@]+"${PIDS[@]}"}; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    [ "$OWN_LOG_DIR" = 1 ] && [ "${STATUS:-1}" = 0 ] && rm -rf "$LOG_DIR"
  fi
  return 0
}
trap cleanup EXIT

echo "starting $N peers for $LAYERS layers of $(basename "$MODEL_PATH") (logs in $LOG_DIR)" >&2
for i in $(seq 0 $((N - 1))); do
  first=$(( i * LAYERS / N )); last=$(( (i + 1) * LAYERS / N - 1 ))
  port=$(( BASE_PORT + i ))
  extra=()
  [ "$i" -gt 0 ] && extra+=(--peers "ws://127.0.0.1:$BASE_PORT")
  [ "$METRICS_PORT" -gt 0 ] && extra+=(--metrics-port $(( METRICS_PORT + i )))
  meshinfer join --model "$MODEL_PATH" --layers "$first-$last" --listen "127.0.0.1:$port" \
    --key "$LOG_DIR/peer-$i.key" ${extra[@]+"${extra[@]}"} >"$LOG_DIR/peer-$i.log" 2>&1 &
  PIDS+=($!)
done
for i in $(seq 0 $((N - 1))); do
  for _ in $(seq 1 600); do
    grep -q '^ready:' "$LOG_DIR/peer-$i.log" 2>/dev/null && break
    if ! kill -0 "${PIDS[$i]}" 2>/dev/null; then
      echo "peer $i failed to start:" >&2; tail -n 20 "$LOG_DIR/peer-$i.log" >&2; exit 1
    fi
    sleep 0.5
  done
  grep '^ready:' "$LOG_DIR/peer-$i.log" >&2 || { echo "peer $i did not become ready" >&2; exit 1; }
done
# wait until gossip has spread every advert to the first peer
for _ in $(seq 1 60); do
  meshinfer status --peers "ws://127.0.0.1:$BASE_PORT" 2>/dev/null | grep -q '^complete route' && break
  sleep 0.5
done
meshinfer status --peers "ws://127.0.0.1:$BASE_PORT" >&2 || true

if [ "$KEEP" = 1 ]; then
  echo "peers are running; chat with: $VENV/bin/meshinfer chat --peers ws://127.0.0.1:$BASE_PORT" >&2
  echo "(or '. $VENV/bin/activate' first, then plain 'meshinfer')" >&2
  echo "or serve the API and its page: $VENV/bin/meshinfer serve --peers ws://127.0.0.1:$BASE_PORT, then open http://127.0.0.1:8000/" >&2
  echo "stop them with: kill ${PIDS[*]}" >&2
  exit 0
fi
meshinfer chat --peers "ws://127.0.0.1:$BASE_PORT" -p "$PROMPT" ${CHAT_ARGS[@]+"${CHAT_ARGS[@]}"}
STATUS=0
