"""`encode-bench`: side-by-side load tests of the encoder, in one run, on loopback.

Configurations (`--compare`): `on` (dynamic batching), `off` (one request per forward, the
baseline), `ray` (the same model behind Ray Serve's `@serve.batch`, skipped when Ray is absent),
and `ceiling` (the same batches through the model in a loop, no HTTP). For each server: a
closed-loop concurrency sweep and an open-loop Poisson rate sweep, then its batch-size histogram
from `/metrics`. Writes `results.json` and PNG plots into `--out`.

    encode-bench --compare on,off,ray,ceiling --concurrency 1,16,64 --rates 50,150,300 --out bench-results
    encode-bench --url http://127.0.0.1:30000 --concurrency 8   # a server that is already running
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import httpx

from .launcher import ServerProcess
from .load import closed_loop, make_payloads, open_loop


def batch_histogram(url: str) -> dict[str, float]:
    """Batches per size bucket, from `encoder_batch_size_bucket` (cumulative buckets made per-bucket)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    cumulative: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("encoder_batch_size_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            cumulative[le] = cumulative.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
    histogram, previous = {}, 0.0
    for le, count in cumulative.items():
        histogram[le] = count - previous
        previous = count
    return histogram


def progress_bar(total: int, label: str):
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=label, leave=False, file=sys.stderr)
    except ImportError:
        return None


def sweep(url: str, config: str, args, payloads: list[str]) -> list[dict]:
    """The closed-loop points, then the open-loop ones, each with a progress bar."""
    points = [(closed_loop, f"c={c}", c, max(args.requests, c * 4)) for c in args.concurrency]
    points += [(open_loop, f"rate={r:g}", r, max(int(r * args.open_seconds), 20)) for r in args.rates]
    results = []
    for generator, label, load, total in points:
        bar = progress_bar(total, f"{config} {label}")
        result = asyncio.run(generator(url, config, load, total, args.modality, payloads, bar)).as_dict()
        if bar is not None:
            bar.close()
        report(result)
        results.append(result)
    return results


def report(point: dict) -> None:
    load = f"c={point['load']:g}" if point["mode"] == "closed" else f"{point['load']:g}/s"
    print(f"{point['config']:10s} {point['mode']:6s} {load:>8s}  {point['throughput_rps']:8.1f} req/s  "
          f"p50 {point['p50_ms']:7.1f}  p99 {point['p99_ms']:7.1f} ms  batch {point['mean_batch_size']:5.1f}  "
          f"errors {point['errors']}", flush=True)


def server_flags(config: str, args) -> list[str]:
    flags = ["--model", args.model, "--max-batch-size", str(args.max_batch_size), "--max-wait-ms",
             str(args.max_wait_ms)]
    return flags + ["--enable-dynamic-batching", "true" if config == "on" else "false"]


