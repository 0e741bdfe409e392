from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Window(_message.Message):
    __slots__ = ("window", "requests", "failures", "failure_ratio", "tripped")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    FAILURE_RATIO_FIELD_NUMBER: _ClassVar[int]
    TRIPPED_FIELD_NUMBER: _ClassVar[int]
    window: str
    requests: int
    failures: int
    failure_ratio: float
    tripped: bool
    def __init__(self, window: _Optional[str] = ..., requests: _Optional[int] = ..., failures: _Optional[int] = ..., failure_ratio: _Optional[float] = ..., tripped: _Optional[bool] = ...) -> None: ...

class Breaker(_message.Message):
    __slots__ = ("instant", "open_for_s", "rerouting", "paged", "paged_for_s", "forced", "windows")
    INSTANT_FIELD_NUMBER: _ClassVar[int]
    OPEN_FOR_S_FIELD_NUMBER: _ClassVar[int]
    REROUTING_FIELD_NUMBER: _ClassVar[int]
    PAGED_FIELD_NUMBER: _ClassVar[int]
    PAGED_FOR_S_FIELD_NUMBER: _ClassVar[int]
    FORCED_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    instant: str
    open_for_s: float
    rerouting: bool
    paged: bool
    paged_for_s: float
    forced: str
    windows: _containers.RepeatedCompositeFieldContainer[Window]
    def __init__(self, instant: _Optional[str] = ..., open_for_s: _Optional[float] = ..., rerouting: _Optional[bool] = ..., paged: _Optional[bool] = ..., paged_for_s: _Optional[float] = ..., forced: _Optional[str] = ..., windows: _Optional[_Iterable[_Union[Window, _Mapping]]] = ...) -> None: ...

class Pool(_message.Message):
    __slots__ = ("name", "cluster", "fallback", "queue_depth", "queue_depth_by_class", "inflight", "max_inflight", "inflight_tokens", "token_budget", "tier", "breaker", "engine_picks", "draining_engines", "long_prompts", "long_quiet_s")
    class QueueDepthByClassEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_BY_CLASS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BREAKER_FIELD_NUMBER: _ClassVar[int]
    ENGINE_PICKS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_ENGINES_FIELD_NUMBER: _ClassVar[int]
    LONG_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    LONG_QUIET_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    cluster: str
    fallback: str
    queue_depth: int
    queue_depth_by_class: _containers.ScalarMap[str, int]
    inflight: int
    max_inflight: int
    inflight_tokens: int
    token_budget: int
    tier: str
    breaker: Breaker
    engine_picks: str
    draining_engines: _containers.RepeatedCompositeFieldContainer[DrainingEngine]
    long_prompts: str
    long_quiet_s: float
    def __init__(self, name: _Optional[str] = ..., cluster: _Optional[str] = ..., fallback: _Optional[str] = ..., queue_depth: _Optional[int] = ..., queue_depth_by_class: _Optional[_Mapping[str, int]] = ..., inflight: _Optional[int] = ..., max_inflight: _Optional[int] = ..., inflight_tokens: _Optional[int] = ..., token_budget: _Optional[int] = ..., tier: _Optional[str] = ..., breaker: _Optional[_Union[Breaker, _Mapping]] = ..., engine_picks: _Optional[str] = ..., draining_engines: _Optional[_Iterable[_Union[DrainingEngine, _Mapping]]] = ..., long_prompts: _Optional[str] = ..., long_quiet_s: _Optional[float] = ...) -> None: ...

class DrainingEngine(_message.Message):
    __slots__ = ("engine", "reason", "state", "requests", "tokens", "for_s", "deadline_in_s", "gone", "landed")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FOR_S_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_IN_S_FIELD_NUMBER: _ClassVar[int]
    GONE_FIELD_NUMBER: _ClassVar[int]
    LANDED_FIELD_NUMBER: _ClassVar[int]
    engine: str
    reason: str
    state: str
    requests: int
    tokens: int
    for_s: float
    deadline_in_s: float
    gone: bool
    landed: int
    def __init__(self, engine: _Optional[str] = ..., reason: _Optional[str] = ..., state: _Optional[str] = ..., requests: _Optional[int] = ..., tokens: _Optional[int] = ..., for_s: _Optional[float] = ..., deadline_in_s: _Optional[float] = ..., gone: _Optional[bool] = ..., landed: _Optional[int] = ...) -> None: ...

class Canary(_message.Message):
    __slots__ = ("pool", "digits", "batch", "order", "rolled_back", "rollback_reason")
    POOL_FIELD_NUMBER: _ClassVar[int]
    DIGITS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    ROLLED_BACK_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    pool: str
    digits: _containers.RepeatedScalarFieldContainer[str]
    batch: int
    order: str
    rolled_back: bool
    rollback_reason: str
    def __init__(self, pool: _Optional[str] = ..., digits: _Optional[_Iterable[str]] = ..., batch: _Optional[int] = ..., order: _Optional[str] = ..., rolled_back: _Optional[bool] = ..., rollback_reason: _Optional[str] = ...) -> None: ...

