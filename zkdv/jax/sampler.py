"""Batches in an order the prover cannot choose: ``proof.batches`` and ``proof.grain_batches``.

The order comes from the proof's key seed (``zkdv.keys``, as ``proof.key(t)``) and the
dataset's Merkle root (``zkdv.data``). ``proof.batches`` writes a ``data`` record declaring
the dataset (before the first step), and each step takes the oldest batch drawn and not yet
stepped on: its record commits that batch's row indices (``data_rows``), its probes carry
each opened row's audit path in the dataset tree, and the commit thread checks that the
batch the step hashed holds exactly those dataset rows (``DataOrderError`` naming the step,
leaf and row otherwise). Pass each batch to the step unchanged: transform it inside the step.

Example::

  for batch in proof.batches({"x": x, "y": y}, batch_size=32, epochs=2):
    state = train_step(state, batch)
"""

import threading

import jax
import jax.numpy as jnp
import numpy as np

from zkdv import data as data_lib
from zkdv import digest
from zkdv import errors
from zkdv import records as records_lib
from zkdv import transcript

_FIX = ("Pass each batch proof.batches yields to the next step unchanged, in order, one "
        "step per batch (transform it inside the step).")


class SampledBatch:
  """A drawn batch: its number in the order and its dataset rows; ``redrawn`` when the
  arrays the loop was given hold other rows (``DataOrder.go_back``)."""

  def __init__(self, order: "DataOrder", number: int, rows: np.ndarray,
               redrawn: bool = False):
    self.order, self.number, self.rows, self.redrawn = order, number, rows, redrawn

  def put_into(self, program, leaves: list) -> list:
    """A step's input ``leaves`` with this batch's dataset rows in its batch leaves, in
    place of the rows drawn before a resumed run went back (``DataOrder.go_back``), and
    placed as those were: NumPy, an array JAX placed, or one committed to its sharding."""
    out = list(leaves)
    for i, held in zip(program.batch_indices, self._data_leaves(program.batch_layouts)):
      if held is not None:
        rows, drawn = self.order.tree.leaves[held][self.rows], leaves[i]
        if getattr(drawn, "committed", False):
          out[i] = jax.device_put(rows, drawn.sharding)
        elif isinstance(drawn, jax.Array):
          out[i] = jnp.asarray(rows)
        else:
          out[i] = rows
    return out

  def record_field(self) -> bytes:
    """The step record's ``data_rows``."""
    return data_lib.pack_rows(self.rows)

  def _data_leaves(self, layouts) -> list:
    """Per batch leaf, the dataset leaf it holds (``zkdv.data.batch_leaves``)."""
    try:
      return data_lib.batch_leaves(layouts, self.order.declaration)
    except ValueError as e:
      raise errors.DataOrderError(f"{e}: the step's non-key batch leaves are the dataset's, "
                                  f"in order, as proof.batches yields them. {_FIX}") from None

  def check(self, step: int, layouts, row_levels) -> None:
    """Raises DataOrderError unless each batch leaf's Merkle leaves (``row_levels[leaf]
    [0]``, as the step committed them) are the dataset rows this batch drew. A leaf of one
    row per Merkle leaf compares with the dataset tree's own leaves (nothing is hashed);
    groups of rows are hashed from the dataset's rows."""
    tree = self.order.tree
    for leaf, held in enumerate(self._data_leaves(layouts)):
      if held is None:
        continue
      layout = layouts[leaf]
      expected = ([tree.leaf_hash(held, int(i)) for i in self.rows] if layout.row_group == 1
                  else digest.row_leaf_hashes(layout, tree.leaves[held][self.rows]))
      got = row_levels[leaf][0]
      for group, (a, b) in enumerate(zip(expected, got)):
        if a != b:
          first = group * layout.row_group
          rows = self.rows[first:first + layout.row_group].tolist()
          group_rows = (f" (rows {first}..{first + len(rows) - 1}: {rows})"
                        if len(rows) > 1 else "")
          raise errors.DataOrderError(
              f"step {step}: row {first} of batch leaf {layout.path} is not dataset row "
              f"{rows[0]}{group_rows} of batch {self.number} that proof.batches drew for it. "
              f"{_FIX}")

  def batch_paths(self, layouts) -> list:
    """Per dataset leaf, per row of the batch, its dataset audit path (a full replay's
    update check proves every row)."""
    self._data_leaves(layouts)
    tree = self.order.tree
    return [[tree.path(leaf, int(i)) for i in self.rows] for leaf in range(len(tree.leaves))]

  def probe_paths(self, layouts, probes: list) -> list:
    """Per probe ``[leaf, row, ...]``, per data row it opens, its dataset audit path."""
    data_leaf, tree = self._data_leaves(layouts), self.order.tree
    paths = []
    for leaf, row, *_ in probes:
      group = layouts[leaf].row_group
      paths.append([tree.path(data_leaf[leaf], int(self.rows[row * group + j]))
                    for j in range(group)])
    return paths


