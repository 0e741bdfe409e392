"""The prefill pace (core/prefill_pace.py), with a stepped clock: it paces only while the
latency-bound classes miss their mark, settles where they meet it, never shuts the others out, and
lets go when nobody needs protecting."""

from __future__ import annotations

from extproc.core.prefill_pace import PrefillPace

PROMPT = 500  # tokens per prompt of the classes without a target
TARGET = 2.0


def run(pace: PrefillPace, seconds: float, demand: float, latency, start: float = 0.0, loans_per_s: float = 4.0,
        slots: int = 16):
    """Drive `pace` for `seconds` from `start`: prompts of PROMPT tokens asked for at `demand`
    tokens a second start when their delay says (a prompt waits its turn holding one of `slots`:
    while all are held, the next waits in line), and a latency-bound request answers every
    1/loans_per_s with `latency(started rate now)`. Returns (the rates at each second, the
    prompt tokens a second that started over the last 5 s)."""
    step = 0.01
    now, next_prompt, next_loan, rates, started = start, start, start, [], []
    while now < start + seconds:
        if now >= next_prompt and sum(1 for t in started[-slots:] if t > now) < slots:
            started.append(now + pace.delay(now, PROMPT))
            next_prompt += PROMPT / demand
        if now >= next_loan:
            recent = sum(1 for t in started if now - 2.0 <= t <= now) * PROMPT / 2.0
            pace.observe(now, latency(recent), TARGET)
            next_loan += 1 / loans_per_s
        if int(now / step) % int(1 / step) == 0:
            rates.append(pace.update(now))
        now = round(now + step, 6)
    last = [t for t in started if start + seconds - 5 <= t <= start + seconds]
    return rates, len(last) * PROMPT / 5


def loans(started_rate: float) -> float:
    """A loan's latency: 0.5 s alone, and a second more for every 4000 prompt tokens a second
    that start beside it (their prefill shares its engine's steps)."""
    return 0.5 + started_rate / 4000


def test_without_latency_bound_answers_it_never_paces():
    pace = PrefillPace()
    delays = [pace.delay(t / 10, PROMPT) for t in range(300)]
    assert pace.rate is None and max(delays) == 0


def test_while_the_latency_bound_classes_meet_their_mark_it_does_not_pace():
    pace = PrefillPace()
    rates, started = run(pace, 30, demand=4000, latency=lambda rate: 1.0)  # pressure 0.5
    assert set(rates) == {None}
    assert abs(started - 4000) < 250


def test_it_converges_to_the_rate_at_which_they_meet_it():
    # Unpaced, 8000 tokens a second start: loans take 2.5 s (pressure 1.25). In the band
    # (pressure 0.4-0.6 of the 2 s target: loans in 0.8-1.2 s) 1200-2800 tokens a second start.
    pace = PrefillPace()
    rates, _ = run(pace, 60, demand=8000, latency=loans)
    assert rates[1] is None  # not before the pressure is known
    settled = rates[-20:]
    assert all(r is not None and 1200 * 0.8 <= r <= 2800 * 1.25 for r in settled), settled
    _, started = run(pace, 20, demand=8000, latency=loans, start=60)
    assert 1200 * 0.8 <= started <= 2800 * 1.25


def test_it_never_shuts_the_others_out():
    # Loans miss their target whatever runs beside them (3 s alone): the pace falls to its floor,
    # a quarter of the demand it found, and stays there.
    pace = PrefillPace()
    rates, started = run(pace, 60, demand=4000, latency=lambda rate: 3.0)
    assert rates[-1] == pace.floor() == 0.25 * 4000
    assert started >= 0.25 * 4000 * 0.8


def test_it_lets_go_when_no_latency_bound_request_answers_for_a_window():
    pace = PrefillPace()
    run(pace, 30, demand=4000, latency=loans)
    assert pace.rate is not None
    rates, started = run(pace, 15, demand=4000, latency=loans, start=30, loans_per_s=1e-9)
    assert rates[-1] is None
    assert pace.delay(45.5, PROMPT) == 0


def test_it_lets_go_when_it_held_nobody_back_for_a_window():
    pace = PrefillPace()
    run(pace, 30, demand=4000, latency=loans)
    assert pace.rate is not None
    rates, _ = run(pace, 15, demand=100, latency=lambda rate: 1.0, start=30)  # demand fell far below the pace
    assert rates[-1] is None


def test_a_prompt_within_a_quarter_second_of_its_time_goes_at_once_and_the_rest_wait_for_theirs():
    pace = PrefillPace(burst_s=0.25)
    pace.rate = 2000.0  # tokens a second: one 500-token prompt every 0.25 s
    pace._delayed_at = pace._changed_at = pace._observed_at = pace._last = 0.0
    delays = [pace.delay(0.0, PROMPT) for _ in range(4)]
    assert delays == [0.0, 0.0, 0.25, 0.5]  # their times: 0, 0.25, 0.5, 0.75
    assert [pace.delay(1.0, PROMPT) for _ in range(3)] == [0.0, 0.0, 0.25]  # 1.0, 1.25, 1.5
