"""`/metrics` scraped with a real Prometheus text parser: the counters move as requests,
loads and evictions happen; the admin token guards it."""

import os
import time
import unittest

import numpy as np
import requests
from prometheus_client.parser import text_string_to_metric_families

from server import MODELS, Server, reference

CONFIG = f"""
[server]
max_loaded_models = 1
keep_alive = "-1"
admin_token = "s3cret"
[models.m1]
path = "{os.path.join(MODELS, "mlp-100m-1")}"
[models.m2]
path = "{os.path.join(MODELS, "mlp-100m-2")}"
[models.huge]
path = "{os.path.join(MODELS, "mlp-10m")}"
memory = "100TiB"
"""

AUTH = {"Authorization": "Bearer s3cret"}


def scrape(base):
    r = requests.get(base + "/metrics", headers=AUTH, timeout=30)
    r.raise_for_status()
    samples = {}
    families = {}
    for fam in text_string_to_metric_families(r.text):
        families[fam.name] = fam
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return families, samples


def value(samples, name, **labels):
    """The sample `name{labels}`. A series that is not there fails: a default of 0 would let
    `== 0` checks pass on a metric that was never exported."""
    key = (name, tuple(sorted(labels.items())))
    if key not in samples:
        have = sorted(str(dict(l)) for (n, l) in samples if n == name)
        raise AssertionError(f"/metrics has no series {name}{labels} (series of that name: {have or 'none'})")
    return samples[key]


def infer(base, model):
    x, y = reference(model.replace("m", "mlp-100m-"))
    body = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.flatten().tolist()}]}
    r = requests.post(f"{base}/v2/models/{model}/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = np.array(r.json()["outputs"][0]["data"], dtype=np.float32).reshape(y.shape)
    assert np.abs(out - y).max() <= 1e-4


class MetricsTest(unittest.TestCase):
    def test_counters_move_with_requests_loads_and_evictions(self):
        with Server(CONFIG) as s:
            self.assertEqual(requests.get(s.base + "/metrics", timeout=10).status_code, 401)
            _, before = scrape(s.base)
            infer(s.base, "m1")
            infer(s.base, "m1")
            infer(s.base, "m2")  # evicts m1: budget of one model
            r = requests.post(f"{s.base}/v2/models/m2/infer", json={"inputs": "nope"}, timeout=30)
            self.assertEqual(r.status_code, 400)
            x, _ = reference("mlp-10m")
            body = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.flatten().tolist()}]}
            r = requests.post(f"{s.base}/v2/models/huge/infer", json=body, timeout=30)
            self.assertEqual(r.status_code, 503)
            families, after = scrape(s.base)

            def grew(name, by=1, **labels):
                delta = value(after, name, **labels) - value(before, name, **labels)
                self.assertGreaterEqual(delta, by, f"{name} {labels}: +{delta}")

            grew("snooze_requests_total", 2, model="m1", protocol="kserve", outcome="ok")
            grew("snooze_requests_total", 1, model="m2", protocol="kserve", outcome="invalid_input")
            grew("snooze_loads_total", 1, model="m1", outcome="ok")
            grew("snooze_loads_total", 1, model="m2", outcome="ok")
            grew("snooze_unloads_total", 1, model="m1", reason="evicted")
            grew("snooze_refusals_total", 1, model="huge", reason="insufficient_memory")
            # Histograms: counts and the 100 µs .. 60 s buckets.
            grew("snooze_request_duration_seconds_count", 2, model="m1")
            grew("snooze_load_duration_seconds_count", 1, model="m2")
            grew("snooze_queue_wait_seconds_count", 1, model="m2")
            buckets = {float(s.labels["le"]) for s in families["snooze_request_duration_seconds"].samples if "le" in s.labels}
            self.assertTrue({0.0001, 60.0, float("inf")} <= buckets, buckets)
            # Gauges are the picture now.
            self.assertEqual(value(after, "snooze_model_state", model="m2", state="ready"), 1.0)
            self.assertEqual(value(after, "snooze_model_state", model="m1", state="ready"), 0.0)
            self.assertEqual(value(after, "snooze_model_state", model="m1", state="unloaded"), 1.0)
            self.assertGreater(value(after, "snooze_model_footprint_bytes", model="m2", kind="measured"), 50 << 20)
            self.assertGreater(value(after, "snooze_memory_bytes", device="cpu", kind="budget"), 0)
            self.assertGreater(value(after, "snooze_memory_bytes", device="cpu", kind="process"), 0)
            self.assertEqual(value(after, "snooze_queue_depth", model="m1", priority="normal"), 0.0)
            self.assertIn("snooze_pressure_level", families)
            # The answer leaves from inside the run: its lease ends a moment later.
            deadline = time.monotonic() + 10
            while value(after, "snooze_model_leases", model="m2") != 0.0 and time.monotonic() < deadline:
                time.sleep(0.05)
                _, after = scrape(s.base)
            self.assertEqual(value(after, "snooze_model_leases", model="m2"), 0.0)


if __name__ == "__main__":
    unittest.main()
