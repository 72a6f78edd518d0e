"""The subcommands of `python -m miles.ci`, grouped by the subsystem they drive."""
