"""The admission gate: one request's life from its headers to its release, over the pure core.

The ext_proc servicer calls `open` (headers), `enqueue` and `wait` (body), `response_started`
(response headers), `fail_over` (when that response is a failure the client has not seen yet)
and `close` (the exchange is over, however it ended). Where each step happens:

- its phase and outcome change in one place, `_perform`, as the request's state machine says
  (core/request_life.py: the table of what each event does in each phase);
- a request is classified and checked in `open`, parsed, checked for its model (core/catalog.py),
  routed (core/routing.py) and put in line or **admitted** in `enqueue`, admitted from the line
  in `wait`; one without a body is passed through, or answered with a model list, in `pass_through`;
- it is **refused** by raising a `Rejection` from refusals.py (attempts.py for retries);
- it is **failed over** in failover.py, **shadowed** in shadow.py, **placed** on a backend in
  placement.py; an admitted long prompt **yields** its engine in yielding.py;
- its slot is **released** in `close`, through slots.py;
- every outcome is recorded and told to the observers (metrics, log, capacity model) in decisions.py.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable, Mapping

from ..control.plane import ControlPlane
from ..core.appointments import ServiceTime, drain_rate
from ..core.breaker import failure_kind, is_failure
from ..core.capacity import check_context, request_cost
from ..core.catalog import check_model, listing, lists_models
from ..core.config import Config
from ..core.events import Observers
from ..core.headers import CLASS, FALLBACK, POOL, PREDICTED_WAIT_MS, PRIORITY, QUEUE_WAIT_MS
from ..core.openai_request import check_size, parse_completion_request, rewritten
from ..core.outcomes import HttpReply, Outcome, Rejection
from ..core.priority import Callers, Classifier
from ..core.request_life import (Ended, FallbackDone, Held, Listed, NoBody, Phase, Placed, Queued, Refused,
                                 ResponseStarted, Routed, SlotGranted, WaitBegun)
from ..core.routing import Route, RoutingView, route
from ..core.tokens import estimate_prompts
from ..ops.metrics import Metrics
from ..stores.queue import Lease, QueueStore, StoreClosed, Waiter, WaitExpired
from .attempts import Attempts
from .decisions import Decisions
from .exchange import Admission, Exchange, ResponsePlan, Tickets, attempt_of, body_changes, remaining_wait
from .failover import HOLD_MARGIN_S, Failover
from .placement import BackendPicker
from .pool_watch import PoolWatch
from .refusals import Refusals
from .prefill_pacing import PaceWait, PrefillPacing
from .relay import Relay
from .request_driver import RequestDriver, end_of
from .shadow import ShadowCopies
from .slots import LaneWait, Slots
from .waiting_room import Appointment, WaitingRoom
from .yielding import LongPromptYields

Start = LaneWait | PaceWait  # a slot, and a wait before the request starts (AdmissionGate._start)


class AdmissionGate:
    def __init__(self, config: Config, store: QueueStore, metrics: Metrics, control: ControlPlane,
                 relay: Relay | None = None, clock: Callable[[], float] = time.monotonic,
                 observers: Observers | None = None, rng: random.Random | None = None,
                 picker: BackendPicker | None = None, long_rule: Callable[[str], str | None] = lambda pool: None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):  # (`sleep`: seconds of `clock`)
        self.config = config
        self._sleep = sleep
        self.store = store
        self.metrics = metrics
        self.control = control
        self.clock = clock
        rng = rng or random.Random()
        self.draining = False
        self.started = int(time.time())  # the `created` of the models it lists (Unix seconds)
        self._callers = Callers(config)
        self._classifier = Classifier(config)
        self._background: set[asyncio.Task] = set()
        self.tickets = Tickets()
        self.observers = observers or Observers()  # who hears what the request path reports (core/events.py)
        self.pools = PoolWatch(config, metrics, clock, self.observers)
        self.pool_changed = self.pools.changed  # the store's callback on every change of a pool
        self.view = RoutingView(store.depth, control.permit, lambda: control.canary_digits, self.pools.ahead)
        self.refusals = Refusals(config, store.depth, self.pools.seconds_to_drain, control.opens_in, rng)
        self.decisions = Decisions(self.observers)
        self.slots = Slots(store, self.observers, picker, clock, sleep)
        self.pacing = PrefillPacing(lambda: self.config, metrics, self.observers, clock, sleep, self.slots.places_apart)
        self.attempts = Attempts(config, control.begin_attempt, self.refusals, self.observers, clock)
        self.service = ServiceTime()
        self.waiting_room = WaitingRoom(store, self.pools.ahead, self._drain_rate,
                                        self.service.mean, self.observers, clock, self.refusals.retry_after)
        # (each decision on a request reads the configuration it arrived under: exchange.config)
        self.failover = Failover(store, relay, self.view, control.record, self.slots, self.tickets,
                                 self.observers, clock, lambda: self.draining, self.decisions.rerouted)
        self.shadow = ShadowCopies(config.pools, store, relay, self.view, lambda: control.shadow_share,
                                   self.slots, self.tickets, self.observers, clock, rng, self._in_background)
        self.driver = RequestDriver(store, self.slots, self.decisions, self.shadow, control, self.service, clock,
                                    self._in_background)
        self._perform = self.driver.perform  # an exchange's phase and outcome change there alone
        self.yields = LongPromptYields(self._perform, clock, long_rule, rng)  # long prompts that give way
        self.picker: BackendPicker | None = self.slots.picker
        self.holding: set[str] = self.slots.holding  # (the same set: exchanges admitted and not yet released)

    def reconfigure(self, config: Config) -> None:
        """Put a reloaded configuration in force for the next decision (ops/reload.py): the
        callers and the classification cache are rebuilt, the retry budget keeps its counts
        under the new settings, the tiers are read again at the current depths. Exchanges
        already in line or in flight are decided under the configuration they arrived under
        (`exchange.config`), to their end; the pool set
        and the class set are the same (a change of either needs a restart)."""
        assert config.pools.keys() == self.config.pools.keys() and config.classes.keys() == self.config.classes.keys()
        self.config = config
        self._callers = Callers(config)
        self._classifier = Classifier(config)
        self.refusals.config = config
        self.attempts.reconfigure(config)
        self.pools.reconfigure(config)

    # -- the request -----------------------------------------------------------------------

    def open(self, headers: Mapping[str, str]) -> Exchange:
        """Headers arrived: identify, classify, check what can be checked. Raises Rejection."""
        if self.draining:
            raise self.refusals.draining()
        authorization = headers.get("authorization")
        caller = self._callers.identify(authorization)
        classification = self._classifier.classify(headers, caller)
        length = headers.get("content-length")
        if length is not None and (length := length.strip()).isdigit():
            check_size(int(length), self.config.limits.max_body_bytes)
        exchange = Exchange(self.tickets.exchange_id(), caller, classification, arrived_at=self.clock(), config=self.config,
                            path=headers.get(":path", "/v1/chat/completions"), method=headers.get(":method"),
                            attempt=attempt_of(headers), authorization=authorization)
        if classification.lowered:
            self.decisions.claims_lowered(exchange)
        return exchange

    def answers_itself(self, exchange: Exchange) -> bool:
        """GET /v1/models where pools list their models: answered in the headers phase, a body or none."""
        return lists_models(exchange.config, exchange.method, exchange.path)

    def pass_through(self, exchange: Exchange) -> HttpReply | None:
        """A request without a body, or one the sidecar answers itself: nothing to admit. Where
        pools list their models, GET /v1/models is answered from the configuration (the reply;
        core/catalog.py). Raises Rejection."""
        reply = listing(exchange.config, exchange.caller, exchange.method, exchange.path, self.started)
        self._perform(exchange, NoBody() if reply is None else Listed())
        return reply

    async def enqueue(self, exchange: Exchange, raw_body: bytes) -> Waiter | Appointment | Start | None:
        """The body arrived: parse it, route it, take a slot (None: admitted), a place in line
        (the Waiter to `wait` with), for a request back before its appointment a hold until then
        (an Appointment), or a slot but not yet its start (a Start: a long prompt without an engine of its
        own, a prompt waiting for its turn on the prefill pace)."""
        started = self.clock()
        try:
            if self.draining:
                raise self.refusals.draining()
            exchange.request = request = parse_completion_request(raw_body, exchange.config.limits.max_body_bytes,
                                                                  exchange.path)
            check_model(exchange.config, exchange.caller, request.model)  # 400, 404 or 403 before any queue
            limits = exchange.config.requests
            prompt_tokens, prompts, longest = estimate_prompts(request.body, request.api)
            exchange.prompt_tokens = prompt_tokens
            check_context(longest, request.max_tokens, limits.default_max_tokens,
                          limits.max_model_len, limits.context_reserve)
            exchange.cost = cost = request_cost(prompt_tokens, request.max_tokens, limits.default_max_tokens,
                                                prompts, request.samples)
            attempt = exchange.attempt
            # (a request that names itself, or counts its attempts, has the attempt ledger's word)
            avoid = await self.attempts.check(exchange, raw_body) if attempt.key or attempt.counted \
                else self.attempts.first(exchange)
            return await self._place(exchange, avoid, may_hold=True)
        except Rejection as rejection:
            self._rejected(exchange, rejection)
            raise
        finally:
            self.decisions.decided_in(self.clock() - started)

    async def _place(self, exchange: Exchange, avoid: str | None, may_hold: bool) -> Waiter | Appointment | Start | None:
        """Route the parsed request and take a slot, a place in line, or (`may_hold`) a hold until
        its appointment; or raise the Rejection that turns it away."""
        assert exchange.request is not None and exchange.cost is not None
        returning = exchange.attempt.returning and exchange.config.queue.appointments  # it keeps its place
        c, cost = exchange.classification, exchange.cost
        chosen = route(c.class_name, c.branch_id, exchange.request.model, exchange.config, self.view, avoid=avoid,
                       cost=cost, returning=returning)
        if chosen.probe is not None and chosen.refusal is None:
            chosen = await self._probe(exchange, chosen, avoid, cost, returning)
        exchange.route_to(chosen)
        self._perform(exchange, Routed())
        turned_away: tuple[Outcome, float] | None = None
        if chosen.refusal in (Outcome.SHED_OVERLOADED, Outcome.SHED_QUEUE_FULL):
            turned_away = (chosen.refusal, 0.0)
        elif chosen.refusal is not None:
            raise self.refusals.for_route(chosen)
        else:
            if chosen.rerouted:
                self.decisions.rerouted(exchange)
            forecast = self.waiting_room.decide_wait(exchange, chosen.pool, returning, self._longest_hold(exchange))
            turned_away = None if forecast is None else (Outcome.DEFERRED, forecast)
        if turned_away is not None:
            rejection = await self.waiting_room.turn_away(exchange, chosen.pool, *turned_away)
            held = self.waiting_room.hold(exchange, chosen.pool, rejection, self._longest_hold(exchange), avoid) \
                if may_hold and returning else None
            if held is None:
                raise rejection
            self._perform(exchange, Held())
            return held
        ticket = self.tickets.ticket(exchange.config, exchange, chosen.pool, exchange.classification.score, cost)
        if ticket.bounded:
            self.yields.arrived(chosen.pool)  # a long prompt in its prefill there gives its engine up
        try:
            result = await self.store.enqueue(chosen.pool, ticket)
        except StoreClosed:
            raise self.refusals.draining() from None
        if isinstance(result, Lease):
            return self._granted(exchange, result)
        exchange.waiter = result
        self._perform(exchange, Queued())
        return result

    def _granted(self, exchange: Exchange, lease: Lease) -> Start | None:
        """A slot: admitted, or a long prompt's LaneWait for an engine of its own (its booked pace turn unwaited),
        else a PaceWait over the prefill pace (`_start` then looks for an engine), else a LaneWait for a spill turn."""
        exchange.lease = self.slots.granted(lease)
        self.slots.holding.add(exchange.id)  # (a drain waits for it from here: it holds a slot)
        lane = self.slots.lane_needed(exchange)
        paced = self.pacing.needed(lease.pool, lease.ticket.bounded, exchange.prompt_tokens)
        start = lane if lane is not None and lease.ticket.long else paced or lane
        self._perform(exchange, SlotGranted(lane_needed=isinstance(start, LaneWait), paced=isinstance(start, PaceWait)))
        return start

    def _longest_hold(self, exchange: Exchange) -> float:
        """The longest Envoy keeps a request the sidecar has not answered (its filter's
        max_message_timeout, as configured), less a margin for the answer."""
        return exchange.config.limits.max_message_timeout_s - HOLD_MARGIN_S

    async def _probe(self, exchange: Exchange, chosen: Route, avoid: str | None, cost: int, returning: bool) -> Route:
        """`chosen` lets the request through as a probe: with the permit, there; without it,
        routed again as if that pool had said no."""
        if await self.control.take_probe(chosen.pool, chosen.probe):
            return chosen
        c = exchange.classification
        return route(c.class_name, c.branch_id, exchange.request.model if exchange.request else None, exchange.config,
                     self.view, avoid=avoid, probe_denied=frozenset({chosen.pool}), cost=cost, returning=returning)

    def _drain_rate(self, pool: str) -> float | None:
        snapshot = self.pools.snapshot(pool)
        return drain_rate(self.pools.drain_rate(pool), snapshot.inflight if snapshot else 0, self.service.mean(pool))

    def hold_seconds(self, exchange: Exchange) -> int:
        """How long Envoy must keep the request while it waits in line."""
        return math.ceil(min(exchange.may_wait_s + HOLD_MARGIN_S, exchange.config.limits.max_message_timeout_s))

    async def wait(self, exchange: Exchange, waiter: Waiter | Appointment | Start) -> None:
        """In line until admitted (or refused: raises Rejection); held until its appointment
        first, then decided again as it would be if it came back then; one that has its slot
        waits for its start (a Start: an engine of its own, its turn on the prefill pace)."""
        if isinstance(waiter, Appointment):
            await self._sleep(max(0.0, waiter.at - self.clock()))
            try:
                placed = await self._place(exchange, waiter.avoid, may_hold=False)
            except Rejection as rejection:
                self._rejected(exchange, rejection)
                raise
            if placed is None:
                return
            waiter = placed
        if isinstance(waiter, (LaneWait, PaceWait)):
            return await self._start(exchange, waiter)
        exchange.waiter = None  # from here the store's wait answers for the ticket, cancelled or not
        self._perform(exchange, WaitBegun())
        try:
            lease = await self.store.wait(waiter, remaining_wait(exchange, self.clock()))
        except WaitExpired:
            raise await self._expired(exchange, waiter.pool) from None
        except StoreClosed:
            rejection = self.refusals.draining()
            self._rejected(exchange, rejection)
            raise rejection from None
        if (start := self._granted(exchange, lease)) is not None:
            await self._start(exchange, start)

    async def _start(self, exchange: Exchange, start: Start) -> None:
        """It has its slot: admitted once it may start, a long prompt when it has an engine of its
        own, a paced one at its turn (or when its wait, or what Envoy holds it, ran out; or the
        sidecar drains: it starts then); refused as expired in line, a long prompt whose wait ran
        out where it would go beside latency-bound requests (Slots.wait_for_lane)."""
        until = self.clock() + max(0.0, min(remaining_wait(exchange, self.clock()), self._longest_hold(exchange)))
        if isinstance(start, PaceWait):
            await self.pacing.wait(start, until, lambda: self.draining)
        if self.slots.lane_needed(exchange) is not None \
                and not await self.slots.wait_for_lane(exchange, until, lambda: self.draining):  # (after its pace)
            raise await self._expired(exchange, start.pool)
        self._perform(exchange, Placed())

    async def _expired(self, exchange: Exchange, pool: str) -> Rejection:
        """Its wait ran out: an appointment, or past its deadline a final answer (counted refused)."""
        rejection = await self.waiting_room.turn_away(exchange, pool, Outcome.EXPIRED_IN_QUEUE)
        self._rejected(exchange, rejection)
        return rejection

    def admission(self, exchange: Exchange) -> Admission:
        """What Envoy is told of an admitted request: its pool, priority and class, and its body
        when the pool's paired model, the engine's priority or a `max_tokens` the client did not
        set changes it (exchange.py: body_changes)."""
        assert exchange.route is not None and exchange.request is not None
        pool = exchange.config.pools[exchange.route.pool]
        headers = ((POOL, pool.cluster), (PRIORITY, f"{exchange.classification.score:g}"),
                   (CLASS, exchange.class_name))
        changes = body_changes(exchange.config, exchange, exchange.route)
        return Admission(headers, rewritten(exchange.request, **changes) if changes else None, exchange.endpoints)

    def _rejected(self, exchange: Exchange, rejection: Rejection) -> None:
        self._perform(exchange, Refused(rejection.outcome))

    def refused(self, exchange: Exchange | None, rejection: Rejection) -> dict | None:
        """The decision record of a request answered with `rejection`, counted and recorded exactly
        once: where the gate decided it already, or it was counted admitted, nothing changes."""
        if exchange is None:  # before an exchange existed (bad headers, 401)
            return self.decisions.count_rejection("unclassified", rejection)
        self._perform(exchange, Refused(rejection.outcome))
        return exchange.decision

    # -- the response ----------------------------------------------------------------------

    def response_started(self, exchange: Exchange, status: int, details: str = "", upstream: str = "") -> ResponsePlan:
        """Response headers arrived (from upstream, or Envoy's own reply): count the outcome,
        and decide whether the client gets them or an answer from the fallback pool. `upstream`:
        the backend that answered (Envoy's `upstream.address`), where it really ran."""
        exchange.upstream_status = status
        self.yields.ended(exchange)
        chosen = exchange.route
        if chosen is None or exchange.phase is not Phase.ADMITTED:
            self._perform(exchange, ResponseStarted())  # Envoy's own reply: nothing was admitted
            return ResponsePlan(())
        failed = is_failure(status)
        if failed:
            exchange.failover.failed_in = chosen.pool
        fail_over = failed and self.failover.possible(exchange)  # if the fallback cannot answer, the failure stands
        # Its response came: the machine hears it first, so whatever fails below is not its client leaving.
        self._perform(exchange, ResponseStarted(fail_over=fail_over))
        if upstream and exchange.endpoints is not None:  # (placed by the sidecar: it may have run elsewhere)
            self.slots.ran_on(exchange, upstream)
        streamed = exchange.request is not None and exchange.request.stream
        self.decisions.answered(chosen.pool, status)
        now = self.clock()
        # a failure of an engine stopped under it is the drain's, not the pool's: counted apart
        kind = failure_kind(status, details) if failed else "success"
        if not (failed and chosen.probe is None and self.slots.failed_on_leaving_engine(exchange, upstream, kind)):
            self.control.record(chosen.pool, failed, chosen.probe, kind)
        headers: tuple[tuple[str, str], ...] = ((QUEUE_WAIT_MS, str(round(exchange.queue_wait_s * 1000))),)
        if exchange.forecast_wait_s is not None:
            headers += ((PREDICTED_WAIT_MS, str(round(exchange.forecast_wait_s * 1000))),)
        if fail_over:
            return ResponsePlan(headers, fail_over=True, finished=not streamed)
        self.decisions.first_byte(exchange, now, succeeded=not failed)
        if chosen.rerouted:
            headers += ((FALLBACK, "true"),)
        if exchange.shadowed:
            self.shadow.response_started(exchange, status)
        read_body = exchange.shadowed and not failed and not streamed
        return ResponsePlan(headers, read_body=read_body, finished=not streamed and not read_body)

    @staticmethod
    def reads_attributes(exchange: Exchange, status: int) -> bool:
        """Whether `response_started` reads the response's attributes (code details, upstream
        address): the details name a failure's kind, the address moves a request the sidecar
        placed. A success of a pool that does not pick needs neither, and reading them costs."""
        return exchange.endpoints is not None or is_failure(status)

    def failover_hold_seconds(self, exchange: Exchange) -> int:
        return self.failover.hold_seconds(exchange)

    async def fail_over(self, exchange: Exchange) -> HttpReply | None:
        """The fallback pool's answer to a failed attempt; None: nothing better, pass the failure on."""
        reply = await self.failover.answer(exchange)
        self._perform(exchange, FallbackDone())
        self.decisions.first_byte(exchange, self.clock(), succeeded=False)  # the fallback's answer, or the failure
        return reply

    def response_body(self, exchange: Exchange, body: bytes) -> None:
        self.shadow.response_body(exchange, body)

    # -- the end ---------------------------------------------------------------------------

    async def close(self, exchange: Exchange) -> None:
        """The exchange is over, however it ended: release its slot exactly once.

        Who ended it is told by what Envoy sent, never by how the stream closed (a reset or a
        half-close says nothing: tests/e2e/test_envoy_stream.py). Envoy turns every upstream failure
        before the response (connect failure, reset, timeout, no healthy host, overflow) into
        response headers of its own, which `response_started` counts; an exchange that ends
        without response headers was ended by its client (or by Envoy going away), so it is a
        cancellation, never an upstream failure: it cannot move a breaker.

        Envoy resets the stream when an exchange ends, which may cancel the task running this
        at any await: the release is handed over before the first one, and what follows it
        (the attempt ledger, a probe permit) runs in a task of its own."""
        try:
            self._perform(exchange, Ended())  # every end releases (core/request_life.py): below, whatever fails
        finally:
            self.yields.ended(exchange)
            await self.slots.release(exchange, end_of(exchange))  # the first await: nothing above may suspend

    def _in_background(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        """Stop admitting: new requests and everyone in line get 503 with retry-after."""
        self.draining = True
        self.metrics.serving.set(0)
        await self.store.close()

