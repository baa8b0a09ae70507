"""The service in-process: admission, priorities, timeouts, on the real built-in encoder."""
