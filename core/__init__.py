"""core: see README.md."""
