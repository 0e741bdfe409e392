"""The waiting room through real Envoy, with the real `openai` client at its default retries:
the requests turned away during a burst are told when to come back (`retry-after-ms`), come
back then on their own, are recognised (the SDK numbers its attempts; the body names the
request) and answered; one that cannot be answered before its deadline is told so once."""

from __future__ import annotations

import asyncio

import openai

from ..conftest import e2e_config, start_stack
from ..helpers import metric


def burst_config(**overrides) -> dict:
    config = e2e_config(**overrides)
    config["pools"]["primary"]["tiers"] = {"yellow": 1, "orange": 2, "red": 3, "hard_max": 30}
    config["classes"]["complaint"] = {"base": 1, "max_wait_s": 30, "deadline_s": 60}
    return config


async def test_requests_turned_away_in_a_burst_come_back_at_their_appointment_and_are_answered(tmp_path):
    stack = start_stack(tmp_path, burst_config())
    try:
        client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused")  # max_retries: the default, 2

        async def ask(i: int) -> str:
            reply = await client.chat.completions.create(
                model="deepseek-sim", messages=[{"role": "user", "content": f"complaint number {i}"}], max_tokens=8,
                extra_headers={"x-ticket-type": "complaint"})
            return reply.choices[0].message.content

        answers = await asyncio.gather(*(ask(i) for i in range(12)))  # one slot: most of them find a full line
        assert all(answer.split() == ["ok"] * 8 for answer in answers)
        url = stack.metrics_url
        given = metric(url, "extproc_appointments_total", pool="primary", result="given")
        assert given >= 4  # past the red tier (3 waiting) they were turned away...
        assert metric(url, "extproc_admission_outcomes_total", outcome="shed_overloaded") == given
        # ...and each came back and was admitted: twelve requests, twelve admissions
        assert metric(url, "extproc_admission_outcomes_total", outcome="admitted") == 12
        assert metric(url, "extproc_appointments_total", result="past_deadline") == 0
        await client.close()
    finally:
        stack.stop()


async def test_a_request_past_its_deadline_is_answered_once_and_the_client_does_not_retry(tmp_path):
    config = burst_config()
    config["classes"]["complaint"]["deadline_s"] = 0.5  # shorter than the line ahead of it
    stack = start_stack(tmp_path, config)
    try:
        client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused")

        async def ask(i: int) -> int:
            try:
                await client.chat.completions.create(
                    model="deepseek-sim", messages=[{"role": "user", "content": f"late complaint {i}"}],
                    max_tokens=64, extra_headers={"x-ticket-type": "complaint"})
                return 200
            except openai.RateLimitError as error:
                assert error.response.headers["x-should-retry"] == "false"
                assert error.code == "deadline_unreachable"
                return 429

        statuses = await asyncio.gather(*(ask(i) for i in range(12)))
        finals = metric(stack.metrics_url, "extproc_admission_outcomes_total", outcome="rejected_past_deadline")
        assert statuses.count(429) == finals >= 1
        # every request ended once: admitted, or told once that it would not be served in time
        # (x-should-retry: false stops the SDK from trying again; an appointment brings it back)
        admitted = metric(stack.metrics_url, "extproc_admission_outcomes_total", outcome="admitted")
        assert admitted == statuses.count(200) and admitted + finals == 12
        await client.close()
    finally:
        stack.stop()
