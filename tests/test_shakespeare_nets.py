"""simulations/nets.py's character model reads fedkl.data.shakespeare's feature rows as the data module lays
them out (intercept, then one one-hot block per context position, oldest first, the row over sqrt(k + 1))."""

import os

import numpy as np
import pytest
import torch

from fedkl.data.shakespeare import NUM_SYMBOLS, context_features
from fedkl.problems.torch_model import load_factory

# loaded by path, the way `--model simulations/nets.py:char_mlp` loads it (tests never import simulations/)
char_mlp = load_factory(os.path.join(os.path.dirname(__file__), "..", "simulations", "nets.py") + ":char_mlp")


def test_char_mlp_sees_each_position_symbol_embedding():
    k = 5
    contexts = np.random.default_rng(0).integers(0, NUM_SYMBOLS, size=(7, k))
    x = torch.as_tensor(context_features(contexts), dtype=torch.float32)
    net = char_mlp(x.shape[1], NUM_SYMBOLS)
    # by hand: the embedding column of each position's symbol (scale 1: the row scaling undone), concatenated
    emb = net.embed.weight.T[torch.as_tensor(contexts)].flatten(1)
    assert torch.allclose(net(x), net.body(emb), atol=1e-5)
    # the positions are not interchangeable: reversing the context changes the prediction
    assert not torch.allclose(
        net(x), net(torch.as_tensor(context_features(contexts[:, ::-1].copy()), dtype=torch.float32))
    )


def test_char_mlp_refuses_a_layout_that_is_not_shakespeare():
    with pytest.raises(ValueError, match="1 \\+ 36 \\* context"):
        char_mlp(1 + NUM_SYMBOLS * 3 + 2, NUM_SYMBOLS)


def test_the_committed_shakespeare_report_is_what_its_result_files_say(tmp_path):
    """simulations/results/shakespeare.md is generated from the committed result.json / study.json files,
    never edited by hand: regenerating it gives the same text."""
    import importlib.util
    import os
    import types

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "simulations", "studies", "shakespeare.py")
    spec = importlib.util.spec_from_file_location("shakespeare_study", path)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    out = tmp_path / "shakespeare.md"
    study.report(types.SimpleNamespace(out=str(out)))
    with open(study.REPORT) as f:
        assert out.read_text() == f.read()
