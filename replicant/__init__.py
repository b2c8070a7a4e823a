"""replicant: see README.md."""
