"""The ZKDV driver: one proof's lifecycle, its transcript and its compiled steps.

The driver dispatches steps on the training thread; a ``Committer`` hashes
and writes them on the commit thread, and a challenger (``zkdv.challengers``)
decides which steps are opened.

Example::

  proof = zkdv.jax.ZKDV("my-run", zkdv.ZKDVConfig())
  proof.start(rolling_window=4, probe_ratio=0.01)

  @proof.jit(donate_argnums=(0,))
  def train_step(state, batch):
    ...
    return state.apply_gradients(grads=grads)

  for batch in batches:
    state = train_step(state, batch)
  proof.finish()
"""

import datetime
import logging
import os
import pathlib
import re

import jax
import jaxlib

from zkdv import __version__
from zkdv import challenge
from zkdv import challengers
from zkdv import config as config_lib
from zkdv import errors
from zkdv import keys
from zkdv import records
from zkdv import transcript
from zkdv.jax import closing
from zkdv.jax import digests as digests_lib
from zkdv.jax import processes
from zkdv.jax import resume as resume_lib
from zkdv.jax import sampler
from zkdv.jax import shared_decisions
from zkdv.jax import start as start_lib
from zkdv.jax.committer import Committer
from zkdv.jax.dispatch import Dispatcher
from zkdv.jax.step import ProofFunction

logger = logging.getLogger("zkdv")


def _default_folder(name: str) -> pathlib.Path:
  slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "proof"
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  return pathlib.Path.cwd() / "zkdv-proofs" / f"{slug}-{stamp}-{os.urandom(3).hex()}"


def _root_record(name: str, config: config_lib.ZKDVConfig, group, challenger,
                 run: dict) -> dict:
  devices = jax.devices()
  return {
      "type": "root",
      "format_version": transcript.FORMAT_VERSION,
      "prover": transcript.PROVER,
      "name": name,
      "versions": {"zkdv": __version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__},
      "platform": devices[0].platform,
      "device_kinds": sorted({d.device_kind for d in devices}),
      "config": config.to_record(),
      "challenger": challenger.root_fields(),
      **({"processes": group.count} if group.multi else {}),
      **run,
  }


def _identity(base):
  """The init function of ``proof.init_from(base)``: the base params themselves."""
  return base


