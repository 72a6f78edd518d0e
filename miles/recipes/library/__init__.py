"""One module per recipe: `RECIPE` (the shared form) with its declared platform overlays."""
