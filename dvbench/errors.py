"""Errors of the DVBench client; each says what to do."""


class DVBenchError(Exception):
  """Base class of DVBench client errors."""


class ConfigurationError(DVBenchError, ValueError):
  """The client lacks a server URL or a token."""


class ApiError(DVBenchError):
  """The server refused a request (4xx) or failed (5xx)."""

  def __init__(self, status: int, message: str):
    super().__init__(f"DVBench server answered {status}: {message}")
    self.status, self.message = status, message


class UploadError(DVBenchError, RuntimeError):
  """The transcript could not be uploaded in time."""


class MeasurementError(DVBenchError, ValueError):
  """A measurement cannot be made or submitted as asked."""
