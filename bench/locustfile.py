"""The burst scenario's traffic for teams who load-test with Locust, and the seed's phase-one
test: a step load that raises the rate until the system breaks.

    pip install locust            # beside extproc (pip install -e .)
    locust -f bench/locustfile.py --host http://127.0.0.1:10000 --headless   # the step load
    STEP_USERS=20 STEP_SECONDS=30 STEPS=8 locust -f bench/locustfile.py --host ... --headless

Each user sends tickets of the seed's mix (extproc_testbed.traffic.ticket, 200 branches):
loan approvals, complaints and archive queries with their claims, prompts mostly around 500
tokens with a tail up to the usable context. Locust's statistics carry one entry per class, so
the report shows each class's latency percentiles and failures; the shape adds STEP_USERS users
every STEP_SECONDS, STEPS times, then stops.
"""

from __future__ import annotations

import os
import random

from locust import HttpUser, LoadTestShape, between, task

from extproc_testbed.traffic import Traffic, ticket

TRAFFIC = Traffic()


class Branch(HttpUser):
    wait_time = between(0.5, 2.0)

    def on_start(self) -> None:
        self.rng = random.Random()

    @task
    def send_ticket(self) -> None:
        item = ticket(self.rng, TRAFFIC)
        with self.client.post("/v1/chat/completions", json=item["body"], name=item["class"],
                              headers={"content-type": "application/json", **item["headers"]},
                              catch_response=True) as response:
            if response.status_code == 200:
                response.success()
            else:
                response.failure(f"{response.status_code} {response.headers.get('x-extproc-outcome', '')}".strip())


class StepLoad(LoadTestShape):
    """STEP_USERS more users every STEP_SECONDS, STEPS times (the seed: raise QPS until it breaks)."""

    step_users = int(os.environ.get("STEP_USERS", "20"))
    step_seconds = float(os.environ.get("STEP_SECONDS", "30"))
    steps = int(os.environ.get("STEPS", "8"))

    def tick(self):
        elapsed = self.get_run_time()
        if elapsed > self.step_seconds * self.steps:
            return None
        users = self.step_users * (int(elapsed // self.step_seconds) + 1)
        return users, self.step_users
