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
    """A loan's latency: 0.3 s alone, and a second more for every 8000 prompt tokens a second
    that start beside it (their prefill shares its engine's steps)."""
    return 0.3 + started_rate / 8000


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
    # Unpaced, 14000 tokens a second start: loans take 2.05 s (pressure 1.03). In the band
    # (pressure 0.4-0.6 of the 2 s target: loans in 0.8-1.2 s) 4000-7200 tokens a second start.
    pace = PrefillPace()
    rates, _ = run(pace, 60, demand=14000, latency=loans)
    assert rates[1] is None  # not before the pressure is known
    settled = rates[-20:]
    assert all(r is not None and 4000 * 0.8 <= r <= 7200 * 1.25 for r in settled), settled
    _, started = run(pace, 20, demand=14000, latency=loans, start=60)
    assert 4000 * 0.8 <= started <= 7200 * 1.25


def test_it_never_shuts_the_others_out():
    # Loans miss their target whatever runs beside them (3 s alone): the pace falls to its floor,
    # half the demand it found over its window, and stays there.
    pace = PrefillPace()
    rates, started = run(pace, 60, demand=4000, latency=lambda rate: 3.0)
    assert rates[-1] == pace.floor() >= 0.25 * 4000
    assert set(rates[-20:]) == {pace.floor()}
    assert started >= pace.floor() * 0.8


def test_it_lets_go_when_no_latency_bound_request_answers_for_a_window():
    pace = PrefillPace()
    run(pace, 30, demand=14000, latency=loans)
    assert pace.rate is not None
    rates, started = run(pace, 15, demand=14000, latency=loans, start=30, loans_per_s=1e-9)
    assert rates[-1] is None
    assert pace.delay(45.5, PROMPT) == 0


def test_it_lets_go_when_it_held_nobody_back_for_a_window():
    pace = PrefillPace()
    run(pace, 30, demand=14000, latency=loans)
    assert pace.rate is not None
    rates, _ = run(pace, 15, demand=100, latency=lambda rate: 1.0, start=30)  # demand fell far below the pace
    assert rates[-1] is None


def test_a_prompt_within_a_quarter_second_of_its_time_goes_at_once_and_the_rest_wait_for_theirs():
    pace = PrefillPace(burst_s=0.25, smooth=1e9, floor_share=0.0)  # the rate alone binds
    pace.rate = 2000.0  # tokens a second: one 500-token prompt every 0.25 s
    pace._delayed_at = pace._changed_at = pace._observed_at = pace._last = 0.0
    delays = [pace.delay(0.0, PROMPT) for _ in range(4)]
    assert delays == [0.0, 0.0, 0.25, 0.5]  # their times: 0, 0.25, 0.5, 0.75
    assert [pace.delay(1.0, PROMPT) for _ in range(3)] == [0.0, 0.0, 0.25]  # 1.0, 1.25, 1.5


def test_while_loans_answer_a_surge_is_spread_over_a_second_or_two():
    # 1000 tokens a second for 20 s, then 20 prompts at once: at most twice the last two
    # seconds' demand starts, so the surge's prompts start over the next seconds, not together.
    pace = PrefillPace()
    run(pace, 20, demand=1000, latency=lambda rate: 1.0)
    assert pace.rate is None
    delays = [pace.delay(20.0, PROMPT) for _ in range(20)]
    assert delays[0] == 0 and 0 < max(delays) <= pace.max_lead_s
    assert sorted(delays) == delays and len(set(delays)) > 10


def test_without_latency_bound_requests_a_surge_goes_at_once():
    pace = PrefillPace()
    for t in range(20):
        pace.delay(float(t), PROMPT)
    assert [pace.delay(20.0, PROMPT) for _ in range(20)] == [0.0] * 20


def test_a_pace_that_begins_on_the_first_prompt_after_a_quiet_spell_keeps_a_floor_of_its_demand():
    # loans over their target, and then prompts: the pace does not begin at one token a second
    pace = PrefillPace()
    for i in range(10):
        pace.observe(i * 0.5, 3.0, TARGET)
    rates, started = run(pace, 30, demand=4000, latency=lambda rate: 1.0, start=5.0)  # loans in the band
    assert pace.rate is None or pace.rate >= 0.2 * 4000
    assert started >= 0.5 * 4000


def test_a_peak_long_gone_does_not_hold_the_floor_above_the_demand():
    pace = PrefillPace()
    run(pace, 10, demand=20000, latency=lambda rate: 1.0, slots=1000)  # a peak, loans fine: no pace
    rates, _ = run(pace, 60, demand=4000, latency=lambda rate: 3.3, start=40)  # later, loans over target
    assert pace.floor() <= 0.5 * 4000 * 1.25
    assert rates[-1] == pace.floor()


def test_the_samples_are_kept_to_the_window_when_no_prompt_asks():
    pace = PrefillPace(window_s=10.0)
    for i in range(5000):
        pace.observe(i * 0.01, 1.0, TARGET)
    assert len(pace._samples) <= 10.0 / 0.01 + 1


def test_without_the_cut_only_a_surge_is_spread():
    pace = PrefillPace(burst_s=0.25)
    pace.rate = 10.0  # the loans' latency set a rate of ten tokens a second...
    pace._demand = 4000.0
    pace._delayed_at = pace._changed_at = pace._observed_at = pace._last = 0.0
    assert [pace.delay(t / 4, PROMPT, cut=False) for t in range(8)] == [0.0] * 8  # ...not applied: 2000 a second go
    assert max(pace.delay(2.0, PROMPT, cut=False) for _ in range(20)) > 0  # a surge of 20 at once is still spread
