"""The processor of examples/ml_batch.py: batch inference with a small numpy MLP.

The model is built when this module is imported. sandboxq preloads the processor's module
in the fork server, so it is built once there and every child starts with it already in
memory (shared copy-on-write), instead of loading it once per job.
"""

from __future__ import annotations

import os

# The pool is the parallelism: one BLAS thread per child, or N children fight over cores.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

FEATURES, HIDDEN, CLASSES = 64, 256, 10

# Fixed random weights stand in for a trained model: same seed, same predictions.
_rng = np.random.default_rng(seed=42)
W1 = _rng.normal(0.0, FEATURES**-0.5, (FEATURES, HIDDEN)).astype(np.float32)
B1 = np.zeros(HIDDEN, dtype=np.float32)
W2 = _rng.normal(0.0, HIDDEN**-0.5, (HIDDEN, CLASSES)).astype(np.float32)
B2 = np.zeros(CLASSES, dtype=np.float32)


def predict(x: np.ndarray) -> np.ndarray:
    """Class probabilities for each row of ``x``: ReLU hidden layer, softmax output."""
    hidden = np.maximum(x @ W1 + B1, 0.0)
    logits = hidden @ W2 + B2
    logits -= logits.max(axis=1, keepdims=True)
    exp = np.exp(logits)
    return np.asarray(exp / exp.sum(axis=1, keepdims=True))


def infer_batch(batch: int, rows: int, seed: int) -> dict[str, object]:
    """Score one batch. The batch is generated from ``seed`` here, so the job's payload
    stays small; a real one would read its rows from storage by batch id."""
    x = np.random.default_rng(seed).normal(size=(rows, FEATURES)).astype(np.float32)
    probs = predict(x)
    labels = probs.argmax(axis=1)
    return {
        "batch": batch,
        "rows": rows,
        "per_class": np.bincount(labels, minlength=CLASSES).tolist(),
        "mean_confidence": round(float(probs.max(axis=1).mean()), 4),
        "pid": os.getpid(),
    }