class State(_message.Message):
    __slots__ = ("replica", "shared", "draining", "pools", "canary", "shadow_share", "shadow_share_by_operator")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    CANARY_FIELD_NUMBER: _ClassVar[int]
    SHADOW_SHARE_FIELD_NUMBER: _ClassVar[int]
    SHADOW_SHARE_BY_OPERATOR_FIELD_NUMBER: _ClassVar[int]
    replica: str
    shared: bool
    draining: bool
    pools: _containers.RepeatedCompositeFieldContainer[Pool]
    canary: Canary
    shadow_share: float
    shadow_share_by_operator: bool
    def __init__(self, replica: _Optional[str] = ..., shared: _Optional[bool] = ..., draining: _Optional[bool] = ..., pools: _Optional[_Iterable[_Union[Pool, _Mapping]]] = ..., canary: _Optional[_Union[Canary, _Mapping]] = ..., shadow_share: _Optional[float] = ..., shadow_share_by_operator: _Optional[bool] = ...) -> None: ...

class SetBreakerRequest(_message.Message):
    __slots__ = ("pool", "action")
    class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ACTION_UNSPECIFIED: _ClassVar[SetBreakerRequest.Action]
        FORCE_OPEN: _ClassVar[SetBreakerRequest.Action]
        FORCE_CLOSED: _ClassVar[SetBreakerRequest.Action]
        RESET: _ClassVar[SetBreakerRequest.Action]
    ACTION_UNSPECIFIED: SetBreakerRequest.Action
    FORCE_OPEN: SetBreakerRequest.Action
    FORCE_CLOSED: SetBreakerRequest.Action
    RESET: SetBreakerRequest.Action
    POOL_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    pool: str
    action: SetBreakerRequest.Action
    def __init__(self, pool: _Optional[str] = ..., action: _Optional[_Union[SetBreakerRequest.Action, str]] = ...) -> None: ...

class SetCanaryRequest(_message.Message):
    __slots__ = ("action",)
    class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ACTION_UNSPECIFIED: _ClassVar[SetCanaryRequest.Action]
        ADVANCE: _ClassVar[SetCanaryRequest.Action]
        ROLL_BACK: _ClassVar[SetCanaryRequest.Action]
    ACTION_UNSPECIFIED: SetCanaryRequest.Action
    ADVANCE: SetCanaryRequest.Action
    ROLL_BACK: SetCanaryRequest.Action
    ACTION_FIELD_NUMBER: _ClassVar[int]
    action: SetCanaryRequest.Action
    def __init__(self, action: _Optional[_Union[SetCanaryRequest.Action, str]] = ...) -> None: ...

class SetShadowShareRequest(_message.Message):
    __slots__ = ("share", "clear")
    SHARE_FIELD_NUMBER: _ClassVar[int]
    CLEAR_FIELD_NUMBER: _ClassVar[int]
    share: float
    clear: bool
    def __init__(self, share: _Optional[float] = ..., clear: _Optional[bool] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("exchanges_in_flight",)
    EXCHANGES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    exchanges_in_flight: int
    def __init__(self, exchanges_in_flight: _Optional[int] = ...) -> None: ...

class DrainEngineRequest(_message.Message):
    __slots__ = ("pool", "engine", "deadline_s")
    POOL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    pool: str
    engine: str
    deadline_s: float
    def __init__(self, pool: _Optional[str] = ..., engine: _Optional[str] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class UndrainEngineRequest(_message.Message):
    __slots__ = ("pool", "engine")
    POOL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    pool: str
    engine: str
    def __init__(self, pool: _Optional[str] = ..., engine: _Optional[str] = ...) -> None: ...

class ReloadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ConfigChange(_message.Message):
    __slots__ = ("key", "old_value", "new_value", "restart_reason")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OLD_VALUE_FIELD_NUMBER: _ClassVar[int]
    NEW_VALUE_FIELD_NUMBER: _ClassVar[int]
    RESTART_REASON_FIELD_NUMBER: _ClassVar[int]
    key: str
    old_value: str
    new_value: str
    restart_reason: str
    def __init__(self, key: _Optional[str] = ..., old_value: _Optional[str] = ..., new_value: _Optional[str] = ..., restart_reason: _Optional[str] = ...) -> None: ...

class ReloadResponse(_message.Message):
    __slots__ = ("accepted", "version", "previous_version", "changes", "needs_restart", "refused_reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    NEEDS_RESTART_FIELD_NUMBER: _ClassVar[int]
    REFUSED_REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    version: str
    previous_version: str
    changes: _containers.RepeatedCompositeFieldContainer[ConfigChange]
    needs_restart: _containers.RepeatedCompositeFieldContainer[ConfigChange]
    refused_reason: str
    def __init__(self, accepted: _Optional[bool] = ..., version: _Optional[str] = ..., previous_version: _Optional[str] = ..., changes: _Optional[_Iterable[_Union[ConfigChange, _Mapping]]] = ..., needs_restart: _Optional[_Iterable[_Union[ConfigChange, _Mapping]]] = ..., refused_reason: _Optional[str] = ...) -> None: ...
