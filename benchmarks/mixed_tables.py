"""The Markdown tables `python benchmarks/mixed.py` prints, in the layout docs/BENCHMARKS.md shows."""

from __future__ import annotations


def _row(cells) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def mixed_table(results: dict[str, dict]) -> str:
    """One row per arm of each `--cache` setting: `results` maps the setting (off, on) to `run_mixed_once`'s
    result (its capacity and the medians over the rounds)."""
    header = ["cache", "capacity (req/s)", "arm", "interactive p50 (ms)", "interactive p99 (ms)",
              "offline (req/s)", "total (req/s)", "interactive errors"]
    lines = [_row(header), _row(["---"] * len(header))]
    for cache, result in results.items():
        for index, (arm, median) in enumerate(result["median"].items()):
            offline = median["offline_rps"] if arm != "idle" else "-"
            lines.append(_row([cache if index == 0 else "", result["capacity_rps"] if index == 0 else "", arm,
                               median["interactive_p50_ms"], median["interactive_p99_ms"], offline,
                               median["total_rps"], f"{median['interactive_errors']} of "
                               f"{median['interactive_requests']}"]))
    return "\n".join(lines)


def wait_table(points: list[dict]) -> str:
    """One row per `--max-wait-ms`: throughput (p99) at each concurrency, then the mean batches."""
    rows = [point for point in points if "concurrency" in point]
    concurrencies = sorted({point["concurrency"] for point in rows})
    header = ["`--max-wait-ms`", *(f"c={c} req/s (p99 ms)" for c in concurrencies),
              "mean batch " + " / ".join(f"c={c}" for c in concurrencies), "errors"]
    lines = [_row(header), _row(["---"] * len(header))]
    for wait in dict.fromkeys(point["max_wait_ms"] for point in rows):
        mine = {point["concurrency"]: point for point in rows if point["max_wait_ms"] == wait}
        cells = [f"{mine[c]['throughput_rps']} ({mine[c]['p99_ms']})" if c in mine else "-" for c in concurrencies]
        batches = " / ".join(str(mine[c]["mean_batch"]) if c in mine else "-" for c in concurrencies)
        lines.append(_row([wait, *cells, batches, sum(point["errors"] for point in mine.values())]))
    return "\n".join(lines)
