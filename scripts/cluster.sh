#!/usr/bin/env bash
# A working local Helios cluster on the real servers, for trying it out:
#   npm run cluster                 install what is missing, start the servers, build, start 3 nodes,
#                                   a demo HTTP target and demo jobs; Ctrl-C stops what it started
#   npm run cluster -- --nodes 5    more nodes (ports 8081, 8082, …)
#   npm run cluster -- down         stop a cluster left running by an earlier call
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="$ROOT/.helios/cluster"
NODES=3
BASE_PORT="${HELIOS_CLUSTER_BASE_PORT:-8080}"
TARGET_PORT="${HELIOS_DEMO_TARGET_PORT:-9099}"
cd "$ROOT"
stopped=0
stop_started() {
  [[ "$stopped" == 1 ]] && return 0
  stopped=1
  if [[ -f "$STATE/pids" ]]; then
    # Read once: a cluster in the foreground may remove the file while `down` waits here.
    local pids=()
    mapfile -t pids <"$STATE/pids" || true
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for _ in $(seq 1 40); do
      local alive=0
      for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
      [[ "$alive" == 0 ]] && break
      sleep 0.25
    done
    for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
    rm -f "$STATE/pids"
  fi
  # Only the servers this script started (they were down before) are stopped.
  if [[ -s "$STATE/started-servers" ]]; then
    # shellcheck disable=SC2046
    bash scripts/infra.sh down $(cat "$STATE/started-servers")
  fi
  rm -f "$STATE/started-servers"
  echo "cluster stopped"
}

while [[ $# -gt 0 ]]; do
  case "$1" in
    down) stop_started; exit 0 ;;
    --nodes) NODES="$2"; shift 2 ;;
    *) echo "usage: npm run cluster [-- --nodes N | down]" >&2; exit 2 ;;
  esac
done

mkdir -p "$STATE"
if [[ -f "$STATE/pids" ]]; then stop_started; stopped=0; fi
bash scripts/infra.sh status | awk '$NF == "down" { print ($1 == "postgres" ? "pg" : $1) }' | tr '\n' ' ' >"$STATE/started-servers"
trap 'echo; stop_started' INT TERM EXIT
bash scripts/infra.sh up
[[ -d node_modules ]] || npm ci --no-audit --no-fund
# npm run put node_modules/.bin first on the PATH before it existed: now that `npm ci` has filled
# it, forget any `node` the shell looked up earlier so the pinned Node.js 24 (devDependency "node")
# runs the nodes, not the system's.
hash -r
echo "[cluster] Node.js $(node --version)"
node -e 'process.exit(Number(process.versions.node.split(".")[0]) >= 24 ? 0 : 1)' ||
  { echo "[cluster] Node.js 24 or newer is needed: run this as 'npm run cluster'" >&2; exit 1; }
npm run build --silent

# The node flags the image ships (Dockerfile, ENV NODE_OPTIONS), unless the caller set its own.
export NODE_OPTIONS="${NODE_OPTIONS:-$(sed -n 's/^ *NODE_OPTIONS=\([^ ]*\).*/\1/p' Dockerfile)}"
TOKEN="dev-$(node -e "process.stdout.write(require('crypto').randomBytes(16).toString('hex'))")"
# shellcheck disable=SC1091
source .helios/env
node scripts/demo-target.mjs "$TARGET_PORT" >"$STATE/demo-target.log" 2>&1 &
echo $! >>"$STATE/pids"
for i in $(seq 1 "$NODES"); do
  HELIOS_NODE_ID="node-$i" HELIOS_HTTP_PORT=$((BASE_PORT + i)) HELIOS_API_TOKENS="$TOKEN:admin" \
    node dist/main.js node >"$STATE/node-$i.log" 2>&1 &
  echo $! >>"$STATE/pids"
done
API="http://127.0.0.1:$((BASE_PORT + 1))"
for i in $(seq 1 "$NODES"); do
  for _ in $(seq 1 120); do
    curl -fsS "http://127.0.0.1:$((BASE_PORT + i))/readyz" >/dev/null 2>&1 && break
    sleep 0.5
  done
  curl -fsS "http://127.0.0.1:$((BASE_PORT + i))/readyz" >/dev/null || { tail -20 "$STATE/node-$i.log"; exit 1; }
done

export HELIOS_API_URL="$API" HELIOS_API_TOKEN="$TOKEN"
target="http://127.0.0.1:$TARGET_PORT"
printf '%s\n' \
  "{\"name\":\"demo.every-5s\",\"schedule\":\"*/5 * * * * *\",\"target\":{\"url\":\"$target/hello\",\"method\":\"POST\",\"body\":{\"hello\":\"world\"}}}" \
  "{\"name\":\"demo.flaky-every-10s\",\"schedule\":\"*/10 * * * * *\",\"target\":{\"url\":\"$target/flaky\"},\"retry\":{\"maxAttempts\":3,\"backoffMs\":500}}" \
  "{\"name\":\"demo.berlin-weekday-morning\",\"schedule\":\"30 7 * * 1-5\",\"timezone\":\"Europe/Berlin\",\"target\":{\"url\":\"$target/report\"}}" |
  while read -r job; do
    echo "$job" >"$STATE/job.json"
    node dist/main.js jobs apply -f "$STATE/job.json" >/dev/null
  done

echo
echo "Helios is running: $NODES nodes, API on ports $((BASE_PORT + 1))-$((BASE_PORT + NODES)), demo target on $TARGET_PORT."
echo
echo "  export HELIOS_API_URL=$API HELIOS_API_TOKEN=$TOKEN"
echo "  npx node dist/main.js cluster      # leader, nodes, queue depth (npx: the pinned Node.js 24)"
echo "  npx node dist/main.js jobs list"
echo "  curl -H \"Authorization: Bearer \$HELIOS_API_TOKEN\" $API/api/v1/jobs"
echo "  $API/docs                          # OpenAPI UI"
echo "  logs: $STATE/node-*.log"
echo
echo "Calls arriving at the demo target (Ctrl-C stops the cluster):"
tail -n +1 -f "$STATE/demo-target.log" &
echo $! >>"$STATE/pids"
wait
