"""Secure aggregation (``--secagg``, fedkl.flower.secagg): with dropouts the SecAgg+ sum equals the plain
sum of the surviving users' clipped answers up to the stated quantization bound, the released model is
the one without SecAgg up to that bound (same ledger), no reply reaching the server carries one user's
answer (the same interception finds them without SecAgg), and algorithms that need per-user values
refuse ``--secagg`` in one line before reading data."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.quantization import dequantize, quantize
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
from test_flower import _cfg, _ledger_view  # the small least-squares run of the Flower tests

from fedkl.data import load_dataset
from fedkl.federation.base import ClippedGradient
from fedkl.federation.clipping import clip_rows
from fedkl.federation.inprocess import InProcessFederation
from fedkl.flower import localgrid, secagg
from fedkl.flower.client_app import make_client_app
from fedkl.flower.codec import ClientSpec
from fedkl.flower.federation import FlowerFederation
from fedkl.flower.server_app import run_flower_simulation
from fedkl.problems import make_problem
from fedkl.runner import RunConfig

pytestmark = pytest.mark.flower

SPEC = ClientSpec.build("synthetic-least-squares", "least-squares", {"seed": 4, "n_users": 10})
CLIP = 0.5


class DropAtMaskedVectors(localgrid.Fault):
    """The node takes part in the key exchange, then drops out before sending its masked vector
    (the survivors' masks with it must be removed with its reconstructed key)."""

    def reply(self, partition_id, request, reply):
        configs = request.content.config_records.get(RECORD_KEY_CONFIGS)
        if configs is not None and Key.CIPHERTEXT_LIST in configs:  # the collect-masked-vectors stage
            return None
        return reply


class Recording:
    """A Grid in front of another that keeps every reply the server code receives."""

    def __init__(self, grid) -> None:
        self.grid, self.replies = grid, []

    def get_node_ids(self):
        return self.grid.get_node_ids()

    def send_and_receive(self, messages, *, timeout=None):
        out = list(self.grid.send_and_receive(messages, timeout=timeout))
        self.replies.extend(out)
        return out

    def push_messages(self, messages):
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids):
        out = list(self.grid.pull_messages(message_ids))
        self.replies.extend(out)
        return out

    def arrays(self) -> list[np.ndarray]:
        """Every numeric array in every reply: ArrayRecords, and bytes in ConfigRecords that decode as arrays."""
        found = []
        for r in self.replies:
            if r.has_error():
                continue
            for rec in r.content.array_records.values():
                found += [np.asarray(a.numpy(), dtype=np.float64) for a in rec.values()]
            for rec in r.content.config_records.values():
                for v in rec.values():
                    for b in v if isinstance(v, list) else [v]:
                        if isinstance(b, bytes):
                            try:
                                found.append(np.asarray(bytes_to_ndarray(b), dtype=np.float64))
                            except Exception:
                                pass  # keys, ciphertexts, shares: not arrays
        return found


def _reference():
    dataset = load_dataset(SPEC.dataset, **SPEC.kwargs[0])
    return InProcessFederation(make_problem(SPEC.problem, dataset, **SPEC.kwargs[1]), dataset)


def _federation(secure: bool, faults):
    grid = Recording(localgrid.LocalGrid(make_client_app(SPEC), 10, faults=faults))
    return FlowerFederation(grid, num_users=10, wait_for_nodes=0.0, secagg=secure), grid


def _contains(arrays, answer: np.ndarray, qrange: int) -> bool:
    """Whether some array is the answer, or its quantization (within one level), in the clear."""
    levels = (answer + CLIP) * qrange / (2 * CLIP)
    for a in arrays:
        if a.shape == answer.shape and (np.allclose(a, answer, atol=1e-9) or np.all(np.abs(a - levels) <= 1.0)):
            return True
    return False


