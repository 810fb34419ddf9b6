"""The verifier fails closed: every tampering is caught and named.

Transcripts here are written record by record (``write_transcript``) with a real
exported program, so the verifier is tested on exactly what
docs/protocol.md specifies.
"""

import dataclasses
import functools
import pathlib
import random
import shutil
import tempfile
from unittest import mock

import cbor2
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from tests import testing
from zkdv import challenge
from zkdv import digest
from zkdv import errors
from zkdv import merkle
from zkdv import receipt as receipt_lib
from zkdv import records
from zkdv import transcript
from zkdv import verify

STATE = (digest.LeafLayout(".params['w']", "float32", (3,)),
         digest.LeafLayout(".params['b']", "float32", ()))
# Five rows: an odd count, which the protocol does not group (digest.row_group_for).
BATCH = (digest.LeafLayout("[0]", "float32", (5, 3)),)
SEED = bytes(range(32))
STEPS = 6


def sgd_step(w, b, x):
  """The update program: it reads its batch."""
  return w - 0.1 * jnp.mean(x, axis=0) * w + 0.01, b + jnp.sum(x) * 1e-3


def precomputed_step(w, b, x):
  """A program that ignores its batch and writes fixed weights."""
  del x
  return jnp.full_like(w, 0.5), b * 0 + 2.0


@functools.cache
def exported_program(fn=sgd_step) -> tuple[bytes, object]:
  specs = [jax.ShapeDtypeStruct(l.shape, l.dtype) for l in STATE + BATCH]
  exported = jax.export.export(jax.jit(fn, keep_unused=True))(*specs)
  return bytes(exported.serialize()), jax.jit(exported.call)


def batch_of(i: int) -> np.ndarray:
  return (np.arange(15, dtype=np.float32).reshape(5, 3) + i) / 7


def program_record(program_id: bytes, state=STATE, mode="exact") -> dict:
  return {"type": "program", "program_id": program_id, "number": 0, "blob": program_id,
          "function": "sgd_step", "mode": mode,
          "state_layout": [l.to_record() for l in state],
          "batch_layout": [l.to_record() for l in BATCH],
          "inputs": ["state", "state", "batch"], "post_state_outputs": [0, 1],
          "params_leaves": [0, 1], "static_arguments": [], "compiler_options": {},
          "platforms": ["cpu"], "nr_devices": 1}


class _Dvbench:
  """A server's side of one proof slot: its signing key and challenge key K."""

  def __init__(self):
    self.signing_key = receipt_lib.new_signing_key()
    self.server_key = receipt_lib.public_key_bytes(self.signing_key)
    self.key = challenge.new_key()
    self.nonce = bytes(32)

  def challenger(self, policy: dict) -> dict:
    return {"kind": "dvbench", "server_key": self.server_key, "nonce": self.nonce,
            "key_commitment": challenge.key_commitment(self.key), "owner": "alice",
            "experiment": "alice/mnist", "policy": policy}


