"""HTTP: the FastAPI app (routes, body limits, error bodies, the API key) and the `/encode` response body.

Protocol fronts live here, one module each; they parse and answer, and hand every request to
`encode_server.service`. May import: service, admission, records, ops.
"""
