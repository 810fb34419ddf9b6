"""A benchmark's pins on where a run starts and how much of its data is probed.

Beside the training programs, the training set and the audit level (``routes_submissions``),
a benchmark may pin:

- ``init_program``: the program id of the attested init a proof must start with
  (``proof.init`` or ``proof.init_from``);
- ``base_checkpoint``: the params digest of the checkpoint a fine-tuning run must start
  from (``proof.init_from``; the digest ``final_params`` and measurements use). A proof that
  starts from a base checkpoint is accepted only by a benchmark that pins that very
  checkpoint: without the pin, a declared base could be any model, another owner's entry
  among them;
- ``min_probe_ratio``: the least probability with which the server's challenges open each
  batch row;
- ``data_order``: ``"server-seeded"``, every step's rows its batch of the order the proof's
  slot seeds over the pinned training set (``proof.batches``, ``zkdv.data``), as the
  server's verification showed it (needs ``training_set``).

A pin holds on what the server's own verification showed (the start claim holds, and its
stored facts name the init program and the base) and on the proof's challenge policy, which
the server stored from the root it bound to its slot. The same rule refuses a submission
(409 naming each pin that does not hold) and fills the leaderboard's ``pins``.

Example::

  pins = parse(record)          # from a registration's definition
  said, broken = check(pins, start_of(store, proof_id))
  said["base_checkpoint"]       # "holds", "not pinned", or what breaks it
"""

import json

from starlette.exceptions import HTTPException

from dvbench.server import labels

FIELDS = ("init_program", "base_checkpoint", "min_probe_ratio", "data_order")
DATA_ORDERS = ("server-seeded",)
NOT_PINNED = "not pinned"


def _digest(value, what: str) -> bytes | None:
  if value is not None and not (isinstance(value, bytes) and len(value) == 32):
    raise HTTPException(400, f"{what}: null or a 32-byte digest.")
  return value


def parse(record: dict) -> dict:
  """The pins of a benchmark's definition (None: not pinned); 400 naming a wrong one."""
  ratio = record.get("min_probe_ratio")
  if ratio is not None and not (isinstance(ratio, float) and 0 < ratio <= 1):
    raise HTTPException(400, "min_probe_ratio: null or a float in (0, 1].")
  order = record.get("data_order")
  if order is not None and order not in DATA_ORDERS:
    raise HTTPException(400, f"data_order: null or one of {list(DATA_ORDERS)}, got "
                        f"{str(order)[:40]!r}.")
  if order is not None and record.get("training_set") is None:
    raise HTTPException(400, "data_order: a data order is one over the pinned training set: "
                        "register training_set too.")
  if (record.get("audit") == "full-replay" and record.get("training_set") is not None
      and order is None):
    raise HTTPException(400, "data_order: a full-replay benchmark with a training set pins "
                        "data_order='server-seeded': then every replayed row is checked "
                        "against the set at its index (without it, only probed rows are "
                        "proven members).")
  return {"init_program": _digest(record.get("init_program"), "init_program"),
          "base_checkpoint": _digest(record.get("base_checkpoint"), "base_checkpoint"),
          "min_probe_ratio": ratio, "data_order": order}


def start_of(store, proof_id: str) -> dict:
  """What the server's verification showed of a proof's start, and its probe ratio:
  ``{"attested", "init_program", "base_checkpoint", "probe_ratio", "base_of", "data",
  "dataset"}``, the hex ids None where absent; ``base_of``: the proof (``{"id",
  "experiment"}``) that ended first with the base checkpoint as its final params, if any;
  ``data`` and ``dataset``: ``labels.data_standing``."""
  stored = store.proof_claims(proof_id)
  shown = (stored or {"claims": {}})["claims"]
  challenger = store.challenger(proof_id)
  base = shown.get(labels.BASE_CHECKPOINT)
  return {"attested": shown.get("start") == "holds",
          "init_program": shown.get(labels.INIT_PROGRAM), "base_checkpoint": base,
          "probe_ratio": json.loads(challenger["policy"])["probe_ratio"] if challenger else 0.0,
          "base_of": store.first_with_final_params(base) if base else None,
          **labels.data_standing(stored)}


