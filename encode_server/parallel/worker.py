"""A worker rank, started by rank 0: a tensor-parallel rank or a data-parallel replica.

It builds the same model as rank 0 (built-ins come from a fixed seed; folders hold the same
weights), then takes batches of raw request data from rank 0, in order, over a ZMQ channel, and
decodes and preprocesses them itself.

- A tensor-parallel rank joins `torch.distributed`, shards its encoder, and for every batch agrees
  on the layout digest with the other ranks (an all-gather) before the forward, so that a rank
  that could not prepare a batch makes every rank skip it instead of waiting in a collective.
- A data-parallel replica runs whole batches and sends the rows back.

The worker dies with rank 0 (PR_SET_PDEATHSIG), so no rank outlives the server.

    python -m encode_server.parallel.worker --role tp --rank 1 --world-size 2 ...  (rank 0 runs this)
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

import torch
import zmq

from encode_server.media.decoding import MediaError, MediaLimits, decode_bytes, decode_frames
from encode_server.models import load_adapter
from encode_server.ops.libc import libc
from encode_server.ops.logs import configure_logging, route_library_logs
from encode_server.ops.settings import Settings
from encode_server.parallel.channel import pack_result, unpack_batch

log = logging.getLogger("encode_server.parallel.worker")


def die_with_parent() -> None:
    """Ask Linux to send SIGTERM to this process when rank 0 exits (a no-op elsewhere)."""
    lib = libc() if sys.platform.startswith("linux") else None
    if lib is not None:
        lib.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def prepare(adapter, limits: MediaLimits, modality: str, raw_items: list):
    """Decode and preprocess a batch as rank 0 did; returns (prepared, layouts)."""
    decoded = []
    for index, raw in enumerate(raw_items):
        location = f"item {index}"
        item = decode_frames(raw, limits, location) if isinstance(raw, list) else \
            decode_bytes(modality, raw, limits, location)
        decoded.append(item)
    layouts = [adapter.processor.item_layout(modality, item) for item in decoded]
    return adapter.processor.preprocess(modality, decoded), layouts


def run_tensor_parallel(adapter, limits: MediaLimits, batches: zmq.Socket) -> None:
    from encode_server.parallel.tensor_parallel import agree_on_layout

    while True:
        batch_id, modality, raw_items = unpack_batch(batches.recv_multipart())
        try:
            prepared, _ = prepare(adapter, limits, modality, raw_items)
        except (MediaError, ValueError, RuntimeError) as exc:
            log.warning("batch %d: could not prepare it here: %s", batch_id, exc)
            prepared = None
        try:
            agree_on_layout(prepared)
        except RuntimeError as exc:
            log.warning("batch %d skipped: %s", batch_id, exc)
            continue
        adapter.forward(prepared)  # collectives inside; rank 0 keeps the rows


def run_data_parallel(adapter, limits: MediaLimits, batches: zmq.Socket, results: zmq.Socket) -> None:
    while True:
        batch_id, modality, raw_items = unpack_batch(batches.recv_multipart())
        try:
            prepared, layouts = prepare(adapter, limits, modality, raw_items)
            rows = adapter.forward(prepared)  # rank 0 checks the row count when it slices the rows
            if prepared.layouts != layouts:
                raise RuntimeError("processor grids differ from the items' layouts")
            results.send_multipart(pack_result(batch_id, rows, prepared.layouts), copy=False)
        except Exception as exc:  # reported to rank 0, which retries the requests elsewhere
            results.send_multipart(pack_result(batch_id, None, [], error=f"{type(exc).__name__}: {exc}"))


#: A rank's exit status when its start-up failed; rank 0 says why (it runs the same checks) or names the rank.
START_FAILED = 3


def main(argv: list[str] | None = None) -> None:
    """Run a rank; a start-up failure is one line (none for a sharding error, which rank 0 meets and reports
    too), never a traceback, and exits `START_FAILED`."""
    from encode_server.models.sharding.blocks import ShardingError

    try:
        serve_rank(argv)
    except ShardingError:  # the same model and --tp-size on every rank: rank 0 reports it, once
        sys.exit(START_FAILED)
    except (ValueError, OSError, RuntimeError) as exc:
        log.error("cannot start: %s", exc)
        sys.exit(START_FAILED)
    except KeyboardInterrupt:  # Ctrl-C reaches every process of the group: rank 0 says it
        sys.exit(128 + signal.SIGINT)


def serve_rank(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="encode-server worker rank (started by rank 0)")
    parser.add_argument("--role", choices=("tp", "dp"), required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--settings-json", required=True)
    parser.add_argument("--batch-endpoint", required=True)
    parser.add_argument("--result-endpoint")
    parser.add_argument("--dist-init")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    die_with_parent()
    settings = Settings(**json.loads(args.settings_json))
    configure_logging(settings.log_level, settings.log_format, process=f"rank{args.rank}")
    if args.device == "cpu":
        torch.set_num_threads(settings.cpu_threads_per_rank(args.world_size))
    route_library_logs()  # transformers' lines in the rank's format too
    adapter = load_adapter(settings.model, args.device, settings.dtype)
    limits = MediaLimits.from_settings(settings, adapter)
    context = zmq.Context()
    batches = context.socket(zmq.PULL)
    batches.connect(args.batch_endpoint)
    if args.role == "tp":
        from encode_server.parallel.tensor_parallel import start_tensor_parallel

        start_tensor_parallel(adapter, args.device, args.dist_init, args.rank, args.world_size)
        run_tensor_parallel(adapter, limits, batches)
    else:
        results = context.socket(zmq.PUSH)
        results.connect(args.result_endpoint)
        adapter.warmup()
        results.send_multipart(pack_result(-args.rank, None, []))  # ready
        run_data_parallel(adapter, limits, batches, results)


if __name__ == "__main__":
    main()
