"""The runnable code of the tutorial "Train a Flax model with TrainState", steps 2-6,
character for character (the illustrative PRNG-key variant of step 4 calls undefined
helpers and is left out). ``API_URL`` is supplied by the caller."""

_DVBENCH_LINES = {
    'from dvbench import Client\n\nclient = Client(API_URL)\n'
    'experiment = client.experiment("your-name/jax-train-state")\n': "import zkdv\n",
    'experiment.proof(backend="jax")': 'zkdv.jax.ZKDV("your-name/jax-train-state")',
    'experiment.proof(backend="jax", config=config)':
        'zkdv.jax.ZKDV("your-name/jax-train-state", config)',
    "client.close()\n": "",
}


def without_server(code: str) -> str:
  """The same code with ``zkdv.jax.ZKDV(...)`` in place of ``experiment.proof(...)``."""
  for dvbench_line, local_line in _DVBENCH_LINES.items():
    assert dvbench_line in code, dvbench_line
    code = code.replace(dvbench_line, local_line)
  return code

STEPS_2_TO_6 = '''
from dvbench import Client

client = Client(API_URL)
experiment = client.experiment("your-name/jax-train-state")
proof = experiment.proof(backend="jax")
proof.start(rolling_window=4, probe_ratio=0.01)

import zkdv

config = zkdv.ZKDVConfig(
    sampling_policy=zkdv.SamplingPolicy(
        update_check_probability=0.01,
    ),
)
proof = experiment.proof(backend="jax", config=config)

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
import zkdv


class TinyClassifier(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        return nn.Dense(2)(tokens.astype(jnp.float32))


model = TinyClassifier()
params = model.init(
    jax.random.key(0),
    jnp.ones((1, 4), dtype=jnp.uint32),
)["params"]

state = zkdv.jax.contrib.TrainState.create(
    proof=proof,
    apply_fn=model.apply,
    params=params,
    tx=optax.adam(1e-2),
)

@proof.jit(donate_argnums=(0,))
def train_step(state, batch):
    tokens = batch[:, :4]
    labels = batch[:, 4].astype(jnp.int32)

    def loss(params):
        logits = state.apply_fn({"params": params}, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits,
            labels,
        ).mean()

    grads = jax.grad(loss)(state.params)
    return state.apply_gradients(grads=grads)

batch = jnp.asarray(
    [
        [0, 0, 0, 1, 0],
        [0, 1, 0, 1, 0],
        [1, 0, 1, 0, 1],
        [1, 1, 1, 0, 1],
    ],
    dtype=jnp.uint32,
)

for _ in range(10):
    state = train_step(state, batch)

from pathlib import Path
from flax import serialization

proof.finish()
Path("jax-checkpoint.msgpack").write_bytes(
    serialization.to_bytes(state.params),
)
client.close()
'''