def write_transcript(folder=None, *, steps=STEPS, policy=None, server=None, fn=sgd_step,
                     state=STATE, receipt_verdict="verified", segment_length=1,
                     fake_step=None) -> pathlib.Path:
  """An honest transcript: every challenge answered, blobs and all.

  The state is committed every ``segment_length`` steps.
  ``server`` (a ``_Dvbench``) makes it server-challenged, with a signed receipt.
  ``fake_step`` writes that step's post-state as the honest one plus 1 (a faked step;
  its check answers are those of the faked run).
  """
  folder = pathlib.Path(folder or tempfile.mkdtemp(prefix="zkdv-verify-")) / "t"
  policy = challenge.Policy(**(policy or {"update_check_probability": 1.0,
                                          "state_check_probability": 0.5,
                                          "probe_ratio": 0.5}),
                            segment_length=segment_length)
  policy_record = policy.to_record()
  writer = transcript.TranscriptWriter(folder)
  blob, run = exported_program(fn)
  challenger = (server.challenger(policy_record) if server else
                {"kind": "self", "seed_commitment": challenge.key_commitment(SEED),
                 "policy": policy_record})
  writer.append({"type": "root", "format_version": transcript.FORMAT_VERSION,
                 "prover": transcript.PROVER, "name": "hand-written", "versions": {},
                 "platform": "cpu", "device_kinds": ["cpu"],
                 "config": {"rtol": 1e-5, "atol": 1e-6}, "challenger": challenger})
  program_id = writer.put_blob(blob)
  writer.append(program_record(program_id, state))
  w, b = np.linspace(-1, 1, 3, dtype=np.float32), np.float32(0.25)
  segment = None  # (first step, start state, batches)
  decisions = {}  # step -> its Decision
  for t in range(steps):
    x = batch_of(t)
    pre = [w, np.asarray(b)]
    post = [np.asarray(a) for a in run(w, b, x)]
    if t == fake_step:
      post = [post[0] + np.float32(1), post[1]]
    pre_digest, _ = digest.digest_state_arrays(state, pre)
    post_digest, pieces = digest.digest_state_arrays(state, post)
    trees = digest.batch_trees(BATCH, [x])
    starts = t % segment_length == 0
    ends = t % segment_length == segment_length - 1 or t == steps - 1
    if starts:
      segment = (t, pre, [])
    segment[2].append(x)
    record = {"type": "step", "index": t, "program": 0,
              "batch": digest.batch_digest(BATCH, [digest.tree_root(l) for l in trees])}
    if starts:
      record["pre_state"] = pre_digest
    if ends:
      record["post_state"] = post_digest
    step_id = writer.append(record)
    c = (challenge.step_challenge_server(server.key, step_id) if server
         else challenge.step_challenge_self(SEED, t))
    decisions[t] = challenge.decide(t, c, policy)
    deciding = challenge.deciding_step("dvbench" if server else "self", segment[0], t)
    _answer(writer, decisions[t], decisions[deciding] if ends else None,
            segment, x, post, trees)
    w, b = post
  final = {"type": "final", "steps": steps, "status": "clean", "discontinuities": []}
  if steps:
    whole = [p[0] for p in pieces] if not any(l.pieces for l in state) else [
        digest.leaf_digest(a) for a in post]
    final.update(final_state=post_digest, final_state_leaves=pieces,
                 final_params=digest.params_digest(
                     [dataclasses.replace(l, pieces=None) for l in state], whole, [0, 1]))
  if not server:
    final["seed"] = SEED
  writer.append(final)
  writer.close()
  if server:
    write_receipt(folder, server, receipt_verdict)
  return folder


def _answer(writer, decision, segment_decision, segment, x, post, trees) -> None:
  """Probes of the step; when it ends ``segment``, the segment's update and state checks
  (``segment_decision``)."""
  blob = lambda a: writer.put_blob(digest.byte_view(np.asarray(a)))
  required = challenge.required_checks(decision, segment_decision)
  if required["update"]:
    first_step, start, batches = segment
    record = {"type": "check", "step": decision.step, "kind": "update",
              "pre_state_blobs": [blob(a) for a in start], "result": {"equal": True},
              "first": first_step, "batch_blobs": [[blob(b)] for b in batches]}
    writer.append(record)
  if required["state"]:
    writer.append({"type": "check", "step": decision.step, "kind": "state",
                   "post_state_blobs": [blob(a) for a in post]})
  rows = decision.probe_rows(0, BATCH[0].rows)
  if rows:
    writer.append({"type": "check", "step": decision.step, "kind": "probe",
                   "batch_roots": [digest.tree_root(t) for t in trees],
                   "probes": [records.probe_entry(0, r, digest.byte_view(x[r]), 1,
                                                  merkle.inclusion_proof(trees[0], r))
                              for r in rows]})


def write_receipt(folder: pathlib.Path, server: _Dvbench, verdict="verified", **changes):
  records = transcript.read_transcript(folder).records
  fields = {"format": 1, "proof_id": records[0].record_id.hex(),
            "transcript_id": records[0].record_id, "server_key": server.server_key,
            "owner": "alice", "experiment": "alice/mnist", "nonce": server.nonce,
            "challenge_key": server.key,
            "policy": records[0].record["challenger"]["policy"], "records": len(records),
            "last_record_id": records[-1].record_id, "verdict": verdict, "checks": 0,
            "issued_at": 0.0, **changes}
  (folder / receipt_lib.RECEIPT_FILE).write_bytes(receipt_lib.sign(fields, server.signing_key))


