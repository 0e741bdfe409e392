"""What operators set at run time (a shadow share, a forced breaker, the canary's batch) lives in
the control plane's controls and breaker states, apart from the file: a reload gives the control
plane the file's new settings (server.py's one list of what follows a reload) and leaves what the
operator set as it was. The same through a served sidecar and its admin API:
tests/e2e/test_reload.py."""

from __future__ import annotations

from extproc.control.plane import ControlPlane
from extproc.core.breaker import Permit
from extproc.core.config import parse_config
from extproc.ops.metrics import Metrics
from extproc.stores.control import LocalControlStore

from .test_reload_plan import canary_config, edited


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def plane(data: dict) -> ControlPlane:
    config = parse_config(data)
    return ControlPlane(config, LocalControlStore(config.retries, clock=Clock()), Metrics())


async def test_an_operators_shadow_share_outlives_a_reload_and_the_files_applies_once_cleared():
    control = plane(canary_config())
    assert control.shadow_share == 0.0  # the file's
    assert await control.set_shadow_share(0.5) == 0.5
    control.reconfigure(parse_config(edited(canary_config(), {"shadow.share": 0.2})))
    assert control.shadow_share == 0.5 and control.config.shadow.share == 0.2
    assert await control.set_shadow_share(None) == 0.2  # cleared: the file's, as reloaded
    control.reconfigure(parse_config(edited(canary_config(), {"shadow.share": 0.1})))
    assert control.shadow_share == 0.1


async def test_a_forced_breaker_outlives_a_reload_that_changes_its_thresholds():
    control = plane(canary_config())
    await control.force("fallback", "open")
    control.reconfigure(parse_config(edited(canary_config(), {"pools.fallback.breaker.instant.threshold": 0.5,
                                                              "pools.fallback.breaker.instant.open_s": 5})))
    assert control.breakers["fallback"].settings.instant.open_s == 5  # the file's thresholds and times apply
    assert control.breakers["fallback"].state.forced == "open"
    assert control.permit("fallback")[0] is Permit.NO


async def test_the_canary_batch_outlives_a_reload_and_goes_on_in_the_files_new_order():
    control = plane(canary_config())
    await control.canary_advance()
    await control.canary_advance()
    assert control.controls.canary.digits == "01"
    control.reconfigure(parse_config(edited(canary_config(), {"canary.order": "9876543210"})))
    assert control.controls.canary.digits == "01"
    assert (await control.canary_advance()).digits == "019"  # on, in the new order
