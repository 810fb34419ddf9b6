"""Private JAX primitives the update finder needs a rule for, in one place.

It stays apart from ``zkdv/jax/_compat.py`` (the other private JAX APIs):
``zkdv.interpreters`` sits below ``zkdv.jax``, and importing anything under
``zkdv.jax`` runs its ``__init__``, which imports the driver, which imports
``zkdv.interpreters.find``: ``import zkdv.interpreters.find`` would then fail
on a partially initialized module.

Example: ``find_rules[_compat.shard_map_p] = _call_rule``.

``debug_callback_p`` and ``debug_print_p`` are the primitives that
``jax.debug.callback`` and ``jax.debug.print`` bind; JAX exports neither.
"""

from jax._src.debugging import debug_callback_p
from jax._src.debugging import debug_print_p
from jax._src.shard_map import shard_map_p

__all__ = ["debug_callback_p", "debug_print_p", "shard_map_p"]
