"""HTTP: the FastAPI app that mounts every front's routes (`app.py`, with the server's own routes, error bodies
and the API key), uvicorn with a drain first (`draining.py`), the listening sockets and the error-answer log.
May import: runtime (whose lifespan it runs), service, ops, records; the fronts only through the runtime.
"""
