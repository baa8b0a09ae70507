"""`encode-bench` against a peer: the same model behind Ray Serve's `@serve.batch` (`ray_peer.py`), swept
beside this server's configurations in one run, with the same flags, results and plots as `encode-bench`.

    python benchmarks/ray_compare.py --compare on,off,ray,ceiling --concurrency 1,16,64 --rates 50,150,300 \\
        --out bench-results/ray

`ray` is one more `--compare` configuration (the default: on,off,ray,ceiling). It needs `ray[serve]` (the
peers extra: pip install -e '.[bench,peers]'); without it the ray configuration is skipped, saying so, and the
others run. The peer serves images only.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `python benchmarks/ray_compare.py` from anywhere

from encode_server.bench.__main__ import parse_args, run  # noqa: E402
from encode_server.bench.launcher import ServerProcess  # noqa: E402


def missing_reason(modality: str) -> str | None:
    """Why the Ray peer cannot run here (None: it can)."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        return "ray[serve] is not installed (the peers extra: pip install -e '.[bench,peers]')"
    if modality != "image":
        return "the Ray Serve peer serves images only"
    return None


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(arg == "--compare" or arg.startswith("--compare=") for arg in argv):
        argv = ["--compare", "on,off,ray,ceiling", *argv]
    args = parse_args(argv)
    reason = missing_reason(args.modality) if "ray" in args.compare else None
    if reason:
        print(f"ray: skipped ({reason})", flush=True)
        return run(args, skipped={"ray": reason})

    def peer() -> ServerProcess:
        return ServerProcess("--model", args.model, "--max-batch-size", str(args.max_batch_size), "--max-wait-ms",
                             str(args.max_wait_ms), module="benchmarks.ray_peer", cwd=ROOT, startup_timeout=300)

    return run(args, peers={"ray": peer})


if __name__ == "__main__":
    main()
