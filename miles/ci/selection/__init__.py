"""Selection: which registered tests a CI event runs, which a change may skip, how they shard."""
