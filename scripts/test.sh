#!/usr/bin/env bash
# The project's test command (CI runs it through .ci/run): set-up through the lock, lint, types,
# workflow lint, the unit tests spread over the machine's cores (pytest-xdist), then the tests that
# measure speed (marked `serial`) in an invocation of their own, the Triton kernels through the
# interpreter, and the perf tier's smoke profile (tiny model on CPU). Each step's time is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
step() {  # NAME COMMAND...: run one step and say how long it took
  local name=$1 start=$SECONDS
  shift
  echo "== $name"
  "$@"
  echo "== $name: $((SECONDS - start)) s"
}
step install bash scripts/install.sh
step lint python3 -m ruff check .
step format python3 -m ruff format --check .
step types python3 -m mypy
step "workflow lint" actionlint
# Independent tests on every core; the speed-measuring ones never run beside other workers. A module's
# tests share one worker (--dist loadfile): its module-scoped server starts once, and its closing
# checks (the fuzz module's) see the cases its other tests sent. Not in pytest.ini: any --dist there
# makes pytest-benchmark disable itself in every run, the perf tier's rounds included.
step "unit tests" python3 -m pytest tests/unit -q -n auto --dist loadfile -m "not perf and not serial" "$@"
serial_tests() {  # exit 5 (nothing collected) is fine when the arguments select no such test
  local status=0
  python3 -m pytest tests/unit -q -m serial -rP "$@" || status=$?
  [ "$status" -eq 0 ] || [ "$status" -eq 5 ]
}
step "unit tests that measure speed (serial)" serial_tests "$@"
# Triton kernels on CPU through the interpreter (read when triton is imported: its own invocation).
step "kernels under the interpreter" env TRITON_INTERPRET=1 python3 -m pytest tests/unit/kernels -q -n auto
step "perf smoke" python3 -m pytest -m perf --profile smoke --model tiny --trials 1 -q -rs
echo "== all steps passed in $SECONDS s"