def _short(hex_id: str) -> str:
  return f"{hex_id[:16]}…"


def _base_named(start: dict) -> str:
  """The proof's base checkpoint, and whose final params it is where known."""
  first = start["base_of"]
  return f"base checkpoint {_short(start['base_checkpoint'])}" + (
      f" (the final params of proof {first['id']} of '{first['experiment']}')" if first else "")


def _init_program(pin: bytes | None, start: dict) -> str:
  if pin is None:
    return NOT_PINNED
  if not start["attested"]:
    return f"no attested start (it pins init program {_short(pin.hex())})"
  if start["init_program"] != pin.hex():
    return (f"init program {_short(start['init_program'])}, not the pinned "
            f"{_short(pin.hex())}")
  return "holds"


def _base_checkpoint(pin: bytes | None, start: dict) -> str:
  if pin is None:
    return NOT_PINNED if start["base_checkpoint"] is None else (
        f"the start is {_base_named(start)}, and the benchmark pins no base checkpoint: "
        "it ranks only starts from the key")
  if start["base_checkpoint"] is None:
    return (f"the start is not from the pinned base checkpoint {_short(pin.hex())} "
            f"({'from the key' if start['attested'] else 'unattested'})")
  if start["base_checkpoint"] != pin.hex():
    return f"the start is {_base_named(start)}, not the pinned {_short(pin.hex())}"
  return "holds"


def _probe_ratio(pin: float | None, start: dict) -> str:
  ratio = start["probe_ratio"]
  if pin is None:
    return f"{NOT_PINNED} (the proof opened each batch row with probability {ratio:g})"
  if ratio < pin:
    return f"probe ratio {ratio:g}, below the pinned minimum {pin:g}"
  return "holds"


def _data_order(pin: str | None, training_set: dict | None, start: dict) -> str:
  if pin is None:
    return f"{NOT_PINNED} (data: {start['data']})"
  root = training_set["root"].hex()
  if start["data"] == f"order {pin}" and start["dataset"] == root:
    return "holds"
  if start["dataset"] is not None and start["dataset"] != root:
    return (f"data {start['data']} over dataset {_short(start['dataset'])}, not the pinned "
            f"training set {_short(root)}")
  return (f"data {start['data']}: the batches were not drawn with proof.batches from the "
          f"pinned training set {_short(root)} in a {pin} order")


def check(pins: dict, start: dict) -> tuple[dict, list[str]]:
  """(what each pin says of the proof, the pins it breaks, each named).

  Example: ``check({"min_probe_ratio": 0.75, ...}, start)[1]`` is
  ``["min_probe_ratio: probe ratio 0.5, below the pinned minimum 0.75"]``.
  """
  said = {"init_program": _init_program(pins["init_program"], start),
          "base_checkpoint": _base_checkpoint(pins["base_checkpoint"], start),
          "probe_ratio": _probe_ratio(pins["min_probe_ratio"], start),
          "data_order": _data_order(pins["data_order"], pins.get("training_set"), start)}
  broken = [f"{name}: {text}" for name, text in zip(FIELDS, said.values())
            if text != "holds" and not text.startswith(NOT_PINNED)]
  return said, broken


def left_open(pins: dict) -> list[str]:
  """What the start and probe pins leave open, for the benchmark's ``left_open``."""
  open_ = []
  if pins["init_program"] is None and pins["base_checkpoint"] is None:
    open_.append("the init: any attested start from the key (an init program of the "
                 "prover's, proof.init); starts from a base checkpoint are not accepted")
  elif pins["init_program"] is None:
    open_.append("the init program: any, from the pinned base checkpoint")
  if pins["min_probe_ratio"] is None:
    open_.append("the probe ratio: any above the server's minimum")
  return open_
