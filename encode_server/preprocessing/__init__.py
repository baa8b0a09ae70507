"""Preprocessing outside the request's thread: `--preprocess-workers` processes (the pool, its tasks,
one worker as the pool sees it, what a worker does, tensors through shared memory) and
`--preprocess-device cuda`. May import: media, ops, parallel.worker (a worker's model set-up).
"""
