#!/usr/bin/env bash
# The stand-in Flink image's entrypoint, with the official image's interface: `jobmanager`,
# `taskmanager`, `standalone-job` and `history-server` start that process in the
# foreground, `help` prints the usage, anything else runs as given. Before any of them,
# FLINK_PROPERTIES (`key: value` lines) and the JobManager's address go into
# conf/config.yaml. It runs as whoever the container starts as and drops no privileges.
set -euo pipefail

conf_dir="$FLINK_HOME/conf"
[[ "$(id -u)" == 0 ]] && echo "WARNING: running Flink as root; run it as a non-root user."

settings=("-Djobmanager.rpc.address=${JOB_MANAGER_RPC_ADDRESS:-$(hostname -f)}"
          "-Dblob.server.port=6124" "-Dquery.server.port=6125")
[[ -n "${TASK_MANAGER_NUMBER_OF_TASK_SLOTS:-}" ]] \
  && settings+=("-Dtaskmanager.numberOfTaskSlots=$TASK_MANAGER_NUMBER_OF_TASK_SLOTS")
while IFS= read -r line; do
  line="$(sed 's/^[[:space:]]*//;s/[[:space:]]*$//' <<<"$line")"
  [[ -z "$line" ]] && continue
  key="${line%%:*}"
  value="$(sed 's/^[[:space:]]*//' <<<"${line#*:}" | envsubst)"
  settings+=("-D${key}=${value}")
done <<<"${FLINK_PROPERTIES:-}"
bash "$FLINK_HOME/bin/config-parser-utils.sh" "$conf_dir" "$FLINK_HOME/bin" "$FLINK_HOME/lib" \
  "${settings[@]}"

jemalloc="/usr/lib/$(uname -m)-linux-gnu/libjemalloc.so.2"
if [[ "${DISABLE_JEMALLOC:-false}" == false && -f "$jemalloc" ]]; then
  export LD_PRELOAD="${LD_PRELOAD:+$LD_PRELOAD:}$jemalloc"
fi

case "${1:-help}" in
  help)
    echo "Usage: $(basename "$0") (jobmanager|standalone-job|taskmanager|history-server)"
    exit 0 ;;
  jobmanager) shift; exec "$FLINK_HOME/bin/jobmanager.sh" start-foreground "$@" ;;
  standalone-job) shift; exec "$FLINK_HOME/bin/standalone-job.sh" start-foreground "$@" ;;
  taskmanager) shift; exec "$FLINK_HOME/bin/taskmanager.sh" start-foreground "$@" ;;
  history-server) shift; exec "$FLINK_HOME/bin/historyserver.sh" start-foreground "$@" ;;
  *) exec "$@" ;;
esac
