"""`extproc admin ...`: a command-line client of the operator API, and how it prints state."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict

from ..admin.v1 import admin_pb2 as pb
from ..admin.v1 import admin_pb2_grpc as pb_grpc
from .state import long_prompts_said

TOKEN_ENV = "EXTPROC_ADMIN_TOKEN"


def format_state(state: pb.State) -> str:
    lines = [f"replica {state.replica}{'  (state shared through Redis)' if state.shared else ''}"
             f"{'  DRAINING' if state.draining else ''}"]
    lines.append(f"{'pool':<10}{'tier':<8}{'queue':>6}{'inflight':>10}{'tokens':>16}  breaker")
    for pool in state.pools:
        b = pool.breaker
        levels = [f"instant {b.instant}" + (f" ({b.open_for_s:.0f}s left)" if b.instant == "open" else "")]
        if b.rerouting:
            levels.append(f"rerouting to {pool.fallback or 'nowhere'}")
        if b.paged:
            levels.append(f"PAGED {b.paged_for_s:.0f}s ago")
        if b.forced:
            levels.append(f"forced {b.forced}")
        budget = "-" if pool.token_budget < 0 else str(pool.token_budget)
        lines.append(f"{pool.name:<10}{pool.tier:<8}{pool.queue_depth:>6}{f'{pool.inflight}/{pool.max_inflight}':>10}"
                     f"{f'{pool.inflight_tokens}/{budget}':>16}  {', '.join(levels)}")
        windows = "  ".join(f"{w.window} {w.failures}/{w.requests}{' TRIPPED' if w.tripped else ''}" for w in b.windows)
        by_class = ", ".join(f"{k} {v}" for k, v in sorted(pool.queue_depth_by_class.items()))
        lines.append(f"{'':<10}failures {windows}" + (f"; waiting: {by_class}" if by_class else ""))
        if pool.engine_picks == "ignored":
            lines.append(f"{'':<10}ENGINE PICKS IGNORED: Envoy balances {pool.cluster} by a policy of its own "
                         "(extproc check-config --envoy)")
        elif pool.engine_picks:
            lines.append(f"{'':<10}engine picks {pool.engine_picks}")
        if said := long_prompts_said(pool.long_prompts or None, pool.long_quiet_s):
            lines.append(f"{'':<10}long prompts: {said}")
        lines += [f"{'':<10}{engine_line(d)}" for d in pool.draining_engines]
    c = state.canary
    if c.pool:
        rolled = f"  ROLLED BACK: {c.rollback_reason}" if c.rolled_back else ""
        lines.append(f"canary {c.pool}: batch {c.batch}/{len(c.order)}, digits {','.join(c.digits) or 'none'}{rolled}")
    by_operator = "  (set at run time: `extproc admin shadow clear` for the file's)"
    lines.append(f"shadow share {state.shadow_share:g}{by_operator if state.shadow_share_by_operator else ''}")
    return "\n".join(lines)


def engine_line(d: pb.DrainingEngine) -> str:
    """One draining engine: why, what it still runs, and what may be done with it."""
    why = "drained by an operator" if d.reason == "operator" else "gone from the pool's engines"
    if d.reason == "operator" and d.gone:
        why += ", gone since"
    running = f"{d.requests} request(s) running, {d.tokens} tokens"
    if d.landed:  # Envoy's retries past the engines the sidecar named
        running += f", {d.landed} ran there unplaced"
    state = {"idle": "IDLE: runs nothing, may be stopped",
             "overdue": f"OVERDUE by {-d.deadline_in_s:.0f}s: {running}; stopped, they go to the pool's other engines",
             }.get(d.state, f"{running}, deadline in {d.deadline_in_s:.0f}s")
    return f"draining {d.engine} ({why}, for {d.for_s:.0f}s): {state}"


def format_reload(result: pb.ReloadResponse) -> str:
    if not result.accepted:
        lines = [f"refused: {result.refused_reason}"]  # (it names each key that needs a restart, and why)
        lines += [f"  {c.key}: {c.old_value} → {c.new_value}" for c in result.needs_restart]
        return "\n".join(lines + [f"version {result.version} stays in force"])
    if not result.changes:
        return f"no change: version {result.version} stays in force"
    lines = [f"version {result.version} in force (previous {result.previous_version})"]
    lines += [f"  {c.key}: {c.old_value} → {c.new_value}" for c in result.changes]
    return "\n".join(lines)


def shadow_share(text: str) -> float | str:
    """`extproc admin shadow`'s argument: a share, or `clear`."""
    return text if text == "clear" else float(text)


def deadline_s(text: str) -> float:
    """`extproc admin engine drain --deadline-s`: a finite number of seconds above 0."""
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"a finite number of seconds above 0, not {text!r}")
    return value


def _token(path: str | None) -> str | None:
    if path:
        return Path(path).read_text("utf-8").strip()
    return os.environ.get(TOKEN_ENV) or None


class ClientTlsError(Exception):
    """The TLS flags cannot make a channel; the message says why."""


