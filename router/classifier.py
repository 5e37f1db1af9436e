"""The domain classifier: word n-grams (router.features) into a linear model.

Training uses scikit-learn's ``LogisticRegression``; serving needs only numpy:
the artefact is a plain ``.npz`` (no pickle) holding the vocabulary, one
weight row per key (exported from the fitted model), the class names, the
feature parameters and a format version. ``predict`` sums the weight rows of
a text's ~60 keys (router.scorer: one lookup per distinct word, summed as packed ints).

Example::

    clf = DomainClassifier.load()            # the shipped router/data/domain_classifier.npz
    clf.predict("Translate to French: good morning")   # -> "translation"
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from polyinfer.config import DOMAINS
from router.errors import ClassifierArtefactError
from router.features import FeatureConfig, Vocabulary
from router.scorer import TextScorer

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: vocabulary of n-gram keys (1: hashed n-grams)
DEFAULT_ARTEFACT = Path(__file__).resolve().parent / "data" / "domain_classifier.npz"


@dataclass(frozen=True)
class TrainConfig:
    c: float = 8.0  # inverse l2 strength of the logistic regression
    max_iter: int = 300
    class_weight_balanced: bool = True

    def __post_init__(self) -> None:
        if self.c <= 0 or self.max_iter <= 0:
            raise ValueError("c and max_iter must be positive")


class DomainClassifier:
    """Maps a prompt text to one of polyinfer.config.DOMAINS."""

    def __init__(self, vocabulary: Vocabulary, classes: Sequence[str], weights: np.ndarray,
                 bias: np.ndarray, meta: dict[str, object] | None = None) -> None:
        if weights.shape != (len(vocabulary.keys), len(classes)):
            raise ValueError(f"weights: expected {(len(vocabulary.keys), len(classes))}, got "
                             f"{weights.shape}")
        self.vocabulary = vocabulary
        self.classes = tuple(classes)
        # [num_keys + 1, num_classes] float32: the last row (unseen keys) is zeros
        self.weights = np.concatenate([weights, np.zeros((1, len(classes)))]).astype(np.float32)
        self.bias = bias.astype(np.float32)  # [num_classes]
        self._bias = self.bias.tolist()
        self.meta = dict(meta or {})
        self.scorer = TextScorer(vocabulary, weights.astype(np.float32))

    def scores(self, text: str) -> np.ndarray:
        """[num_classes] class scores: what ``predict`` takes the best of."""
        total, num_keys = self._summed_rows(text)
        return total * np.float32(1.0 / math.sqrt(num_keys)) + self.bias

    def reference_scores(self, text: str) -> np.ndarray:
        """The same scores from the spelled-out keys (what ``scores`` is checked against)."""
        rows, num_keys = self.vocabulary.reference_rows(text)
        return self.weights[rows].astype(np.float64).sum(axis=0) / math.sqrt(num_keys) + self.bias

    def predict(self, text: str) -> str:
        # NOTE: on 8 Python floats, no numpy call (router.scorer)
        return self.classes[self.scorer.best(text, self._bias)]

    def _summed_rows(self, text: str) -> tuple[np.ndarray, int]:
        return self.scorer.summed_rows(text)

    # --- training ----------------------------------------------------------------------

    @classmethod
    def fit(cls, texts: Sequence[str], labels: Sequence[str],
            features: FeatureConfig | None = None, train: TrainConfig | None = None,
            meta: dict[str, object] | None = None) -> DomainClassifier:
        unknown = sorted(set(labels) - set(DOMAINS))
        if unknown:
            raise ValueError(f"labels outside DOMAINS: {unknown}")
        vocabulary = Vocabulary.build(texts, features or FeatureConfig())
        model = fit_model(vocabulary.matrix(texts), labels, train or TrainConfig())
        return cls.from_model(vocabulary, model, meta)

    @classmethod
    def from_model(cls, vocabulary: Vocabulary, model: Any,
                   meta: dict[str, object] | None = None) -> DomainClassifier:
        """The fitted ``LogisticRegression``'s weights, one row per vocabulary key."""
        classes = [str(c) for c in model.classes_]
        weights = np.ascontiguousarray(model.coef_.T.astype(np.float32))
        bias = model.intercept_.astype(np.float32)
        if len(classes) == 2:  # sklearn's binary case: one column for the positive class
            weights = np.concatenate([-weights / 2, weights / 2], axis=1)
            bias = np.array([-bias[0] / 2, bias[0] / 2], np.float32)
        return cls(vocabulary, classes, weights, bias, meta)

    # --- artefact ----------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        header = {"format_version": FORMAT_VERSION,
                  "features": self.vocabulary.config.to_dict(),
                  "classes": list(self.classes), "meta": self.meta}
        keys = json.dumps(self.vocabulary.to_json(), ensure_ascii=False).encode()
        with open(path, "wb") as f:
            np.savez_compressed(f, header=np.frombuffer(json.dumps(header).encode(), np.uint8),
                                keys=np.frombuffer(keys, np.uint8), weights=self.weights[:-1],
                                bias=self.bias)

    @classmethod
    def load(cls, path: str | Path | None = None) -> DomainClassifier:
        p = Path(path) if path is not None else DEFAULT_ARTEFACT
        try:
            with np.load(p, allow_pickle=False) as z:
                header = json.loads(bytes(z["header"]).decode())
                if header.get("format_version") != FORMAT_VERSION:
                    raise ClassifierArtefactError(
                        f"{p}: format_version {header.get('format_version')!r}, expected "
                        f"{FORMAT_VERSION}")
                keys = json.loads(bytes(z["keys"]).decode())
                weights, bias = z["weights"], z["bias"]
        except (OSError, KeyError, ValueError) as e:
            raise ClassifierArtefactError(f"{p}: cannot read classifier artefact: {e}") from e
        vocabulary = Vocabulary.from_json(FeatureConfig(**header["features"]), keys)
        return cls(vocabulary, header["classes"], weights, bias, header.get("meta"))


def fit_model(x: Any, labels: Sequence[str], train: TrainConfig) -> Any:
    """scikit-learn's ``LogisticRegression`` fitted on the training matrix ``x``."""
    from sklearn.linear_model import LogisticRegression

    model = LogisticRegression(C=train.c, max_iter=train.max_iter,
                               class_weight="balanced" if train.class_weight_balanced else None)
    return model.fit(x, list(labels))
