"""Private JAX primitives the update finder needs a rule for, in one place.

It stays apart from ``zkdv/jax/_compat.py`` (the other private JAX APIs):
``zkdv.interpreters`` sits below ``zkdv.jax``, and importing anything under
``zkdv.jax`` runs its ``__init__``, which imports the driver, which imports
``zkdv.interpreters.find``: ``import zkdv.interpreters.find`` would then fail
on a partially initialized module.

Example: ``find_rules[_compat.shard_map_p] = _call_rule``.
"""

from jax._src.shard_map import shard_map_p

__all__ = ["shard_map_p"]
