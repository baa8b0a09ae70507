"""The dispatch policy, its queues and cost model, and the running scheduler (fake clock, fake engine)."""
