"""The `visor eval` and `visor model train-demo` subcommands: argument parsing only; the work is
imported when a command runs (so `visor ask` never pays for torch)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_eval(sub: Any) -> None:
    e = sub.add_parser("eval", help="accuracy per scenario, compression profile and detail level")
    e.add_argument("--model", default="models/demo", help="checkpoint folder (in-process)")
    e.add_argument("--suite", default="synthetic", help="synthetic or jsonl:FILE")
    e.add_argument(
        "--profiles", default="none,low-latency,balanced,high-precision", help="comma-separated"
    )
    e.add_argument(
        "--details", default="", help="comma-separated detail levels (low,auto,high), uncompressed"
    )
    e.add_argument("--seed", type=int, default=0, help="held-out evaluation seed")
    e.add_argument("--n", type=int, default=200, help="items (synthetic) or first N (jsonl)")
    e.add_argument("--sweep", action="store_true", help="also each method at 30/50/70/80%%")
    e.add_argument("--plot", type=Path, help="PNG: accuracy vs visual tokens kept")
    e.add_argument("--target", help="HOST:PORT of a running gateway (default: in-process)")
    e.add_argument("--key", default="visor-dev-key", help="API key for --target")
    e.add_argument("--threads", type=int, default=1, help="torch threads (in-process)")
    e.add_argument("--json", action="store_true", help="print one JSON object, no progress")
    e.set_defaults(fn=_eval)


def add_train(model_sub: Any) -> None:
    t = model_sub.add_parser("train-demo", help="train the demo model on the synthetic suite")
    t.add_argument("--out", default="models/demo")
    # Unset options take train.TrainConfig's defaults: the committed model's recipe.
    t.add_argument("--seed", type=int)
    t.add_argument("--steps", type=int, help="optimiser steps (schedule length)")
    t.add_argument("--vision-steps", type=int, help="first stage (dense targets)")
    t.add_argument("--minutes", type=float, help="wall-clock cap")
    t.add_argument("--threads", type=int, help="torch threads")
    t.add_argument("--lr", type=float, help="peak learning rate")
    t.add_argument("--init", help="start from this trained checkpoint (no first stage)")
    t.add_argument("--detail-every", type=int, help="every n-th step: resolution scenarios")
    t.set_defaults(fn=_train)


def _eval(args: argparse.Namespace) -> int:
    import torch

    from bench.quality import evaluate, report
    from shared.errors import VisorError

    torch.set_num_threads(max(1, args.threads))
    try:
        result = _run_eval(args, evaluate)
    except (ValueError, VisorError) as exc:
        print(f"visor eval: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 2
    if args.plot is not None:
        report.plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
    else:
        print(report.table(result))
    return 0


def _run_eval(args: argparse.Namespace, evaluate: Any) -> dict[str, Any]:
    result: dict[str, Any] = evaluate.run(
        model=Path(args.model),
        suite_spec=args.suite,
        profile_names=[p for p in args.profiles.split(",") if p],
        detail_levels=[d for d in args.details.split(",") if d],
        seed=args.seed,
        n=args.n,
        sweep=args.sweep or args.plot is not None,
        target=args.target,
        key=args.key,
        progress=not args.json and sys.stderr.isatty(),
    )
    return result


def _train(args: argparse.Namespace) -> int:
    from bench.quality import train

    names = ("seed", "steps", "vision_steps", "minutes", "threads", "lr", "init", "detail_every")
    given = {k: getattr(args, k) for k in names}
    cfg = train.TrainConfig(**{k: v for k, v in given.items() if v is not None})
    recipe = train.train(Path(args.out), cfg)
    print(json.dumps(recipe))
    return 0
