"""The one entry point: `visor core|gateway|ask|demo|eval|bench|cache|model ...`.

Each command imports only what it needs, so `visor ask` and `visor gateway` never import torch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shared import logs, secret
from shared.config import ConfigError, LogConfig, build, environ, read_file


def _core(args: argparse.Namespace) -> int:
    from core.config import CacheConfig, CoreConfig, SchedulerConfig

    data, env = read_file(args.config), environ()
    cfg = build(CoreConfig, "core", data, env)
    cache = build(CacheConfig, "cache", data, env)
    sched = build(SchedulerConfig, "scheduler", data, env)
    keys = _deployment_keys(data, env)
    logs.configure("core", _log_level(data, env), keys.log_key)
    from core import server
    from core.model.config import ModelConfigError

    try:
        asyncio.run(server.run(cfg, cache, sched, keys.core_token))
    except ModelConfigError as exc:  # a checkpoint this core cannot serve: one line, no trace
        logs.get("core").error("model_unsupported", config_error=str(exc))
        return 2
    return 0


def _gateway(args: argparse.Namespace) -> int:
    from gateway.config import GatewayConfig, LimitsConfig
    from gateway.tenants import ConfigFile, tenants_from

    data, env = read_file(args.config), environ()
    cfg = build(GatewayConfig, "gateway", data, env)
    lim = build(LimitsConfig, "limits", data, env)
    tenants_from(data, cfg, lim)  # every section is checked before anything starts
    if getattr(args, "check_sandbox", False):
        logs.configure("gateway", _log_level(data, env))
        from gateway import server

        return server.check_sandbox(cfg, lim)
    keys = _deployment_keys(data, env)
    logs.configure("gateway", _log_level(data, env), keys.log_key)
    from gateway import server

    asyncio.run(server.run(cfg, lim, ConfigFile(args.config, data), keys.core_token))
    return 0


def _log_level(data: dict[str, Any], env: Mapping[str, str]) -> str:
    return build(LogConfig, "log", data, env).level


def _deployment_keys(data: dict[str, Any], env: Mapping[str, str]) -> secret.DeploymentKeys:
    return secret.load(build(secret.DeploymentConfig, "deployment", data, env))


def _ask(args: argparse.Namespace) -> int:
    from visor import errors
    from visor.client import Client
    from visor.request import Answer

    media = [Path(p).read_bytes() for p in args.images]
    asked = {} if args.logprobs is None else {"logprobs": True, "top_logprobs": args.logprobs}
    answer = None
    try:
        with Client(args.target, args.key, timeout=args.timeout) as client:
            for event in client.generate(
                args.prompt,
                media,
                detail=args.detail,
                max_visual_tokens=args.max_visual_tokens,
                profile=args.profile,
                max_new_tokens=args.max_new_tokens,
                **asked,
            ):
                if isinstance(event, Answer):
                    answer = event
                elif not args.json:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
    except errors.VisorError as err:
        payload = {"status": err.code.name, "reason": err.reason.value, "message": err.message}
        if args.json:
            print(json.dumps({"error": payload}))
        else:
            print(
                f"refused: {payload['status']} {payload['reason']}: {err.message}", file=sys.stderr
            )
        return 1
    assert answer is not None  # the client's stream ends with the Answer or raises
    if args.json:
        print(json.dumps(answer.as_json()))
    else:
        print()
        from shared.metrics import STAGES

        shown = [k for k in STAGES if k in answer.timings_ms]
        stages = " ".join(f"{k}={answer.timings_ms[k]:.1f}" for k in shown)
        print(
            f"[served_by={answer.served_by} usage={answer.usage} timings_ms: {stages}]",
            file=sys.stderr,
        )
    return 0


def _init_demo(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if (out / "config.json").exists() and not args.force:
        print(f"{out} already holds a model (use --force to rebuild)")
        return 0
    from core.model import demo

    demo.build(out, preset=args.preset, seed=args.seed)
    print(
        f"demo model written to {out} (random weights: its answers are noise; "
        "`visor model train-demo` trains it)"
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from visor import demo

    return demo.run(Path(args.model), Path(args.samples), serve=args.serve, config=args.config)


def _cache(args: argparse.Namespace) -> int:
    from core.cache import CacheUnavailable, FeatureCache
    from core.config import CacheConfig

    cfg = build(CacheConfig, "cache", read_file(args.config), environ())
    try:
        cache = FeatureCache.from_config(cfg)
    except CacheUnavailable as exc:
        print(f"visor: the feature cache cannot be opened: {exc.reason}", file=sys.stderr)
        return 2
    try:
        if args.cache_cmd == "purge":
            print(json.dumps({"tenant_purged": True, "entries_removed": cache.purge(args.tenant)}))
        else:
            s = cache.stats()
            print(
                json.dumps(
                    {
                        "entries": s.entries,
                        "bytes": s.bytes,
                        "max_bytes": s.max_bytes,
                        "tenants_by_prefix": s.tenants,
                        "path": cfg.path,
                    }
                )
            )
    finally:
        cache.close()
    return 0


def _bench_cache(args: argparse.Namespace) -> int:
    from bench import cache

    logs.configure("bench", "warning")  # stdout carries the one JSON object only
    return cache.main(Path(args.model), args.repeats)


def _bench_wire(args: argparse.Namespace) -> int:
    from bench import wire

    logs.configure("bench", "warning")
    return wire.main(Path(args.model), args.tiles, args.repeats)


def _certs(args: argparse.Namespace) -> int:
    from shared import certs

    made = certs.write_dev_certs(Path(args.out), args.dns_name, args.days)
    for name in made.__slots__:
        print(f"{name:13} {getattr(made, name)}")
    return 0


def _health(args: argparse.Namespace) -> int:
    from shared import probe
    from shared.tls import TlsFiles

    files = TlsFiles(args.ca, args.cert, args.key)
    return probe.main(args.target, args.service, files, args.server_name, args.timeout)


def _add_deploy_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    c = sub.add_parser("certs", help="certificates for mTLS between gateway and core")
    cd = c.add_subparsers(dest="certs_cmd", required=True).add_parser(
        "dev", help="a development CA, a core server cert and a gateway client cert"
    )
    cd.add_argument("--out", required=True, help="directory for the PEM files")
    cd.add_argument(
        "--dns-name",
        action="append",
        default=[],
        help="extra DNS name in the core cert (repeatable), e.g. the headless Service name",
    )
    cd.add_argument("--days", type=int, default=30, help="validity in days")
    cd.set_defaults(fn=_certs)
    h = sub.add_parser("health", help="one grpc.health.v1 check; exit 0 when SERVING")
    h.add_argument("--target", default="127.0.0.1:50052")
    h.add_argument("--service", default="", help="e.g. visor.v1.Core; empty = whole server")
    h.add_argument("--ca", default="", help="PEM CA of the server's certificate (mTLS)")
    h.add_argument("--cert", default="", help="PEM client certificate (mTLS)")
    h.add_argument("--key", default="", help="PEM client key (mTLS)")
    h.add_argument("--server-name", default="", help="name to check in the server's cert")
    h.add_argument("--timeout", type=float, default=3.0)
    h.set_defaults(fn=_health)


def _bench_gateway(args: argparse.Namespace) -> int:
    from bench import gateway

    logs.configure("bench", "warning")
    return gateway.main(Path(args.model), args.repeats)


def _bench_soak(args: argparse.Namespace) -> int:
    from bench import soak

    logs.configure("bench", "warning")
    # Phase lengths left out keep SoakSettings' defaults (one place says how long a soak runs).
    phases = {
        k: v for k in ("seconds_alone", "seconds_noisy") if (v := getattr(args, k)) is not None
    }
    settings = soak.SoakSettings(Path(args.model), seed=args.seed, **phases)
    out = Path(args.out) if args.out else None
    return soak.main(settings, Path(args.logs), out)


def _bench_batching(args: argparse.Namespace) -> int:
    from bench import batching

    logs.configure("bench", "warning")
    return batching.main(
        Path(args.model),
        args.n,
        args.seed,
        args.threads,
        args.plot,
        args.gap,
        quiet=args.json,
        peer_name=args.peer,
        dtype=args.dtype,
        compile=args.compile,
    )


def _bench_compression(args: argparse.Namespace) -> int:
    from bench import compression

    logs.configure("bench", "warning")
    return compression.main(Path(args.model), args.n, args.seed, args.threads, quiet=args.json)


def _bench_structured(args: argparse.Namespace) -> int:
    from bench import structured

    logs.configure("bench", "warning")
    return structured.main(Path(args.model), args.steps, args.samples)


def _bench_e2e(args: argparse.Namespace) -> int:
    from bench import e2e

    logs.configure("bench", "warning")
    settings = e2e.Settings(
        Path(args.model),
        args.n,
        args.seed,
        args.concurrency,
        args.threads,
        args.rounds,
        Path(args.logs),
    )
    return e2e.main(settings, args.json, args.plot)


def _add_e2e_bench(bs: Any) -> None:
    e = bs.add_parser(
        "e2e", help="each optimisation and all of them, through a real gateway and core"
    )
    e.add_argument("--model", default="models/demo")
    e.add_argument("--n", type=int, default=200, help="sessions in the workload")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--concurrency", type=int, default=16, help="closed-loop clients")
    e.add_argument("--threads", type=int, default=1, help="the core's torch threads")
    e.add_argument("--rounds", type=int, default=2, help="replays of every row, in turn")
    e.add_argument("--json", action="store_true", help="no progress bars; stdout is JSON")
    e.add_argument("--plot", type=Path, help="write a PNG chart here")
    e.add_argument("--logs", default=".visor/bench-e2e", help="service logs and caches go here")
    e.set_defaults(fn=_bench_e2e)


def _add_structured_bench(bs: Any) -> None:
    st = bs.add_parser("structured", help="llguidance vs xgrammar vs outlines-core: masks, schemas")
    st.add_argument("--model", default="models/demo", help="read for its tokenizer")
    st.add_argument("--steps", type=int, default=300, help="batch-16 steps timed per schema")
    st.add_argument("--samples", type=int, default=8, help="answers generated per schema")
    st.set_defaults(fn=_bench_structured)


def _add_scheduler_benches(bs: Any) -> None:
    for name, fn, text in (
        ("batching", _bench_batching, "scheduler policies on a seeded mixed workload"),
        ("compression", _bench_compression, "visual tokens, TTFT and req/s per profile"),
    ):
        p = bs.add_parser(name, help=text)
        p.add_argument("--model", default="models/bench")
        p.add_argument("--n", type=int, default=16, help="requests in the workload")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--threads", type=int, default=1, help="torch threads")
        p.add_argument("--json", action="store_true", help="no progress bars; stdout is JSON")
        if name == "batching":
            p.add_argument("--plot", type=Path, help="write a PNG chart here")
            p.add_argument(
                "--gap",
                type=float,
                help="mean seconds between arrivals in the latency replay (default: the gap "
                "that offers 0.9 of request-count's throughput, measured first)",
            )
            p.add_argument(
                "--peer",
                choices=("llama.cpp",),
                help="instead: visor vs llama-server on the same decoder (built on demand under "
                ".visor/llama.cpp; 8 prompts x 64 tokens, batch 1 and 8, 1 and 2 threads)",
            )
            p.add_argument("--dtype", default="auto", help="[core] dtype of visor's side of --peer")
            p.add_argument(
                "--compile",
                action="store_true",
                help="[core] compile on visor's side of --peer (it runs with batch_invariant off)",
            )
        p.set_defaults(fn=fn)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="visor", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn, text in (("core", _core, "run a core"), ("gateway", _gateway, "run a gateway")):
        s = sub.add_parser(name, help=text)
        s.add_argument("--config", type=Path, help="TOML file (default: built-in defaults)")
        if name == "gateway":
            s.add_argument(
                "--check-sandbox",
                action="store_true",
                help="start one decode worker, print which protections are active, exit",
            )
        s.set_defaults(fn=fn)
    a = sub.add_parser("ask", help="ask a gateway about images")
    a.add_argument("images", nargs="*", help="media files")
    a.add_argument("--prompt", required=True)
    a.add_argument("--key", default="visor-dev-key")
    a.add_argument("--target", default="127.0.0.1:50051")
    a.add_argument("--detail", choices=("low", "auto", "high"), default="auto")
    a.add_argument("--profile", default="")
    a.add_argument("--max-visual-tokens", type=int, default=0, help="per image; 0 = unset")
    a.add_argument("--max-new-tokens", type=int, default=0)
    a.add_argument("--timeout", type=float, default=60.0, help="deadline in seconds")
    a.add_argument("--json", action="store_true", help="print one JSON object at the end")
    a.add_argument(
        "--logprobs",
        type=int,
        metavar="N",
        help="with --json: each token's logprob and its N (0..20) likeliest alternatives",
    )
    a.set_defaults(fn=_ask)
    d = sub.add_parser("demo", help="start core + gateway, send the samples, print answers")
    d.add_argument("--model", default="models/demo")
    d.add_argument("--samples", default="models/samples")
    d.add_argument("--config", type=Path)
    d.add_argument("--serve", action="store_true", help="keep serving until Ctrl-C")
    d.set_defaults(fn=_demo)
    c = sub.add_parser("cache", help="feature-cache tools (run on the core's host)")
    cs = c.add_subparsers(dest="cache_cmd", required=True)
    st = cs.add_parser("stats", help="entries and bytes, per tenant prefix")
    pu = cs.add_parser("purge", help="delete every entry of one tenant")
    pu.add_argument("--tenant", required=True)
    for s in (st, pu):
        s.add_argument("--config", type=Path)
        s.set_defaults(fn=_cache)
    b = sub.add_parser("bench", help="benchmarks (one JSON object each)")
    bs = b.add_subparsers(dest="bench_cmd", required=True)
    w = bs.add_parser("wire", help="uint8 + fused normalisation vs float32 tensors over gRPC")
    w.add_argument("--model", default="models/demo")
    w.add_argument("--tiles", type=int, default=5)
    w.add_argument("--repeats", type=int, default=30)
    w.set_defaults(fn=_bench_wire)
    bc = bs.add_parser("cache", help="cold vs warm features: encode vs LMDB, TTFT, throughput")
    bc.add_argument("--model", default="models/demo")
    bc.add_argument("--repeats", type=int, default=10)
    bc.add_argument("--json", action="store_true", help="accepted for symmetry; output is JSON")
    bc.set_defaults(fn=_bench_cache)
    bg = bs.add_parser("gateway", help="1080p/4K JPEG to a tile: sandboxed vs in-process vs Pillow")
    bg.add_argument("--model", default="models/demo", help="read for the encoder's tile size")
    bg.add_argument("--repeats", type=int, default=20)
    bg.add_argument("--json", action="store_true", help="accepted for symmetry; output is JSON")
    bg.set_defaults(fn=_bench_gateway)
    sk = bs.add_parser("soak", help="noisy-neighbour soak with faults; exits 1 if a target fails")
    sk.add_argument("--model", default="models/demo")
    sk.add_argument(
        "--seconds-alone",
        type=float,
        help="default 450; equal to --seconds-noisy, both p99s are the same rank",
    )
    sk.add_argument("--seconds-noisy", type=float, help="default 450")
    sk.add_argument("--seed", type=int, default=0)
    sk.add_argument("--logs", default=".visor/soak", help="service logs and caches go here")
    sk.add_argument("--out", default="", help="also write the JSON report to this file")
    sk.add_argument("--json", action="store_true", help="accepted for symmetry; output is JSON")
    sk.set_defaults(fn=_bench_soak)
    _add_scheduler_benches(bs)
    _add_structured_bench(bs)
    _add_e2e_bench(bs)
    m = sub.add_parser("model", help="model tools").add_subparsers(dest="model_cmd", required=True)
    i = m.add_parser("init-demo", help="build the demo checkpoint (no download)")
    i.add_argument("--out", default="models/demo")
    i.add_argument("--preset", default="demo")
    i.add_argument("--seed", type=int, default=0)
    i.add_argument("--force", action="store_true")
    i.set_defaults(fn=_init_demo)
    _add_deploy_commands(sub)
    from bench.quality import commands as quality  # argument parsing only: no torch here

    quality.add_train(m)
    quality.add_eval(sub)
    return p


# GNU OpenMP's waiting, set by every command; only processes that load torch read it (libgomp
# reads it once, as torch loads it). By default it spins ~300,000 times at a barrier, except
# once it manages more threads than there are CPUs (it keeps a worker pool per thread that ran a
# parallel region: the core's loading, model and encoder threads), when it spins 100 times and
# sleeps on a futex, so nearly every barrier of a decode step pays a wake-up. Active waiting
# with a bounded count spins 1,000 times in that case and 20,000 otherwise: far below the
# default's worst case, so a spinning worker cannot keep the event loop off a CPU for long
# (bench/results/HISTORY.md).
OPENMP_WAITS = {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "20000"}


def _set_openmp_waits() -> None:
    """Either variable already in the environment leaves both as the operator set them."""
    if not OPENMP_WAITS.keys() & os.environ.keys():
        os.environ.update(OPENMP_WAITS)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    _set_openmp_waits()
    try:
        return int(args.fn(args))
    except ConfigError as exc:
        print(f"visor: configuration error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"visor: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
