"""The dflash_* custom metrics of a bundle's Triton models (Triton Python-backend metrics API,
`pb_utils.MetricFamily`; they appear on the server's /metrics with labels model and version).
Written by `dflash-trt build` into both models' 1/ folders; the Helm chart's autoscaling reads them.
accepted_tokens_total / draft_blocks_total is tau.
"""
import collections
import threading

import triton_python_backend_utils as pb_utils

WINDOW = 256
GAUGES = {
    "dflash_requests_active": "requests being decoded",
    "dflash_requests_waiting": "requests accepted and waiting to be scheduled",
    "dflash_kv_cache_utilization": "KV-cache capacity in use (0..1)",
    "dflash_acceptance_length": f"mean tokens per verify block over the last {WINDOW} blocks",
}
COUNTERS = {
    "dflash_draft_blocks_total": "verify blocks (one drafted block each)",
    "dflash_accepted_tokens_total": "tokens produced by verify blocks, bonus token included",
}


class Metrics:
    def __init__(self, model, version):
        labels = {"model": str(model), "version": str(version)}
        kinds = [(GAUGES, pb_utils.MetricFamily.GAUGE), (COUNTERS, pb_utils.MetricFamily.COUNTER)]
        self.families = {n: pb_utils.MetricFamily(name=n, description=d, kind=k)
                         for table, k in kinds for n, d in table.items()}
        self.m = {n: f.Metric(labels=labels) for n, f in self.families.items()}
        self.window = collections.deque(maxlen=WINDOW)
        self.lock = threading.Lock()

    def set(self, name, value):
        self.m[name].set(float(value))

    def blocks_done(self, tokens_per_block: list):
        """One request's verify blocks, as the tokens each produced (bonus included)."""
        with self.lock:
            self.window.extend(tokens_per_block)
            self.m["dflash_draft_blocks_total"].increment(float(len(tokens_per_block)))
            self.m["dflash_accepted_tokens_total"].increment(float(sum(tokens_per_block)))
            if self.window:
                self.set("dflash_acceptance_length", sum(self.window) / len(self.window))
