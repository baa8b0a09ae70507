"""Where the repository's files are, for tests and the tools that share their support (no imports beyond
the standard library, so the compatibility tools' own venvs can import it)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
#: Inputs and outputs recorded from other systems (real SGLang's frames, vLLM's identifiers and media).
GOLDEN = TESTS / "golden"
#: References computed with `transformers`' full processors by the reference tools.
DATA = TESTS / "data"
#: Put on `PYTHONPATH`, it makes a process run as on a machine without torchvision.
NO_TORCHVISION = TESTS / "support" / "no_torchvision"
