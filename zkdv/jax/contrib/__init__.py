"""Drop-in replacements for training utilities of the JAX ecosystem.

``zkdv.jax.contrib.TrainState`` replaces Flax Linen's ``TrainState``;
``zkdv.jax.contrib.nnx.Optimizer`` replaces Flax NNX's ``nnx.Optimizer``
(imported on first use, as it imports ``flax.nnx``).
"""

import importlib

from zkdv.jax.contrib.train_state import TrainState

__all__ = ["TrainState", "nnx"]


def __getattr__(name):
  if name == "nnx":
    return importlib.import_module("zkdv.jax.contrib.nnx")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
