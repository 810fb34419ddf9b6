"""The DVBench client: experiments, live proof upload, transcript upload.

Example::

  from dvbench import Client
  client = Client(API_URL)                    # token from DVBENCH_TOKEN or `dvbench login`
  experiment = client.experiment("alice/mnist-mlp")
  proof = experiment.proof(backend="jax")     # the full zkdv.jax.ZKDV driver, uploading
  ...
  proof.finish()
  client.close()
"""

import json
import os
import pathlib
import time
from collections.abc import Callable

import cbor2
import httpx

from dvbench import console
from dvbench import errors
from dvbench.console import logger

console.show_by_default()
from zkdv.verify import claims

TOKEN_FILE = pathlib.Path(os.environ.get("DVBENCH_CONFIG_DIR",
                                         pathlib.Path.home() / ".config" / "dvbench")) / "token"
# Every request the client sends is idempotent (envelopes carry a sequence number, blobs and
# roots are content-addressed), so these answers are retried with backoff.
_RETRY_STATUS = {429, 500, 502, 503, 504}
_MAX_DELAY = 2.0
_MAX_RETRY_AFTER = 30.0
SETTLED_STATES = (*claims.REPLAYED_STATES, claims.UNCHALLENGED, claims.SELF_AUDITED,
                  "invalid", "unverifiable", "abandoned", "crashed")


def _read_token_file() -> tuple[str | None, str | None]:
  try:
    data = json.loads(TOKEN_FILE.read_text())
  except (OSError, ValueError):
    return None, None
  return data.get("token"), data.get("url")


CONNECT_SECONDS = 3.0  # to open a connection, and to retry a server never reached
SAY_AFTER_SECONDS = 8.0  # a request retried this long is reported (once), then retried on


def _retry_after(response: httpx.Response) -> float | None:
  """The server's ``Retry-After`` in seconds (bounded), if it sent one."""
  value = response.headers.get("retry-after", "")
  return min(float(value), _MAX_RETRY_AFTER) if value.isdigit() else None


def _error_text(response: httpx.Response) -> str:
  try:
    return str(response.json().get("error", response.text))
  except (ValueError, AttributeError):
    return response.text


class Http:
  """Requests with bounded retries: connection errors, 429 and 5xx, with exponential
  backoff that honours ``Retry-After``, until ``retry_seconds`` have passed.

  Until the server has answered once, a connection that cannot be opened fails
  within ``CONNECT_SECONDS`` (a wrong URL); afterwards, requests are retried for
  ``retry_seconds`` (a server restarting).
  """

  def __init__(self, url: str, token: str | None, timeout: float = 30.0,
               retry_seconds: float = 60.0):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    self.url = url.rstrip("/")
    self.retry_seconds = retry_seconds
    self.reached = False  # whether the server has answered a request
    self._client = httpx.Client(base_url=self.url, headers=headers,
                                timeout=httpx.Timeout(timeout, connect=CONNECT_SECONDS))

  def request(self, method: str, path: str, *, ok=(200, 201), retry_seconds=None,
              while_retrying: Callable[[], str] | None = None, **kwargs) -> httpx.Response:
    """The response (status in ``ok``), retried as the class says. A request retried for
    ``SAY_AFTER_SECONDS`` is logged once, with ``while_retrying()`` (what goes on meanwhile,
    e.g. training), and again when the server answers."""
    started = time.monotonic()
    deadline = started + (self.retry_seconds if retry_seconds is None else retry_seconds)
    delay, said = 0.05, False
    while True:
      wait = delay
      try:
        response = self._client.request(method, path, **kwargs)
        self.reached = True
        if said and response.status_code not in _RETRY_STATUS:
          logger.info("%s answers again (%s %s, after %.0f s)", self.url, method, path,
                      time.monotonic() - started)
        if response.status_code in ok:
          return response
        if response.status_code not in _RETRY_STATUS:
          raise errors.ApiError(response.status_code, _error_text(response))
        problem = f"HTTP {response.status_code}: {_error_text(response)[:200]}"
        wait, answered = _retry_after(response) or delay, True
      except httpx.TransportError as e:
        problem, answered = f"{type(e).__name__}: {e}", False
        if not self.reached and isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
          deadline = min(deadline, started + CONNECT_SECONDS)
      if time.monotonic() + wait > deadline:
        if not self.reached:
          raise errors.UploadError(
              f"cannot reach a DVBench server at {self.url} ({problem}). Check the URL "
              "(Client(API_URL), $DVBENCH_URL or `dvbench login --url`) and that `dvbench "
              "serve` runs there.")
        if answered:  # busy, or refusing for now: it says so
          raise errors.UploadError(
              f"the DVBench server at {self.url} answered {method} {path} with {problem} "
              f"for {time.monotonic() - started:.0f} s; try again later.")
        raise errors.UploadError(
            f"the DVBench server at {self.url} stopped answering {method} {path} "
            f"({problem}) for {time.monotonic() - started:.0f} s; is it still running?")
      if not said and time.monotonic() - started >= SAY_AFTER_SECONDS:
        said = True
        meanwhile = while_retrying() if while_retrying is not None else ""
        logger.warning("cannot reach %s (%s %s: %s); retrying for %.0f s more%s", self.url,
                       method, path, problem, deadline - time.monotonic(),
                       f"; {meanwhile}" if meanwhile else "")
      time.sleep(wait)
      delay = min(delay * 2, _MAX_DELAY)

  def listing(self, path: str):
    """Every item of a paged JSON listing (``x-next-after``), page by page."""
    after = None
    while True:
      params = {} if after is None else {"after": after}
      response = self.request("GET", path, params=params)
      yield from response.json()
      after = response.headers.get("x-next-after")
      if after is None:
        return

  def put_blob(self, proof_id: str, digest: str, read, retry_seconds=None,
               while_retrying=None) -> None:
    """Uploads a blob for a proof unless the server already holds it for that proof.

    A blob counts for the proofs it was uploaded for, not for every proof that
    names it. ``read()`` gives the bytes; it is called only when they must be sent.
    """
    path = f"/api/v1/proofs/{proof_id}/blobs/{digest}"
    if self.request("HEAD", path, ok=(200, 404), retry_seconds=retry_seconds,
                    while_retrying=while_retrying).status_code != 200:
      self.request("PUT", path, content=read(), retry_seconds=retry_seconds,
                   while_retrying=while_retrying,
                   headers={"content-type": "application/octet-stream"})

  def post_blobs(self, proof_id: str, blobs: list[tuple[str, bytes]], retry_seconds=None,
                 while_retrying=None) -> None:
    """Uploads many small blobs ``(hex digest, bytes)`` for a proof in one request."""
    self.request("POST", f"/api/v1/proofs/{proof_id}/blobs",
                 content=cbor2.dumps([[bytes.fromhex(d), data] for d, data in blobs]),
                 retry_seconds=retry_seconds, while_retrying=while_retrying,
                 headers={"content-type": "application/cbor"}, ok=(201,))

  def close(self) -> None:
    self._client.close()