@functools.cache
def good_transcript() -> pathlib.Path:
  return write_transcript()


def copy_of(src: pathlib.Path) -> pathlib.Path:
  dst = pathlib.Path(tempfile.mkdtemp()) / "t"
  shutil.copytree(src, dst)
  return dst


def records_of(path, kind=None) -> list[dict]:
  recs = [r.record for r in transcript.read_transcript(path).records]
  return [r for r in recs if kind is None or r["type"] == kind]


def rechained(edit, src: pathlib.Path | None = None) -> pathlib.Path:
  """A copy whose records are edited by ``edit`` and re-chained consistently."""
  src = src or good_transcript()
  records = [dict(r) for r in records_of(src)]
  for r in records:
    r.pop("prev", None)
  dst = pathlib.Path(tempfile.mkdtemp()) / "t"
  writer = transcript.TranscriptWriter(dst)
  for r in edit(records):
    writer.append(r)
  writer.close()
  shutil.rmtree(dst / transcript.BLOBS_DIR)
  shutil.copytree(src / transcript.BLOBS_DIR, dst / transcript.BLOBS_DIR)
  return dst


def first(records, record_type, **match) -> dict:
  return next(r for r in records if r["type"] == record_type
              and all(r.get(k) == v for k, v in match.items()))


def flip_byte(path: pathlib.Path, position: int) -> None:
  data = bytearray(path.read_bytes())
  data[position] ^= 0x01 << (position % 8)
  path.write_bytes(bytes(data))


class VerifierTestCase(parameterized.TestCase):

  def assert_fails(self, path, code=None, verdict=verify.INVALID, **kwargs):
    report = verify.verify(path, **kwargs)
    self.assertIsNone(report.fault, report.dumps())  # hostile input is a finding, not a fault
    self.assertNotEqual(report.verdict, verify.VERIFIED)
    self.assertNotEqual(report.exit_code, 0)
    self.assertNotEmpty(report.findings)
    if verdict is not None:
      self.assertEqual(report.verdict, verdict, report.dumps())
    if code is not None:
      self.assertIn(code, {f.code for f in report.findings}, report.dumps())
    for f in report.findings:
      self.assertTrue(f.where and f.message)
    return report

  def assert_refused_naming(self, report, verdict, code, named):
    """``report`` is ``verdict`` (never a fault) with a ``code`` finding naming ``named``
    (a field or a place) in its location or message."""
    self.assertIsNone(report.fault, report.dumps())
    self.assertEqual(report.verdict, verdict, report.dumps())
    found = [f for f in report.findings if f.code == code]
    self.assertNotEmpty(found, report.dumps())
    self.assertTrue(any(named in f"{f.where} {f.message}" for f in found), report.dumps())


