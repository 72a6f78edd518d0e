"""ROCm forms of the recipe scripts: the shared recipe plus a declared overlay."""
