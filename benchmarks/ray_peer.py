"""The peer for the benchmark: the same model served by Ray Serve with `@serve.batch`.

Same model, same `max_batch_size` and wait, same request and response shape (minus ZMQ delivery).
Decoding, the processor and the forward run in threads so the replica's event loop stays free, as
a careful Ray Serve user would write it. Needs the optional `peers` extra (`ray[serve]`).

    python benchmarks/ray_peer.py --port 8001 --max-batch-size 32 --max-wait-ms 0
"""


import argparse
import asyncio
import base64
import io
import signal
import sys
import threading

from fastapi import FastAPI, Request  # module level: Ray's ingress resolves handler annotations here
from fastapi.responses import JSONResponse


def build_app(model: str, max_batch_size: int, max_wait_s: float):
    from ray import serve

    api = FastAPI()

    @serve.deployment(max_ongoing_requests=1024)
    @serve.ingress(api)
    class RayEncoder:
        def __init__(self) -> None:
            from encode_server.models import load_adapter

            self.adapter = load_adapter(model, "auto", "auto")
            self.adapter.warmup()

        @serve.batch(max_batch_size=max_batch_size, batch_wait_timeout_s=max_wait_s)
        async def encode_batch(self, requests: list[list]) -> list[tuple[list[int], int]]:
            items = [item for request in requests for item in request]

            def run():
                prepared = self.adapter.processor.preprocess("image", items)
                return prepared, self.adapter.forward(prepared)

            prepared, rows = await asyncio.to_thread(run)
            answers, start, index = [], 0, 0
            for request in requests:
                tokens = sum(layout.tokens for layout in prepared.layouts[index:index + len(request)])
                answers.append(([tokens, rows.shape[1]], len(requests)))
                start, index = start + tokens, index + len(request)
            return answers

        @api.get("/health")
        async def health(self):
            return {"status": "ok"}

        @api.post("/encode")
        async def encode(self, request: Request):
            from PIL import Image

            body = await request.json()

            def decode():
                return [Image.open(io.BytesIO(base64.b64decode(item))).convert("RGB") for item in body["mm_items"]]

            try:
                images = await asyncio.to_thread(decode)
            except Exception as exc:
                return JSONResponse({"status": "error", "message": str(exc)}, status_code=400)
            shape, batch_size = await self.encode_batch(images)
            return {"req_id": body["req_id"], "embedding_shape": shape, "batch_size": batch_size}

    return RayEncoder.bind()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="tiny-qwen2.5-vl")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-wait-ms", type=float, default=0.0)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args()
    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, logging_level=args.log_level.upper(),
             runtime_env={"env_vars": {"PYTHONPATH": str(__import__("pathlib").Path(__file__).resolve().parents[1])}})
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(build_app(args.model, args.max_batch_size, args.max_wait_ms / 1000.0), name="encoder",
              route_prefix="/")
    print(f"encode-server ready: http://127.0.0.1:{args.port}", file=sys.stderr, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
