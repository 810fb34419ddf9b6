"""The probes a resumed run owes for steps its resume discarded (``OwedAnswers``).

A DVBench proof's server drew probes for every stored step, those of a segment a crash left
open included. The resumed run discards those steps, and answers their probes when a step
trains the same batch again: the same rows, the same dataset rows under ``proof.batches``.
Across processes with a server's decisions, the rows come from every process in the round
that decides that step (``zkdv.jax.shared_decisions``).

Example::

  owed = OwedAnswers(openings)
  owed.start(point.owed_probes, key_seed)
  owed.match(job, roots, trees, replaying=False)  # on the commit thread, as a step commits
  owed.steps                                      # discarded steps still owed
"""

import dataclasses

from zkdv.jax.commit_jobs import StepJob


class OwedAnswers:
  """The owed probes of a resumed run, answered as steps train their batches again.

  Args:
    openings: writes the probe records (``zkdv.jax.openings.Openings``).

  Attributes:
    in_rounds: answers go in rounds (across processes, with a server's decisions), set by
      ``zkdv.jax.shared_decisions.SharedDecisions``.
  """

  def __init__(self, openings):
    self.openings = openings
    self.in_rounds = False
    self._owed: list = []  # ``zkdv.jax.resume.OwedProbes``
    self._key_seed: bytes | None = None
    # step -> [(owed probes, batch roots)] its batch answers in the round deciding it, and
    # the rows they open there (``rows_for_round``: read on the training thread once the
    # server decided the step, which it did after storing its record, written after
    # ``match`` put them here).
    self._in_rounds: dict[int, list] = {}
    self._rows: dict[int, set] = {}

  def start(self, owed: list, key_seed: bytes) -> None:
    """A resumed run's owed probes; ``key_seed`` derives their steps' keys."""
    self._owed, self._key_seed = list(owed), key_seed

  @property
  def steps(self) -> list[int]:
    """The discarded steps whose probes are still owed."""
    return sorted(owed.decision.step for owed in self._owed)

  def match(self, job: StepJob, roots: list, trees, replaying: bool) -> None:
    """Answers the owed probes whose batch step ``job`` (batch leaves' row ``roots``)
    trains again, its keys its own step's (probes never open them); in rounds, keeps them
    for the round deciding the step. ``replaying``: a replayed step, whose rows a
    multi-process run gathers as it runs, before this: later steps answer them."""
    if not self._owed or (job.opened is None and not self.in_rounds) or (
        self.in_rounds and replaying):
      return
    data_rows = None if job.data is None else job.data.record_field()
    layouts = job.program.batch_layouts
    for owed in list(self._owed):
      own = owed.answered_by(layouts, roots, self._key_seed, data_rows)
      if own is None:
        continue
      self._owed.remove(owed)
      if self.in_rounds:  # before the step's record is written, so before its round
        self._in_rounds.setdefault(job.index, []).append((owed, own))
        self._rows.setdefault(job.index, set()).update(
            (leaf, row) for leaf, layout in enumerate(layouts)
            for row in owed.decision.leaf_probe_rows(leaf, layout))
      else:
        self.openings.probe(dataclasses.replace(job, index=owed.decision.step),
                            owed.decision, trees, own)

  def rows_for_round(self, step: int) -> list:
    """``[leaf, row]`` of the rows the probes owed open in step ``step``'s batch (asked
    once, by the round that decides the step)."""
    return [list(r) for r in sorted(self._rows.pop(step, ()))]

  def answered_in_round(self, step: int) -> list:
    """``[(owed probes, batch roots)]`` the round deciding step ``step`` answers."""
    return self._in_rounds.pop(step, [])
