#!/usr/bin/env bash
# Real local servers for Helios: PostgreSQL 15, etcd 3.4, Kafka 4 (KRaft), as plain processes
# with their data, logs and pids under .helios/. No Docker.
#
#   scripts/infra.sh install                 get what is missing (Debian packages, Kafka jars)
#   scripts/infra.sh up [pg|etcd|kafka ...]  start (idempotent), wait until each answers, write .helios/env
#   scripts/infra.sh down [pg|etcd|kafka ...] stop only what this script started (recorded pids)
#   scripts/infra.sh status                  print each server, its address and pid
#   scripts/infra.sh reset                   down, then delete all server data
#
# Ports are loopback-only and non-default so a developer's own servers are not disturbed;
# override with HELIOS_PG_PORT, HELIOS_ETCD_PORT, HELIOS_KAFKA_PORT. The defaults lie below the
# ephemeral range (32768-60999), where an outgoing connection's local port can take a server's
# port for a moment and make its start fail ("Address already in use" was seen under load).
#
# The chaos test runs nodes in network namespaces behind a bridge of its own; it sets
# HELIOS_NETNS_HOST (the bridge's address, e.g. 10.200.79.1, a /24 that exists only on this
# machine) and HELIOS_KAFKA_NETNS_PORT, and then PostgreSQL also listens on that address (trusting
# that /24 only) and Kafka gets a second listener there, advertised as such, so clients inside the
# namespaces are sent to an address they can reach. Unset (the default), everything is loopback only.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="${HELIOS_STATE_DIR:-$ROOT/.helios}"
PG_BIN="${HELIOS_PG_BIN:-/usr/lib/postgresql/15/bin}"
# The ports a checkout's servers were started with are remembered in .helios/ports, so a later call
# without the exports (a restart by the chaos test, a new shell) reaches the same servers instead of
# starting others on the default ports; exported variables still win.
if [[ -f "$STATE/ports" ]]; then
  while IFS='=' read -r name value; do
    if [[ "$name" =~ ^HELIOS_[A-Z_]+_PORT$ && -z "${!name:-}" ]]; then export "$name=$value"; fi
  done <"$STATE/ports"
fi
PG_PORT="${HELIOS_PG_PORT:-15432}"
ETCD_PORT="${HELIOS_ETCD_PORT:-12379}"
ETCD_PEER_PORT="${HELIOS_ETCD_PEER_PORT:-12380}"
KAFKA_PORT="${HELIOS_KAFKA_PORT:-19092}"
KAFKA_CONTROLLER_PORT="${HELIOS_KAFKA_CONTROLLER_PORT:-19093}"
KAFKA_HEAP="${HELIOS_KAFKA_HEAP:--Xms256m -Xmx512m}"
NETNS_HOST="${HELIOS_NETNS_HOST:-}"
KAFKA_NETNS_PORT="${HELIOS_KAFKA_NETNS_PORT:-}"
if [[ -n "$NETNS_HOST" && ! "$NETNS_HOST" =~ ^10\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]]; then
  printf '[infra] ERROR: HELIOS_NETNS_HOST must be a private 10.x.y.z address, got %s\n' "$NETNS_HOST" >&2
  exit 2
fi
PG_DB="helios"

log() { printf '[infra] %s\n' "$*" >&2; }
die() { printf '[infra] ERROR: %s\n' "$*" >&2; exit 1; }

# Prints the last lines of a server log and fails: a server that does not come up must say why.
fail_with_log() {
  local what="$1" file="$2"
  printf '[infra] ERROR: %s did not come up; last lines of %s:\n' "$what" "$file" >&2
  tail -n 40 "$file" >&2 || true
  exit 1
}

alive() { [[ -n "${1:-}" ]] && kill -0 "$1" 2>/dev/null; }
pid_of() { [[ -f "$1" ]] && head -n1 "$1" || true; }

as_postgres() {
  if [[ "$(id -u)" == 0 ]]; then
    su postgres -s /bin/bash -c "$1"
  else
    bash -c "$1"
  fi
}

