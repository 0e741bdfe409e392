#!/usr/bin/env bash
# The seed's mix through inference-perf: the three class configs at once, one inference-perf per
# class (api.headers is one header set per run), each at its class's share of the staircase
# (4, 8, 12, 16, 20 req/s in all, 30 s a step).
#
#   INFERENCE_PERF=/path/to/venv/bin/inference-perf TARGET=http://127.0.0.1:10000 \
#     OUT=/tmp/inference-perf-mix bench/inference-perf/run-mix.sh
#
# Run from the repository root, with the tokenizer built (python bench/make_tokenizer.py
# bench/.tokenizer) and `extproc demo` (or your stack) listening at TARGET. Writes each class's
# reports under OUT/CLASS/ (summary_lifecycle_metrics.json, stage_N_lifecycle_metrics.json) and
# its console output to OUT/CLASS.log. The stages are timed, so the three stay in step.
set -euo pipefail
INFERENCE_PERF=${INFERENCE_PERF:-inference-perf}
TARGET=${TARGET:-http://127.0.0.1:10000}
OUT=${OUT:-inference-perf-mix}
CONFIGS=${CONFIGS:-bench/inference-perf}   # a folder of CLASS.yaml (e.g. edited copies)
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1
pids=()
for class in loan_approval complaint archive_query; do
  "$INFERENCE_PERF" --config_file "$CONFIGS/$class.yaml" \
    --server.base_url "$TARGET" --storage.local_storage.path "$OUT/$class" >"$OUT/$class.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
