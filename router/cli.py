"""`polyinfer train-classifier`: retrain the domain classifier and report held-out F1.

Examples::

    # the shipped artefact: default corpus from the repository's data/ + stdlib + templates
    polyinfer train-classifier --out router/data/domain_classifier.npz
    # add your own labelled prompts, or traces recorded with prompt text
    polyinfer train-classifier --jsonl labelled.jsonl --traces traces.jsonl --out my.npz
    # only your own
    polyinfer train-classifier --no-default-corpus --jsonl labelled.jsonl --out my.npz
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import random
from pathlib import Path
from typing import Any

from router.corpus import Example, is_held_out
from router.errors import RouterError
from router.training import evaluate, format_report, load_labelled, train

logger = logging.getLogger(__name__)

DEFAULT_DATA = Path(__file__).resolve().parents[1] / "data"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("train-classifier", help="retrain the request domain classifier",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help="data dir with prompts/ (Spec-Bench, GSM8K) for the default corpus "
                        "(default: %(default)s)")
    p.add_argument("--no-default-corpus", action="store_true",
                   help="train only on --jsonl/--traces, not on the default corpus")
    p.add_argument("--jsonl", type=Path, action="append", default=[],
                   help="labelled JSONL: domain + text|prompt|prompt_text|messages (repeatable)")
    p.add_argument("--traces", type=Path, action="append", default=[],
                   help="trace JSONL whose records carry prompt text and a domain (repeatable)")
    p.add_argument("--held-out", type=float, default=0.2,
                   help="fraction of --jsonl/--traces groups held out for the report")
    p.add_argument("--out", type=Path, default=Path("domain_classifier.npz"))
    p.add_argument("--report", type=Path, help="also write the held-out report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        train_set, test_set = _collect(args)
    except RouterError as e:
        logger.error("%s", e)
        return 2
    if not train_set:
        logger.error("no training data: give --data, --jsonl or --traces")
        return 2
    meta = {"version": datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ"),
            "num_train": len(train_set), "num_held_out": len(test_set)}
    try:
        clf = train(train_set, meta)
    except RouterError as e:
        logger.error("%s", e)
        return 2
    reports = _reports(clf, test_set)
    clf.meta["held_out_macro_f1"] = {k: v["macro_f1"] for k, v in reports.items()}
    clf.save(args.out)
    for name, rep in reports.items():
        print(format_report(name, rep))
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes, trained on {len(train_set)})")
    if args.report:
        args.report.write_text(json.dumps(reports, indent=2))
    return 0


def _collect(args: argparse.Namespace) -> tuple[list[Example], list[Example]]:
    train_set: list[Example] = []
    test_set: list[Example] = []
    if not args.no_default_corpus:
        from router.dataset import build_default

        if not (args.data / "prompts").is_dir():
            raise RouterError(f"no prompts/ folder in {args.data} (give --data DIR or "
                              "--no-default-corpus)")
        split = build_default(args.data)
        train_set += split.train
        test_set += split.test
    extra = [e for p in args.jsonl for e in load_labelled(p, "jsonl")]
    extra += [e for p in args.traces for e in load_labelled(p, "traces")]
    for e in extra:
        (test_set if is_held_out(e.group, args.held_out) else train_set).append(e)
    random.Random(0).shuffle(train_set)
    return train_set, test_set


def _reports(clf: Any, test_set: list[Example]) -> dict[str, dict[str, Any]]:
    if not test_set:
        return {}
    out = {"held-out (all sources)": evaluate(clf, test_set)}
    real = [e for e in test_set if e.source == "spec_bench"]
    if real:
        out["held-out Spec-Bench question ids"] = evaluate(clf, real)
    return out
