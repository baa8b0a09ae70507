"""Scheduling: the pure dispatch policy, its queues, the learned cost model, the clock, what waiting
requests ask of a shared encode (`demand`), the queue's load and a newcomer's estimated wait (`load`, for
`/v1/load` and the autoscaling gauges), and the scheduler, the one owner of the queue, with its thread and
mailbox. May import: records, ops. The policy itself imports nothing but the settings'
defaults; the scheduler thread imports the scheduler, never the other way round.
"""
