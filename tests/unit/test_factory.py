"""The factory contract (autopar.factory): `file.py:factory` returns the model, or a dict with
'model' and optional 'example_inputs', 'loss_fn', 'example_targets'; every bad return value
or file is one line naming what was wrong and what to return instead."""
from __future__ import annotations

import textwrap

import pytest
import torch

from autopar.factory import load_factory, user_model
from autopar.losses import cross_entropy

HF_FILE = '''
from transformers import GPT2Config, GPT2LMHeadModel

def factory():
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                      n_head=4, use_cache=False))
'''


def _write(tmp_path, body: str, name: str = "my_model.py"):
    f = tmp_path / name
    f.write_text(textwrap.dedent(body))
    return f


def test_a_transformers_model_alone_gets_causal_lm_defaults(tmp_path):
    f = _write(tmp_path, HF_FILE)
    user = load_factory(f"{f}:factory", device="meta")
    assert user.name == "my_model:factory"
    assert all(p.is_meta for p in user.model.parameters())       # planning allocates nothing
    (ids,) = user.inputs()                                        # the config's n_positions
    assert ids.shape == (1, 16) and ids.dtype == torch.long and ids.is_meta
    assert user.inputs(seq_len=8)[0].shape == (1, 8)
    assert user.loss() is cross_entropy


def test_a_dict_overrides_the_defaults(tmp_path):
    f = _write(tmp_path, '''
        import torch

        def my_loss(out, y):
            return out.float().mean()

        def factory():
            return {"model": torch.nn.Linear(4, 4), "example_inputs": torch.ones(2, 4),
                    "loss_fn": my_loss, "example_targets": torch.zeros(2, 4)}
    ''')
    user = load_factory(f"{f}:factory")
    assert isinstance(user.model, torch.nn.Linear)
    assert len(user.example_inputs) == 1 and user.example_inputs[0].shape == (2, 4)
    assert user.loss().__name__ == "my_loss" and user.example_targets.shape == (2, 4)


@pytest.mark.parametrize("ret, words", [
    ("(torch.nn.Linear(2, 2), (torch.ones(1, 2),))", ["tuple", "now a dict"]),
    ("{'modle': torch.nn.Linear(2, 2)}", ["unknown key", "'modle'"]),
    ("{'example_inputs': (torch.ones(1, 2),)}", ["no 'model'"]),
    ("{'model': 3}", ["'model' = a int"]),
    ("{'model': torch.nn.Linear(2, 2), 'example_inputs': ()}", ["example_inputs", "non-empty"]),
    ("{'model': torch.nn.Linear(2, 2), 'loss_fn': 'ce'}", ["loss_fn = a str"]),
    ("None", ["returned a NoneType", "return the model"]),
])
def test_bad_return_values_are_one_line(tmp_path, ret, words):
    f = _write(tmp_path, f"import torch\n\ndef factory():\n    return {ret}\n")
    with pytest.raises(ValueError) as err:
        load_factory(f"{f}:factory")
    msg = str(err.value)
    assert "\n" not in msg and "my_model:factory()" in msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize("spec, body, words", [
    ("{d}/none.py:factory", None, ["does not exist"]),
    ("{d}/my_model.py", "def factory(): pass\n", ["expected 'path/to/file.py:name'"]),
    ("{d}/my_model.py:build", "def factory(): pass\n", ["no function 'build'"]),
    ("{d}/my_model.py:factory", "import no_such_module_xyz\n",
     ["importing", "ModuleNotFoundError"]),
    ("{d}/my_model.py:factory", "def factory():\n    raise RuntimeError('out of memory')\n",
     ["raised RuntimeError: out of memory"]),
])
def test_bad_files_and_specs_are_one_line(tmp_path, spec, body, words):
    if body is not None:
        _write(tmp_path, body)
    with pytest.raises(ValueError) as err:
        load_factory(spec.format(d=tmp_path))
    assert "\n" not in str(err.value)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_sequence_length_is_checked_against_context_and_example_inputs(tmp_path):
    user = load_factory(f"{_write(tmp_path, HF_FILE)}:factory", device="meta")
    with pytest.raises(ValueError, match=r"--seq=32 exceeds my_model:factory's context of 16"):
        user.inputs(seq_len=32, option="--seq")
    with pytest.raises(ValueError, match=r"--seq=0: the sequence length must be a positive"):
        user.inputs(seq_len=0, option="--seq")
    fixed = user_model({"model": user.model, "example_inputs": (torch.zeros(1, 8),)}, name="m")
    with pytest.raises(ValueError, match=r"--seq=4 but m's example_inputs have sequence "
                                         r"length 8"):
        fixed.inputs(seq_len=4, option="--seq")
    bare = user_model(torch.nn.Linear(2, 2), name="lin")
    with pytest.raises(ValueError, match=r"lin: no sequence length .* pass --seq S"):
        bare.inputs()


def test_a_factory_file_imports_its_sibling_module(tmp_path):
    """As `python my_model.py` would: the file's folder is on sys.path while it is imported
    and after (the factory may import lazily when it runs)."""
    (tmp_path / "my_layers_sib.py").write_text("import torch\nWIDTH = 8\n")
    (tmp_path / "my_model_sib.py").write_text(
        "import torch\nfrom my_layers_sib import WIDTH\n\n"
        "def factory():\n    import my_layers_sib\n"
        "    return {'model': torch.nn.Linear(WIDTH, my_layers_sib.WIDTH),\n"
        "            'example_inputs': (torch.zeros(2, WIDTH),)}\n")
    user = load_factory(f"{tmp_path / 'my_model_sib.py'}:factory")
    assert user.model.in_features == 8
