#!/usr/bin/env bash
# The seed's mix through guidellm: the three constant-* scenarios at once, one guidellm per class
# (guidellm sends one header set per run), each at its class's share of 6, 12 and 18 req/s.
#
#   GUIDELLM=/path/to/venv/bin/guidellm TARGET=http://127.0.0.1:10000 OUT=/tmp/guidellm-mix \
#     bench/guidellm/run-mix.sh
#
# Run from the repository root, with the tokenizer built (python bench/make_tokenizer.py
# bench/.tokenizer) and `extproc demo` (or your stack) listening at TARGET. Writes
# OUT/CLASS.json (guidellm's full report) and OUT/CLASS.log. Each step ends on a request count,
# so the three runs drift apart by each step's tail: read each class's steps by its own rates.
set -euo pipefail
GUIDELLM=${GUIDELLM:-guidellm}
TARGET=${TARGET:-http://127.0.0.1:10000}
OUT=${OUT:-guidellm-mix}
SCENARIOS=${SCENARIOS:-bench/guidellm}   # a folder of constant-CLASS.yaml (e.g. edited copies)
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1
# Ten worker processes per guidellm by default; three of them on a small machine starve the stack.
export GUIDELLM__MAX_WORKER_PROCESSES=${GUIDELLM__MAX_WORKER_PROCESSES:-2}
pids=()
for class in loan_approval complaint archive_query; do
  "$GUIDELLM" run --scenario "$SCENARIOS/constant-$class.yaml" \
    --backend "kind=openai_http,target=$TARGET" \
    --output "kind=json,path=$OUT/$class.json" --disable-console-interactive >"$OUT/$class.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