class Experiment:
  """A named experiment ``owner/name`` on the server."""

  def __init__(self, client: "Client", name: str, info: dict):
    self.client, self.name, self.info = client, name, info

  def __repr__(self):
    return f"Experiment({self.name!r})"

  def proof_slot(self) -> dict:
    """A one-time proof slot: the server's nonce, policy, key and key commitment."""
    owner, name = self.name.split("/")
    return self.client.http.request(
        "POST", f"/api/v1/experiments/{owner}/{name}/slots",
        while_retrying=lambda: "the proof, and training with it, starts once it answers").json()

  def proof(self, backend: str = "jax", config=None, *, run_name: str | None = None,
            tags=(), run_config: dict | None = None, resume: str | None = None):
    """The ``zkdv.jax.ZKDV`` driver for this experiment, uploading live.

    ``run_name``, ``tags`` and ``run_config`` (your hyperparameters) go into the proof's
    root record and onto its pages, shown as declared by you; e.g.
    ``experiment.proof(run_name="lr 3e-4", tags=["sweep-1"], run_config={"lr": 3e-4})``.
    ``resume=PROOF_ID`` continues a proof of this experiment whose run stopped before
    ``finish()`` (crashed, preempted) from the checkpoint of its last committed state, or
    of an earlier segment end it replays from (docs/jax.md, "Resuming a run"); its root
    keeps the first run's fields.
    """
    if backend != "jax":
      raise ValueError(f"backend {backend!r} is not available; use backend='jax'.")
    from dvbench.jax_proof import DVBenchProof  # pylint: disable=g-import-not-at-top
    for earlier in self.client.proofs:
      if earlier.experiment.name == self.name and earlier.unused:
        earlier.discard(f"experiment.proof() made a new proof of {self.name} before this one "
                        "ran a step")
    if resume is not None:
      if run_name is not None or tags or run_config is not None:
        raise ValueError("a resumed proof keeps the run_name, tags and run_config of its "
                         "root; call experiment.proof(resume=...) without them.")
      return DVBenchProof(self, config, resume_id=resume)
    return DVBenchProof(self, config, run_name=run_name, tags=tags, run_config=run_config)

  def upload(self, path: str | os.PathLike, timeout: float = 300.0,
             **uploader_options) -> str:
    """Uploads an existing transcript folder (again); returns its proof id.

    Records the server already has are skipped, so a client restarted after a
    crash sends the same transcript and the server ends with exactly its records;
    a proof the server has closed with all of them is not sent again, and a ``crashed``
    one (a live run killed before it closed its proof, perhaps after its final record)
    is reopened, sent what it lacks and closed.
    """
    from dvbench.upload import Uploader, uploaded_already  # pylint: disable=g-import-not-at-top
    done = uploaded_already(self.client.http, pathlib.Path(path))
    if done is not None:  # a finished proof sent again: nothing to do
      return done
    uploader = Uploader(self.client.http, self.name, pathlib.Path(path), **uploader_options)
    uploader.start()
    uploader.finish(timeout=timeout, require_final=False)
    return uploader.proof_id

  def measure(self, checkpoint):
    """A ``Measurement`` of ``checkpoint`` (params pytree, msgpack bytes or path).

    The checkpoint must be the final params of a verified proof of this experiment.
    """
    from dvbench.measurement import Measurement  # pylint: disable=g-import-not-at-top
    return Measurement(self, checkpoint)

  def proofs(self) -> list[dict]:
    owner, name = self.name.split("/")
    return self.client.http.request("GET", f"/api/v1/experiments/{owner}/{name}").json()["proofs"]


