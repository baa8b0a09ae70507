"""`encode-bench`: side-by-side load tests of the encoder, in one run, on loopback.

Configurations (`--compare`): `on` (dynamic batching), `off` (one request per forward, the
baseline), `ceiling` (the same batches through the model in a loop, no HTTP), and `cache-on` /
`cache-off` (dynamic batching with the embedding cache at `--cache-bytes`, and with it off; `on` and
`off` run with the cache off, so that they measure batching alone). The comparisons with peers (Ray
Serve, SGLang's own encoder server, vLLM's own encoder instance) are benchmarks of a checkout, not of this
command: `benchmarks/ray_compare.py` runs this sweep against a Ray Serve peer, `benchmarks/sglang_compare.py`
against SGLang, `benchmarks/vllm_compare.py` against vLLM (docs/BENCHMARKS.md). The run prints the machine
(`machine.py`: the CPU model, the cores it may use, the torch version) at its start and beside its figures,
and records it in `results.json`. Workloads (`--workload`, see
`workloads.py`): `single` (one image per request), `chat` (Zipf-popular conversations re-sending
earlier turns' images) and `unique` (chat's shape, nothing ever repeated: the cache's worst case);
every configuration gets a fresh server per workload. For each server: a closed-loop concurrency
sweep and an open-loop Poisson rate sweep, with per point the cache's hit rate and the tokens
encoded (from `/metrics`), the server's resident memory and the bytes its cache holds; then its
batch-size histogram. Writes `results.json` and PNG plots (with matplotlib, of the bench extra) into
`--out` (default `bench-results/`, which git ignores; it refuses to replace results git tracks, such as
docs/bench's, unless `--overwrite-tracked` says so).

    encode-bench --compare on,off,ceiling --concurrency 1,16,64 --rates 50,150,300 --out bench-results/batching
    encode-bench --compare cache-on,cache-off --workload chat,unique --concurrency 1,32 --rates 100 \
        --out bench-results/cache
    encode-bench --url http://127.0.0.1:30000 --concurrency 8   # a server that is already running

Every request's media is its own by default (the same pixels or samples, different bytes: see
`workloads.py`), so a server's embedding cache does not answer the benchmark; each point prints the
hit rate the server's `/metrics` counted during it, with a warning above `HIT_RATE_WARNING`.
`--repeat-media` sends the same 32 items again and again instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path

try:
    import httpx
except ImportError:  # the bench extra is not installed: say so in one line rather than a traceback
    raise SystemExit("encode-bench needs the bench extra (httpx, matplotlib, tqdm): "
                     "pip install 'encode-server[bench]', or in a checkout pip install -e '.[bench]'") from None

from encode_server.bench.launcher import ServerProcess
from encode_server.bench.load import closed_loop, make_payloads, open_loop
from encode_server.bench.machine import describe_machine
from encode_server.bench.workloads import WORKLOADS, make_workload
from encode_server.ops.memory import cpu_seconds, resident_bytes

#: Server configurations and the flags that make them (besides the model and batching settings).
SERVER_CONFIGS = ("on", "off", "cache-on", "cache-off")
#: Every configuration `--compare` takes: the servers, then the in-process ceiling.
CONFIGS = (*SERVER_CONFIGS, "ceiling")
#: The files a run writes into `--out`.
OUTPUTS = ("results.json", "throughput.png", "latency.png", "batch_sizes.png")
#: Why the plots were not drawn, when matplotlib is missing.
NO_PLOTS = ("plots skipped: matplotlib is not installed (the bench extra: pip install 'encode-server[bench]', "
            "or in a checkout pip install -e '.[bench]'); results.json holds every figure")
#: A peer configuration: a context manager that serves `/encode` as this server does, its `url` on loopback.
Peer = Callable[[], AbstractContextManager]

#: Above this share of items answered by the server's embedding cache, a point measures the cache.
HIT_RATE_WARNING = 0.10

#: `/metrics` series read around every point (summed over their labels).
POINT_METRICS = ("encoder_cache_hits_total", "encoder_cache_misses_total", "encoder_cache_bytes",
                 "encoder_batch_tokens_sum", "encoder_forward_seconds_count")


#: Headers of every request to the server under test (`--api-key`).
HEADERS: dict[str, str] = {}


def batch_histogram(url: str) -> dict[str, float]:
    """Batches per size bucket, from `encoder_batch_size_bucket` (cumulative buckets made per-bucket)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10, headers=HEADERS).text
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


