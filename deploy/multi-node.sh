#!/usr/bin/env bash
# Several encoder nodes behind a router: start one encoder per node (single-gpu.sh, tensor-parallel.sh or
# data-parallel.sh) and give the router every node's address. Routers spread /encode over the nodes and
# route by /health (503 while a node drains or lost a rank). This script starts the local node and
# prints the line to add to the router's encoder list.
# Usage: MODE=data-parallel MODEL=/models/... ./multi-node.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
echo "router: add http://$(hostname -I | awk '{print $1}'):${PORT:-30000} to the encoder pool" >&2
exec "$here/${MODE:-single-gpu}.sh" "$@"
