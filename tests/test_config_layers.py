"""spotguard.config.Layers: the one precedence every command uses (flag > SPOTGUARD_* > file >
default), and errors that name the field where the bad value came from."""
from __future__ import annotations

import argparse

import pytest

from spotguard.config import ConfigError, Layers, positive_float


def layers(tmp_path, flags: dict, env: dict, file_text: str | None = None, keys=("resync", "workers")) -> Layers:
    args = argparse.Namespace(**{"resync": None, "workers": None, "config": None, **flags})
    if file_text is not None:
        path = tmp_path / "settings.yaml"
        path.write_text(file_text)
        args.config = str(path)
    return Layers(args, env, file_keys=keys)


def test_each_layer_wins_over_the_ones_below_it(tmp_path):
    file = "resync: 3\nworkers: 3\n"
    assert layers(tmp_path, {"resync": "1"}, {"SPOTGUARD_RESYNC": "2"}, file).get("resync", 4) == ("1", "--resync")
    assert layers(tmp_path, {}, {"SPOTGUARD_RESYNC": "2"}, file).get("resync", 4) == \
        ("2", "--resync (from SPOTGUARD_RESYNC)")
    assert layers(tmp_path, {}, {"SPOTGUARD_RESYNC": ""}, file).get("resync", 4) == \
        (3, f"resync (in {tmp_path / 'settings.yaml'})")
    assert layers(tmp_path, {}, {}).get("resync", 4) == (4, "--resync")


def test_a_setting_without_a_variable_skips_the_environment(tmp_path):
    got = layers(tmp_path, {}, {"SPOTGUARD_WORKERS": "9", "OTHER": "7"})
    assert got.get("workers", 1, env=None) == (1, "--workers")
    assert got.get("workers", 1, env="OTHER") == ("7", "--workers (from OTHER)")


def test_bad_values_name_their_field(tmp_path):
    with pytest.raises(ConfigError) as err:
        layers(tmp_path, {}, {"SPOTGUARD_RESYNC": "soon"}).parse("resync", 60, positive_float)
    assert err.value.field == "--resync (from SPOTGUARD_RESYNC)"
    with pytest.raises(ConfigError) as err:
        layers(tmp_path, {}, {}, "bogus: 1\n")
    assert err.value.field == f"bogus (in {tmp_path / 'settings.yaml'})"
    with pytest.raises(ConfigError) as err:
        layers(tmp_path, {}, {}, "- a list\n")
    assert err.value.field == "--config"


def test_the_supervisor_reads_the_same_layers(tmp_path):
    from spotguard.cli import build_parser
    from spotguard.supervisor.cli import options_from_args

    path = tmp_path / "supervisor.yaml"
    path.write_text("resync: 7\nworkers: 2\nlease-name: from-file\n")
    args = build_parser().parse_args(["supervisor", "--config", str(path), "--workers", "5"])
    options = options_from_args(args, {"SPOTGUARD_RESYNC": "9"})
    assert (options.workers, options.resync, options.lease_name) == (5, 9.0, "from-file")
    with pytest.raises(ConfigError) as err:
        options_from_args(args, {"SPOTGUARD_SCALE_OUT_DELAY": "-1"})
    assert err.value.field == "--scale-out-delay (from SPOTGUARD_SCALE_OUT_DELAY)"