def scrape(url: str) -> dict[str, float]:
    """Every sample of `/metrics` summed by name over its labels ({} when the server has none)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10, headers=HEADERS).text
    except httpx.HTTPError:
        return {}
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name = head.partition("{")[0]
        try:
            totals[name] = totals.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return totals


def point_metrics(before: dict[str, float], after: dict[str, float], pid: int | None, requests: int = 0) -> dict:
    """The cache hit rate, tokens encoded, forwards and the server's CPU time per request during a point
    (`_cpu_s` in the snapshots); memory held at its end."""
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in POINT_METRICS}
    cpu = after.get("_cpu_s", 0.0) - before.get("_cpu_s", 0.0) if "_cpu_s" in before else None
    lookups = delta["encoder_cache_hits_total"] + delta["encoder_cache_misses_total"]
    rss = resident_bytes(pid) if pid else None
    return {
        "hit_rate": delta["encoder_cache_hits_total"] / lookups if lookups else None,
        "tokens_encoded": int(delta["encoder_batch_tokens_sum"]),
        "forwards": int(delta["encoder_forward_seconds_count"]),
        "rss_mib": rss / 2**20 if rss else None,
        "cache_mib": after.get("encoder_cache_bytes", 0.0) / 2**20 if "encoder_cache_bytes" in after else None,
        "server_cpu_ms_per_request": 1e3 * cpu / requests if cpu is not None and requests else None,
    }


def sweep(url: str, config: str, args, workload, pid: int | None = None) -> list[dict]:
    """The closed-loop points, then the open-loop ones, each with a progress bar and its server metrics."""
    points = [(closed_loop, f"c={c}", c, max(args.requests, c * 4)) for c in args.concurrency]
    points += [(open_loop, f"rate={r:g}", r, max(int(r * args.open_seconds), 20)) for r in args.rates]
    results = []
    for generator, label, load, total in points:
        bar = progress_bar(total, f"{config} {workload.name} {label}")
        before: dict[str, float] = {}

        def snapshot(before: dict[str, float] = before) -> None:  # after the warm-up, before the clock starts
            before.update(scrape(url))
            if pid and cpu_seconds(pid) is not None:
                before["_cpu_s"] = cpu_seconds(pid)

        point = asyncio.run(generator(url, config, load, total, args.modality, workload, bar,
                                      on_start=snapshot, headers=HEADERS, warm=args.warm_requests)).as_dict()
        if bar is not None:
            bar.close()
        point["workload"] = workload.name
        after = scrape(url)
        if pid and cpu_seconds(pid) is not None:
            after["_cpu_s"] = cpu_seconds(pid)
        point.update(point_metrics(before, after, pid, point["requests"]))
        report(point)
        results.append(point)
    return results


def report(point: dict) -> None:
    load = f"c={point['load']:g}" if point["mode"] == "closed" else f"{point['load']:g}/s"
    extras = ""
    if point.get("hit_rate") is not None:
        extras += f"  hit {100 * point['hit_rate']:5.1f}%"
    if point.get("rss_mib") is not None:
        extras += f"  rss {point['rss_mib']:6.0f} MiB"
    if point.get("cache_mib") is not None:
        extras += f"  cache {point['cache_mib']:6.1f} MiB"
    if point.get("server_cpu_ms_per_request") is not None:
        extras += f"  cpu {point['server_cpu_ms_per_request']:5.2f} ms/req"
    print(f"{point.get('workload', ''):7s}{point['config']:10s} {point['mode']:6s} {load:>8s}  "
          f"{point['throughput_rps']:8.1f} req/s  p50 {point['p50_ms']:7.1f}  p99 {point['p99_ms']:7.1f} ms  "
          f"batch {point['mean_batch_size']:5.1f}  errors {point['errors']}{extras}", flush=True)
    warning = hit_rate_warning(point)
    if warning:
        print(warning, file=sys.stderr, flush=True)


def hit_rate_warning(point: dict) -> str | None:
    """A warning when the server's embedding cache answered more than `HIT_RATE_WARNING` of a point's items."""
    rate = point.get("hit_rate")
    if rate is None or rate <= HIT_RATE_WARNING or point.get("config") == "cache-on":
        return None
    return (f"warning: the server's embedding cache answered {100 * rate:.0f}% of the items at this point: the "
            f"figures measure the cache, not the encoder (the media repeat: leave out --repeat-media, or start the "
            f"server with --cache-bytes 0)")


def run_hit_rate(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The share of item lookups the server's cache answered between two scrapes (None: no lookups, or no
    metrics to read)."""
    hits = after.get("encoder_cache_hits_total", 0.0) - before.get("encoder_cache_hits_total", 0.0)
    misses = after.get("encoder_cache_misses_total", 0.0) - before.get("encoder_cache_misses_total", 0.0)
    return hits / (hits + misses) if hits + misses > 0 else None