def test_secure_sum_is_the_sum_of_the_survivors_up_to_the_stated_quantization_and_hides_each_answer():
    ref = _reference()
    d = ref.num_params
    w = torch.linspace(-1, 1, d, dtype=torch.float64)
    faults = {2: localgrid.drop(), 6: DropAtMaskedVectors()}  # one drops before the key exchange, one after
    fed, grid = _federation(True, faults)
    ans = fed.sum(ClippedGradient(w, CLIP))
    assert ans.values.shape == (1, d) and ans.failed == [2, 6]
    kinds = {uid: why.split(":")[0] for uid, why in fed.failures[-1]["failed"].items()}
    assert kinds == {ref.user_ids[2]: "secagg-dropped", ref.user_ids[6]: "secagg-dropped"}

    rows, _ = clip_rows(ref.compute(ClippedGradient(w, CLIP)).values, CLIP)
    keep = [u for u in range(10) if u not in (2, 6)]
    plain = rows[keep].sum(0)
    qrange = secagg.quantization_range(10)
    bound = secagg.error_bound(CLIP, d, qrange, len(keep))
    err = float((ans.total() - plain).norm())
    assert err <= bound, (err, bound)
    assert bound <= 1e-4 * CLIP * len(keep)  # the stated size: about 2 k Delta sqrt(d)

    # nothing the server received is one user's answer (clipped at C or C'), in the clear or quantized
    sent = clip_rows(ref.compute(ClippedGradient(w, secagg.preclip(CLIP, d, qrange))).values, CLIP)[0]
    arrays = grid.arrays()
    assert arrays  # the masked vectors are there, and were checked
    for u in range(10):
        assert not _contains(arrays, rows[u].numpy(), qrange) and not _contains(arrays, sent[u].numpy(), qrange)

    # the same interception sees every answer without SecAgg (the check above can fail)
    fed, grid = _federation(False, {})
    fed.sum(ClippedGradient(w, CLIP))
    assert all(_contains(grid.arrays(), rows[u].numpy(), qrange) for u in range(10))


def test_dequantized_answer_never_exceeds_the_clip_so_the_sensitivity_is_unchanged():
    """Flower's own quantize/dequantize on answers at the lowered clip, in the worst direction (every
    coordinate equal) and random ones: the dequantized norm is <= C for every rounding draw."""
    np.random.seed(0)  # Flower's stochastic rounding draws from numpy's global generator
    for d, qrange in ((5, 1 << 22), (1000, 1 << 8), (50, 16)):
        c = secagg.preclip(CLIP, d, qrange)
        dirs = [np.ones(d), *np.random.standard_normal((20, d))]
        for v in dirs:
            x = c * (1 + 1e-12) * v / np.linalg.norm(v)
            for _ in range(20):
                deq = dequantize(quantize([x], CLIP, qrange), CLIP, qrange)[0]
                assert np.linalg.norm(deq) <= CLIP
                assert np.max(np.abs(deq - x)) < secagg.step(CLIP, qrange)
    with pytest.raises(secagg.SecAggError, match="too coarse"):
        secagg.preclip(CLIP, 10_000, 16)
    assert secagg.quantization_range(10) == 1 << 22 and 5000 * secagg.quantization_range(5000) < secagg.MODULUS_RANGE


def test_released_model_and_ledger_with_secagg_equal_those_without_up_to_quantization(tmp_path):
    """noisy-gd, one round, same noise: user 3 drops out (after the key exchange under SecAgg); the
    released model differs by at most lr/n times the sum's bound, and the ledger is the same."""
    users, lr = 10, 0.5
    plain = run_flower_simulation(
        _cfg(tmp_path, "plain", users=users, rounds=1), "flower-local", log=lambda s: None, faults={3: localgrid.drop()}
    )
    secure = run_flower_simulation(
        _cfg(tmp_path, "secure", users=users, rounds=1, secagg=True),
        "flower-local",
        log=lambda s: None,
        faults={3: DropAtMaskedVectors()},
    )
    assert plain["failed_users"] == secure["failed_users"] == [1]
    d = plain["w"].numel()
    bound = lr / users * secagg.error_bound(CLIP, d, secagg.quantization_range(users), users - 1)
    diff = float((plain["w"] - secure["w"]).norm())
    assert diff <= bound and bound < 1e-4 * float(plain["w"].norm())
    assert _ledger_view(plain["ledger_path"])[0] == _ledger_view(secure["ledger_path"])[0]
    assert plain["rho_spent"] == secure["rho_spent"] and plain["sigma"] == secure["sigma"]
    # what the guarantee assumes of clients changes: the server can no longer bound a masked answer
    assert plain["guarantee"]["clients"]["name"] == "any"
    assert secure["guarantee"]["clients"]["name"] == "fedkl clients (secure aggregation)"