def _channel(args) -> grpc.Channel:
    """TLS (admin.tls) when any TLS flag is given: the sidecar's certificate checked against
    --ca-file (the system's roots without it), this client's certificate presented when given.
    Plain only without any: a certificate given without a CA must never send the token in clear."""
    if args.ca_file is None and args.cert_file is None and args.key_file is None:
        return grpc.insecure_channel(args.address)
    if (args.cert_file is None) != (args.key_file is None):
        given, missing = ("--cert-file", "--key-file") if args.key_file is None else ("--key-file", "--cert-file")
        raise ClientTlsError(f"{given} needs {missing}: a client certificate is presented with its private key")

    def read(flag: str, path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as error:
            raise ClientTlsError(f"{flag}: cannot read {path}: {error.strerror}") from None

    credentials = grpc.ssl_channel_credentials(read("--ca-file", args.ca_file), read("--key-file", args.key_file),
                                               read("--cert-file", args.cert_file))
    return grpc.secure_channel(args.address, credentials)


def run(args) -> int:
    token = _token(args.token_file)
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    try:
        channel = _channel(args)
    except ClientTlsError as error:
        print(f"extproc admin: {error}", file=sys.stderr)
        return 2
    with channel:
        stub = pb_grpc.AdminStub(channel)
        try:
            if args.admin_command == "state":
                result = stub.GetState(pb.GetStateRequest(), metadata=metadata, timeout=5)
            elif args.admin_command == "breaker":
                action = {"open": pb.SetBreakerRequest.FORCE_OPEN, "closed": pb.SetBreakerRequest.FORCE_CLOSED,
                          "reset": pb.SetBreakerRequest.RESET}[args.action]
                result = stub.SetBreaker(pb.SetBreakerRequest(pool=args.pool, action=action), metadata=metadata, timeout=5)
            elif args.admin_command == "canary":
                action = {"advance": pb.SetCanaryRequest.ADVANCE, "rollback": pb.SetCanaryRequest.ROLL_BACK}[args.action]
                result = stub.SetCanary(pb.SetCanaryRequest(action=action), metadata=metadata, timeout=5)
            elif args.admin_command == "shadow":
                cleared = args.share == "clear"
                request = pb.SetShadowShareRequest(clear=True) if cleared else pb.SetShadowShareRequest(share=args.share)
                result = stub.SetShadowShare(request, metadata=metadata, timeout=5)
            elif args.admin_command == "reload":
                result = stub.Reload(pb.ReloadRequest(), metadata=metadata, timeout=30)
            elif args.admin_command == "engine" and args.action == "drain":
                request = pb.DrainEngineRequest(pool=args.pool, engine=args.engine, deadline_s=args.deadline_s or 0)
                result = stub.DrainEngine(request, metadata=metadata, timeout=30)
            elif args.admin_command == "engine":
                request = pb.UndrainEngineRequest(pool=args.pool, engine=args.engine)
                result = stub.UndrainEngine(request, metadata=metadata, timeout=30)
            else:
                drained = stub.Drain(pb.DrainRequest(), metadata=metadata, timeout=5)
                print(f"draining: {drained.exchanges_in_flight} admitted exchanges still running")
                return 0
        except grpc.RpcError as error:
            print(f"extproc admin: {error.code().name}: {error.details()}", file=sys.stderr)
            return 2
    refused = args.admin_command == "reload" and not result.accepted
    if getattr(args, "json", False):
        print(json.dumps(MessageToDict(result, preserving_proto_field_name=True), indent=2))
    elif args.admin_command == "reload":
        print(format_reload(result), file=sys.stderr if refused else sys.stdout)
    else:
        print(format_state(result))
    return 1 if refused else 0


def add_parser(sub) -> None:
    admin = sub.add_parser("admin", help="read and act on a running sidecar (the operator API)")
    admin.add_argument("--address", default="127.0.0.1:50071", help="the sidecar's admin API (admin.host:admin.port)")
    admin.add_argument("--token-file", help=f"file holding the admin token (default: ${TOKEN_ENV})")
    admin.add_argument("--ca-file", help="TLS (admin.tls): the CA that signed the sidecar's certificate "
                       "(default, when --cert-file is given: the system's roots)")
    admin.add_argument("--cert-file", help="TLS: this client's certificate, for admin.tls.require_client_cert "
                       "(with --key-file)")
    admin.add_argument("--key-file", help="TLS: this client's private key (with --cert-file)")
    commands = admin.add_subparsers(dest="admin_command", required=True)
    state = commands.add_parser("state", help="queues, in-flight, limits, tiers, breakers, canary, shadow share")
    state.add_argument("--json", action="store_true")
    breaker = commands.add_parser("breaker", help="force a pool's breaker open or closed, or reset it")
    breaker.add_argument("pool")
    breaker.add_argument("action", choices=["open", "closed", "reset"])
    canary = commands.add_parser("canary", help="advance the canary by one batch, or roll the last one back")
    canary.add_argument("action", choices=["advance", "rollback"])
    shadow = commands.add_parser("shadow", help="set the shadow share (0..1), in force over the file's "
                                 "shadow.share until cleared")
    shadow.add_argument("share", type=shadow_share, help="0..1, or `clear`: the file's shadow.share applies again")
    commands.add_parser("drain", help="stop admitting; admitted exchanges finish")
    engine = commands.add_parser("engine", help="drain one engine of a pool before it is stopped (it gets no new "
                                 "request; what it runs finishes), or take a drained one back")
    engine.add_argument("action", choices=["drain", "undrain"])
    engine.add_argument("pool")
    engine.add_argument("engine", help="IP:PORT, as `extproc admin state` and Envoy's hosts name it")
    engine.add_argument("--deadline-s", type=deadline_s, help="how long it may run what it holds "
                        "(default: the configuration's engine_drain.deadline_s)")
    engine.add_argument("--json", action="store_true")
    reload = commands.add_parser("reload", help="read the configuration file again and apply it (as SIGHUP does); "
                                 "exit 1 when refused")
    reload.add_argument("--json", action="store_true")
    admin.set_defaults(func=run)
