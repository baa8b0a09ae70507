"""Media: parse, fetch and decode each item on its own, off the event loop, within its limits; the URL
guard; the priority-ordered decode threads. May import: ops.
"""
