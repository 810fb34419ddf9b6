"""Drop-in replacements for training utilities of the JAX ecosystem."""

from zkdv.jax.contrib.train_state import TrainState

__all__ = ["TrainState"]
