"""`python -m tools.zoo`: the model zoo's command (see `tests/support/zoo/run.py`)."""

from tests.support.zoo.run import main

if __name__ == "__main__":
    raise SystemExit(main())
