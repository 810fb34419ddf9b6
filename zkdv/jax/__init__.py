"""ZKDV for JAX: the ``ZKDV`` driver and ``contrib.TrainState``.

Example::

  proof = zkdv.jax.ZKDV("my-run").start()
  state = zkdv.jax.contrib.TrainState.create(proof=proof, ...)
"""

from zkdv.jax import contrib
from zkdv.jax.driver import ZKDV

__all__ = ["ZKDV", "contrib"]
