#!/usr/bin/env bash
# The compose tier (`make compose-test`): docker-compose.yml run end to end on the project's
# own Docker Engine.
#
# 1. Install Docker Engine, debootstrap and Compose v2 when missing, and start a private
#    dockerd (scripts/docker_engine.sh: its socket and data under $SI_CACHE_DIR/docker), so
#    the other tiers never see it; it is stopped when this script ends, however it ends.
# 2. Have every image of the stack (deploy/compose_images.py): pulled, else a local stand-in
#    under the same name, then the project's own images; layers cached in the engine's data.
# 3. Run tests/compose (SI_COMPOSE_TEST=1 lets pytest collect it), which brings the stack up,
#    replays the sample, kills a TaskManager, and takes it all down again.
#
# Steps 2 and 3 each hold the machine's heavy-run lock (/tmp/si-heavy.lock) while they run.
# Arguments go to pytest. Timings: $SI_CACHE_DIR/reports/compose_{images,test}.json.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${SI_CACHE_DIR:-$ROOT/.cache}"
PY="$CACHE/venv/bin/python"
LOCK="${SI_HEAVY_LOCK:-/tmp/si-heavy.lock}"  # the machine's heavy-run lock
cd "$ROOT"

bash scripts/docker_engine.sh install
bash scripts/docker_engine.sh start
trap 'bash scripts/docker_engine.sh stop' EXIT
eval "$(bash scripts/docker_engine.sh env)"

# The test's settings: throwaway passwords (hex: safe in URLs and JAAS) and free loopback
# ports for what the stack publishes.
mkdir -p "$CACHE/compose-test" "$CACHE/reports"
ENV_FILE="$CACHE/compose-test/test.env"
{
  sed -e '/^REDIS_PASSWORD=/d' -e '/^KAFKA_PASSWORD=/d' -e '/^GRAFANA_ADMIN_PASSWORD=/d' .env.example
  for name in REDIS_PASSWORD KAFKA_PASSWORD GRAFANA_ADMIN_PASSWORD; do
    echo "$name=$("$PY" -c 'import secrets; print(secrets.token_hex(12))')"
  done
} >"$ENV_FILE"
read -r SI_TEST_FLINK_PORT SI_TEST_REDIS_PORT SI_TEST_PROMETHEUS_PORT < <("$PY" -c '
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
')
export SI_TEST_FLINK_PORT SI_TEST_REDIS_PORT SI_TEST_PROMETHEUS_PORT
export SI_COMPOSE_ENV_FILE="$ENV_FILE" SI_COMPOSE_TEST=1

start=$SECONDS
flock "$LOCK" "$PY" -m deploy.compose_images --env-file "$ENV_FILE" \
  -f docker-compose.yml -f tests/compose/docker-compose.test.yml --profile cpu \
  --timings "$CACHE/reports/compose_images.json"
images_s=$((SECONDS - start))

start=$SECONDS
status=0
flock "$LOCK" "$PY" -m pytest tests/compose -p no:cacheprovider "$@" || status=$?
tests_s=$((SECONDS - start))
printf '{"images_s": %d, "tests_s": %d, "status": %d}\n' "$images_s" "$tests_s" "$status" \
  >"$CACHE/reports/compose_test.json"
echo "compose tier: images ${images_s} s, tests ${tests_s} s (pytest exit ${status})"
exit "$status"
