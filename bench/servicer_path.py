"""The request path through the sidecar's servicer, without gRPC or Envoy: what its decisions
cost in its own process, read far more steadily than `extproc bench overhead` can on a busy
machine.

    python bench/servicer_path.py [--exchanges 3000] [--rounds 7]
    python bench/servicer_path.py --instructions    # machine instructions per exchange (valgrind)

Each exchange is what Envoy sends for an admitted, non-streamed completion (request headers with
the attributes the template asks for, the buffered body, response headers), driven through
`ExtProcServicer.Process` as gRPC drives it, every answer read. Three setups, side by side:

- `passthrough`: the benchmark's pass-through, answering as the sidecar answers
  (testbed/extproc_testbed/passthrough.py), deciding nothing;
- `sidecar`: the sidecar at the default log level (decision lines on, written to /dev/null),
  configured as `extproc bench overhead` configures it (no shadow copies, room for every request);
- `sidecar_log_off`: the same at `warning`;
- `sidecar_redis`: the sidecar with the Redis queue (a redis-server of its own, started here),
  at the default log level. Its CPU is this process's only: Redis's own is not in it.

`--concurrent N` keeps N exchanges in flight at once (1 by default): under load the Redis
store sends the calls of one loop turn together, which one exchange at a time never shows.

CPU: the process's time per exchange (its log writer's thread included) over `--rounds` rounds,
the best and the median. Instructions (`--instructions`, needs valgrind): the same exchanges
counted by callgrind, the difference between two runs of different lengths, so the start is
left out; they repeat to within half a per cent. Neither counts gRPC, Envoy, or what the
real server's other threads cost the main one: compare setups within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.struct_pb2 import Struct

BODY = json.dumps({"model": "deepseek-sim", "messages": [{"role": "user", "content": "Is ticket 1234 resolved?"}],
                   "max_tokens": 1}).encode()
SETUPS = ("passthrough", "sidecar", "sidecar_log_off", "sidecar_redis")


def _headers(pairs: list[tuple[str, str]]) -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]))


def _attributes(values: dict) -> dict[str, Struct]:
    struct = Struct()
    struct.update(values)
    return {"envoy.filters.http.ext_proc": struct}


def exchange_messages() -> list[pb.ProcessingRequest]:
    """The messages of one exchange, as Envoy sends them for `extproc bench overhead`'s load
    (wrk's POST: no client request id, so no attempt ledger)."""
    # Only the headers the sidecar reads: envoy/envoy.yaml's forward_rules keep Envoy's own
    # (:authority, :scheme, x-forwarded-proto...) and wrk's content-type from it.
    request = _headers([(":method", "POST"), (":path", "/v1/chat/completions"), ("content-length", str(len(BODY))),
                        ("x-ticket-type", "complaint")])
    response = _headers([(":status", "200")])
    return [
        pb.ProcessingRequest(request_headers=request),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY, end_of_stream=True)),
        pb.ProcessingRequest(response_headers=response, attributes=_attributes(
            {"response.code_details": "via_upstream", "upstream.address": "127.0.0.1:8000"})),
    ]


class Setup:
    """The servicer of `setup`; a sidecar is built as `extproc serve` builds it, its store
    started (for Redis: the pools' limits written), its other background loops not run."""

    def __init__(self, setup: str):
        self.setup = setup
        self.server = self.redis = None

    async def __aenter__(self):
        if self.setup == "passthrough":
            from extproc_testbed.passthrough import AnswersLikeSidecar

            return AnswersLikeSidecar()
        from extproc.core.config import parse_config
        from extproc.envoy.servicer import ExtProcServicer
        from extproc.server import SidecarServer
        from extproc_testbed.overhead import sidecar_config

        level = logging.WARNING if self.setup.endswith("log_off") else logging.INFO
        for name in ("", "extproc"):
            logging.getLogger(name).setLevel(level)
        redis_url = None
        if self.setup == "sidecar_redis":
            from extproc_testbed.redis_server import RedisServer

            self.redis = RedisServer(Path(tempfile.mkdtemp(prefix="servicer-path-redis-"))).start()
            redis_url = self.redis.url
        config = sidecar_config(max_inflight=128, redis_url=redis_url)
        config["listen"] = {"host": "127.0.0.1", "grpc_port": 0, "metrics_port": 0}
        config["admin"] = {"port": 0}
        self.server = SidecarServer(parse_config(config))
        await self.server.store.start()
        return ExtProcServicer(self.server.gate)

    def flush(self) -> None:
        """Write the decision lines buffered so far (a sidecar's)."""
        if self.server is not None:
            self.server.decision_log.flush()

    async def __aexit__(self, *_):
        if self.server is not None:
            self.flush()
            await self.server.store.stop()
        if self.redis is not None:
            self.redis.kill()


