"""`encode-bench` as a script: python scripts/bench.py --help (the code lives in encode_server/bench)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from encode_server.bench.__main__ import main  # noqa: E402

if __name__ == "__main__":
    main()