class ZKDV(resume_lib.ResumingRun, closing.ClosingRun):
  """A verifiable training run: ``start``, ``jit``/``attest``, ``finish``.

  Attributes:
    name: the proof's name, written into the root record.
    config: its ``zkdv.ZKDVConfig``.
    run: the declared ``run_name``, ``tags`` and ``run_config`` the root carries for the
      run's pages (``zkdv.records.run_fields``); shown as declared, never verified.
    path: the transcript folder (set by ``start``).
    policy: the effective ``challenge.Policy`` (set by ``start``).
    steps: the number of steps recorded so far.
    checks: how many update, state and probe checks were answered.
    discontinuities: steps whose pre-state was not the previous post-state.
    committed_here: state pieces and batch rows this process hashed (in a
      multi-process run, each process hashes those it holds).
    resume_from: the transcript folder of a crashed run this proof continues
      (``ZKDV(name, resume=folder)``), or None.
  """

  def __init__(self, name: str, config: config_lib.ZKDVConfig | None = None, *,
               resume: str | os.PathLike | None = None, run_name: str | None = None,
               tags=(), run_config: dict | None = None):
    if not isinstance(name, str) or not name:
      raise ValueError(f"a proof needs a non-empty name, got {name!r}.")
    self.run = records.run_fields(run_name, tags, run_config)
    config = config_lib.ZKDVConfig() if config is None else config
    if not isinstance(config, config_lib.ZKDVConfig):
      raise TypeError(f"config must be a zkdv.ZKDVConfig, got {type(config).__name__}.")
    self.name = name
    self.config = config
    self.resume_from = None if resume is None else pathlib.Path(resume)
    self.unresumed = False  # a resumed run that ended before its resume record (``finish``)
    self.path: pathlib.Path | None = None
    self.policy: challenge.Policy | None = None
    self._writer: transcript.TranscriptWriter | None = None  # process 0 only
    self._group: processes.ProcessGroup | None = None
    self._committer: Committer | None = None
    self._challenger = None
    self._digests = None
    self._finished = False
    self._aborted = False
    self._finish_error: errors.ZKDVError | None = None
    self._registered: dict[str, ProofFunction] = {}
    self._called: set[str] = set()  # the names of proof.jit/attest steps called
    self._dispatcher: Dispatcher | None = None
    self._key_seed: bytes | None = None  # the seed of the proof's keys (zkdv.keys)
    self._pending_init: start_lib.InitProgram | None = None  # written before step 0
    self._resumed_init: start_lib.InitProgram | None = None  # recorded before a crash
    self._data_order: sampler.DataOrder | None = None  # set by proof.batches

  def __repr__(self):
    return f"ZKDV({self.name!r})"

  def __copy__(self) -> "ZKDV":
    return self

  def __deepcopy__(self, memo) -> "ZKDV":
    """The proof itself: a copied state (``copy.deepcopy(state)``, ``nnx.clone``)
    still belongs to this run, as a copied Flax state shares its ``apply_fn``."""
    del memo
    return self

  @property
  def writes_transcript(self) -> bool:
    """Whether this process writes the transcript: in a multi-process run only
    process 0 does; the others send it the digests of what they hold."""
    return self._writer is not None

  @property
  def challenger_kind(self) -> str | None:
    """``"self"`` or ``"dvbench"``: who chooses the checks (set by ``start``)."""
    return None if self._challenger is None else self._challenger.kind

  # -- lifecycle -------------------------------------------------------------

  def start(self, rolling_window: int = 16, probe_ratio: float = 0.0) -> "ZKDV":
    """Opens the transcript and writes its root record.

    A proof that is used without ``start()`` starts itself at its first step
    with these defaults.

    Args:
      rolling_window: at most this many steps may be in flight whose records
        are not yet written or whose challenges are not yet decided (bounds
        the batches ZKDV keeps for a server's late challenges; a decided
        step's answer is written behind at most a window of newer steps). An adaptive
        segment is at most this long, so an undecided segment's batches stay
        within the window too. A server's challenger widens the window, up to
        its policy's, when its decisions take longer than that many steps; a
        DVBench proof's adaptive segments may grow to half that largest window
        (``zkdv.config.adaptive_segment_bound``).
      probe_ratio: the probability with which each batch row is opened as a data
        probe: a step is probed with probability ``min(1, 32 * probe_ratio)``, and opens
        at least a 32nd of each batch leaf's rows (``zkdv.challenge.step_probed``).
    """
    if self._group is not None:
      raise errors.ProofStateError(f"{self!r} is already started; start() runs once.")
    if self.resume_from is not None:
      return self._start_resumed()
    sampling = self.config.sampling_policy
    group = processes.ProcessGroup.current()
    # A step's record waits for the next step, which a window of one would never admit.
    segment_length = (1 if group.multi or rolling_window == 1 else self.config.segment_length
                      or min(config_lib.MAX_SEGMENT_LENGTH, rolling_window))
    policy = challenge.Policy(sampling.update_check_probability,
                              sampling.state_check_probability, probe_ratio, rolling_window,
                              segment_length, sampling.full_replay)

    def open_transcript() -> dict:  # on process 0; a failure leaves every process unstarted
      seed = challenge.new_key()
      challenger = self._make_challenger(policy, seed, group)
      path = (pathlib.Path(self.config.output_dir) if self.config.output_dir
              else _default_folder(self.name))
      writer = transcript.TranscriptWriter(path)  # refuses a folder that holds a transcript
      root = _root_record(self.name, self.config, group, challenger, self.run)
      try:
        writer.append(root, durable=True)
      except BaseException:
        writer.close()
        raise
      if challenger.kind == "self":  # kept until final reveals it, so a crash can resume
        transcript.write_atomically(path / resume_lib.SEED_FILE, seed, mode=0o600)
      self._writer, self._challenger = writer, challenger
      return {"run_id": os.urandom(16), "seed": seed, "folder": str(path),
              "challenger": root["challenger"], "window": rolling_window,
              "key_seed": keys.key_seed(root["challenger"], writer.transcript_id)}

    run = group.open_run(open_transcript)
    path = pathlib.Path(run["folder"])
    self._key_seed = run["key_seed"]
    if group.is_writer:
      logger.info("ZKDV proof %r: transcript at %s (checks chosen by %s)", self.name, path,
                  self._challenger.kind)
    else:
      self._challenger = shared_decisions.follower_challenger(run["challenger"], run["seed"])
      logger.info("ZKDV proof %r: process %d commits its shards; process 0 writes %s",
                  self.name, group.index, path)
    self._open(path, group, run["window"])  # process 0's: rounds follow the same window
    return self

  def _open(self, path: pathlib.Path, group, window: int | None = None) -> None:
    """The committer and dispatcher of a started proof (``window``: the first rolling
    window, the policy's when None)."""
    self.path, self.policy = path, self._challenger.policy
    self._digests = digests_lib.for_config(self.config.digest_backend)
    # A server's challenger may widen the window up to its policy's (Dispatcher._size_window).
    self._committer = Committer(self._writer, group, self._digests, self.config,
                                min(window or self.policy.rolling_window,
                                    self.policy.rolling_window),
                                on_error=self._report_failure)
    self._committer.prover_replays = not self.policy.full_replay  # the verifier replays all
    if isinstance(self._challenger, challengers.ServerChallenger) and not group.multi:
      self._challenger.on_decision = self._committer.answer  # across processes: rounds
    self._dispatcher = Dispatcher(self._committer, self._challenger, self._digests, group,
                                  self.config)
    self._group = group

  def _make_challenger(self, policy: challenge.Policy, seed: bytes, group):
    """The challenger of this proof: self-chosen checks (DVBench proofs override it)."""
    del group
    return challengers.SelfChallenger(policy, seed)

  # -- compiling steps -------------------------------------------------------

  def jit(self, fun=None, /, **jit_options):
    """``jax.jit`` for a step that calls ``state.apply_gradients``.

    Usable as ``@proof.jit`` or ``@proof.jit(donate_argnums=(0,), ...)`` with
    every ``jax.jit`` option.
    """
    if fun is None:
      return lambda f: ProofFunction(self, f, jit_options)
    return ProofFunction(self, fun, jit_options)

  def attest(self, fun=None, /, *, state_argnum: int = 0, **jit_options):
    """Registers a manual update function for a loop without TrainState.

    ``fun(state, *batch)`` must return the new state, alone or beside outputs of
    another structure (found by the state's tree structure and shapes: a tuple or
    list state is returned as itself); argument ``state_argnum`` is the state,
    every other dynamic argument is batch evidence.
    """
    if fun is None:
      return lambda f: self.attest(f, state_argnum=state_argnum, **jit_options)
    return ProofFunction(self, fun, jit_options, state_argnum=state_argnum)

  def init(self, init_fn, /, *args, **kwargs):
    """``init_fn(*args, **kwargs)``, run as an exported program whose output is the
    attested start of the proof (docs/design.md §10, claim "start").

    Every PRNG key among the arguments is replaced by the proof's start key
    (``proof.key()``, derived from its slot). A verifier replays the init program
    from the recorded inputs bit for bit, again with other example values (the
    outputs must not change) and with another key (the params must), and checks
    that every leaf of the first step's state is one of its outputs.
    ``TrainState.create(proof=proof, params=...)`` with params from ``proof.init``
    adds the optimizer state and step to the same program. Call it before the
    first step::

      params = proof.init(model.init, jax.random.key(0), jnp.ones((1, 4)))["params"]
    """
    return self._attest_start(init_fn, args, kwargs)

  def init_from(self, base, init_fn=None, /, *args, **kwargs):
    """The start of a fine-tuning run: ``init_fn(base, *args, **kwargs)`` (``base``
    itself when ``init_fn`` is None), run as an exported program whose input ``base``
    is a params pytree, the base checkpoint. The record declares its params digest
    (the digest ``final_params`` and measurements use), so readers see a start from
    that checkpoint, never a start from scratch. A verifier checks the opened base
    against the declared digest, replays the program on it bit for bit, and checks
    that the base matters (replayed with other base values, the params change).
    PRNG keys among ``args`` become the start key, as in ``proof.init``::

      params = proof.init_from(pretrained)
      state = TrainState.create(proof=proof, apply_fn=model.apply, params=params, tx=tx)
    """
    return self._attest_start(_identity if init_fn is None else init_fn, args, kwargs, base)

  def _attest_start(self, init_fn, args: tuple, kwargs: dict, base=None):
    self.ensure_started()
    if self.resume_from is not None and self._committer.init_recorded:
      # attested before the crash: the same outputs, from the same start key (kept, so that
      # TrainState.create builds the start state with the program that recorded it)
      self._resumed_init = start_lib.run_init(init_fn, args, kwargs, self._key_seed, base)
      return self._resumed_init.outputs
    if self.steps:
      raise errors.ProofStateError(
          f"{self!r} already recorded {self.steps} steps; proof.init() attests the "
          "initial state, so call it before the first step.")
    if self._committer.init_recorded or self._pending_init is not None:
      raise errors.ProofStateError(f"{self!r} already has an attested start; "
                                   "proof.init() runs once per proof.")
    self._pending_init = start_lib.run_init(init_fn, args, kwargs, self._key_seed, base)
    return self._pending_init.outputs

  def extend_init(self, part, build):
    """``build(part)`` as outputs of the init program when ``part`` came from
    ``proof.init`` and no step ran yet (``TrainState.create`` calls it); else None. A
    resumed run builds it the same way, recording nothing: a state built outside that
    program may differ in its bits (an optimizer's init computed eagerly), and the attested
    start is a state the run may replay from."""
    if self._resumed_init is not None and self._dispatcher.restored is not None:
      init = start_lib.extend_init(self._resumed_init, part, build, self._key_seed)
      return None if init is None else init.outputs
    if self._pending_init is None or self.steps:
      return None
    init = start_lib.extend_init(self._pending_init, part, build, self._key_seed)
    if init is None:
      return None
    self._pending_init = init
    return init.outputs

  def key(self, step: int | None = None, impl=None) -> jax.Array:
    """The proof's public PRNG key: the start key (``step`` None, what ``proof.init``
    uses) or step ``step``'s key, the only value a PRNG-key batch argument of that step
    may hold. Both derive from the proof's slot (``zkdv.keys``), not from the prover.

    Example: ``state = train_step(state, batch, proof.key(t))`` at step ``t``.
    """
    self.ensure_started()
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
      raise ValueError(f"step must be None (the start key) or an int >= 0, got {step!r}.")
    return start_lib.proof_key(self._key_seed, step, impl)

  def step_key(self, impl=None) -> jax.Array:
    """The key of the next step this proof records: ``proof.key(proof.steps)``.

    Example: ``key, step_key = jax.random.split(key)`` becomes
    ``step_key = proof.step_key()``.
    """
    return self.key(self.steps, impl)

  def batches(self, dataset, batch_size: int, *, epochs: int = 1):
    """Batches of ``dataset`` (a pytree of arrays sharing a leading axis) in an order the
    prover cannot choose: seeded by the proof's slot, as ``proof.key``. Each step takes the
    next batch unchanged; its record commits the batch's row indices and a verifier checks
    them and every probed row against the dataset's Merkle root (``zkdv.jax.sampler``)::

      for batch in proof.batches({"x": x, "y": y}, batch_size=32, epochs=2):
        state = train_step(state, batch)
    """
    return sampler.batches(self, dataset, batch_size, epochs)

  def grain_batches(self, source, batch_size: int, *, epochs: int = 1, read_options=None):
    """``batches`` of a Grain data source (``grain.sources.RandomAccessDataSource``), read by
    Grain in the same seeded order (the optional ``grain`` extra)."""
    return sampler.grain_batches(self, source, batch_size, epochs, read_options)

  def submit_record(self, record: dict) -> None:
    """Queues a record (written in order with the steps) where this process writes."""
    if self._writer is not None:
      self._committer.pipeline.submit(lambda job: self._writer.append(record, durable=True))

  def _write_pending_init(self) -> None:
    if self._pending_init is not None:
      self._committer.submit_init(self._pending_init)
      self._pending_init = None

  # -- what proof.jit steps call ----------------------------------------------

  def note_call(self, name: str) -> None:
    """Records that the step ``name`` was called (``finish`` then names it if no
    step was recorded)."""
    self._called.add(name)

  def ensure_started(self) -> None:
    """Starts the proof with default arguments if start() was not called.

    Raises ProofStateError once the proof is finished.
    """
    if self._finished:
      raise errors.ProofStateError(
          f"{self!r} is finished; start a new proof to record more steps.")
    if self._group is None:
      logger.info("ZKDV proof %r was not started; starting it with default arguments.",
                  self.name)
      self.start()

  def register(self, fn: ProofFunction) -> None:
    """Records a step function; a proof takes TrainState steps or one proof.attest function."""
    kind = "manual" if fn.manual else "trainstate"
    other = self._registered.get("trainstate" if fn.manual else "manual")
    if other is not None:
      raise errors.AttestedProgramAlreadyRegisteredError(
          f"{fn.__name__} ({'proof.attest' if fn.manual else 'TrainState'}) "
          f"meets {other.__name__} ({'TrainState' if fn.manual else 'proof.attest'}) "
          "on the same proof.")
    if fn.manual and self._registered.get("manual") not in (None, fn):
      raise errors.AttestedProgramAlreadyRegisteredError(
          f"{self._registered['manual'].__name__} is already registered with "
          "proof.attest; a proof attests one manual update function.")
    self._registered.setdefault(kind, fn)

  def run_step(self, program, leaves: list) -> list:
    """Dispatches one step of ``program`` and queues its commitment and checks."""
    self._write_pending_init()
    index = self.steps
    data = None if self._data_order is None else self._data_order.take(index)
    try:
      return self._dispatcher.run(program, leaves, data)
    except BaseException:
      unused = self._dispatcher.untaken_batch  # a resumed run's first: maybe redrawn
      if unused is not None:
        self._dispatcher.untaken_batch = None
        self._data_order.give_back(unused)  # not recorded: the batch is stepped on again
      raise