class DataOrder:
  """A proof's seeded order over one dataset: what was drawn and not yet stepped on."""

  def __init__(self, proof, tree: data_lib.DatasetTree, declaration: data_lib.Declaration):
    self.tree, self.declaration = tree, declaration
    self.order = data_lib.Order(proof._key_seed, declaration)  # pylint: disable=protected-access
    self.drawn = 0  # batches drawn so far
    self.reads_ahead = False  # a Grain loader reads the order from where it was created
    self._pending: list[SampledBatch] = []
    self._lock = threading.Lock()

  def draw(self) -> SampledBatch:
    """The next batch of the order, queued for the next step not yet given one."""
    with self._lock:
      batch = SampledBatch(self, self.drawn, self.order.batch(self.drawn))
      self.drawn += 1
      self._pending.append(batch)
    return batch

  def go_back(self, number: int, restored: str) -> SampledBatch:
    """Batch ``number`` again, for a resumed run that replays the committed steps after
    ``restored`` (how a message names that state): the order goes on after it, batches
    drawn ahead and not yet stepped on included (``SampledBatch.redrawn``).
    ResumeStateError when a Grain loader reads the order ahead (``proof.grain_batches``)."""
    if self.reads_ahead:
      raise errors.ResumeStateError(
          f"the restored state is {restored}, before the last committed state, and "
          "proof.grain_batches reads its batches on from the last committed state: draw "
          "them with proof.batches (the same order) to replay the steps after it.")
    with self._lock:
      ahead = len(self._pending)
      self._pending = [SampledBatch(self, n, self.order.batch(n), redrawn=True)
                       for n in range(number + 1, number + 1 + ahead)]
      self.drawn = number + 1 + ahead
      return SampledBatch(self, number, self.order.batch(number), redrawn=True)

  def take(self, step: int) -> SampledBatch:
    """The batch step ``step`` consumes: the oldest drawn and not yet stepped on."""
    with self._lock:
      if not self._pending:
        raise errors.DataOrderError(
            f"step {step} has no batch from proof.batches: every step of a proof that "
            f"draws its data consumes the next batch ({self.drawn} drawn, each stepped on "
            f"already). {_FIX}")
      return self._pending.pop(0)

  def give_back(self, batch: SampledBatch) -> None:
    """Returns a batch whose step raised before it was recorded (it is stepped on again)."""
    with self._lock:
      self._pending.insert(0, batch)


def _order_for(proof, leaves: list, paths: list, batch_size: int) -> DataOrder:
  """The proof's data order over ``leaves``, declared (its ``data`` record queued) on first
  use; a later call must name the same dataset and batch size, and continues the order."""
  proof.ensure_started()
  tree = data_lib.DatasetTree(leaves, paths)
  declaration = tree.declaration(batch_size)
  order = proof._data_order  # pylint: disable=protected-access
  declared, trained = (order.declaration, None) if order is not None else _resumed(proof)
  if declared is not None:
    if declared != declaration:
      raise errors.DataOrderError(
          f"this proof draws batches of {declared.batch_size} rows from the dataset "
          f"{declared.root.hex()[:16]}…; a proof draws from one dataset, one batch size "
          f"(got {batch_size} rows of {tree.root.hex()[:16]}…).")
    if order is None:  # a resumed run goes on with the batch after its restored state's
      order = DataOrder(proof, tree, declaration)
      order.drawn = trained
      proof._data_order = order  # pylint: disable=protected-access
    return order
  if proof.steps or proof._group.multi:  # pylint: disable=protected-access
    raise errors.DataOrderError(
        "proof.batches declares the dataset before the first step of a single-process "
        f"proof ({proof.steps} steps recorded): call it before training.")
  order = DataOrder(proof, tree, declaration)
  proof._data_order = order  # pylint: disable=protected-access
  proof.submit_record(declaration.to_record())
  return order


