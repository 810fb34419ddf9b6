"""The few private JAX APIs ZKDV needs, in one place."""

from jax._src.tree_util import broadcast_prefix  # pylint: disable=unused-import
