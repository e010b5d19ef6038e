"""Problems inside a TOML file: unknown keys and sections, wrong types, bad values; each names the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtrain.errors import ConfigError


@pytest.mark.parametrize(
    "text, message",
    [
        ("[training]\nstepz = 3\n", "unknown key training.stepz in {path} (did you mean training.steps?)"),
        ("[trainin]\nsteps = 3\n", "unknown key trainin.steps in {path} (did you mean training.steps?)"),
        ("[trainin]\n", "unknown section [trainin] in {path} (did you mean [training]?)"),
        ("steps = 3\n", "unknown key steps in {path} (did you mean training.steps?)"),
        ('[training]\nsteps = "ten"\n', "training.steps expects an integer, got 'ten' (in {path})"),
        ("[training]\nsteps = 10.0\n", "training.steps expects an integer, got 10.0 (in {path})"),
        ("[training]\nsteps = true\n", "training.steps expects an integer, got true (in {path})"),
        ('[compile]\nenable = "yes"\n', "compile.enable expects a boolean (true/false), got 'yes' (in {path})"),
        ('[compile]\ncomponents = "model"\n', "compile.components expects a list of strings, got 'model' (in {path})"),
        (
            "[activation_checkpoint]\nselective_ac_option = 2\n",
            "activation_checkpoint.selective_ac_option expects a string (quote it in TOML), got 2 (in {path})",
        ),
        (
            '[lr_scheduler]\ndecay_type = "exp"\n',
            "lr_scheduler.decay_type must be one of linear, sqrt, cosine; got 'exp' (in {path})",
        ),
        ("[training]\nseq_len = 0\n", "training.seq_len must be >= 2; got 0 (in {path})"),
        ("[training\nsteps = 3\n", "cannot parse {path}: "),
    ],
)
def test_toml_errors_name_key_and_file(load, configs_dir: Path, text, message):
    path = configs_dir / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load(["--config", "bad"])
    assert message.format(path=path.resolve()) in str(err.value)
    assert "\n" not in str(err.value)


def test_toml_error_is_reported_even_when_cli_overrides_the_key(load, configs_dir: Path):
    (configs_dir / "bad.toml").write_text('[training]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match="training.steps expects an integer"):
        load(["--config", "bad", "--training.steps", "3"])


def test_a_byte_order_mark_and_windows_line_ends_are_read(load, configs_dir: Path):
    # What Notepad saves: UTF-8 with a BOM, CRLF line ends; tomllib alone refuses the BOM at line 1, column 1.
    (configs_dir / "bom.toml").write_bytes("\ufeff[training]\r\nsteps = 7\r\n".encode())
    assert load(["--config", "bom"]).training.steps == 7
    (configs_dir / "latin1.toml").write_bytes("[job]\ndescription = \"caf\xe9\"\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="latin1.toml: not UTF-8 text$"):
        load(["--config", "latin1"])
