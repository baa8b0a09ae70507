"""The repository as a whole: the package layout, the tests' own layout, docs, deployment files, scripts and the
test harness."""