def _resumed(proof) -> tuple:
  """(the dataset a resumed proof's transcript declared, the batches its restored state
  trained on), or (None, None). A step a resume discards trained no batch that counts:
  batch ``n`` is the one after the ``n`` steps the state went through
  (``zkdv.verify.order.check_order``)."""
  if proof.resume_from is None:
    return None, None
  restored = proof._dispatcher.restored  # pylint: disable=protected-access
  if restored is None:
    raise errors.DataOrderError("a resumed proof calls proof.batches before its first step.")
  records = [p.record for p in transcript.read_transcript(proof.path).records]
  declared = next((r for r in records if r.get("type") == "data"), None)
  if declared is None:
    return None, None
  discarded = sum(len(records_lib.discarded_steps(r["after"], r["step"])) for r in records
                  if r.get("type") == "resume")
  return data_lib.Declaration.from_record(declared), restored.after + 1 - discarded


def batches(proof, dataset, batch_size: int, epochs: int = 1):
  """Batches of ``dataset`` (a pytree of arrays sharing a leading axis) in the proof's
  seeded order: ``epochs`` epochs of ``rows // batch_size`` batches, each a pytree like
  ``dataset`` of NumPy arrays with ``batch_size`` rows. See the module docstring."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(dataset)
  leaves = [np.asarray(x) for _, x in flat]
  order = _order_for(proof, leaves, [jax.tree_util.keystr(p) for p, _ in flat], batch_size)
  _check_epochs(epochs)
  for _ in range(epochs * order.declaration.batches_per_epoch):
    batch = order.draw()
    yield jax.tree.unflatten(treedef, [x[batch.rows] for x in leaves])


def _check_epochs(epochs) -> None:
  if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
    raise ValueError(f"epochs must be an int >= 1, got {epochs!r}.")


class _Ordered:
  """A Grain data source reading ``source`` in a data order, from batch ``first`` on."""

  def __init__(self, source, order: DataOrder, first: int, count: int):
    self._source, self._order, self._first, self._count = source, order, first, count

  def __len__(self):
    return self._count * self._order.declaration.batch_size

  def __getitem__(self, i):
    n, offset = divmod(int(i), self._order.declaration.batch_size)
    return self._source[int(self._order.order.batch(self._first + n)[offset])]


def grain_batches(proof, source, batch_size: int, epochs: int = 1, read_options=None):
  """Batches of a Grain data source (``grain.sources.RandomAccessDataSource``: ``len`` and
  ``source[i]``, records that are pytrees of arrays) in the proof's seeded order, read by
  Grain (``MapDataset.batch``; ``read_options``: Grain's threads and prefetch). The dataset
  tree reads every record once, here."""
  import grain  # pylint: disable=import-outside-toplevel  # the optional "grain" extra

  _check_epochs(epochs)
  records = [source[i] for i in range(len(source))]
  flat, _ = jax.tree_util.tree_flatten_with_path(records[0])
  leaves = [np.stack(column) for column in zip(*(jax.tree.leaves(r) for r in records))]
  del records
  order = _order_for(proof, leaves, [jax.tree_util.keystr(p) for p, _ in flat], batch_size)
  count = epochs * order.declaration.batches_per_epoch
  order.reads_ahead = True
  dataset = grain.MapDataset.source(_Ordered(source, order, order.drawn, count)).batch(
      batch_size, drop_remainder=True).to_iter_dataset(read_options)
  for batch in dataset:
    order.draw()
    yield batch
