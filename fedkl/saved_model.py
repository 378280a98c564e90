"""A run's released model as a file: ``model.pt`` (format ``fedkl-model/1``), and loading it back.

The file is one ``torch.save`` of a dict of plain values (read back with ``torch.load(...,
weights_only=True)``: no pickled code runs on load):

* ``format``: ``"fedkl-model/1"``;
* ``state_dict``: ``{"w": tensor}``, the released parameters exactly as the algorithm released them
  (dtype kept, so a reload is bit-for-bit);
* ``problem``: the public problem spec (:func:`fedkl.problems.problem_spec`: name, task, dim, reg,
  dtype, num_classes / label_bound) that rebuilds the model class without the data (``dtype``: the float
  type it computes in, float32 or float64; a file written before it was recorded: the problem's default);
* ``receipt``: what the parameters cost and under which guarantee: ``algorithm``, ``run_id``,
  ``epsilon`` (the ledger's largest per-user epsilon), ``delta``, ``rho``, ``budget``,
  ``neighbouring`` (the user-level relation), ``accountant``, ``guarantee``, ``clients_assumed``,
  ``ledger`` (``path``, ``run_id``), ``dataset`` and ``settings`` (the run's public settings, without
  the noise seed: a seed would let anyone recompute and subtract the noise).

It holds the private output only: no test metric, no reference model, no trivial baseline, no
intermediate iterate (those are not released values). ``fedkl predict`` and
:func:`fedkl.load_model` read it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from fedkl.data.base import FederatedDataset
from fedkl.federation.inprocess import InProcessFederation
from fedkl.problems import Problem, default_dtype, problem_from_spec, problem_spec
from fedkl.results import strict

FORMAT = "fedkl-model/1"
DROPIN_FORMAT = "fedkl-dropin-model/1"  # the drop-in strategy's model.pt: the app's own network (fedkl.flower.dropin)
_PRIVATE_SETTINGS = ("noise_seed",)  # never written to a model file


@dataclass(frozen=True)
class SavedModel:
    """A released model: ``params`` (the flat parameters), the problem they parametrize and the
    privacy receipt (module docstring)."""

    params: torch.Tensor
    problem_spec: dict
    receipt: dict
    network: Any = None  # problem "torch" trained with a network object (not in the file): give it again

    @property
    def problem(self) -> Problem:
        return problem_from_spec(self.problem_spec, model=self.network)

    def predict(self, X) -> torch.Tensor:
        """Predictions for the rows of ``X`` (``(N, dim)``): ±1 for binary linear models, class
        indices for softmax/MLP, real values for regression."""
        X = torch.as_tensor(X)
        if X.dim() != 2 or X.shape[1] != self.problem_spec["dim"]:
            raise ValueError(f"X must be (records, {self.problem_spec['dim']}), got shape {tuple(X.shape)}")
        return self.problem.predict(self.params, X)

    def check_dataset(self, dataset: FederatedDataset) -> None:
        """ValueError unless ``dataset`` has this model's task and feature dimension."""
        want = self.problem_spec
        if dataset.task != want["task"] or dataset.train.dim != want["dim"]:
            raise ValueError(
                f"the model is a {want['name']} model of a {want['task']} task with {want['dim']} features; "
                f"dataset {dataset.name!r} is {dataset.task} with {dataset.train.dim}"
            )
        have = problem_spec(want["name"], dataset, want["reg"], dtype=want.get("dtype"))  # ValueError: task mismatch
        if have.get("num_classes") != want.get("num_classes"):
            raise ValueError(
                f"the model has {want['num_classes']} classes; dataset {dataset.name!r} has {have['num_classes']}"
            )

    def evaluate(self, dataset: FederatedDataset, split: str = "test") -> dict[str, float]:
        """The metrics ``fedkl run`` reports, of this model on ``dataset``'s ``split`` (NOT private)."""
        self.check_dataset(dataset)
        return InProcessFederation(self.problem, dataset).evaluate(self.params, split)

    def save(self, path: str) -> None:
        payload = {
            "format": FORMAT,
            "state_dict": {"w": self.params.detach().clone()},
            "problem": dict(self.problem_spec),
            "receipt": dict(self.receipt),
        }
        tmp = path + ".tmp"
        torch.save(payload, tmp)
        os.replace(tmp, path)