class VerifierTest(VerifierTestCase):

  def test_honest_transcript_verifies(self):
    report = verify.verify(good_transcript())
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())
    self.assertEqual(report.exit_code, 0)
    self.assertEqual(report.steps, STEPS)
    self.assertEqual(sum(c.kind == "update" for c in report.checks), STEPS)
    self.assertTrue(all(c.status == "verified" for c in report.checks))
    self.assertGreater(sum(c.kind == "state" for c in report.checks), 0)
    self.assertEqual(report.probed_rows, STEPS * 3)  # 3 of 5 rows at ratio 0.5

  def test_steps_the_challenges_did_not_probe_verify_without_probe_records(self):
    # At ratio 0.01 a step is probed with probability 0.32 (format 10): the fixed seed
    # probes some of the 12 steps and not others, and only those carry a probe record.
    policy = {"update_check_probability": 1.0, "probe_ratio": 0.01}
    folder = write_transcript(steps=12, policy=policy)
    probed = [t for t in range(12) if challenge.decide(
        t, challenge.step_challenge_self(SEED, t), challenge.Policy(**policy)).probed]
    self.assertBetween(len(probed), 1, 11)  # the seed's draws, fixed
    opened = [r["step"] for r in testing.records_of(folder, "check") if r["kind"] == "probe"]
    self.assertEqual(opened, probed)
    report = verify.verify(folder)
    self.assertEqual(report.verdict, verify.VERIFIED, report.dumps())
    self.assertEqual(report.probed_rows, len(probed))  # ceil(5 / 32): a row of 5 each
    self.assertEqual(report.claim("data").status, verify.HOLDS)

  def test_a_run_whose_challenges_probed_no_step_shows_no_data(self):
    # A ratio above 0 whose challenges probed none of the steps opened nothing: the data
    # claim does not hold (it held, "data: probed, 0 rows", before).
    policy = {"update_check_probability": 1.0, "probe_ratio": 1e-9}
    folder = write_transcript(steps=4, policy=policy)
    self.assertFalse(any(challenge.decide(
        t, challenge.step_challenge_self(SEED, t), challenge.Policy(**policy)).probed
        for t in range(4)))
    report = verify.verify(folder)
    self.assertEqual(report.probed_rows, 0)
    claim = report.claim("data")
    self.assertEqual(claim.status, verify.DOES_NOT_HOLD, report.dumps())
    self.assertIn("the challenges probed none of the steps", claim.detail)

  def test_a_ratio_too_small_for_a_draw_still_probes_with_its_probability(self):
    # 32 * 5e-324 * 2**64 rounds down to 0: a floor would probe no step at all, so a
    # policy of a tiny ratio would open nothing while claiming probes. It is rounded up.
    with mock.patch.object(challenge, "_draw", return_value=0):
      self.assertTrue(challenge.step_probed(bytes(32), 5e-324))
    with mock.patch.object(challenge, "_draw", return_value=1):
      self.assertFalse(challenge.step_probed(bytes(32), 5e-324))

  @parameterized.parameters(*range(6))
  def test_any_flipped_record_byte_fails(self, seed):
    rng = random.Random(seed)
    size = (good_transcript() / transcript.RECORDS_FILE).stat().st_size
    for _ in range(8):
      path = copy_of(good_transcript())
      flip_byte(path / transcript.RECORDS_FILE, rng.randrange(size))
      self.assert_fails(path, verdict=None)

  @parameterized.parameters(*range(4))
  def test_any_flipped_blob_byte_fails(self, seed):
    rng = random.Random(seed)
    blobs = sorted((good_transcript() / transcript.BLOBS_DIR).iterdir())
    for _ in range(6):
      blob = rng.choice(blobs)
      path = copy_of(good_transcript())
      flip_byte(path / transcript.BLOBS_DIR / blob.name, rng.randrange(blob.stat().st_size))
      report = self.assert_fails(path)
      self.assertTrue({f.code for f in report.findings} & {"blob", "program_id", "probe", "opening"})

  def test_flipped_program_blob_byte_fails_naming_the_program(self):
    program = records_of(good_transcript(), "program")[0]
    for position in (0, 100, 1000, -1):
      path = copy_of(good_transcript())
      blob = transcript.blob_path(path, program["blob"])
      flip_byte(blob, position % blob.stat().st_size)
      self.assert_fails(path, "program_id")

  @parameterized.parameters(*range(1, 6))
  def test_deleted_duplicated_or_reordered_record_fails(self, index):
    raw = transcript.read_transcript(good_transcript()).records
    for edit in ("delete", "duplicate", "swap"):
      parts = [r.raw for r in raw]
      if edit == "delete":
        del parts[index]
      elif edit == "duplicate":
        parts.insert(index, parts[index])
      else:
        parts[index], parts[index + 1] = parts[index + 1], parts[index]
      path = copy_of(good_transcript())
      (path / transcript.RECORDS_FILE).write_bytes(b"".join(parts))
      self.assert_fails(path, "chain")

  def test_edited_digest_with_ids_recomputed_downstream(self):
    for k in (0, 3, STEPS - 1):
      def edit(records, k=k):
        [r for r in records if r["type"] == "step"][k]["post_state"] = bytes(32)
        return records
      report = self.assert_fails(rechained(edit))
      self.assertTrue({f.code for f in report.findings} & {"replay", "discontinuity",
                                                           "final_state", "opening"})

  def test_edited_batch_digest_fails_the_opening(self):
    def edit(records):
      first(records, "step", index=2)["batch"] = bytes(32)
      return records
    self.assert_fails(rechained(edit), "opening")

  def test_unknown_collectives_is_a_format_error(self):
    def edit(records):
      first(records, "program")["collectives"] = "carrier-pigeon"
      return records
    report = self.assert_fails(rechained(edit), "schema")
    self.assertIn("(program).collectives: one of ['default',", report.dumps())

  def test_post_state_layout_must_describe_the_same_leaves(self):
    def edit(records):
      program = first(records, "program")
      program["post_state_layout"] = [dict(l) for l in program["state_layout"]]
      program["post_state_layout"][0]["shape"] = [7]
      return records
    report = self.assert_fails(rechained(edit), "schema")
    self.assertIn("(program).post_state_layout: the leaves of state_layout", report.dumps())

  def test_replaced_revealed_seed(self):
    def edit(records):
      records[-1]["seed"] = bytes(32)
      return records
    self.assert_fails(rechained(edit), "seed")

  @parameterized.parameters("update", "state", "probe")
  def test_dropped_challenged_check_names_step_and_kind(self, kind):
    dropped = first(records_of(good_transcript()), "check", kind=kind)
    def edit(records):
      return [r for r in records if (r.get("step"), r.get("kind")) != (dropped["step"], kind)]
    report = self.assert_fails(rechained(edit),
                               "missing_probe" if kind == "probe" else "missing_check")
    message = next(f.message for f in report.findings if f.code.startswith("missing"))
    self.assertIn(f"step {dropped['step']}", message)
    self.assertIn("data probes" if kind == "probe" else f"a {kind} check", message)

  def test_check_decisions_are_recomputed_from_the_seed(self):
    policy = challenge.Policy.from_record(records_of(good_transcript())[0]["challenger"]["policy"])
    checks = {(c["step"], c["kind"]) for c in records_of(good_transcript(), "check")}
    for t in range(STEPS):
      decision = challenge.decide(t, challenge.step_challenge_self(SEED, t), policy)
      self.assertEqual((t, "state") in checks, decision.state)
    report = verify.verify(good_transcript())
    self.assertTrue(all(c.challenged for c in report.checks))

  def test_torn_or_unfinished_transcript_is_never_a_success(self):
    path = copy_of(good_transcript())
    records = path / transcript.RECORDS_FILE
    records.write_bytes(records.read_bytes()[:-7])
    report = self.assert_fails(path, "torn_tail", verify.UNVERIFIABLE)
    self.assertIn("unfinished", {f.code for f in report.findings})
    self.assertEqual(report.exit_code, 2)
    self.assertEqual(report.steps, STEPS)  # everything complete was still checked
    self.assertTrue(all(c.status == "verified" for c in report.checks))

  def test_missing_blob_could_not_verify(self):
    path = copy_of(good_transcript())
    check = records_of(path, "check")[0]
    transcript.blob_path(path, check["pre_state_blobs"][-1]).unlink()
    self.assertEqual(self.assert_fails(path, "missing_blob", verify.UNVERIFIABLE).exit_code, 2)

  def test_check_before_its_step_fails(self):
    def edit(records):
      check = first(records, "check", step=2)
      records.remove(check)
      records.insert(records.index(first(records, "step", index=2)), check)
      return records
    self.assert_fails(rechained(edit), "check_step")

  def test_second_check_of_the_same_kind_fails(self):
    def edit(records):
      check = first(records, "check", step=1, kind="update")
      records.insert(records.index(check), dict(check))
      return records
    report = self.assert_fails(rechained(edit), "schema")
    self.assertIn("a second update check of step 1", report.dumps())


