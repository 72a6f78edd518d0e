"""What the tests share: launching ranks, tiny checkpoints from the shared cache, reading results.

Imported one way everywhere, as `tests.support` (pyproject puts the project root on pytest's
path; `ranks.launch` puts it on the path of every process it starts, so a worker script imports
it the same way). Not tests: nothing here is collected.
"""
