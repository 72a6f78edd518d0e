"""Selection: which registered tests a CI event runs, which a change may skip, and how they split into shards."""