class ProbeTamperTest(VerifierTestCase):
  """Data probes: each step opens the rows its challenge selects, with Merkle proofs."""

  @parameterized.named_parameters(
      ("dropped_probe", lambda c: c["probes"].pop()),
      ("moved_probe", lambda c: c["probes"][0].__setitem__(1, (c["probes"][0][1] + 1) % 4)),
      ("duplicated_probe", lambda c: c["probes"].__setitem__(1, c["probes"][0])),
      ("bad_proof", lambda c: c["probes"][0][4].__setitem__(0, bytes(32))),
      ("bad_roots", lambda c: c["batch_roots"].__setitem__(0, bytes(32))),
      ("row_out_of_range", lambda c: c["probes"][0].__setitem__(1, 2**40), "schema"),
      ("flipped_row", lambda c: c["probes"][0].__setitem__(
          3, bytes([c["probes"][0][3][0] ^ 1]) + c["probes"][0][3][1:])),
      ("short_row", lambda c: c["probes"][0].__setitem__(3, c["probes"][0][3][:-1])),
      ("row_as_digest", lambda c: c["probes"][0].__setitem__(3, bytes(32))),
      ("row_in_one_chunk_list", lambda c: c["probes"][0].__setitem__(
          3, [c["probes"][0][3]]), "schema"),
      # the same bytes said to be two rows: the leaf groups one row in a Merkle row
      ("row_split_in_two", lambda c: c["probes"][0].__setitem__(2, 2)),
      ("rows_of_two_widths", lambda c: c["probes"][0].__setitem__(
          2, len(c["probes"][0][3]) + 1), "schema"),
  )
  def test_edited_probes_fail(self, change, code="probe"):
    def edit(records):
      change(first(records, "check", kind="probe", step=2))
      return records
    self.assert_fails(rechained(edit), code)

  def test_dataset_paths_without_a_declared_dataset_are_a_finding(self):
    def with_paths(records):
      check = first(records, "check", kind="update")
      check["data_paths"] = [[] for _ in check["batch_blobs"]]
      return records
    report = self.assert_fails(rechained(with_paths), "data_row")
    self.assertIn("carries dataset paths, but no data record declares a dataset",
                  report.dumps())

  def test_a_short_row_is_named(self):
    def edit(records):
      probe = first(records, "check", kind="probe", step=2)["probes"][0]
      probe[3] = probe[3][:-4]
      return records
    report = self.assert_fails(rechained(edit), "probe")
    self.assertIn("its data rows are", report.dumps())

  def test_hostile_row_counts_are_refused_before_drawing(self):
    huge = digest.LeafLayout("[0]", "float32", (2**39, 1))
    huge = dataclasses.replace(huge, row_group=digest.row_group_for(huge))  # the protocol's
    def edit(records):
      first(records, "program")["batch_layout"] = [huge.to_record()]
      return records
    report = self.assert_fails(rechained(edit))  # bounded: returns, does not hang
    self.assertTrue({f.code for f in report.findings} & {"probe", "blob", "opening"})


