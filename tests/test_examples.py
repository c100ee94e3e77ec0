"""examples/03_transformer.py, a few steps on 8 CPU host devices: the loss falls with either
sequence-parallel attention, and a checkpoint restores into a fresh model and resumes;
examples/05_packed_documents.py: training on packed documents with segment ids lowers the loss,
and the packed forward equals per-document forward calls."""

import importlib.util
import pathlib
import re

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


def test_packed_documents_train_and_match_per_document_calls(capsys):
    """The ring with segment ids on sp=4 x tp=2: 20 steps lower the loss by over 1, and
    the packed forward equals the documents' separate forward calls (bf16 layers), while
    without segment ids it does not."""
    import pk_jax as pk

    pk.shutdown()
    result = _example("05_packed_documents.py").main(["--steps", "20"])
    out = capsys.readouterr().out
    assert "sp=4 x tp=2; ring attention (contiguous) with segment ids" in out, out
    assert result["losses"][-1] < result["losses"][0] - 1.0, result["losses"]
    assert result["doc_err"] <= 0.02 * result["scale"] + 1e-2, result
    assert result["unmasked_err"] > 10 * max(result["doc_err"], 1e-2), result


EXAMPLES = ("01_tp_mlp_flax.py", "02_tp_mlp_equinox.py", "03_transformer.py", "04_moe_flax.py",
            "05_packed_documents.py")


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_option_has_help_and_a_default(name):
    parser = _example(name).arguments()
    # --help's options section, one entry per option ("  --steps STEPS  training steps ...").
    entries = re.split(r"\n  (?=-)", parser.format_help().split("\noptions:\n", 1)[1])
    options = [a for a in parser._actions if a.dest != "help"]
    assert options
    for action in options:
        assert action.help and action.help.strip(), f"{name}: {action.option_strings} has no help"
        [entry] = [e for e in entries if e.split()[0].rstrip(",") == action.option_strings[0]]
        assert "(default:" in entry, f"{name}: {action.option_strings} shows no default: {entry}"


def test_heads_that_do_not_split_fail_with_a_clear_error(capsys):
    example = _example("03_transformer.py")
    with pytest.raises(SystemExit) as info:
        example.main(["--heads", "6", "--steps", "1"])  # 8 devices: sp = 2, tp = 4
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--heads 6" in err and "multiple of 4" in err and "e.g. 4, 8, 16, 32" in err, err
    with pytest.raises(SystemExit):
        example.main(["--heads", "4", "--attention", "ulysses", "--steps", "1"])
    assert "Ulysses" in capsys.readouterr().err


def test_resume_with_other_model_options_names_the_checkpoint(tmp_path, capsys):
    import numpy as np

    import pk_jax as pk

    example = _example("03_transformer.py")
    checkpoint = str(tmp_path / "lm.npz")
    example.main(["--steps", "1", "--checkpoint", checkpoint, *SMALL])
    capsys.readouterr()
    other = [*SMALL[:SMALL.index("--dim")], "--dim", "32", *SMALL[SMALL.index("--dim") + 2:]]
    pk.shutdown()
    with pytest.raises(SystemExit):
        example.main(["--steps", "1", "--resume", checkpoint, *other])
    err = capsys.readouterr().err
    assert checkpoint in err and "--dim 64" in err and "--dim 32" in err, err
    # A checkpoint that does not record its options: the shapes tell.
    with np.load(checkpoint) as data:
        arrays = {k: data[k] for k in data.files if k != "config"}
    np.savez(checkpoint, **arrays)
    pk.shutdown()
    with pytest.raises(SystemExit):
        example.main(["--steps", "1", "--resume", checkpoint, *other])
    err = capsys.readouterr().err
    assert checkpoint in err and "has shape" in err and "--dim" in err, err


def _losses(out: str) -> list[float]:
    return [float(v) for v in re.findall(r"step +\d+  loss ([0-9.]+)", out)]


@pytest.mark.parametrize("fp8,sequence_parallel", [("tensor", False), ("block", True)])
def test_tp_mlp_trains_in_fp8_close_to_bf16(capsys, fp8, sequence_parallel):
    """examples/01_tp_mlp_flax.py with --fp8 (issue 40 section 3): 30 steps on tp=8 with the
    GEMMs by the fp8 recipe (e4m3 forward with this step's scales, bf16 dgrad and wgrad) follow
    the bf16 run's loss curve within 8% at every step (on CPU the gap was 0.1-3.6%, from the
    fp8 rounding of the forward), and both runs lower the loss by more than 90%."""
    import pk_jax as pk

    sp = ["--sequence-parallel"] if sequence_parallel else []
    runs = {}
    for mode in ("none", fp8):
        pk.shutdown()
        _example("01_tp_mlp_flax.py").main(["--steps", "30", "--fp8", mode, *sp])
        out = capsys.readouterr().out
        runs[mode] = _losses(out)
        assert len(runs[mode]) == 30, out
    assert f"GEMMs in fp8 ({fp8} scaling)" in out, out
    bf16, low = runs["none"], runs[fp8]
    assert bf16[-1] < 0.1 * bf16[0] and low[-1] < 0.1 * low[0], (bf16, low)
    gaps = [abs(a - b) / b for a, b in zip(low, bf16)]
    assert max(gaps) <= 0.08, gaps
