"""The registry: the suite catalog, the registrations read from test files, the rules they obey."""