def describe_hit_rate(rate: float | None) -> str:
    if rate is None:
        return "none measured (the server's cache is off, or its /metrics could not be read)"
    above = f" (above {100 * HIT_RATE_WARNING:g}%: the figures measure the cache)" if rate > HIT_RATE_WARNING else ""
    return f"{100 * rate:.1f}%{above}"


def cache_comparison(points: list[dict]) -> list[dict]:
    """Per workload and load: cache-on against cache-off, medians over the rounds (`--repeat`)."""
    groups: dict[tuple, list[dict]] = {}
    for point in points:
        if point["config"] in ("cache-on", "cache-off"):
            groups.setdefault((point["workload"], point["mode"], point["load"], point["config"]), []).append(point)

    def median(group: list[dict], field: str) -> float | None:
        values = [p[field] for p in group if p.get(field) is not None]
        return float(statistics.median(values)) if values else None

    rows = []
    for (workload, mode, load, config), on in sorted(groups.items(), key=lambda kv: str(kv[0])):
        off = groups.get((workload, mode, load, "cache-off"))
        if config != "cache-on" or off is None:
            continue
        row = {"workload": workload, "mode": mode, "load": load, "rounds": min(len(on), len(off))}
        for field in ("throughput_rps", "p50_ms", "p99_ms", "rss_mib", "tokens_encoded", "server_cpu_ms_per_request"):
            row[f"{field}_on"], row[f"{field}_off"] = median(on, field), median(off, field)
        row["hit_rate"], row["cache_mib"] = median(on, "hit_rate"), median(on, "cache_mib")
        row["throughput_ratio"] = (row["throughput_rps_on"] / row["throughput_rps_off"]
                                   if row["throughput_rps_off"] else None)
        rows.append(row)
    for row in rows:
        load = f"c={row['load']:g}" if row["mode"] == "closed" else f"{row['load']:g}/s"
        hit = f"{100 * row['hit_rate']:.1f}%" if row["hit_rate"] is not None else "n/a"
        cpu = ""
        if row["server_cpu_ms_per_request_on"] is not None and row["server_cpu_ms_per_request_off"] is not None:
            cpu = (f", server CPU {row['server_cpu_ms_per_request_on']:.2f} vs "
                   f"{row['server_cpu_ms_per_request_off']:.2f} ms/req")
        print(f"cache {row['workload']:7s} {row['mode']:6s} {load:>8s}: on {row['throughput_rps_on']:7.1f} vs off "
              f"{row['throughput_rps_off']:7.1f} req/s (x{row['throughput_ratio'] or 0:.3f}), p99 "
              f"{row['p99_ms_on']:.1f} vs {row['p99_ms_off']:.1f} ms, hit {hit}{cpu} "
              f"(median of {row['rounds']} rounds)", flush=True)
    return rows


def server_flags(config: str, args) -> list[str]:
    flags = ["--model", args.model, "--max-batch-size", str(args.max_batch_size), "--max-wait-ms",
             str(args.max_wait_ms)]
    flags += ["--enable-dynamic-batching", "false" if config == "off" else "true"]
    return flags + ["--cache-bytes", args.cache_bytes if config == "cache-on" else "0"]