def test_dp_fedavg_sums_securely_without_per_user_answers(tmp_path):
    kw = dict(algorithm="dp-fedavg", users=10, rounds=2, sampling_rate=1.0, local_steps=2)
    plain = run_flower_simulation(_cfg(tmp_path, "plain", **kw), "flower-local", log=lambda s: None)
    secure = run_flower_simulation(_cfg(tmp_path, "secure", secagg=True, **kw), "flower-local", log=lambda s: None)
    assert secure["failures"]["requests"] == 2 and not secure["failures"]["by_request"]
    assert float((plain["w"] - secure["w"]).norm()) <= 1e-4 * float(plain["w"].norm())


def test_federation_with_secagg_refuses_per_user_answers():
    fed, _ = _federation(True, {})
    with pytest.raises(ValueError, match="sums only"):
        fed.compute(ClippedGradient(torch.zeros(fed.num_params, dtype=torch.float64), CLIP))


@pytest.mark.parametrize(
    "settings, needle",
    [
        ({"algorithm": "mean-output-pert"}, "needs per-user answers"),
        ({"algorithm": "sc-output-pert"}, "needs per-user answers"),
        ({"algorithm": "dp-fedavg", "adaptive_clip": True}, "needs per-user answers"),
    ],
)
def test_algorithms_that_need_per_user_values_refuse_secagg(settings, needle):
    with pytest.raises(ValueError, match=needle):
        RunConfig.from_settings(secagg=True, backend="flower-local", **settings)


def test_cli_refuses_secagg_in_one_line_before_reading_data():
    for args, needle in (
        (["--algorithm", "mean-output-pert", "--backend", "flower-local"], "needs per-user answers"),
        (["--backend", "inprocess"], "Flower"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "fedkl.cli", "run", "--secagg", "--dataset", "synthetic-least-squares", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr


def test_deployed_server_app_sums_securely_with_the_run_config_key(tmp_path):
    """`flwr run . --run-config "fedkl-secagg=true"`: the deployed ServerApp (fedkl.flower.client_app.app on
    the nodes) trains through SecAgg+; a node that drops after the key exchange is reported, not fatal."""
    from flwr.app import Context, RecordDict

    from fedkl.flower import client_app, server_app

    rc = {
        "fedkl-dataset": "synthetic-least-squares",
        "fedkl-users": 8,
        "fedkl-rounds": 2,
        "fedkl-secagg": True,
        "fedkl-noise-seed": 3,
        "fedkl-out": str(tmp_path / "out"),
        "fedkl-wait-for-nodes": 0.0,
    }
    grid = Recording(localgrid.LocalGrid(client_app.app, 8, run_config=rc, faults={5: DropAtMaskedVectors()}))
    server_app._deployed_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    res = json.loads((tmp_path / "out" / "flower_result.json").read_text())
    assert res["failed_users"] == [1, 1] and res["failures"]["counts"] == {"secagg-dropped": 2}
    assert res["ledger"]["releases"] == 2
    assert all(r.metadata.message_type in ("query.fedkl", "train") for r in grid.replies)
    assert sum(r.metadata.message_type == "train" for r in grid.replies) > 0
    assert not any(
        "answer" in r.content for r in grid.replies if not r.has_error() and r.metadata.message_type == "train"
    )


def test_secagg_over_flower_simulation_ray_gives_the_model_without_it(tmp_path):
    users, lr = 6, 0.5
    plain = run_flower_simulation(_cfg(tmp_path, "plain", users=users, rounds=1), "flower-local", log=lambda s: None)
    secure = run_flower_simulation(
        _cfg(tmp_path, "secure", users=users, rounds=1, secagg=True), "flower-sim", log=lambda s: None
    )
    d = plain["w"].numel()
    bound = lr / users * secagg.error_bound(CLIP, d, secagg.quantization_range(users), users)
    assert float((plain["w"] - secure["w"]).norm()) <= bound
    assert secure["failures"]["requests"] == 1 and not secure["failures"]["by_request"]
