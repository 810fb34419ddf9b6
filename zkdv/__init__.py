"""ZKDV: verifiable training. ``import zkdv`` does not import JAX.

Example::

  import zkdv
  config = zkdv.ZKDVConfig(
      sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.01))
  proof = zkdv.jax.ZKDV("my-run", config)   # zkdv.jax loads on first use
"""

import importlib

__version__ = "0.1.0"

from zkdv import errors
from zkdv import overlap
from zkdv.config import SamplingPolicy, Tolerance, ZKDVConfig

__all__ = ["SamplingPolicy", "Tolerance", "ZKDVConfig", "errors", "overlap", "jax"]

_LAZY_SUBMODULES = ("jax",)


def __getattr__(name):
  if name in _LAZY_SUBMODULES:
    return importlib.import_module(f"zkdv.{name}")
  raise AttributeError(f"module 'zkdv' has no attribute {name!r}")
