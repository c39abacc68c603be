"""The forgetting-knobs bench's knobs: dotted settings of the profile, checked like params.yaml before any fine-tune."""

import pytest

from bench.quality.forgetting_knobs import parse_knob
from tasks.config import ConfigError, parse_config, with_settings


def test_a_knob_is_the_profile_or_dotted_settings_read_as_yaml():
    assert parse_knob("profile") == {}
    assert parse_knob("train.lr=0.001,lora.dropout=0.1") == {"train.lr": 0.001, "lora.dropout": 0.1}
    assert with_settings(parse_config({}), parse_knob("train.steps=8"), "knob").train.steps == 8


def test_a_knob_that_is_not_a_setting_is_refused_naming_it():
    with pytest.raises(SystemExit, match="'train.lr' is not KEY=VALUE"):
        parse_knob("train.lr")
    with pytest.raises(ConfigError, match="train.lrate: not a setting of params.yaml .did you mean train.lr"):
        with_settings(parse_config({}), parse_knob("train.lrate=0.1"), "knob")
