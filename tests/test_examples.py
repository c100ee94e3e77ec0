"""examples/03_transformer.py, a few steps on 8 CPU host devices: the loss falls with either
sequence-parallel attention, and a checkpoint restores into a fresh model and resumes."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = ["--layers", "1", "--seq", "64", "--batch", "4", "--dim", "64", "--heads", "8",
         "--text-bytes", "200000"]


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"),
                                                  ROOT / "examples" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("attention", ("ring", "ulysses"))
def test_transformer_trains_saves_and_resumes(attention, tmp_path, capsys):
    example = _example("03_transformer.py")
    checkpoint = str(tmp_path / "lm.npz")
    first = example.main(["--steps", "6", "--attention", attention, "--checkpoint", checkpoint,
                          *SMALL])
    out = capsys.readouterr().out
    assert first["losses"][-1] < first["losses"][0] - 0.5, first["losses"]
    assert "tokens/s" in out and "6/6" in out and "restored into a fresh model" in out
    assert first["step"] == 6
    import pk_jax as pk

    pk.shutdown()
    second = example.main(["--steps", "2", "--attention", attention, "--resume", checkpoint,
                           *SMALL])
    assert "resumed from" in capsys.readouterr().out and second["step"] == 8
    assert second["losses"][0] < first["losses"][0] - 0.5  # it goes on from the trained model


def test_transformer_with_moe_blocks_trains(capsys):
    example = _example("03_transformer.py")
    result = example.main(["--steps", "6", "--experts", "4", *SMALL])
    assert result["losses"][-1] < result["losses"][0] - 0.5, result["losses"]
    assert "6/6" in capsys.readouterr().out


def test_stdlib_text_and_batches():
    example = _example("03_transformer.py")
    text = example.stdlib_bytes(10_000)
    assert len(text) == 10_000 and b"import" in text.tobytes()
    inputs, targets = next(example.batches(text, 16, 3, seed=0))
    assert inputs.shape == targets.shape == (16, 3)
    assert (inputs[1:] == targets[:-1]).all()
