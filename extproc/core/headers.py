"""Every HTTP header name the sidecar reads or sets: its whole contract with clients and with
the Envoy configuration (envoy/envoy.yaml routes on POOL, and strips it before upstream)."""

from __future__ import annotations

# What a caller claims about its request (bounded by what its identity may claim: priority.py).
TICKET_TYPE = "x-ticket-type"
URGENT_LEVEL = "x-urgent-level"
VIP_LEVEL = "x-vip-level"
BULK = "x-bulk"
BRANCH_ID = "x-branch-id"
CLAIM_HEADERS = (TICKET_TYPE, URGENT_LEVEL, VIP_LEVEL, BULK, BRANCH_ID)

# How a request names itself, and says it is a retry (retries.py).
IDEMPOTENCY_KEY = "idempotency-key"
REQUEST_ID = "x-request-id"
SDK_RETRY_COUNT = "x-stainless-retry-count"  # the OpenAI SDKs' attempt counter
RETRY_HEADERS = (IDEMPOTENCY_KEY, REQUEST_ID, SDK_RETRY_COUNT)

# Set on an admitted request. POOL picks the Envoy route (an allow-list of clusters); copies
# sent by clients are removed before a route is chosen.
POOL = "x-llm-pool"
PRIORITY = "x-llm-priority"
CLASS = "x-llm-class"
OWN_HEADERS = frozenset({POOL, PRIORITY, CLASS})

# Every request header the sidecar reads (the others are never decoded).
REQUEST_HEADERS_READ = frozenset({
    "authorization", "content-length", ":method", ":path", *OWN_HEADERS, *CLAIM_HEADERS, *RETRY_HEADERS,
})

# Set on responses.
QUEUE_WAIT_MS = "x-queue-wait-ms"  # time spent in the sidecar's line
FALLBACK = "x-llm-fallback"  # "true": served by the home pool's fallback
OUTCOME = "x-extproc-outcome"  # on every refusal and model list the sidecar gives: the outcome's name
RETRY_AFTER = "retry-after"  # whole seconds (an appointment rounded up)
RETRY_AFTER_MS = "retry-after-ms"  # the same, in milliseconds (the OpenAI SDKs read it first)
SHOULD_RETRY = "x-should-retry"  # "false" on a final answer (the OpenAI SDKs obey it)
PREDICTED_WAIT_MS = "x-queue-wait-predicted-ms"  # the wait in line forecast at arrival