class Client:
  """Connection to a DVBench server.

  Args:
    api_url: the server, e.g. ``http://127.0.0.1:8000``; default ``$DVBENCH_URL``
      or the URL saved by ``dvbench login``.
    token: an API token; default ``$DVBENCH_TOKEN`` or the saved token.
  """

  def __init__(self, api_url: str | None = None, token: str | None = None):
    saved_token, saved_url = _read_token_file()
    url = api_url or os.environ.get("DVBENCH_URL") or saved_url
    if not url:
      raise errors.ConfigurationError(
          "no DVBench server: pass Client(API_URL) or set DVBENCH_URL.")
    self.token = token or os.environ.get("DVBENCH_TOKEN") or saved_token
    self.http = Http(url, self.token)
    self.proofs: list = []  # the proofs made through this client

  @property
  def url(self) -> str:
    return self.http.url

  def experiment(self, name: str) -> Experiment:
    """Creates (or gets) the experiment ``owner/name``; needs the owner's token."""
    if not isinstance(name, str) or name.count("/") != 1:
      raise ValueError(f"experiment names are 'owner/name', got {name!r}.")
    if not self.token:
      raise errors.ConfigurationError(
          "no API token: set DVBENCH_TOKEN or run 'dvbench login --token TOKEN' "
          "(tokens come from 'dvbench token create OWNER').")
    info = self.http.request("POST", "/api/v1/experiments", json={"name": name}).json()
    return Experiment(self, name, info)

  def benchmark(self, name: str):
    """The benchmark ``owner/name`` (``dvbench.benchmark.Benchmark``): its owner registers it,
    anyone with a verified proof submits to it."""
    from dvbench.benchmark import Benchmark  # pylint: disable=g-import-not-at-top
    return Benchmark(self, name)

  def proof_status(self, proof_id: str) -> dict:
    return self.http.request("GET", f"/api/v1/proofs/{proof_id}").json()

  def page(self, proof_id: str) -> str:
    """The proof's page on the server."""
    return f"{self.url}/proofs/{proof_id}"

  def summary(self, proof_id: str, wait: float = 0.0) -> str:
    """One line on the proof: its state, steps and checks, and its page; ``wait``: seconds
    to wait for the server's verdict first. E.g. ``alice/run proof 3f..: verified steps —
    start unattested, 10 steps, 4 checks (4 replayed); http://127.0.0.1:8000/proofs/3f..``"""
    status = self.wait_for_verdict(proof_id, wait)
    state = claims.Standing(status["state"], tuple(status.get("shortfalls") or ()),
                            status.get("base_checkpoint")).label
    if status.get("failure") and status["state"] not in (*claims.REPLAYED_STATES,
                                                         claims.UNCHALLENGED):
      state = f"{state} ({status['failure']})"
    return (f"{status.get('experiment')} proof {proof_id}: {state}, {status['steps']} steps, "
            f"{status.get('checks', 0)} checks ({status.get('checks_verified', 0)} replayed); "
            f"{self.page(proof_id)}")

  def wait_for_verdict(self, proof_id: str, timeout: float = 300.0) -> dict:
    """Polls until the server has settled the proof; returns its status.

    A settled proof is ``verified`` (every claim of ``zkdv verify --strict`` holds),
    ``verified steps`` or ``within tolerance`` (server-chosen checks replayed; its
    ``label`` names each claim that does not hold), ``unchallenged`` (no update check
    was chosen), ``self-audited`` (the prover chose its own checks), ``invalid`` (a
    finding, in ``failure``), ``unverifiable`` (the verification itself failed and was
    given up: ``failure`` says why; no verdict) or ``abandoned``.
    """
    deadline = time.monotonic() + timeout
    while True:
      status = self.proof_status(proof_id)
      if status["state"] in SETTLED_STATES or time.monotonic() > deadline:
        return status
      time.sleep(0.25)

  def close(self) -> None:
    """Stops uploads of proofs that were never finished, then disconnects. A proof that never
    ran a step is discarded; one that stopped midway is left to become ``crashed``."""
    for proof in self.proofs:
      if proof.unused:
        proof.discard("the client was closed before the proof ran a step")
      elif not proof._finished:  # pylint: disable=protected-access
        proof.abandon()
    self.http.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