def plot(results: dict, out: Path) -> list[str]:
    """Draw the plots into `out`; the names of the files written ([] without matplotlib, after saying so on
    stderr)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(NO_PLOTS, file=sys.stderr, flush=True)
        return []
    written = []
    several = len({p.get("workload") for p in results["points"]}) > 1
    points = [{**p, "config": f"{p['workload']}:{p['config']}" if several else p["config"]} for p in results["points"]
              if p.get("repeat", 0) == 0]  # the first round; the comparisons hold the medians
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


def tracked_outputs(out: Path) -> list[str]:
    """The files of `OUTPUTS` in `out` that git tracks (such as docs/bench's published figures); [] outside a
    git work tree, or without git."""
    anchor = out.resolve()
    while not anchor.is_dir():
        anchor = anchor.parent
    try:
        done = subprocess.run(["git", "-C", str(anchor), "ls-files", "-z", "--", *(str(out.resolve() / name)
                                                                                 for name in OUTPUTS)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return sorted(Path(name).name for name in done.stdout.split("\0") if name) if done.returncode == 0 else []


def check_out(out: Path, overwrite_tracked: bool) -> None:
    """Refuse, before anything runs, to write over results git tracks unless `--overwrite-tracked` says so:
    a warning would scroll past during a long run, and the published figures would be replaced unnoticed."""
    tracked = tracked_outputs(out)
    if tracked and not overwrite_tracked:
        raise SystemExit(f"encode-bench: --out {out} holds results that git tracks ({', '.join(tracked)}): they are "
                         f"the repository's published figures. Write elsewhere (the default, bench-results/, is "
                         f"ignored by git), or pass --overwrite-tracked to replace them on purpose")


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """`encode-bench`'s flags, each with its help."""
    parser = argparse.ArgumentParser(prog="encode-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    numbers = lambda kind: (lambda text: [kind(x) for x in text.split(",") if x])  # noqa: E731
    parser.add_argument("--url", help="benchmark this running server instead of starting servers")
    parser.add_argument("--api-key", default=os.environ.get("ENCODER_API_KEY"),
                        help="the server's --api-key, sent as 'Authorization: Bearer <key>' [env: ENCODER_API_KEY]")
    parser.add_argument("--repeat-media", action="store_true",
                        help="send the same 32 items again and again (single workload) instead of a unique copy per "
                             "request: with the server's cache on, this measures the cache")
    parser.add_argument("--compare", type=lambda t: t.split(","), default=["on", "off", "ceiling"],
                        help=f"comma-separated configurations, each a fresh server (with --url: not used): "
                             f"{', '.join(CONFIGS)} (on: dynamic batching; off: one request per forward; cache-on, "
                             f"cache-off: batching with the embedding cache at --cache-bytes and without it; ceiling: "
                             f"the same batches through the model in this process, no HTTP) (default: on,off,ceiling)")
    parser.add_argument("--concurrency", type=numbers(int), default=[1, 16, 64],
                        help="comma-separated closed-loop points: requests kept in flight at once, each point "
                             "sending --requests requests (or 4 per client, if more); empty: none (default: 1,16,64)")
    parser.add_argument("--rates", type=numbers(float), default=[50.0, 150.0, 300.0],
                        help="comma-separated open-loop points: requests per second, Poisson arrivals for "
                             "--open-seconds each; empty (--rates \"\"): none (default: 50,150,300)")
    parser.add_argument("--requests", type=int, default=400, help="requests per closed-loop point")
    parser.add_argument("--open-seconds", type=float, default=6.0, help="length of each open-loop point")
    parser.add_argument("--modality", choices=("image", "audio"), default="image",
                        help="what every request carries: one image, or one audio clip (default: image)")
    parser.add_argument("--workload", type=lambda t: t.split(","), default=["single"],
                        help=f"comma-separated: {', '.join(WORKLOADS)}")
    parser.add_argument("--warm-requests", type=int, default=8,
                        help="requests of the workload sent before each point's clock starts; as many as a point "
                             "sends measures a cache in its steady state rather than from cold")
    parser.add_argument("--chat-conversations", type=int, default=256, help="conversations in the chat workload")
    parser.add_argument("--zipf", type=float, default=1.1, help="popularity exponent of the chat conversations")
    parser.add_argument("--cache-bytes", default="auto", help="the cache-on server's --cache-bytes")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds over the server configurations (comparisons report the median of the rounds)")
    parser.add_argument("--image-size", type=int, default=56,
                        help="side in pixels of the square images sent (--modality image); 56 is 4 patches of "
                             "28 for Qwen2.5-VL, 4 rows each (default: 56)")
    parser.add_argument("--audio-seconds", type=float, default=1.0,
                        help="length of the clips sent (--modality audio) (default: 1.0)")
    parser.add_argument("--model", default="tiny-qwen2.5-vl", help="the servers' --model (default: tiny-qwen2.5-vl)")
    parser.add_argument("--max-batch-size", type=int, default=32, help="the servers' --max-batch-size (default: 32)")
    parser.add_argument("--max-wait-ms", type=float, default=0.0, help="the servers' --max-wait-ms (default: 0)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"),
                        help="folder for results.json and the plots (default: bench-results, which git ignores)")
    parser.add_argument("--overwrite-tracked", action="store_true",
                        help="write into an --out whose results git tracks (docs/bench: the published figures), "
                             "which is refused otherwise")
    parser.add_argument("--replot", action="store_true",
                        help="only redraw the plots from --out/results.json (needs matplotlib)")
    return parser


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.replot:
        replot(args.out, args.overwrite_tracked)
        return
    run(args)


def replot(out: Path, overwrite_tracked: bool = False) -> list[str]:
    """Redraw the plots of `out/results.json`; says which files it wrote, or why none."""
    source = out / "results.json"
    if not source.is_file():
        raise SystemExit(f"encode-bench --replot: {source} does not exist: give the --out of an earlier run")
    check_out(out, overwrite_tracked)
    written = plot(json.loads(source.read_text()), out)
    if written:
        print("wrote " + ", ".join(str(out / name) for name in written))
    return written


def run(args, peers: Mapping[str, Peer] | None = None, skipped: Mapping[str, str] | None = None) -> dict:
    """The whole benchmark `args` describe; `peers`: more configurations by name, each a server of another
    kind that answers `/encode` (a checkout's peer comparisons give them); `skipped`: configurations left
    out, and why, recorded in the results."""
    peers = dict(peers or {})
    unknown = [config for config in args.compare if config not in (*CONFIGS, *peers, *(skipped or {}))]
    if unknown:
        raise SystemExit(f"encode-bench: unknown configuration {', '.join(map(repr, unknown))}: --compare takes "
                         f"{', '.join(CONFIGS)}. The peer comparisons (Ray Serve, SGLang, vLLM) are a checkout's "
                         f"benchmarks: python benchmarks/ray_compare.py, python benchmarks/sglang_compare.py, "
                         f"python benchmarks/vllm_compare.py (docs/BENCHMARKS.md)")
    check_out(args.out, args.overwrite_tracked)
    args.out.mkdir(parents=True, exist_ok=True)
    machine, machine_line = describe_machine()
    print(machine_line, flush=True)
    payloads = make_payloads(args.modality, 32, args.image_size, args.audio_seconds)
    results: dict = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                     "machine": machine, "points": [], "batch_histograms": {}, "skipped": dict(skipped or {})}

    if args.api_key:
        HEADERS["Authorization"] = f"Bearer {args.api_key}"
    salt = secrets.token_hex(4)  # this run's media differ from an earlier run's against the same server

    def workload(name: str):
        return make_workload(name, args.modality, args.image_size, args.audio_seconds, args.chat_conversations,
                             args.zipf, repeat=args.repeat_media, salt=salt)

    def label(config: str, name: str) -> str:
        return config if len(args.workload) == 1 else f"{name}:{config}"

    if args.url:
        before = scrape(args.url)
        for name in args.workload:
            results["points"] += sweep(args.url, "given", args, workload(name))
        results["batch_histograms"]["given"] = batch_histogram(args.url)
        results["hit_rate"] = run_hit_rate(before, scrape(args.url))
        print(f"cache hit rate over the run: {describe_hit_rate(results['hit_rate'])}", flush=True)
    servers = [] if args.url else [config for config in args.compare if config in SERVER_CONFIGS]
    for repeat in range(args.repeat):  # rounds alternate the configurations, so drifts in load hit all
        for name in args.workload:  # the configurations of one workload run back to back
            for config in servers:
                with ServerProcess(*server_flags(config, args)) as server:
                    points = sweep(server.url, config, args, workload(name), server.proc.pid)
                    results["points"] += [{**point, "repeat": repeat} for point in points]
                    results["batch_histograms"][label(config, name)] = batch_histogram(server.url)
    for config in [] if args.url else [config for config in args.compare if config not in SERVER_CONFIGS]:
        if config in peers:
            for name in args.workload:
                with peers[config]() as server:
                    results["points"] += sweep(server.url, config, args, workload(name))
        elif config == "ceiling":
            from encode_server.bench.ceiling import ceiling

            results["ceiling"] = ceiling(args.model, args.modality, payloads, args.max_batch_size)
            print(f"ceiling    batch {args.max_batch_size}: processor+forward "
                  f"{results['ceiling']['processor_and_forward_rps']:.1f} req/s, forward only "
                  f"{results['ceiling']['forward_only_rps']:.1f} req/s ({results['ceiling']['threads']} torch "
                  "threads, as the server's)", flush=True)
    results["cache_comparison"] = cache_comparison(results["points"])
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    written = plot(results, args.out)
    print(f"wrote {args.out / 'results.json'}" + (f" and {', '.join(written)}" if written else ""))
    print(machine_line, flush=True)  # beside the figures above
    return results


if __name__ == "__main__":
    main()
