#!/usr/bin/env bash
# Runs pytest and fails when no test ran: pytest's exit 5 ("no tests collected") must not pass silently.
set -uo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python3}" -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "[pytest] no tests were collected: failing" >&2
  exit 1
fi
exit "$rc"
