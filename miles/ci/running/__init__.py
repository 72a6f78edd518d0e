"""Running: the plan of a run, and executing it file by file in contained process groups."""
