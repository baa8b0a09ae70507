"""`encode-bench` and the checkout's `benchmarks/` (the soak is `slow`): the one test folder that imports
`benchmarks`, as tests/<package>/ imports the package it tests."""
