"""Settings are checked where they are given: ``Config`` and ``attach``'s keyword arguments (one-line
``ConfigError``), and the environment (each problem said once, the value ignored; typos named)."""

from __future__ import annotations

import logging

import pytest

from stragglerwatch import Config, ConfigError
from stragglerwatch.runtime.log import Problems

WORDS = [("no", False), ("off", False), ("0", False), ("False", False), ("yes", True), ("on", True), ("1", True),
         (0, False), (True, True)]


@pytest.mark.parametrize("word, value", WORDS)
def test_booleans_are_read_strictly(word: object, value: bool) -> None:
    assert Config(enabled=word).enabled is value and Config(native_stacks=word).native_stacks is value


@pytest.mark.parametrize("settings, says", [
    ({"enabled": "maybe"}, "enabled='maybe' is not a boolean"),
    ({"native_stacks": 2}, "native_stacks=2 is not a boolean"),
    ({"flush_interval_s": "1"}, "flush_interval_s='1' is not a number"),
    ({"prometheus_port": "abc"}, "prometheus_port='abc' is not an integer"),
    ({"prometheus_port": 9100.5}, "prometheus_port=9100.5 is not an integer"),
    ({"flush_interval_s": -1}, "flush_interval_s must be > 0"),
])  # fmt: skip
def test_a_wrong_value_is_one_line_when_config_is_built(settings: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as err:
        Config(**settings)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=says):
        Config.resolve(environ={}, **settings)  # what attach does with its keyword arguments


def test_every_bad_environment_setting_is_said_and_typos_are_named(caplog: pytest.LogCaptureFixture) -> None:
    problems = Problems(logging.getLogger("stragglerwatch"))
    env = {"STRAGGLERWATCH_TIMNG": "cuda", "STRAGGLERWATCH_PROMETHEUS_PORT": "abc",
           "STRAGGLERWATCH_CODE_SAMPLE_HZ": "fast", "STRAGGLERWATCH_RUN_DIR": "runs/x"}  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="stragglerwatch"):
        cfg = Config.resolve(environ=env, problems=problems)
    lines = [r.getMessage() for r in caplog.records]
    assert cfg.prometheus_port is None and cfg.code_sample_hz is None and cfg.run_dir == "runs/x"
    assert len(lines) == 3, lines  # three problems, three lines: none rate-limited away
    assert any("STRAGGLERWATCH_TIMNG: no such setting" in line for line in lines)
    assert any("STRAGGLERWATCH_PROMETHEUS_PORT='abc' is not a port" in line for line in lines)
    assert any("STRAGGLERWATCH_CODE_SAMPLE_HZ='fast'" in line for line in lines)


@pytest.mark.parametrize("value, enabled, said", [("off", True, False), ("0", True, False), ("yes", False, False),
                                                  ("please", False, True)])  # fmt: skip
def test_the_disable_variable_is_read_as_every_boolean(value: str, enabled: bool, said: bool,
                                                       caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    problems = Problems(logging.getLogger("stragglerwatch"))
    with caplog.at_level(logging.WARNING, logger="stragglerwatch"):
        cfg = Config.resolve(environ={"STRAGGLERWATCH_DISABLE": value}, problems=problems)
    assert cfg.enabled is enabled
    assert any("STRAGGLERWATCH_DISABLE='please' is not a boolean" in r.getMessage() for r in caplog.records) is said


@pytest.mark.parametrize("given", [1.15, "1.15", "1.15x", "15%"])
def test_a_slowdown_setting_is_a_ratio_in_any_of_its_spellings(given: object) -> None:
    assert Config(straggler_min_slowdown=given).act_rule().min_slowdown == pytest.approx(1.15)
