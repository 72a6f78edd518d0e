"""CI machinery: the suite catalog, test registrations, discovery, audit and the runner."""
