"""How a training step may overlap with commitments and sampled checks.

Example::

  state = TrainState.create(..., zkdv_overlap=zkdv.overlap.NEVER)

* ``UNCHECKED`` (default): commitments pipeline behind training; a sampled
  check is a fence (the step returns once its replay has a result; the check's
  openings are written behind training).
* ``ALWAYS``: sampled checks run beside training too; more live buffers.
* ``NEVER``: every step returns only after its commitment and any check are
  durable; least concurrent residency.
"""

import enum


class Overlap(enum.Enum):
  UNCHECKED = "unchecked"
  ALWAYS = "always"
  NEVER = "never"


UNCHECKED = Overlap.UNCHECKED
ALWAYS = Overlap.ALWAYS
NEVER = Overlap.NEVER
