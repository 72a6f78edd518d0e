"""Collect each test file only where its registrations say it runs (see the plugin)."""

pytest_plugins = ("miles.ci.pytest_plugin", "pytester")
