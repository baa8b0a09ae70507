"""Settings, logs, metrics and housekeeping."""
