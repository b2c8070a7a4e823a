"""mnesite: a Mnesia/Mria-style replicated SQLite database.

The repository's top-level folders install as subpackages of this one (``mnesite.core``,
``mnesite.rlog``, ``mnesite.replicant``, ``mnesite.bootstrap``, ``mnesite.cli``, ``mnesite.spark``),
so that nothing generic lands in a user's site-packages. ``from mnesite import Client`` is the front door.
"""

# The one place the release is named: the package metadata (pyproject.toml reads it), ``mnesite
# --version``, ``status`` and the version announcements between nodes (rlog.versions) all read this.
__version__ = "0.2.0.dev0"

from mnesite.rlog.client import Client, MnesiteError  # noqa: E402  (after __version__: rlog.versions reads it)

__all__ = ["Client", "MnesiteError", "__version__"]
