"""One temporary folder per benchmark run: what the run writes through ``tempfile`` (server
data folders, transcripts, checkpoints) goes under it, and it is removed at the end.

Example::

  if __name__ == "__main__":
    with scratch.run_folder("zkdv-data-order-"):
      main()
"""

import contextlib
import tempfile


@contextlib.contextmanager
def run_folder(prefix: str):
  """A new temporary folder, made ``tempfile``'s default until the block ends; then removed."""
  before = tempfile.tempdir
  with tempfile.TemporaryDirectory(prefix=prefix) as folder:
    tempfile.tempdir = folder
    try:
      yield folder
    finally:
      tempfile.tempdir = before
