"""The shape of a vLLM /metrics page, and where the simulator's differs from a real server's.

A shape is what a parser or a dashboard depends on: each `vllm:` family's type and label names,
and the labels of `vllm:cache_config_info`. tests/e2e/test_sim_shape.py compares `extproc sim`'s
with a real vLLM-CPU server's (a capture checked in under tests/fixtures/, and a live server in
`make test-vllm`), so that drift on either side fails: a family or label the simulator exports
that the real server does not, a real family the simulator neither exports nor lists below.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

CACHE_INFO = "vllm:cache_config_info"

# Real families the simulator does not export, and why. A family the real server adds shows up
# in neither list and fails the comparison until it is exported or named here.
REAL_ONLY = {
    "vllm:estimated_flops_per_gpu": "performance counters of a real GPU",
    "vllm:estimated_read_bytes_per_gpu": "performance counters of a real GPU",
    "vllm:estimated_write_bytes_per_gpu": "performance counters of a real GPU",
    "vllm:engine_sleep_state": "sleep mode (weights offloaded) is not simulated",
    "vllm:prefix_cache_queries": "no prefix caching in the simulator",
    "vllm:prefix_cache_hits": "no prefix caching in the simulator",
    "vllm:external_prefix_cache_queries": "no KV connector",
    "vllm:external_prefix_cache_hits": "no KV connector",
    "vllm:mm_cache_queries": "no multimodal inputs",
    "vllm:mm_cache_hits": "no multimodal inputs",
    "vllm:prompt_tokens_by_source": "no prefix caching or KV transfer: every prompt token is computed",
    "vllm:prompt_tokens_cached": "no prefix caching in the simulator",
    "vllm:prompt_tokens_cached_by_source": "no prefix caching in the simulator",
    "vllm:request_prompt_tokens": "per-request size histograms: not simulated",
    "vllm:request_generation_tokens": "per-request size histograms: not simulated",
    "vllm:iteration_tokens_total": "per-step size histogram: not simulated (sim/stats has the largest step)",
    "vllm:request_max_num_generation_tokens": "per-request size histograms: not simulated",
    "vllm:request_params_n": "per-request parameter histograms: not simulated",
    "vllm:request_params_max_tokens": "per-request parameter histograms: not simulated",
    "vllm:request_time_per_output_token_seconds": "per-request mean TPOT: the ITL histogram stands for it",
    "vllm:request_inference_time_seconds": "prefill + decode: both are exported apart",
    "vllm:request_num_preemptions": "per-request preemptions: the counter vllm:num_preemptions stands for it",
    "vllm:request_prefill_kv_computed_tokens": "no prefix caching: every prompt token is computed",
}
# cache_config_info labels whose values the comparison holds equal (the simulator started with
# the real server's capacity: tests/e2e/test_sim_shape.py), and those known to differ, with both values.
CACHE_VALUES_EQUAL = ("block_size", "cache_dtype", "kv_cache_size_tokens", "num_gpu_blocks", "kv_cache_max_concurrency")
CACHE_VALUES_DIFFER = {"enable_prefix_caching": ("False", "True")}  # (simulator, real): no prefix caching
# The labels the sidecar's probes and this project's docs read: in both, always.
CACHE_LABELS_READ = ("block_size", "num_gpu_blocks", "kv_cache_size_tokens", "enable_prefix_caching")


@dataclass(frozen=True)
class Shape:
    families: dict[str, tuple[str, frozenset[str]]]  # name -> (type, label names)
    cache_config: dict[str, str]  # the labels of vllm:cache_config_info (the first engine's)


def shape(text: str) -> Shape:
    """The `vllm:` families of a Prometheus text page. `_created` samples and families are left
    out (a real server exports them as gauges of their own, prometheus_client as samples)."""
    families: dict[str, tuple[str, frozenset[str]]] = {}
    cache: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:") or family.name.endswith("_created"):
            continue
        labels = frozenset(name for sample in family.samples if not sample.name.endswith("_created")
                           for name in sample.labels if name != "le")
        families[family.name] = (family.type, labels)
        if family.name == CACHE_INFO and family.samples and not cache:
            cache = dict(family.samples[0].labels)
    return Shape(families, cache)


def differences(sim: Shape, real: Shape) -> list[str]:
    """Every way the simulator's shape differs from the real server's, beyond what is listed
    above as known; empty when they agree."""
    found = []
    for name, (kind, labels) in sorted(sim.families.items()):
        if name.startswith("vllm_sim:"):
            continue
        if name not in real.families:
            found.append(f"the simulator exports {name}, the real server does not")
            continue
        real_kind, real_labels = real.families[name]
        if kind != real_kind:
            found.append(f"{name} is a {kind} in the simulator, a {real_kind} in the real server")
        cache_family = name == CACHE_INFO  # its labels are compared one by one below
        if labels != real_labels and not cache_family:
            found.append(f"{name} has labels {sorted(labels)} in the simulator, {sorted(real_labels)} in the real server")
    for name in sorted(set(real.families) - set(sim.families)):
        if name not in REAL_ONLY:
            found.append(f"the real server exports {name}: the simulator neither exports it nor lists it in REAL_ONLY")
    for name in sorted(set(REAL_ONLY) - set(real.families)):
        found.append(f"REAL_ONLY lists {name}, which the real server no longer exports")
    for label in sorted(set(sim.cache_config) - set(real.cache_config)):
        found.append(f"the simulator's {CACHE_INFO} has a label {label} that the real server's has not")
    for label in CACHE_LABELS_READ:
        if label not in sim.cache_config or label not in real.cache_config:
            found.append(f"{CACHE_INFO} label {label} missing in {'the simulator' if label not in sim.cache_config else 'the real server'}")
    for label in CACHE_VALUES_EQUAL:
        if sim.cache_config.get(label) != real.cache_config.get(label):
            found.append(f"{CACHE_INFO} {label}: {sim.cache_config.get(label)!r} in the simulator, "
                         f"{real.cache_config.get(label)!r} in the real server")
    for label, expected in CACHE_VALUES_DIFFER.items():
        seen = (sim.cache_config.get(label), real.cache_config.get(label))
        if seen != expected:
            found.append(f"{CACHE_INFO} {label}: (simulator, real) read {seen}, the known difference is {expected}")
    return found