apt_updated=0
apt_install() {
  if [[ "$apt_updated" == 0 ]]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    apt_updated=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# ---------------------------------------------------------------- install
install_all() {
  mkdir -p "$STATE"
  if [[ ! -x "$PG_BIN/initdb" ]]; then
    log "installing postgresql-15"
    apt_install postgresql-15
  fi
  "$PG_BIN/postgres" --version | grep -q ' 15\.' || die "PostgreSQL 15 expected at $PG_BIN"
  if ! command -v etcd >/dev/null; then
    log "installing etcd-server"
    apt_install etcd-server
  fi
  # nft (packet filtering inside the chaos test's network namespaces: the real partitions).
  if ! command -v nft >/dev/null; then
    log "installing nftables"
    apt_install nftables
  fi
  # ip (the chaos test's network namespaces) and ss (test/integration/db-keepalive.test.ts reads the
  # keep-alive timers the kernel armed on the pool's sockets).
  if ! command -v ss >/dev/null || ! command -v ip >/dev/null; then
    log "installing iproute2"
    apt_install iproute2
  fi
  # The Debian package starts a system etcd on the default ports where systemd runs; ours is separate.
  if ! command -v java >/dev/null || ! java -version 2>&1 | grep -Eq 'version "(1[7-9]|2[0-9])'; then
    log "installing openjdk-17-jre-headless"
    apt_install openjdk-17-jre-headless
  fi
  # promtool checks and unit-tests deploy/prometheus/alerts.yml (test/unit/alerts.test.ts). It comes
  # with the Debian prometheus package; the server it also installs is never started by Helios.
  if ! command -v promtool >/dev/null; then
    log "installing prometheus (for promtool)"
    apt_install prometheus
  fi
  if ! command -v mvn >/dev/null; then
    log "installing maven"
    apt_install maven
  fi
  local libs="$STATE/kafka/libs" stamp
  stamp="$(sha256sum "$ROOT/scripts/kafka/pom.xml" | cut -c1-16)"
  if [[ ! -f "$libs/.stamp" || "$(cat "$libs/.stamp")" != "$stamp" ]]; then
    log "collecting Kafka jars with Maven"
    rm -rf "$libs"
    mkdir -p "$libs"
    (cd "$ROOT/scripts/kafka" && mvn -B -q dependency:copy-dependencies \
      -DincludeScope=runtime -DoutputDirectory="$libs") || die "mvn could not collect the Kafka jars"
    echo "$stamp" >"$libs/.stamp"
  fi
  log "installed: $("$PG_BIN/postgres" --version), $(etcd --version | head -n1), kafka jars $(ls "$libs" | grep -o '^kafka_2.13-[0-9.]*' | head -n1)"
}

# ---------------------------------------------------------------- PostgreSQL
pg_dir="$STATE/pg"
pg_pid() { [[ -f "$pg_dir/data/postmaster.pid" ]] && head -n1 "$pg_dir/data/postmaster.pid" || true; }
pg_psql() { "$PG_BIN/psql" -X -q -h 127.0.0.1 -p "$PG_PORT" -U postgres "$@"; }

# initdb and the server run as `postgres`, which must be able to traverse every folder above the
# data directory; a checkout in a private folder (mktemp -d is 0700) would stop them. Only the
# traverse bit (o+x) is added, and only where it is missing: contents stay unlistable.
allow_postgres_to_reach() {
  [[ "$(id -u)" == 0 ]] || return 0
  local dir="$1"
  while [[ "$dir" != "/" ]]; do
    if ! as_postgres "test -x '$dir'" 2>/dev/null; then
      log "letting postgres traverse $dir (chmod o+x)"
      chmod o+x "$dir"
    fi
    dir="$(dirname "$dir")"
  done
}

pg_up() {
  if alive "$(pg_pid)"; then log "postgres already running (pid $(pg_pid))"; else
    mkdir -p "$pg_dir/run"
    chown -R postgres:postgres "$pg_dir" 2>/dev/null || true
    chmod 755 "$STATE"
    allow_postgres_to_reach "$pg_dir"
    if [[ ! -f "$pg_dir/data/PG_VERSION" ]]; then
      log "initdb $pg_dir/data"
      as_postgres "'$PG_BIN/initdb' -D '$pg_dir/data' -U postgres --auth=trust -E UTF8 --no-locale" \
        >"$pg_dir/initdb.log" 2>&1 || fail_with_log "initdb" "$pg_dir/initdb.log"
      # fsync=off: the dev/test cluster survives a server crash (kill -9) but not an OS crash.
      cat >>"$pg_dir/data/postgresql.conf" <<EOF
listen_addresses = '127.0.0.1'
port = $PG_PORT
unix_socket_directories = '$pg_dir/run'
max_connections = 300
shared_buffers = 256MB
fsync = off
full_page_writes = off
log_min_messages = warning
log_line_prefix = '%m [%p] '
EOF
    fi
    # The port is given on the command line too: postgresql.conf has the one of the initdb.
    local pg_opts="-p $PG_PORT"
    if [[ -n "$NETNS_HOST" ]]; then
      # Trust only the chaos bridge's /24 (it exists only on this machine), idempotently.
      local hba_line="host all all ${NETNS_HOST%.*}.0/24 trust"
      grep -qxF "$hba_line" "$pg_dir/data/pg_hba.conf" || echo "$hba_line" >>"$pg_dir/data/pg_hba.conf"
      pg_opts="$pg_opts -c listen_addresses=127.0.0.1,$NETNS_HOST"
    fi
    as_postgres "'$PG_BIN/pg_ctl' -D '$pg_dir/data' -l '$pg_dir/postgres.log' -o '$pg_opts' -w -t 30 start" >/dev/null \
      || fail_with_log "postgres" "$pg_dir/postgres.log"
    # The pid recorded for `down` is the postmaster's.
    pg_pid >"$pg_dir/pid"
    log "postgres started (pid $(pg_pid))"
  fi
  local i
  for i in $(seq 1 60); do
    pg_psql -d postgres -tAc 'select 1' >/dev/null 2>&1 && break
    sleep 0.5
  done
  pg_psql -d postgres -tAc 'select 1' >/dev/null 2>&1 || fail_with_log "postgres" "$pg_dir/postgres.log"
  if [[ "$(pg_psql -d postgres -tAc "select 1 from pg_database where datname = '$PG_DB'")" != 1 ]]; then
    pg_psql -d postgres -c "create database $PG_DB" >/dev/null
  fi
}

pg_down() {
  local pid; pid="$(pid_of "$pg_dir/pid")"
  if alive "$pid" && [[ "$pid" == "$(pg_pid)" ]]; then
    as_postgres "'$PG_BIN/pg_ctl' -D '$pg_dir/data' -m fast -w -t 30 stop" >/dev/null || kill -9 "$pid" 2>/dev/null || true
    log "postgres stopped"
  fi
  rm -f "$pg_dir/pid"
}

# ---------------------------------------------------------------- etcd
etcd_dir="$STATE/etcd"
etcd_url="http://127.0.0.1:$ETCD_PORT"
etcd_check() {
  # A real write and read through etcd's JSON gateway (keys are base64).
  curl -fsS -m 2 -X POST "$etcd_url/v3/kv/put" -d '{"key":"aGVsaW9zL3JlYWR5","value":"MQ=="}' >/dev/null 2>&1 &&
    curl -fsS -m 2 -X POST "$etcd_url/v3/kv/range" -d '{"key":"aGVsaW9zL3JlYWR5"}' 2>/dev/null | grep -q '"MQ=="'
}

etcd_up() {
  if alive "$(pid_of "$etcd_dir/pid")"; then log "etcd already running (pid $(pid_of "$etcd_dir/pid"))"; else
    mkdir -p "$etcd_dir"
    setsid nohup etcd --name helios --data-dir "$etcd_dir/data" \
      --listen-client-urls "$etcd_url" --advertise-client-urls "$etcd_url" \
      --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
      --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
      --initial-cluster "helios=http://127.0.0.1:$ETCD_PEER_PORT" \
      --log-level warn --logger zap >>"$etcd_dir/etcd.log" 2>&1 </dev/null &
    echo $! >"$etcd_dir/pid"
    log "etcd started (pid $!)"
  fi
  local i
  for i in $(seq 1 60); do etcd_check && return 0; alive "$(pid_of "$etcd_dir/pid")" || break; sleep 0.5; done
  fail_with_log "etcd" "$etcd_dir/etcd.log"
}

stop_pidfile() {
  local name="$1" file="$2" pid i
  pid="$(pid_of "$file")"
  if alive "$pid"; then
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 60); do alive "$pid" || break; sleep 0.25; done
    alive "$pid" && kill -KILL "$pid" 2>/dev/null || true
    log "$name stopped"
  fi
  rm -f "$file"
}
etcd_down() { stop_pidfile etcd "$etcd_dir/pid"; }