def public_settings(settings: dict) -> dict:
    """A run's settings without the values a model file must not carry (the noise seed)."""
    return {k: v for k, v in settings.items() if k not in _PRIVATE_SETTINGS}


# what a resumed run may change: where it writes, its evaluation, its noise seed, its kernels
RUN_LOCAL = ("out", "ledger", "reference", "force", "noise_seed", "kernels")


def model_file(path: str) -> str:
    """``path`` itself, or ``path/model.pt`` for a run folder."""
    return os.path.join(path, "model.pt") if os.path.isdir(path) else path


def resume_settings(run: str, given: dict) -> dict:
    """The settings of a run that resumes ``run`` (a run folder or its model file): the saved run's
    settings and ledger, with ``given`` on top (:func:`check_resume` refuses any that differ)."""
    receipt = load_model(model_file(run)).receipt
    return {**receipt["settings"], "out": None, "noise_seed": None, "ledger": receipt["ledger"]["path"], **given}


def check_resume(run: str, settings: dict, ledger_path: str, spec: dict) -> torch.Tensor:
    """The released parameters a run with ``settings`` on ``ledger_path`` starts from when it
    resumes ``run``. ValueError, one line, when the ledger is not the resumed run's, a setting other
    than :data:`RUN_LOCAL` differs, or the data give another problem: the only value reused is the
    released model (a private output: post-processing costs no budget)."""
    model = load_model(model_file(run))
    receipt = model.receipt
    was = receipt["ledger"]["path"]
    if os.path.abspath(ledger_path) != was:
        raise ValueError(
            f"--resume {run}: its ledger is {was}, not {ledger_path}; a resumed run charges the same ledger"
        )
    if not os.path.exists(was):
        raise ValueError(f"--resume {run}: its ledger {was} is gone; nothing to continue")
    for key, value in receipt["settings"].items():
        if key not in RUN_LOCAL and strict(_path(key, settings.get(key))) != strict(_path(key, value)):
            raise ValueError(
                f"--resume {run}: {key} is {settings.get(key)!r} here but {value!r} in the resumed run; a resumed "
                "run keeps its settings (drop the option, or start a new run)"
            )
    if spec != model.problem_spec:
        raise ValueError(f"--resume {run}: the data give problem {spec}, the saved model is {model.problem_spec}")
    return model.params


def _path(key: str, value: Any) -> Any:
    """A data file ``dataset`` as an absolute path (runs record it so since issue 31; older ones as typed)."""
    from fedkl.data.files import is_data_file

    return os.path.abspath(value) if key == "dataset" and is_data_file(value) else value


def load_model(path: str, model: Any = None) -> SavedModel:
    """The model a run saved at ``path`` (``fedkl-model/1``); ValueError on any other file.
    ``model``: the network (factory or module) of a ``torch`` problem that was trained with a network
    object rather than an import spec (the file cannot hold the object)."""
    try:
        payload = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such model file") from None
    except Exception as e:  # noqa: BLE001  (any unreadable file: one line)
        raise ValueError(f"{path} is not a fedkl model file ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if isinstance(payload, dict) and payload.get("format") == DROPIN_FORMAT:
        raise ValueError(
            f"{path} is the model of a Flower app trained with fedkl's drop-in strategy: the app's own network, "
            "which fedkl cannot rebuild; load it into the app's model with "
            "model.load_state_dict(torch.load(path, weights_only=True)['state_dict']) and evaluate it there"
        )
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{path} is not a {FORMAT} file (found {found!r}; runs before issue 20 saved a bare tensor)")
    spec = payload["problem"]
    if isinstance(spec, dict) and "name" in spec:
        spec = {**spec, "dtype": spec.get("dtype") or default_dtype(spec["name"])}  # written before dtype was kept
    saved = SavedModel(payload["state_dict"]["w"], spec, payload["receipt"], model)
    if saved.params.shape != (saved.problem.num_params,):
        raise ValueError(f"{path}: parameters of shape {tuple(saved.params.shape)} do not fit {saved.problem_spec}")
    return saved


__all__ = ["FORMAT", "RUN_LOCAL", "SavedModel", "check_resume", "load_model", "public_settings", "resume_settings"]
