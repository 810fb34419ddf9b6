"""The ZKDV driver: one proof, its transcript and its compiled steps.

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

import dataclasses
import datetime
import logging
import os
import pathlib
import re
import threading

import jax
import jaxlib
import numpy as np

from zkdv import __version__
from zkdv import config as config_lib
from zkdv import digest
from zkdv import errors
from zkdv import merkle
from zkdv import overlap as overlap_lib
from zkdv import sampling
from zkdv import transcript
from zkdv.jax import arrays
from zkdv.jax import digests as digests_lib
from zkdv.jax import processes
from zkdv.jax import replay
from zkdv.jax.pipeline import CommitPipeline
from zkdv.jax.step import ProofFunction

logger = logging.getLogger("zkdv")


def _default_folder(name: str) -> pathlib.Path:
  slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "proof"
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  return pathlib.Path.cwd() / "zkdv-proofs" / f"{slug}-{stamp}-{os.urandom(3).hex()}"


class ZKDV:
  """A verifiable training run: ``start``, ``jit``/``attest``, ``finish``.

  Attributes:
    name: the proof's name, written into the root record.
    config: its ``zkdv.ZKDVConfig``.
    path: the transcript folder (set by ``start``).
    steps: the number of steps recorded so far.
    checks: how many update and state checks ran.
    discontinuities: steps whose pre-state was not the previous post-state.
    committed_here: state pieces and batch rows this process hashed (in a
      multi-process run, each process hashes those it holds).
  """

  def __init__(self, name: str, config: config_lib.ZKDVConfig | None = None):
    if not isinstance(name, str) or not name:
      raise ValueError(f"a proof needs a non-empty name, got {name!r}.")
    config = config_lib.ZKDVConfig() if config is None else config
    if not isinstance(config, config_lib.ZKDVConfig):
      raise TypeError(f"config must be a zkdv.ZKDVConfig, got {type(config).__name__}.")
    self.name = name
    self.config = config
    self.path: pathlib.Path | None = None
    self.steps = 0
    self.checks = {"update": 0, "state": 0}
    self.discontinuities: list[int] = []
    self.committed_here = {"pieces": 0, "rows": 0}
    self._committed_steps = 0
    self.failed_checks: list[dict] = []
    self._writer: transcript.TranscriptWriter | None = None  # process 0 only
    self._group: processes.ProcessGroup | None = None
    self._pipeline: CommitPipeline | None = None
    self._seed = b""
    self._probe_ratio = 0.0
    self._finished = False
    self._finish_error: errors.ZKDVError | None = None
    self._registered: dict[str, ProofFunction] = {}
    self._program_numbers: dict[bytes, int] = {}  # steps name programs by number
    self._last_post_leaves: list | None = None
    self._last_program = None
    self._last_post: tuple | None = None  # (digest, piece digests, layouts, params mask)
    self._lock = threading.Lock()

  def __repr__(self):
    return f"ZKDV({self.name!r})"

  @property
  def writes_transcript(self) -> bool:
    """Whether this process writes the transcript: in a multi-process run only
    process 0 does; the others send it the digests of what they hold."""
    return self._writer is not None

  # -- lifecycle -------------------------------------------------------------

  def start(self, rolling_window: int = 4, probe_ratio: float = 0.0) -> "ZKDV":
    """Opens the transcript and writes its root record.

    A proof that is used without ``start()`` starts itself at its first step
    with these defaults.

    Args:
      rolling_window: at most this many steps may be in flight whose records
        are not yet durable (bounds the buffer generations ZKDV keeps).
      probe_ratio: the fraction of each batch's rows opened as data probes.
    """
    if self._group is not None:
      raise errors.ProofStateError(f"{self!r} is already started; start() runs once.")
    if isinstance(rolling_window, bool) or not isinstance(rolling_window, int) or rolling_window < 1:
      raise ValueError(f"rolling_window must be an int >= 1, got {rolling_window!r}.")
    if isinstance(probe_ratio, bool) or not isinstance(probe_ratio, (int, float)) or not 0 <= probe_ratio <= 1:
      raise ValueError(f"probe_ratio must be a number in [0, 1], got {probe_ratio!r}.")
    group = processes.ProcessGroup.current()

    def open_transcript() -> dict:  # on process 0; a failure leaves every process unstarted
      seed = sampling.new_seed()
      path = (pathlib.Path(self.config.output_dir) if self.config.output_dir
              else _default_folder(self.name))
      writer = transcript.TranscriptWriter(path)  # refuses a folder that holds a transcript
      try:
        self._write_root(writer, group, seed, rolling_window, probe_ratio)
      except BaseException:
        writer.close()
        raise
      self._writer = writer
      return {"run_id": os.urandom(16), "seed": seed, "folder": str(path)}

    run = group.open_run(open_transcript)
    path, seed = pathlib.Path(run["folder"]), run["seed"]
    if group.is_writer:
      logger.info("ZKDV proof %r: transcript at %s", self.name, path)
    else:
      logger.info("ZKDV proof %r: process %d commits its shards; process 0 writes %s",
                  self.name, group.index, path)
    self.path, self._seed, self._probe_ratio = path, seed, float(probe_ratio)
    self._digests = digests_lib.for_config(self.config.digest_backend)
    self._pipeline = CommitPipeline(rolling_window, on_error=self._report_failure)
    self._group = group
    return self

  def _write_root(self, writer, group, seed, rolling_window, probe_ratio) -> None:
    devices = jax.devices()
    writer.append({
        "type": "root",
        "format_version": transcript.FORMAT_VERSION,
        "prover": transcript.PROVER,
        "name": self.name,
        "versions": {"zkdv": __version__, "jax": jax.__version__,
                     "jaxlib": jaxlib.__version__},
        "platform": devices[0].platform,
        "device_kinds": sorted({d.device_kind for d in devices}),
        "config": self.config.to_record(),
        "start": {"rolling_window": rolling_window, "probe_ratio": float(probe_ratio)},
        "seed_commitment": sampling.seed_commitment(seed),
        **({"processes": group.count} if group.multi else {}),
    }, durable=True)

  def _report_failure(self, error: BaseException) -> None:
    try:
      self._group.report_failure(f"{type(error).__name__}: {error}")
    except Exception:  # pylint: disable=broad-except  # the failure itself is raised at finish
      logger.exception("ZKDV proof %r could not tell the other processes it failed", self.name)

  def finish(self) -> pathlib.Path:
    """Waits for every commitment and check, writes ``final``; idempotent.

    Returns the transcript folder. Raises the first background failure, a
    failed check, or NoTranscriptUpdateError when no step was recorded; the
    ``final`` record is written in every case. In a multi-process run every
    process calls it, and every process raises if process 0's transcript failed.
    """
    if self._finished:
      if self._finish_error is not None:
        raise self._finish_error
      return self.path
    self._require_running()
    self._pipeline.drain()
    self._pipeline.close()
    error = None
    try:
      self._pipeline.raise_if_failed()
    except errors.ZKDVError as e:
      error = e
    if error is None and self.failed_checks:
      first = self.failed_checks[0]
      error = errors.ReplayError(
          f"{len(self.failed_checks)} sampled check(s) did not reproduce the "
          f"committed state; first at step {first['step']}, leaves "
          f"{first['mismatched_leaves']}.")
    if error is None and self.steps == 0:
      error = errors.NoTranscriptUpdateError(
          f"proof {self.name!r} finished without recording any update: the "
          "training step still uses jax.jit.")
    try:
      whole_params = self._gather_sharded_params()
    except Exception as e:  # pylint: disable=broad-except  # e.g. the final state was deleted
      whole_params = None
      error = error or errors.CommitmentError(
          f"could not gather the sharded params for final_params: {type(e).__name__}: {e}. "
          "Keep the state the last step returned alive until finish().")
    try:
      if self._writer is not None:
        self._write_final(clean=error is None, whole_params=whole_params)
        self._writer.close()
    except Exception as e:  # pylint: disable=broad-except  # the others still hear the outcome
      error = error or errors.CommitmentError(
          f"could not write the final record to {self.path}: {type(e).__name__}: {e}")
    error = self._agree_on_outcome(error)
    self._finished = True
    self._finish_error = error
    logger.info("ZKDV proof %r: %d steps, %d update and %d state checks at %s",
                self.name, self.steps, self.checks["update"],
                self.checks["state"], self.path)
    if error is not None:
      raise error
    return self.path

  def _agree_on_outcome(self, error):
    """Process 0's failure, raised on every process of a multi-process run."""
    if not self._group.multi:
      return error
    reported = self._group.broadcast("finish", None if error is None else
                                     f"{type(error).__name__}: {error}")
    if self._committed_steps:  # every process has read the start message by now
      self._group.close_run()
    if error is None and reported is not None:
      error = errors.CommitmentError(
          f"process 0 could not complete the transcript at {self.path}: {reported}")
    return error

  def __enter__(self) -> "ZKDV":
    if self._group is None:
      self.start()
    return self

  def __exit__(self, exc_type, exc, tb):
    if exc_type is None:
      self.finish()
    elif not self._finished and self._group is not None:
      try:
        self.finish()
      except errors.ZKDVError:
        pass  # the exception already propagating says more

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

    ``fun(state, *batch)`` must return the new state (or a tuple whose first
    element is it); argument ``state_argnum`` is the state, every other
    dynamic argument is batch evidence.
    """
    if fun is None:
      return lambda f: self.attest(f, state_argnum=state_argnum, **jit_options)
    return ProofFunction(self, fun, jit_options, state_argnum=state_argnum)

  # -- internals used by ProofFunction and the pipeline ----------------------

  def _require_running(self) -> None:
    """Starts the proof with default arguments if start() was not called."""
    if self._finished:
      raise errors.ProofStateError(
          f"{self!r} is finished; start a new proof to record more steps.")
    if self._group is None:
      logger.info("ZKDV proof %r was not started; starting it with default arguments.",
                  self.name)
      self.start()

  def _register(self, fn: ProofFunction) -> None:
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

  def _run_step(self, program, leaves: list) -> list:
    """Dispatches one step and queues its commitment and checks."""
    pipeline, digests, multi = self._pipeline, self._digests, self._group.multi
    if not multi:  # across processes, failures wait for finish(): see _agree_on_outcome
      pipeline.raise_if_failed()
    with self._lock:
      index = self.steps
      self.steps += 1
    policy = self.config.sampling_policy
    update_check = sampling.is_sampled(self._seed, "update", index,
                                       policy.update_check_probability)
    state_check = sampling.is_sampled(self._seed, "state", index,
                                      policy.state_check_probability)
    state = [leaves[i] for i in program.state_indices]
    batch = [leaves[i] for i in program.batch_indices]
    continuous = (self._last_post_leaves is not None and len(state) == len(self._last_post_leaves)
                  and all(a is b for a, b in zip(state, self._last_post_leaves)))
    pre = None  # the previous post-state: not hashed again
    if not continuous:
      pre = digests.start_state(state, program.state_layouts)
      if any(program.donated[i] for i in program.state_indices):  # hash before donation
        pre = digests.state_digests(digests.materialize(pre))
    rows = digests.start_rows(batch, program.batch_layouts)
    if any(program.donated[i] for i in program.batch_indices):
      rows = self._hash_batch(program, index, rows, copy=True)
    # Openings are whole leaves; across processes, gathering them is a collective.
    opened = [arrays.gather(x) for x in leaves] if update_check else None
    pipeline.reserve()
    if any(program.donated) and pipeline.last_job is not None:
      pipeline.last_job.views_ready.wait()  # no donation of a buffer being hashed
    outs = program.executable(*leaves)
    post = [outs[i] for i in program.post_indices]
    if program.program_id not in self._program_numbers:  # first run: record the program
      program.place_post_state(post)
      self._program_numbers[program.program_id] = len(self._program_numbers)
      pipeline.submit(lambda job: self._write_program(program))
    post_started = digests.start_state(post, program.post_layouts)
    checked = None
    if multi and (update_check or state_check):  # collectives stay on this thread
      checked = ([arrays.gather(x) for x in post],
                 program.replay_sharded(opened) if update_check else None)
    job = pipeline.submit(
        lambda job: self._commit_step(job, program, index, post, post_started, pre, rows,
                                      opened, update_check, state_check, checked),
        holds_slot=True)
    self._last_post_leaves, self._last_program = post, program
    overlap = program.overlap or overlap_lib.UNCHECKED
    if overlap is overlap_lib.NEVER or (
        overlap is overlap_lib.UNCHECKED and (update_check or state_check)):
      job.done.wait()
    if not multi:
      pipeline.raise_if_failed()
    return outs

  def _write_program(self, program) -> None:
    if self._writer is None:
      return
    self._writer.put_blob(program.blob)
    self._writer.append({**program.record,
                         "number": self._program_numbers[program.program_id]})

  def _commit_step(self, job, program, index, post, post_started, pre, rows, opened,
                   update_check, state_check, checked) -> None:
    """Runs on the commit thread: digests, the step record, then any checks.

    In a multi-process run every process sends the digests of what it holds
    to process 0, which writes the records (``checked`` then holds the whole
    post-state and replayed outputs, gathered on the training thread).
    """
    digests, layouts = self._digests, program.post_layouts
    # Checks need the post-state on the host: take views before the next step may donate it.
    post_views = ([arrays.host_view(x) for x in post]
                  if (update_check or state_check) and checked is None else None)
    materialized = digests.materialize(post_started)
    replicas = (digests.replica_digests(post, layouts) if self.config.cross_check_replicas
                else [])
    job.views_ready.set()
    if isinstance(pre, tuple):  # started, not yet hashed
      pre = digests.state_digests(digests.materialize(pre))
    local = digests.state_digests(materialized)
    self.committed_here["pieces"] += sum(d is not None for leaf in local for d in leaf)
    gathered = self._group.gather(f"{index}/state", [local, pre, replicas])
    hashed = rows if isinstance(rows, _HashedBatch) else self._hash_batch(
        program, index, rows, copy=self._group.multi)
    batch = self._commit_batch(program, index, hashed)
    if gathered is None:  # another process writes the records
      self.checks["update"] += update_check
      self.checks["state"] += state_check
      return
    post_pieces = processes.merge([g[0] for g in gathered], "post-state")
    post_digest = digest.state_digest_from_pieces(layouts, post_pieces)
    if pre is None:
      pre_digest = self._last_post[0]
    else:
      pre_digest = digest.state_digest_from_pieces(
          program.state_layouts, processes.merge([g[1] for g in gathered], "pre-state"))
    if self._last_post is not None and pre_digest != self._last_post[0]:
      self.discontinuities.append(index)
      logger.warning("ZKDV proof %r: step %d does not start from the state step "
                     "%d returned (changed outside proof.jit).", self.name, index,
                     index - 1)
    self._writer.append({
        "type": "step", "index": index, "program": self._program_numbers[program.program_id],
        "pre_state": pre_digest, "post_state": post_digest, **batch,
    })
    self._last_post = (post_digest, post_pieces, layouts, program.params_mask)
    self._committed_steps = index + 1
    post_views, replayed = checked if checked is not None else (post_views, None)
    if update_check:
      self._update_check(program, index, opened, post_views, replayed)
    if state_check:
      self._state_check(program, index, post_views)
    _cross_check_replicas(index, layouts, post_pieces, [g[2] for g in gathered])

  def _hash_batch(self, program, index, rows, copy: bool) -> "_HashedBatch":
    """The row hashes and probed rows of the batch rows held here (no I/O).

    ``copy`` takes the probed rows out of the batch's buffers (before donation,
    or to send them to process 0).
    """
    layouts, digests = program.batch_layouts, self._digests
    probed = [(leaf, row) for leaf, layout in enumerate(layouts)
              if layout.key_impl is None and layout.shape
              for row in sampling.probe_rows(self._seed, index, leaf, layout.rows,
                                             self._probe_ratio)]
    held = [(leaf, row, digests.row_bytes(rows[leaf], row)) for leaf, row in probed]
    hashes = digests.row_hashes(rows, layouts)
    self.committed_here["rows"] += sum(h is not None for leaf in hashes for h in leaf)
    return _HashedBatch(hashes, probed, [[leaf, row, bytes(data) if copy else data]
                                         for leaf, row, data in held if data is not None])

  def _commit_batch(self, program, index, hashed: "_HashedBatch") -> dict | None:
    """The step's batch fields: digest, and data probes with their Merkle proofs.

    None on a process other than 0, which only sends what it holds.
    """
    layouts = program.batch_layouts
    gathered = self._group.gather(f"{index}/batch", [hashed.row_hashes, hashed.probes])
    if gathered is None:
      return None
    hashes = processes.merge([g[0] for g in gathered], "batch")
    row_data = {}
    for _, sent in gathered:
      for leaf, row, data in sent:
        row_data.setdefault((leaf, row), data)
    trees = [merkle.tree_levels(h) for h in hashes]
    fields = {"batch": digest.batch_digest(layouts, [digest.tree_root(t) for t in trees])}
    probes = [[leaf, row, self._writer.put_blob(row_data[(leaf, row)]),
               merkle.inclusion_proof(trees[leaf], row)] for leaf, row in hashed.probed]
    if probes:  # an unprobed step stays small: no probe fields at all
      fields["probes"] = probes
      fields["batch_roots"] = [digest.tree_root(t) for t in trees]
    return fields

  def _update_check(self, program, index, opened, post_views, replayed=None) -> None:
    if replayed is None:
      layouts = {i: l for i, l in zip(program.state_indices, program.state_layouts)}
      layouts.update(zip(program.batch_indices, program.batch_layouts))
      inputs = [arrays.from_host(a, layouts[i]) for i, a in enumerate(opened)]
      outs = program.replay(*inputs)
      replayed = [arrays.host_view(outs[i]) for i in program.post_indices]
    result = replay.compare(program.state_layouts, replayed, post_views,
                            exact=program.exact, tolerance=self.config.tolerance)
    blobs = [self._writer.put_blob(digest.byte_view(a)) for a in opened]
    record = {
        "type": "check", "step": index, "kind": "update",
        "pre_state_blobs": [blobs[i] for i in program.state_indices],
        "batch_blobs": [blobs[i] for i in program.batch_indices],
        "result": result,
    }
    if any(l.pieces for l in program.state_layouts):  # name the piece a bad opening breaks
      record["pre_state_pieces"] = [
          digest.piece_digests(l, opened[i])
          for l, i in zip(program.state_layouts, program.state_indices)]
    if not program.exact:  # the verifier compares within tolerance: open post
      record["post_state_blobs"] = [self._writer.put_blob(digest.byte_view(a))
                                    for a in post_views]
    self._writer.append(record, durable=True)
    self.checks["update"] += 1
    if not result["equal"]:
      self.failed_checks.append({"step": index, **result})

  def _state_check(self, program, index, post_views) -> None:
    blobs = [self._writer.put_blob(digest.byte_view(a)) for a in post_views]
    self._writer.append({"type": "check", "step": index, "kind": "state",
                         "post_state_blobs": blobs}, durable=True)
    self.checks["state"] += 1

  def _gather_sharded_params(self) -> dict[int, np.ndarray]:
    """The whole value of each sharded params leaf (a collective across processes)."""
    program = self._last_program
    if program is None:
      return {}
    return {i: arrays.gather(x) for i, (x, l, is_param) in enumerate(zip(
        self._last_post_leaves, program.post_layouts, program.params_mask))
            if is_param and l.pieces is not None}

  def _write_final(self, clean: bool, whole_params: dict) -> None:
    final = {"type": "final", "steps": self.steps, "seed": self._seed,
             "status": "clean" if clean else "aborted",
             "discontinuities": list(self.discontinuities)}
    if self._last_post is not None:
      post_digest, pieces, layouts, params_mask = self._last_post
      final["final_state"] = post_digest
      final["final_state_leaves"] = [list(p) for p in pieces]
      if whole_params is not None and self._committed_steps == self.steps:
        params = [i for i, m in enumerate(params_mask) if m]
        whole = [digest.leaf_digest(whole_params[i]) if i in whole_params else p[0]
                 for i, p in enumerate(pieces)]
        final["final_params"] = digest.params_digest(
            [dataclasses.replace(l, pieces=None) for l in layouts], whole, params)
    self._writer.append(final, durable=True)


@dataclasses.dataclass
class _HashedBatch:
  """What this process holds of a step's batch: row hashes (None: held elsewhere),
  the probed (leaf, row) pairs, and [leaf, row, bytes] of the probed rows held here."""

  row_hashes: list
  probed: list
  probes: list


def _cross_check_replicas(index: int, layouts, pieces, replicas_per_process) -> None:
  """Raises ReplicaDivergenceError if a replica's digest differs from its piece's."""
  for replicas in replicas_per_process:
    for leaf, piece, device, replica_digest in replicas:
      if replica_digest != pieces[leaf][piece]:
        layout = layouts[leaf]
        shard = ("" if layout.pieces is None else
                 f" (shard {piece}, index {[list(b) for b in layout.pieces[piece]]})")
        raise errors.ReplicaDivergenceError(
            f"step {index}: the replica of {layout.path}{shard} on {device} differs "
            "from the committed copy. Replicas of one array must hold the same bytes; "
            "this device computed something else (a hardware fault or a "
            "non-deterministic kernel).")
