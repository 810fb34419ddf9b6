"""Contamination by whole example: the digests that identify an evaluation example.

An example is the tuple of every leaf's row at one index (tokens and their label, an image
and its mask), leaves of empty rows left out. A probed training example matches an
evaluation example when

- the rows at one index of every probed batch leaf equal, leaf for leaf, an evaluation
  example's rows (``example_digest`` of both), or
- the row of one *identifying* leaf equals that leaf's row of an evaluation example. A leaf
  identifies only when its evaluation rows are all distinct and hold at least
  ``MIN_IDENTIFYING_BYTES`` bytes each: a label, a mask or a small scalar repeats across
  unrelated examples and never counts alone. An evaluation set of one leaf: its rows are
  its examples.

The server indexes what a proof's probes opened once the proof is closed, when its worker
verifies it (``probed_digests``), never while records arrive: a leaderboard and a training-set
check read the index only for verified proofs.

Only numpy, BLAKE3 and the record schema here: the server's web process uses it. Example::

  digests = evaluation_digests([tokens_rows, label_rows])  # {digest: example index}
  probed_examples(probed_rows(probe_check_record))         # {example digest, ...}
  probed_digests(stored_check_records)                     # ({row digest}, {example digest})
  rows_in_constants(in_dtypes(on_each_axis(constants), dtypes), leaves)  # [example, ...]
"""

import blake3
import numpy as np

from zkdv import records

MIN_IDENTIFYING_BYTES = 16
_EXAMPLE = b"zkdv example\x00"


def row_digest(row: bytes) -> bytes:
  """BLAKE3 of one row's bytes, as a probe names the row it opens."""
  return blake3.blake3(row).digest()


def example_digest(row_digests: list[bytes]) -> str:
  """The hex digest of the example whose leaves' rows have ``row_digests``, in leaf order."""
  return blake3.blake3(_EXAMPLE + len(row_digests).to_bytes(4, "little")
                       + b"".join(row_digests)).hexdigest()


def identifying(rows: np.ndarray) -> bool:
  """Whether one leaf's evaluation rows (``(rows, bytes per row)`` uint8) identify their
  examples alone: all distinct, each at least ``MIN_IDENTIFYING_BYTES`` bytes."""
  return rows.shape[1] >= MIN_IDENTIFYING_BYTES and len(np.unique(rows, axis=0)) == len(rows)


def evaluation_digests(leaves: list[np.ndarray]) -> dict[str, int]:
  """``{hex digest: example index}`` for an evaluation set given per leaf as ``(rows, bytes
  per row)`` uint8 arrays: every example's digest and the rows of its identifying leaves
  (all rows of a single leaf). The first example wins a digest two examples share."""
  leaves = [leaf for leaf in leaves if leaf.shape[1]]  # empty rows: no part of an example
  digests = [[row_digest(r.tobytes()) for r in leaf] for leaf in leaves]
  found: dict[str, int] = {}
  for leaf, rows in zip(digests, leaves):
    if len(leaves) == 1 or identifying(rows):
      for i, d in enumerate(leaf):
        found.setdefault(d.hex(), i)
  if len(leaves) > 1:
    for i, example in enumerate(zip(*digests)):
      found.setdefault(example_digest(list(example)), i)
  return found


def probed_rows(record: dict) -> list[tuple[int, int, list[bytes]]]:
  """Per probe of a probe check record (checked against ``zkdv.records``) that opens rows
  with bytes: its batch leaf, the index of its first leading-axis row and the
  ``row_digest`` of each row it opens (a group of g rows, Merkle row r, opens rows r*g to
  r*g+g-1). A leaf of empty rows identifies nothing and is no part of an example. Any other
  record: ``[]``."""
  opened = []
  for entry in records.probe_entries(record):
    rows = records.probed_rows(entry)
    if rows:
      opened.append((entry[0], entry[1] * entry[2], _row_digests(rows)))
  return opened


_SHORT_ROW = 64  # bytes: a row this short is looked up before it is hashed


def probed_digests(checks) -> tuple[set[str], set[str]]:
  """(hex ``row_digest`` of every row, ``example_digest`` of every whole example) that the
  probe check records among ``checks`` opened (each decoded and checked by
  ``zkdv.records``, as the server stored it)."""
  rows: set[str] = set()
  examples: set[str] = set()
  for record in checks:
    opened = probed_rows(record)
    rows.update(d.hex() for _, _, digests in opened for d in digests)
    examples |= probed_examples(opened)
  return rows, examples


