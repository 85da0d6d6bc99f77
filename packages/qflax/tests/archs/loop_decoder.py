"""A recurrent decoder run by JAX loops: ``lax.fori_loop`` over a teacher-forced
sequence, and a greedy ``generate`` in ``lax.while_loop`` (its cache is the state)."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int = 32
    layers: int = 2
    vocab: int = 64


class LoopDecoder(nn.Module):
    config: Config = Config()

    def setup(self):
        cfg = self.config
        self.embed = nn.Embed(cfg.vocab, cfg.d_model, embedding_init=nn.initializers.normal(1.0))
        self.cells = [nn.Dense(cfg.d_model, name=f"cell{i}") for i in range(cfg.layers)]
        self.out = nn.Dense(cfg.vocab)

    def step(self, token, state):
        """One token in, its logits and the next state ``(layers, batch, d_model)`` out."""
        x, new = self.embed(token), []
        for cell, h in zip(self.cells, state, strict=True):
            x = jnp.tanh(cell(jnp.concatenate([x, h], axis=-1)))
            new.append(x)
        return self.out(x), jnp.stack(new)

    def initial_state(self, batch):
        return jnp.zeros((self.config.layers, batch, self.config.d_model))

    def __call__(self, ids):
        """Teacher-forced logits ``(batch, time, vocab)``: step 0, then a fori_loop."""
        first, state = self.step(ids[:, 0], self.initial_state(ids.shape[0]))  # makes params
        out = jnp.zeros((*ids.shape, self.config.vocab)).at[:, 0].set(first)

        def body(t, carry):
            state, out = carry
            logits, state = self.step(ids[:, t], state)
            return state, out.at[:, t].set(logits)

        return lax.fori_loop(1, ids.shape[1], body, (state, out))[1]

    def generate(self, first, steps):
        """Greedy tokens ``(batch, steps)`` after ``first``, in a while_loop."""

        def body(carry):
            t, token, state, out = carry
            logits, state = self.step(token, state)
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            return t + 1, token, state, out.at[:, t].set(token)

        out = jnp.zeros((first.shape[0], steps), jnp.int32)
        carry = (jnp.int32(0), first, self.initial_state(first.shape[0]), out)
        return lax.while_loop(lambda c: c[0] < steps, body, carry)[3]


def generate(model, variables, first, steps):
    """``model.generate`` jitted (``steps`` static)."""
    run = jax.jit(lambda v, f: model.apply(v, f, steps, method="generate"))
    return run(variables, first)