async def run_exchanges(servicer, exchanges: list[list[pb.ProcessingRequest]], concurrent: int = 1) -> int:
    """Drive every exchange to its end, `concurrent` at a time; return how many answers came back."""
    from extproc_testbed.stream_context import StreamContext

    answers = 0

    async def one(batch):
        nonlocal answers
        context = StreamContext(batch)
        await servicer.Process(None, context)
        answers += len(context.written)

    for start in range(0, len(exchanges), concurrent):
        wave = exchanges[start:start + concurrent]
        if concurrent == 1:
            await one(wave[0])
        else:
            await asyncio.gather(*(one(batch) for batch in wave))
    return answers


async def time_setup(setup: str, exchanges: int, rounds: int, concurrent: int = 1) -> dict:
    async with Setup(setup) as servicer:
        await run_exchanges(servicer, [exchange_messages() for _ in range(min(exchanges, 2000))], concurrent)  # warm up
        per_exchange = []
        for _ in range(rounds):
            batch = [exchange_messages() for _ in range(exchanges)]
            started = time.process_time()
            answers = await run_exchanges(servicer, batch, concurrent)
            per_exchange.append((time.process_time() - started) / exchanges * 1e6)
            if answers != 3 * exchanges:
                raise SystemExit(f"{setup}: {answers} answers to {exchanges} exchanges (3 each expected)")
    return {"best_us": round(min(per_exchange), 1), "median_us": round(statistics.median(per_exchange), 1)}


async def counted_run(setup: str, exchanges: int, concurrent: int) -> None:
    """Under callgrind: count only the exchanges (instrumentation on around them)."""
    built = Setup(setup)
    async with built as servicer:
        await run_exchanges(servicer, [exchange_messages() for _ in range(300)], concurrent)
        batch = [exchange_messages() for _ in range(exchanges)]
        subprocess.run(["callgrind_control", "--instr=on", str(os.getpid())], capture_output=True, check=False)
        time.sleep(0.5)  # callgrind takes the command at its next check
        await run_exchanges(servicer, batch, concurrent)
        built.flush()  # the decision lines the exchanges wrote
        subprocess.run(["callgrind_control", "--instr=off", str(os.getpid())], capture_output=True, check=False)


def instructions_per_exchange(setup: str, concurrent: int, short: int = 200, long: int = 600) -> int:
    def collected(n: int) -> int:
        out = subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no", "--callgrind-out-file=/dev/null",
                              sys.executable, __file__, "--counted", setup, "--exchanges", str(n),
                              "--concurrent", str(concurrent)],
                             capture_output=True, text=True, check=True).stderr
        return int(re.search(r"Collected : (\d+)", out).group(1))

    return round((collected(long) - collected(short)) / (long - short))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exchanges", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--concurrent", type=int, default=1, help="exchanges in flight at once")
    parser.add_argument("--setups", default=",".join(SETUPS), help="which setups, comma-separated")
    parser.add_argument("--instructions", action="store_true", help="count machine instructions (valgrind)")
    parser.add_argument("--counted", choices=SETUPS, help=argparse.SUPPRESS)  # the run valgrind counts
    args = parser.parse_args()
    if args.instructions and (shutil.which("valgrind") is None or shutil.which("callgrind_control") is None):
        raise SystemExit("--instructions needs valgrind (apt-get install valgrind)")
    stderr, sys.stderr = sys.stderr, open(os.devnull, "w")  # the decision lines: nothing to read here
    try:
        if args.counted:
            asyncio.run(counted_run(args.counted, args.exchanges, args.concurrent))
            return
        setups = args.setups.split(",")
        unknown = set(setups) - set(SETUPS)
        if unknown:
            raise SystemExit(f"unknown setups: {', '.join(sorted(unknown))} (known: {', '.join(SETUPS)})")
        if args.instructions:
            report = {setup: {"instructions": instructions_per_exchange(setup, args.concurrent)} for setup in setups}
        else:
            report = {setup: asyncio.run(time_setup(setup, args.exchanges, args.rounds, args.concurrent))
                      for setup in setups}
    finally:
        sys.stderr = stderr
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
