"""What a run tells its user: the client's and the ZKDV driver's INFO lines, on stderr by
default.

Importing ``dvbench`` shows the ``dvbench.client`` and ``zkdv`` loggers' INFO lines (a proof's
page when it starts, its summary when it finishes, a policy raised to the server's minimum,
a server that stopped answering) until the application configures logging itself: once the
root logger has a handler, those lines go only where the application sends them. To silence
them: ``logging.getLogger("dvbench.client").setLevel(logging.WARNING)``.

Example::

  logger = console.logger
  logger.info("proof %s started: %s", proof_id, page)   # "dvbench: proof ... started: ..."
"""

import logging
import sys

logger = logging.getLogger("dvbench.client")
# logger -> the prefix of its lines (the driver's lines already begin with "ZKDV").
SHOWN_LOGGERS = {"dvbench.client": "dvbench: ", "zkdv": ""}


class UnlessConfigured(logging.StreamHandler):
  """Writes to the current ``sys.stderr`` while the root logger has no handler."""

  def __init__(self, prefix: str = ""):
    super().__init__(sys.stderr)
    self.setFormatter(logging.Formatter(prefix + "%(message)s"))

  def emit(self, record):
    if logging.getLogger().handlers:
      return  # the application chose where logs go; the record propagates there
    self.setStream(sys.stderr)
    super().emit(record)


def show_by_default() -> None:
  """Shows the client's INFO lines on stderr (once; a level set by the user is kept)."""
  for name, prefix in SHOWN_LOGGERS.items():
    shown = logging.getLogger(name)
    if shown.level == logging.NOTSET:
      shown.setLevel(logging.INFO)
    if not any(isinstance(h, UnlessConfigured) for h in shown.handlers):
      shown.addHandler(UnlessConfigured(prefix))
