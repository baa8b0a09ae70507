"""The model zoo: build a tiny checkpoint for every multimodal `model_type` transformers ships (image-text-to-text
and multimodal-LM auto mappings), serve it with encode-server's own loader and adapter, and print a table of
how each (model type, modality) pair is served against what the full model feeds its language model:

    exact           same rows per item as the full model splices (max|diff|/max|ref| <= 1e-4), fused batch too
    wrong           row counts or values differ (both printed)
    refused         the server refuses: CheckpointError at load, ItemError at preprocess (first line shown)
    error           any other exception in the server's code (a bug)
    not applicable  not a decoder LM fed with rows spliced at placeholder tokens (reason shown)
    unbuildable     the tiny checkpoint or the full model's reference cannot be made here (reason shown)

A video item is a `VideoClip` (frames with the source's fps and frame indices, as the server's decoder makes it);
the reference gives the full processor those frames unsampled (`do_sample_frames=False`) with their metadata.

Each type runs in its own subprocess with a timeout (`tests/support/zoo/compare.py`), one at a time; built folders
are cached under `--work`. `--without-torchvision` runs the same with torchvision hidden (the PIL processors).

    python -m tools.zoo --work /tmp/zoo --markdown
    python -m tools.zoo --only llava,qwen2_audio
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.paths import NO_TORCHVISION, ROOT

RESULT_PREFIX = "ZOO-RESULT "
WITHOUT_TORCHVISION_PATH = NO_TORCHVISION
OUTCOMES = ("exact", "wrong", "refused", "error", "not applicable", "unbuildable")


def all_model_types() -> list[str]:
    from tests.support.zoo.catalog import model_types

    return model_types()


def run_one(model_type: str, work: Path, timeout: float, without_torchvision: bool) -> list[dict]:
    """One type in its own interpreter: its result rows, or one `error` row if it crashed or hung."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    if without_torchvision:
        env["PYTHONPATH"] = os.pathsep.join([str(WITHOUT_TORCHVISION_PATH), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep)
    command = [sys.executable, "-m", "tests.support.zoo.compare", model_type, str(work)]
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [{"model_type": model_type, "modality": "-", "result": "error",
                 "detail": f"timed out after {timeout:g} s"}]
    rows = [json.loads(line[len(RESULT_PREFIX):]) for line in done.stdout.splitlines()
            if line.startswith(RESULT_PREFIX)]
    if not rows:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1][:400]
        rows = [{"model_type": model_type, "modality": "-", "result": "error",
                 "detail": f"the subprocess exited with {done.returncode}: {tail}"}]
    return rows


def summary(rows: list[dict]) -> str:
    pairs = [r for r in rows if r["modality"] in ("image", "audio", "video")
             and r["result"] in ("exact", "wrong", "refused", "error")]

    def count(outcome: str, modality: str | None = None) -> int:
        return sum(1 for r in pairs if r["result"] == outcome and (modality is None or r["modality"] == modality))

    def buildable(modality: str) -> int:
        return sum(1 for r in pairs if r["modality"] == modality)

    types_with = {outcome: sorted({r["model_type"] for r in rows if r["result"] == outcome})
                  for outcome in ("not applicable", "unbuildable")}
    return (f"exact {count('exact')} of {len(pairs)} buildable pairs (images {count('exact', 'image')}/"
            f"{buildable('image')}, audio {count('exact', 'audio')}/{buildable('audio')}, video "
            f"{count('exact', 'video')}/{buildable('video')}); wrong {count('wrong')}, "
            f"refused {count('refused')}, error {count('error')}; not applicable {len(types_with['not applicable'])} "
            f"types, unbuildable {sum(1 for r in rows if r['result'] == 'unbuildable')} pairs or types")


def markdown(rows: list[dict], title: str) -> str:
    lines = [f"### {title}", "", "| model_type | modality | result | detail |", "| --- | --- | --- | --- |"]
    for row in rows:
        detail = row["detail"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {row['model_type']} | {row['modality']} | {row['result']} | {detail} |")
    return "\n".join(lines + ["", summary(rows), ""])


def versions() -> str:
    """The library versions a table was made with (torchvision's as installed, hidden or not)."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for package in ("transformers", "torch", "torchvision"):
        try:
            found.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            found.append(f"no {package}")
    return ", ".join(found)


def combined_markdown(report: dict[str, list[dict]]) -> str:
    """One table with a result column per environment (with torchvision, without it), and each one's summary.
    A detail shared by both environments is shown once; otherwise each environment's, labelled."""
    titles = list(report)
    keyed = [{(row["model_type"], row["modality"]): row for row in report[title]} for title in titles]
    order = list(dict.fromkeys(key for rows in keyed for key in rows))
    header = "| model_type | modality | " + " | ".join(titles) + " | detail |"
    lines = [header, "| --- | --- | " + " | ".join("---" for _ in titles) + " | --- |"]
    for key in order:
        rows = [by_key.get(key) for by_key in keyed]
        results = [row["result"] if row else "-" for row in rows]
        details = [row["detail"] if row else "" for row in rows]
        if len(set(details)) == 1:
            detail = details[0]
        else:
            detail = "; ".join(f"{title}: {text}" for title, text in zip(titles, details, strict=True) if text)
        detail = detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(results) + f" | {detail} |")
    lines.append("")
    lines.extend(f"- {title}: {summary(report[title])}" for title in titles)
    return "\n".join(lines + [""])


def plain(rows: list[dict], title: str) -> str:
    lines = [title]
    for row in rows:
        lines.append(f"{row['model_type']:<26} {row['modality']:<6} {row['result']:<15} {row['detail']}")
    return "\n".join(lines + [summary(rows), ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.zoo", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=None, help="folder caching the built checkpoints "
                        "(default: a new temporary folder)")
    parser.add_argument("--only", default="", help="comma-separated model types (default: all)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per model type")
    parser.add_argument("--without-torchvision", action="store_true",
                        help="also run every type with torchvision hidden (transformers' PIL processors)")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="model-zoo-"))
    work.mkdir(parents=True, exist_ok=True)
    types = [t for t in args.only.split(",") if t] or all_model_types()
    envs = [("with torchvision", False)] + ([("without torchvision", True)] if args.without_torchvision else [])
    report: dict[str, list[dict]] = {}
    for title, hidden in envs:
        rows: list[dict] = []
        started = time.monotonic()
        for model_type in types:
            t0 = time.monotonic()
            found = run_one(model_type, work / ("pil" if hidden else "torchvision"), args.timeout, hidden)
            for row in found:
                row["seconds"] = round(time.monotonic() - t0, 1)
                print(f"[zoo] {title}: {row['model_type']} {row['modality']} {row['result']}: {row['detail']}",
                      file=sys.stderr, flush=True)
            rows.extend(found)
        heading = f"{title} ({len(types)} model types, {time.monotonic() - started:.0f} s)"
        report[title] = rows
        print(markdown(rows, heading) if args.markdown else plain(rows, heading))
    if args.markdown and len(report) > 1:
        print(f"### Both environments ({versions()})\n\n{combined_markdown(report)}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
