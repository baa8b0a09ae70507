"""The real server over HTTP on loopback: the end-to-end contract, refusals, security, shutdown."""