class DriverTranscriptTest(VerifierTestCase):
  """Transcripts the driver writes: an attested start holds; other weights do not."""

  def _run(self, swap_params=False, init=True) -> pathlib.Path:
    import optax  # pylint: disable=g-import-not-at-top
    import zkdv  # pylint: disable=g-import-not-at-top
    proof = testing.new_proof("driver", update_p=1.0, state_p=0.5)
    proof.start(probe_ratio=0.5)
    model = testing.TinyClassifier()
    example = jnp.ones((1, 4), jnp.uint32)
    params = (proof.init(model.init, jax.random.key(0), example) if init
              else model.init(jax.random.key(0), example))["params"]
    if swap_params:
      params = jax.tree.map(lambda p: p + 1, params)
    state = zkdv.jax.contrib.TrainState.create(proof=proof, apply_fn=model.apply,
                                               params=params, tx=optax.adam(1e-2))
    train_step = proof.jit(testing.classifier_step, donate_argnums=0)
    for i in range(3):
      state = train_step(state, jnp.asarray(testing.TUTORIAL_BATCH) + i)
    return proof.finish()

  def test_attested_start_holds(self):
    report = verify.verify(self._run())
    self.assertEqual(report.exit_code, 0, report.dumps())
    self.assertEqual(report.claim("start").status, verify.HOLDS)
    self.assertEqual(report.claim("data").status, verify.HOLDS)
    self.assertEqual(report.claim("program").status, verify.HOLDS)

  def test_other_weights_are_not_attested(self):
    report = self.assert_fails(self._run(swap_params=True), "start")
    self.assertIn("is not an output of the init program", report.dumps())
    self.assertEqual(report.claim("start").status, verify.DOES_NOT_HOLD)
    unattested = verify.verify(self._run(init=False))
    self.assertEqual(unattested.exit_code, 0, unattested.dumps())
    self.assertIn("unattested", unattested.claim("start").detail)


