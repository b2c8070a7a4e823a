"""bootstrap: see README.md."""
