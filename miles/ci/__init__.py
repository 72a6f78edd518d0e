"""CI machinery: the suite catalog, test registrations, selection, the runner and its reports.

Entry points: `python -m miles.ci` (cli.py, every command in one table), the markers test
files call (register.py), the pytest plugin (pytest_plugin.py) and the catalog itself
(catalog.toml). The parts import one way: registry <- reports <- selection <- running,
machine beside them, commands on top (tests/unit/test_package_dependencies.py holds the map).
"""