class UntrustedInputTest(VerifierTestCase):

  def _write(self, data: bytes) -> pathlib.Path:
    folder = pathlib.Path(tempfile.mkdtemp())
    (folder / transcript.RECORDS_FILE).write_bytes(data)
    return folder

  def test_malformed_cbor(self):
    report = verify.verify(self._write(b"\xff\xff\xff\x1c garbage"))
    self.assertEqual(report.verdict, verify.INVALID)
    self.assertEqual(report.findings[0].code, "unreadable")

  def test_a_records_file_that_cannot_be_read_is_a_finding_not_a_fault(self):
    folder = pathlib.Path(tempfile.mkdtemp())
    (folder / transcript.RECORDS_FILE).mkdir()  # opened as it is read, record by record
    report = verify.verify(folder)
    self.assertIsNone(report.fault)
    self.assertEqual(report.verdict, verify.UNVERIFIABLE)
    self.assertEqual([f.code for f in report.findings], ["unreadable"])

  def test_huge_length_prefix_and_deep_nesting(self):
    for data in (b"\x5b" + (2**62).to_bytes(8, "big") + b"abc",
                 b"\xbb" + (2**40).to_bytes(8, "big"),
                 b"\x81" * 100000 + b"\x00"):
      report = verify.verify(self._write(data))
      self.assertNotEqual(report.verdict, verify.VERIFIED)
      self.assertIn(report.findings[0].code, {"unreadable", "torn_tail", "no_root"})

  def test_record_of_the_wrong_type(self):
    good = transcript.read_transcript(good_transcript()).records
    for bad in ({"type": "step", "index": "zero"}, {"type": "nonsense"}, {"no": "type"},
                {"type": "check", "step": 0, "kind": "sideways"}):
      folder = self._write(good[0].raw + cbor2.dumps({**bad, "prev": good[0].record_id},
                                                     canonical=True))
      report = verify.verify(folder)
      self.assertEqual(report.verdict, verify.INVALID)
      self.assertIn("schema", {f.code for f in report.findings})

  def test_blob_path_escaping_the_transcript(self):
    def edit(records):
      first(records, "check", kind="update")["pre_state_blobs"][0] = b"../../../../etc/passwd"
      return records
    report = self.assert_fails(rechained(edit), "schema")
    self.assertIn("(check).pre_state_blobs[0]: 32 bytes, got bytes of length 22",
                  report.dumps())
    with self.assertRaisesRegex(errors.TranscriptFormatError, "not a blob digest"):
      transcript.blob_path(good_transcript(), b"../../../../etc/passwd")

  def test_missing_path(self):
    report = verify.verify("/nonexistent/zkdv/transcript")
    self.assertEqual(report.verdict, verify.UNVERIFIABLE)
    self.assertEqual(report.exit_code, 2)

  def test_format_1_could_not_verify(self):
    def edit(records):
      records[0]["format_version"] = 1
      return records
    report = self.assert_fails(rechained(edit), "format_version", verify.UNVERIFIABLE)
    self.assertIn("could not verify: record 0 (root).format_version: transcript format 1 is "
                  f"no longer supported; this zkdv reads format {transcript.FORMAT_VERSION}",
                  report.dumps())


if __name__ == "__main__":
  absltest.main()
