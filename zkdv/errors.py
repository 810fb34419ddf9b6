"""Typed errors of ZKDV. Each message says what happened and what to do.

Example::

  try:
    proof.finish()
  except zkdv.errors.NoTranscriptUpdateError as e:
    print(e)  # ... Decorate the function containing apply_gradients() with proof.jit.
"""


class ZKDVError(Exception):
  """Base class of every error ZKDV raises on purpose."""


class NoTranscriptUpdateError(ZKDVError):
  """No optimizer update reached the transcript."""

  FIX = ("Decorate the function containing apply_gradients() with proof.jit "
         "(not jax.jit).")

  def __init__(self, detail: str, fix: str | None = None):
    super().__init__(f"No transcript update: {detail} {self.FIX if fix is None else fix}")


class ProofIdentityError(ZKDVError):
  """A state was created with a different proof object."""

  def __init__(self, detail: str):
    super().__init__(
        f"Proof identity error: {detail} Use the exact proof instance returned "
        "for this experiment when you create the TrainState "
        "(TrainState.create(proof=proof, ...)).")


class AttestedProgramAlreadyRegisteredError(ZKDVError):
  """A manual proof.attest function and the TrainState integration were mixed."""

  def __init__(self, detail: str):
    super().__init__(
        f"Attested program already registered: {detail} Remove the manual "
        "proof.attest function when using the TrainState integration.")


class StaticArgumentError(ZKDVError):
  """Static arguments changed after the first attested call."""

  def __init__(self, detail: str):
    super().__init__(
        f"Static argument error: {detail} Automatic attestation fixes static "
        "arguments on the first training invocation. Keep their values "
        "unchanged for that compiled step, or make the value a supported "
        "dynamic input.")


class ExportError(ZKDVError):
  """The update program could not be exported with jax.export."""

  FIX = ("Pass randomness explicitly as a dynamic argument, and give "
         "TrainState.create(attest_apply_fn=...) a deterministic, exportable "
         "implementation of apply_fn if the model uses a custom kernel.")

  def __init__(self, detail: str, fix: str | None = None):
    super().__init__(f"Export failure: {detail} {self.FIX if fix is None else fix}")


class ReplayError(ZKDVError):
  """A sampled update check did not reproduce the committed post-state."""

  def __init__(self, detail: str):
    super().__init__(
        f"Replay failure: {detail} Pass randomness explicitly and use "
        "attest_apply_fn only for a deterministic, equivalent implementation.")


class UnsupportedUpdateError(ZKDVError):
  """The update sits where ZKDV cannot attest it (e.g. inside a loop)."""


class StepInputError(ZKDVError, ValueError):
  """A training step was called with inputs its program cannot take."""


class ProofStateError(ZKDVError, RuntimeError):
  """The proof is used out of order (not started, already finished)."""


class CommitmentError(ZKDVError, RuntimeError):
  """Committing or checking a step failed in the background."""


class ReplicaDivergenceError(ZKDVError, RuntimeError):
  """Replicas of one array hold different bytes (``cross_check_replicas``)."""


class TranscriptFormatError(ZKDVError, ValueError):
  """A transcript file or blob is malformed."""


class UnsupportedFormatError(TranscriptFormatError):
  """A transcript's ``format_version`` is not the one this zkdv reads."""


class StepOutputError(ZKDVError, TypeError):
  """A training step did not return the state it updated."""


class ReceiptError(ZKDVError, ValueError):
  """A DVBench receipt that is malformed, altered or signed by another key."""


class ChallengeTimeoutError(ZKDVError, RuntimeError):
  """The challenger gave no decision within the configured time.

  Training waits at the rolling window for the server's challenges; when the
  server stays unreachable the transcript so far is kept in its folder.
  """


def out_of_memory(error: BaseException) -> bool:
  """Whether ``error`` says this machine ran out of memory: a MemoryError, or XLA's
  RESOURCE_EXHAUSTED (e.g. ``jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of
  memory allocating 68719476736 bytes``). It is a fault of the machine that runs a
  program, never a finding about the program.
  """
  return isinstance(error, MemoryError) or str(error).lstrip().startswith("RESOURCE_EXHAUSTED")


class ResumeStateError(ZKDVError, ValueError):
  """A resumed run's restored state is not the last state its transcript committed."""


class UnanswerableChallengeError(ZKDVError, RuntimeError):
  """A resumed run cannot answer a check chosen before the crash (its openings are lost)."""


class DataOrderError(ZKDVError, ValueError):
  """A step's batch is not the one ``proof.batches`` drew for it (``zkdv.jax.sampler``)."""
