"""`python -m tools.zoo`: the model zoo's command (see `run.py`)."""

from tools.zoo.run import main

if __name__ == "__main__":
    raise SystemExit(main())