# ---------------------------------------------------------------- Kafka (KRaft, combined mode)
kafka_dir="$STATE/kafka"
kafka_up() {
  [[ -f "$kafka_dir/libs/.stamp" ]] || die "Kafka jars missing: run scripts/infra.sh install"
  if alive "$(pid_of "$kafka_dir/pid")"; then log "kafka already running (pid $(pid_of "$kafka_dir/pid"))"; else
    mkdir -p "$kafka_dir/data" "$kafka_dir/logs"
    # Kafka refuses two listeners on one port, so the namespaces' listener has a port of its own.
    local listeners="PLAINTEXT://127.0.0.1:$KAFKA_PORT" advertised="PLAINTEXT://127.0.0.1:$KAFKA_PORT"
    local protocols="PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
    if [[ -n "$NETNS_HOST" ]]; then
      [[ -n "$KAFKA_NETNS_PORT" ]] || die "HELIOS_NETNS_HOST needs HELIOS_KAFKA_NETNS_PORT"
      listeners="$listeners,NETNS://$NETNS_HOST:$KAFKA_NETNS_PORT"
      advertised="$advertised,NETNS://$NETNS_HOST:$KAFKA_NETNS_PORT"
      protocols="$protocols,NETNS:PLAINTEXT"
    fi
    cat >"$kafka_dir/server.properties" <<EOF
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$KAFKA_CONTROLLER_PORT
listeners=$listeners,CONTROLLER://127.0.0.1:$KAFKA_CONTROLLER_PORT
advertised.listeners=$advertised
controller.listener.names=CONTROLLER
listener.security.protocol.map=$protocols
inter.broker.listener.name=PLAINTEXT
log.dirs=$kafka_dir/data
num.partitions=1
auto.create.topics.enable=false
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
delete.topic.enable=true
log.retention.hours=24
num.network.threads=2
num.io.threads=4
EOF
    cat >"$kafka_dir/log4j2.properties" <<EOF
status = warn
appender.file.type = File
appender.file.name = file
appender.file.fileName = $kafka_dir/logs/server.log
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.file.ref = file
logger.kafka.name = kafka
logger.kafka.level = INFO
EOF
    local java_opts=("-Dlog4j2.configurationFile=$kafka_dir/log4j2.properties" -Djava.awt.headless=true)
    if [[ ! -f "$kafka_dir/data/meta.properties" ]]; then
      local cluster_id
      cluster_id="$(java -cp "$kafka_dir/libs/*" "${java_opts[@]}" kafka.tools.StorageTool random-uuid 2>>"$kafka_dir/format.log")"
      java -cp "$kafka_dir/libs/*" "${java_opts[@]}" kafka.tools.StorageTool format -t "$cluster_id" \
        -c "$kafka_dir/server.properties" --ignore-formatted >>"$kafka_dir/format.log" 2>&1 \
        || fail_with_log "kafka storage format" "$kafka_dir/format.log"
    fi
    # shellcheck disable=SC2086
    setsid nohup java $KAFKA_HEAP -XX:+UseG1GC -XX:MaxGCPauseMillis=20 "${java_opts[@]}" \
      -cp "$kafka_dir/libs/*" kafka.Kafka "$kafka_dir/server.properties" \
      >>"$kafka_dir/logs/stdout.log" 2>&1 </dev/null &
    echo $! >"$kafka_dir/pid"
    log "kafka started (pid $!)"
  fi
  # Kafka reloads every partition's log on start: with the hundreds a test run leaves behind, on
  # a loaded 2-core machine, that took 40-110 s (over 70 s after a chaos run's 120 s outage), so
  # the wait is 3 minutes (HELIOS_KAFKA_READY_SECONDS overrides it).
  java -cp "$kafka_dir/libs/*" -Dlog4j2.configurationFile="$kafka_dir/log4j2.properties" \
    "$ROOT/scripts/kafka/KafkaReady.java" "127.0.0.1:$KAFKA_PORT" "${HELIOS_KAFKA_READY_SECONDS:-180}" >&2 \
    || { tail -n 20 "$kafka_dir/logs/stdout.log" >&2 || true; fail_with_log "kafka" "$kafka_dir/logs/server.log"; }
}
kafka_down() { stop_pidfile kafka "$kafka_dir/pid"; }

# ---------------------------------------------------------------- env, status
write_env() {
  cat >"$STATE/env" <<EOF
# written by scripts/infra.sh up; source it before running a node or the tests
export HELIOS_DATABASE_URL=postgres://postgres@127.0.0.1:$PG_PORT/$PG_DB
export HELIOS_ETCD_ENDPOINTS=$etcd_url
export HELIOS_KAFKA_BROKERS=127.0.0.1:$KAFKA_PORT
export HELIOS_PG_BIN=$PG_BIN
export HELIOS_INFRA=$ROOT/scripts/infra.sh
export HELIOS_PG_PORT=$PG_PORT
export HELIOS_ETCD_PORT=$ETCD_PORT
export HELIOS_ETCD_PEER_PORT=$ETCD_PEER_PORT
export HELIOS_KAFKA_PORT=$KAFKA_PORT
export HELIOS_KAFKA_CONTROLLER_PORT=$KAFKA_CONTROLLER_PORT
EOF
}

status() {
  local state
  state="down"; alive "$(pid_of "$pg_dir/pid")" && state="up (pid $(pid_of "$pg_dir/pid"))"
  printf '%-9s %-28s %s\n' postgres "127.0.0.1:$PG_PORT/$PG_DB" "$state"
  state="down"; alive "$(pid_of "$etcd_dir/pid")" && state="up (pid $(pid_of "$etcd_dir/pid"))"
  printf '%-9s %-28s %s\n' etcd "$etcd_url" "$state"
  state="down"; alive "$(pid_of "$kafka_dir/pid")" && state="up (pid $(pid_of "$kafka_dir/pid"))"
  printf '%-9s %-28s %s\n' kafka "127.0.0.1:$KAFKA_PORT" "$state"
}

servers() { if [[ $# -eq 0 ]]; then echo "pg etcd kafka"; else echo "$@"; fi; }

cmd="${1:-}"; shift || true
case "$cmd" in
  install) install_all ;;
  up)
    [[ -f "$kafka_dir/libs/.stamp" ]] && command -v etcd >/dev/null || install_all
    for s in $(servers "$@"); do "${s}_up"; done
    write_env
    printf 'HELIOS_PG_PORT=%s\nHELIOS_ETCD_PORT=%s\nHELIOS_ETCD_PEER_PORT=%s\nHELIOS_KAFKA_PORT=%s\nHELIOS_KAFKA_CONTROLLER_PORT=%s\n' \
      "$PG_PORT" "$ETCD_PORT" "$ETCD_PEER_PORT" "$KAFKA_PORT" "$KAFKA_CONTROLLER_PORT" >"$STATE/ports"
    log "ready; source $STATE/env"
    ;;
  down)
    # Reverse order of start.
    list="$(servers "$@")"
    for s in $(echo "$list" | tr ' ' '\n' | tac); do "${s}_down"; done
    ;;
  status) status ;;
  reset)
    "$0" down
    rm -rf "$pg_dir" "$etcd_dir" "$kafka_dir/data" "$kafka_dir/logs" "$STATE/env" "$STATE/ports"
    log "server data deleted"
    ;;
  *) echo "usage: $0 install|up|down|status|reset [pg|etcd|kafka ...]" >&2; exit 2 ;;
esac