def plot(results: dict, out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    points = results["points"]
    configs = sorted({p["config"] for p in points})
    figure, axis = plt.subplots(figsize=(6, 4))
    for config in configs:
        closed = sorted((p["load"], p["throughput_rps"]) for p in points
                        if p["config"] == config and p["mode"] == "closed")
        if closed:
            axis.plot(*zip(*closed), marker="o", label=config)
    styles = iter([("--", "gray"), (":", "black")])
    for name, value in results.get("ceiling", {}).items():
        if name.endswith("_rps"):
            style, color = next(styles)
            axis.axhline(value, linestyle=style, color=color, linewidth=1,
                         label=f"ceiling: {name[:-4].replace('_', ' ')}")
    axis.set(xlabel="concurrency (closed loop)", ylabel="throughput (requests/s)", xscale="log",
             title="Throughput against concurrency")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "throughput.png", dpi=120)
    written.append("throughput.png")
    figure, axis = plt.subplots(figsize=(6, 4))
    for config in configs:
        opened = sorted((p["load"], p["p50_ms"], p["p99_ms"]) for p in points
                        if p["config"] == config and p["mode"] == "open")
        if opened:
            x, p50, p99 = zip(*opened)
            axis.plot(x, p50, marker="o", label=f"{config} p50")
            axis.plot(x, p99, marker="x", linestyle="--", label=f"{config} p99")
    axis.set(xlabel="offered load (requests/s, Poisson arrivals)", ylabel="latency (ms)", yscale="log",
             title="Latency percentiles against load")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "latency.png", dpi=120)
    written.append("latency.png")
    histograms = {c: h for c, h in results.get("batch_histograms", {}).items() if h}
    if histograms:
        figure, axis = plt.subplots(figsize=(6, 4))
        width = 0.8 / len(histograms)
        for offset, (config, histogram) in enumerate(histograms.items()):
            labels = list(histogram)
            axis.bar([i + offset * width for i in range(len(labels))], list(histogram.values()), width, label=config)
        axis.set_xticks(range(len(labels)), [f"<={label}" for label in labels], rotation=45, fontsize=7)
        axis.set(xlabel="requests per forward", ylabel="batches", yscale="log", title="Batch sizes (from /metrics)")
        axis.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(out / "batch_sizes.png", dpi=120)
        written.append("batch_sizes.png")
    plt.close("all")
    return written


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="encode-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    numbers = lambda kind: (lambda text: [kind(x) for x in text.split(",") if x])  # noqa: E731
    parser.add_argument("--url", help="benchmark this running server instead of starting servers")
    parser.add_argument("--compare", type=lambda t: t.split(","), default=["on", "off", "ray", "ceiling"])
    parser.add_argument("--concurrency", type=numbers(int), default=[1, 16, 64])
    parser.add_argument("--rates", type=numbers(float), default=[50.0, 150.0, 300.0])
    parser.add_argument("--requests", type=int, default=400, help="requests per closed-loop point")
    parser.add_argument("--open-seconds", type=float, default=6.0, help="length of each open-loop point")
    parser.add_argument("--modality", choices=("image", "audio"), default="image")
    parser.add_argument("--image-size", type=int, default=56)
    parser.add_argument("--audio-seconds", type=float, default=1.0)
    parser.add_argument("--model", default="tiny-qwen2.5-vl")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-wait-ms", type=float, default=0.0)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--replot", action="store_true", help="only redraw the plots from --out/results.json")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        print("wrote", ", ".join(plot(json.loads((args.out / "results.json").read_text()), args.out)))
        return
    payloads = make_payloads(args.modality, 32, args.image_size, args.audio_seconds)
    results: dict = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                     "points": [], "batch_histograms": {}, "skipped": {}}
    if args.url:
        results["points"] += sweep(args.url, "given", args, payloads)
        results["batch_histograms"]["given"] = batch_histogram(args.url)
    for config in [] if args.url else args.compare:
        if config in ("on", "off"):
            with ServerProcess(*server_flags(config, args)) as server:
                results["points"] += sweep(server.url, config, args, payloads)
                results["batch_histograms"][config] = batch_histogram(server.url)
        elif config == "ray":
            try:
                import ray  # noqa: F401
                from ray import serve  # noqa: F401
            except ImportError:
                results["skipped"]["ray"] = "ray[serve] is not installed (pip install -e '.[bench]')"
                print("ray: skipped (ray[serve] is not installed)", flush=True)
                continue
            if args.modality != "image":
                results["skipped"]["ray"] = "the Ray Serve peer serves images only"
                continue
            with ServerProcess("--model", args.model, "--max-batch-size", str(args.max_batch_size),
                               "--max-wait-ms", str(args.max_wait_ms), module="encode_server.bench.ray_peer",
                               startup_timeout=300) as server:
                results["points"] += sweep(server.url, "ray", args, payloads)
        elif config == "ceiling":
            from .ceiling import ceiling

            results["ceiling"] = ceiling(args.model, args.modality, payloads, args.max_batch_size)
            print(f"ceiling    batch {args.max_batch_size}: processor+forward "
                  f"{results['ceiling']['processor_and_forward_rps']:.1f} req/s, forward only "
                  f"{results['ceiling']['forward_only_rps']:.1f} req/s", flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    written = plot(results, args.out)
    print(f"wrote {args.out / 'results.json'}" + (f" and {', '.join(written)}" if written else ""))


if __name__ == "__main__":
    main()
