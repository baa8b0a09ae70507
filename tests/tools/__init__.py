"""The compatibility harnesses and the model zoo (`tools/`), where they compute something worth pinning."""
