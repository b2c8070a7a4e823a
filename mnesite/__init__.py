"""mnesite: a Mnesia/Mria-style replicated SQLite database.

The repository's top-level folders install as subpackages of this one (``mnesite.core``,
``mnesite.rlog``, ``mnesite.replicant``, ``mnesite.bootstrap``, ``mnesite.cli``, ``mnesite.spark``),
so that nothing generic lands in a user's site-packages. ``from mnesite import Client`` is the front door.
"""

from mnesite.rlog.client import Client, MnesiteError

__all__ = ["Client", "MnesiteError"]
