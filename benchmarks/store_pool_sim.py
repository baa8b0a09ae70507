"""How a pool-wide cache (Mooncake Store behind each pod's own) scales past one machine: a simulation of 8 to
256 encoder pods (docs/BENCHMARKS.md, "A pool-wide cache: Mooncake Store").

The model, stated in full:
- ITEMS distinct media items; each request carries one, drawn with Zipf popularity p(rank) ~ 1 / rank^ZIPF
  (chat traffic: a few items, such as the image every turn re-sends or a shared system-prompt image, are
  asked for very often, most rarely);
- requests are spread round-robin over the pods (a router that ignores content);
- each pod's local cache holds LOCAL items, least recently used out first (the same for every pod);
- per-pod: a local miss is encoded; shared: a local miss is read from the Store if it holds the item
  (STORE items, least recently used out first; its memory is the pool's), else encoded and published;
- a pod restart halfway through: pod 0 loses its local cache (and, per-pod, everything it knew).

Reported per pod count and mode: the share of requests not encoded (hit rate), encodes per 1000 requests, the
encoder time they cost at ENCODE_MS per item and the time the Store reads cost at STORE_READ_MS (so that
"encoder-seconds saved" is net of the reads), and pod 0's hit rate over its first WINDOW requests after its
restart. Popularity, cache sizes and costs are parameters: the defaults are an assumption (see --help), not a
measurement; the measured loopback costs are in BENCHMARKS.md.

    python benchmarks/store_pool_sim.py [--pods 8 16 32 64 128 256] [--requests 400000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from collections import OrderedDict

import numpy as np


class LRU:
    """Keys only, least recently used out first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[int, None] = OrderedDict()

    def hit(self, key: int) -> bool:
        if key in self.entries:
            self.entries.move_to_end(key)
            return True
        return False

    def put(self, key: int) -> None:
        if self.capacity <= 0:
            return
        self.entries[key] = None
        self.entries.move_to_end(key)
        if len(self.entries) > self.capacity:
            self.entries.popitem(last=False)


def simulate(stream: np.ndarray, pods: int, local: int, store: int | None, window: int) -> dict:
    """One run; `store` None: per-pod caches only."""
    caches = [LRU(local) for _ in range(pods)]
    shared = LRU(store) if store is not None else None
    encodes = store_hits = 0
    restart_at = len(stream) // 2
    after_restart = after_restart_hits = 0
    for index, item in enumerate(stream.tolist()):
        pod = index % pods
        if index == restart_at:
            caches[0] = LRU(local)
        cache = caches[pod]
        counting = pod == 0 and index >= restart_at and after_restart < window
        if counting:
            after_restart += 1
        if cache.hit(item):
            if counting:
                after_restart_hits += 1
            continue
        if shared is not None and shared.hit(item):
            store_hits += 1
            cache.put(item)
            if counting:
                after_restart_hits += 1
            continue
        encodes += 1
        cache.put(item)
        if shared is not None:
            shared.put(item)
    total = len(stream)
    return {"hit_rate": 1 - encodes / total, "encodes_per_1000": 1000 * encodes / total,
            "store_hits_per_1000": 1000 * store_hits / total,
            "restarted_pod_hit_rate": after_restart_hits / after_restart if after_restart else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    parser.add_argument("--requests", type=int, default=400_000)
    parser.add_argument("--items", type=int, default=200_000, help="distinct media items")
    parser.add_argument("--zipf", type=float, default=1.0, help="popularity exponent")
    parser.add_argument("--local", type=int, default=2_000, help="items one pod's local cache holds")
    parser.add_argument("--store", type=int, default=100_000, help="items the Store holds (the pool's memory)")
    parser.add_argument("--encode-ms", type=float, default=30.0, help="encoder time per item (assumed)")
    parser.add_argument("--store-read-ms", type=float, default=2.0, help="time one Store read costs (assumed)")
    parser.add_argument("--window", type=int, default=1_000, help="pod 0's requests counted after its restart")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results here")
    options = parser.parse_args()
    rng = np.random.default_rng(options.seed)
    weights = 1.0 / np.arange(1, options.items + 1) ** options.zipf
    stream = rng.choice(options.items, size=options.requests, p=weights / weights.sum())
    rows = []
    for pods in options.pods:
        per_pod = simulate(stream, pods, options.local, None, options.window)
        shared = simulate(stream, pods, options.local, options.store, options.window)
        encode_s = lambda run: run["encodes_per_1000"] * options.encode_ms / 1e3  # noqa: E731
        read_s = shared["store_hits_per_1000"] * options.store_read_ms / 1e3
        rows.append({"pods": pods, "per_pod": per_pod, "shared": shared,
                     "encoder_s_per_1000_per_pod": encode_s(per_pod), "encoder_s_per_1000_shared": encode_s(shared),
                     "store_read_s_per_1000": read_s,
                     "net_s_saved_per_1000": encode_s(per_pod) - encode_s(shared) - read_s})
    print(f"{'pods':>5} {'hit per-pod':>12} {'hit shared':>11} {'encodes/1k per-pod':>19} {'shared':>7} "
          f"{'enc s/1k saved (net)':>21} {'restarted pod hit per-pod':>26} {'shared':>7}")
    for row in rows:
        print(f"{row['pods']:>5} {row['per_pod']['hit_rate']:>12.3f} {row['shared']['hit_rate']:>11.3f} "
              f"{row['per_pod']['encodes_per_1000']:>19.1f} {row['shared']['encodes_per_1000']:>7.1f} "
              f"{row['net_s_saved_per_1000']:>21.2f} {row['per_pod']['restarted_pod_hit_rate']:>26.3f} "
              f"{row['shared']['restarted_pod_hit_rate']:>7.3f}")
    if options.json:
        with open(options.json, "w") as out:
            json.dump({"parameters": vars(options), "rows": rows}, out, indent=2)


if __name__ == "__main__":
    main()
