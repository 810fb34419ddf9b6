"""Private JAX primitives the update finder needs a rule for, in one place."""

from jax._src.shard_map import shard_map_p

__all__ = ["shard_map_p"]
