"""`python -m tests.support.no_plan_server ARGS`: the server (`encode_server.__main__.main(ARGS)`) in a process where
the qwen2_5_vl family has no tensor-parallel plan, for the test that such a family with `--tp-size 2` fails at start.
A module (not `python -c`), so that the test forks it from the test zygote."""

from __future__ import annotations

import dataclasses
import sys

import encode_server.models.families.qwen2_5_vl as qwen2_5_vl
from encode_server.models import registry


def main() -> None:
    qwen2_5_vl.FAMILY = dataclasses.replace(qwen2_5_vl.FAMILY, shard=None)
    registry.families.cache_clear()
    from encode_server.__main__ import main as serve

    serve(sys.argv[1:])


if __name__ == "__main__":
    main()
