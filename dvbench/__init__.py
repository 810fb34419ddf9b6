"""DVBench: verified measurements of verifiable training runs.

Example::

  from dvbench import Client
  client = Client("http://127.0.0.1:8000")
  experiment = client.experiment("alice/mnist-mlp")
"""

from dvbench import errors
from dvbench.client import Client, Experiment

__all__ = ["Client", "Experiment", "errors"]