def _row_digests(rows: list[bytes]) -> list[bytes]:
  """``row_digest`` of each row, each short row's hashed once (a group of labels repeats a
  few values)."""
  short: dict[bytes, bytes] = {}
  return [(short.get(r) or short.setdefault(r, row_digest(r))) if len(r) <= _SHORT_ROW
          else row_digest(r) for r in rows]


def probed_examples(opened: list[tuple[int, int, list[bytes]]]) -> set[str]:
  """The ``example_digest`` of each leading-axis row that probes (``probed_rows``) opened in
  every probed leaf; nothing when they probed fewer than two leaves, whose rows are the
  probed rows."""
  by_leaf: dict[int, dict[int, bytes]] = {}
  for leaf, first, digests in opened:
    by_leaf.setdefault(leaf, {}).update(zip(range(first, first + len(digests)), digests))
  if len(by_leaf) < 2:
    return set()
  order = sorted(by_leaf)
  in_every_leaf = set(by_leaf[order[0]]).intersection(*(by_leaf[leaf] for leaf in order[1:]))
  return {example_digest([by_leaf[leaf][i] for leaf in order]) for i in in_every_leaf}


def _one_element_repeated(row: bytes) -> bool:
  """Whether ``row`` is one element of up to 8 bytes repeated: all ones, all zeros, the
  bytes every filled constant holds (``jnp.ones``), which identify no example."""
  return any(len(row) % size == 0 and row == row[:size] * (len(row) // size)
             for size in (1, 2, 4, 8))


def on_each_axis(constants: list[np.ndarray]) -> list[np.ndarray]:
  """``constants``, and each of more than one axis also with each other axis moved first (its
  rows along that axis made contiguous: evaluation rows baked transposed), for
  ``rows_in_constants``.

  Example: ``on_each_axis([rows.T])`` holds ``rows.T`` and ``rows``.
  """
  return list(constants) + [np.ascontiguousarray(np.moveaxis(c, axis, 0))
                            for c in constants for axis in range(1, c.ndim)]


def in_dtypes(constants: list[np.ndarray], dtypes: list) -> list[np.ndarray]:
  """``constants``, and each also as every one of ``dtypes`` it converts to exactly (the
  same numbers in another dtype: int32 tokens baked as float32), for ``rows_in_constants``.

  Example: ``in_dtypes([np.float32([1, 2])], [np.int32])`` adds ``np.int32([1, 2])``.
  """
  found = list(constants)
  for constant in constants:
    for dtype in dict.fromkeys(np.dtype(d) for d in dtypes):
      if constant.dtype == dtype or not {constant.dtype.kind, dtype.kind} <= set("biuf"):
        continue
      with np.errstate(all="ignore"):
        cast = constant.astype(dtype)
        if np.array_equal(cast.astype(constant.dtype), constant):
          found.append(cast)
  return found


def rows_in_constants(constants: list[np.ndarray], leaves: list[np.ndarray]) -> list[int]:
  """The evaluation examples one of whose identifying rows (``identifying``; every row of
  a single leaf) a program constant holds byte for byte, at any element boundary of the
  constant: rows baked into a training program. A row that is one element repeated (all
  ones) is what honest constants hold and is never looked for. ``leaves`` as
  ``evaluation_digests``.

  Example: a step closing over ``eval_tokens`` has a constant holding its rows: found.
  """
  found = set()
  for leaf in leaves:
    width = leaf.shape[1]
    if width == 0 or not (len(leaves) == 1 or identifying(leaf)):
      continue
    wanted = {row_digest(r.tobytes()): i for i, r in enumerate(leaf)
              if not _one_element_repeated(r.tobytes())}
    if not wanted:
      continue
    head = min(8, width)  # a cheap look at a row's first bytes before its digest
    prefixes = {r[:head].tobytes() for r in leaf if not _one_element_repeated(r.tobytes())}
    for constant in constants:
      data, step = np.ascontiguousarray(constant).tobytes(), max(constant.dtype.itemsize, 1)
      for start in range(0, len(data) - width + 1, step):
        if data[start:start + head] in prefixes:
          index = wanted.get(row_digest(data[start:start + width]))
          if index is not None:
            found.add(index)
  return sorted(found)
