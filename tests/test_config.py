"""load_config: the spec's stats_logger block, refused with the dotted key when wrong."""

from __future__ import annotations

import getpass
import os
from pathlib import Path
from typing import Any

import pytest

from areal_stream.config import (
    StatsLoggerConfig,
    TensorBoardConfig,
    load_config,
)

BASE = {"experiment_name": "exp", "trial_name": "t", "fileroot": "/tmp/fr"}


def test_yaml_file_with_block_and_other_top_level_keys(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        """
actor: {lr: 1.0e-6}          # the rest of an experiment config is ignored
stats_logger:
  experiment_name: gsm8k_grpo
  trial_name: run_001
  fileroot: /path/to/logs
  wandb:
    mode: offline
    project: my-project
    entity: my-team
    tags: [a, b]
    id_suffix: resumed
  swanlab:
    mode: online
    project: my-project
  tensorboard:
    path: /path/to/tensorboard/logs
  trackio: {mode: local, space_id: null}
  console: {enabled: false, max_rows: 20}
  queue_size: 8
  close_timeout: 5
"""
    )
    cfg = load_config(path)
    assert cfg.experiment_name == "gsm8k_grpo" and cfg.trial_name == "run_001"
    assert (cfg.wandb.mode, cfg.wandb.project, cfg.wandb.entity) == (
        "offline",
        "my-project",
        "my-team",
    )
    assert cfg.wandb.tags == ["a", "b"] and cfg.wandb.id_suffix == "resumed"
    assert cfg.swanlab.mode == "online" and cfg.trackio.mode == "local"
    assert cfg.tensorboard_dir() == "/path/to/tensorboard/logs"
    assert cfg.console.enabled is False and cfg.console.max_rows == 20
    assert cfg.queue_size == 8 and cfg.close_timeout == 5.0
    assert isinstance(cfg.close_timeout, float)
    assert cfg.log_dir() == os.path.join(
        "/path/to/logs", "logs", getpass.getuser(), "gsm8k_grpo", "run_001"
    )


def test_block_itself_and_defaults() -> None:
    cfg = load_config(dict(BASE))
    assert cfg == StatsLoggerConfig("exp", "t", "/tmp/fr")
    assert (cfg.wandb.mode, cfg.swanlab.mode, cfg.trackio.mode) == ("disabled",) * 3
    assert cfg.console.enabled is True
    # embedded default: TensorBoard under the log dir; only an explicit null disables it
    assert cfg.tensorboard_dir() == os.path.join(cfg.log_dir(), "tensorboard")
    assert load_config({**BASE, "tensorboard": {"path": None}}).tensorboard_dir() is None
    assert load_config({**BASE, "tensorboard": None}).tensorboard_dir() is None
    assert load_config({**BASE, "tensorboard": {}}).tensorboard_dir() == cfg.tensorboard_dir()
    assert load_config({"stats_logger": BASE}) == cfg
    assert load_config(cfg) is cfg


@pytest.mark.parametrize(
    ("patch", "key", "words"),
    [
        ({"wandb": {"mode": "cloud"}}, "stats_logger.wandb.mode", "invalid mode 'cloud'"),
        ({"swanlab": {"mode": "online2"}}, "stats_logger.swanlab.mode", "invalid mode"),
        ({"trackio": {"mode": "offline"}}, "stats_logger.trackio.mode", "invalid mode"),
        ({"trackio": {"mode": "online"}}, "stats_logger.trackio.space_id", "required"),
        ({"wandb": {"projcet": "x"}}, "stats_logger.wandb.projcet", "unknown key"),
        ({"tensorbaord": {"path": None}}, "stats_logger.tensorbaord", "unknown key"),
        ({"wandb": {"tags": "a"}}, "stats_logger.wandb.tags", "list of strings"),
        ({"wandb": "offline"}, "stats_logger.wandb", "expected a mapping"),
        ({"console": {"enabled": "yes"}}, "stats_logger.console.enabled", "true or false"),
        ({"console": {"max_rows": -1}}, "stats_logger.console.max_rows", ">= 0"),
        ({"queue_size": 0}, "stats_logger.queue_size", ">= 1"),
        ({"queue_size": 2.5}, "stats_logger.queue_size", "integer"),
        ({"close_timeout": 0}, "stats_logger.close_timeout", "> 0"),
        ({"close_timeout": float("inf")}, "stats_logger.close_timeout", "finite"),
        ({"close_timeout": float("nan")}, "stats_logger.close_timeout", "finite"),
        ({"tensorboard": 3}, "stats_logger.tensorboard", "expected a mapping, got int"),
        ({"fileroot": 5}, "stats_logger.fileroot", "expected a string, got int"),
        ({"experiment_name": "a/b"}, "stats_logger.experiment_name", "path component"),
        ({"trial_name": ".."}, "stats_logger.trial_name", "path component"),
        ({"trial_name": 3}, "stats_logger.trial_name", "expected a string"),
        ({"fileroot": None}, "stats_logger.fileroot", "is required"),
        ({"swanlab": {"api_key": 123}}, "stats_logger.swanlab.api_key", "string or null"),
        ({"tensorboard": {"path": ""}}, "stats_logger.tensorboard.path", "directory"),
    ],
)
def test_invalid_config_names_the_key(patch: dict[str, Any], key: str, words: str) -> None:
    with pytest.raises(ValueError) as info:
        load_config({**BASE, **patch})
    msg = str(info.value)
    assert msg.startswith(key + ":"), msg
    assert words in msg


def test_bad_sources(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("stats_logger: [1, 2")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n")
    with pytest.raises(ValueError, match="top level"):
        load_config(lst)
    with pytest.raises(TypeError, match="load_config expects"):
        load_config(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^stats_logger.experiment_name: is required"):
        load_config({"trial_name": "t", "fileroot": "/x"})


def test_programmatic_config_is_validated_too() -> None:
    from areal_stream.config import validate

    cfg = StatsLoggerConfig("e", "t", "/x", tensorboard=TensorBoardConfig(path=None))
    cfg.wandb.mode = "nope"
    with pytest.raises(ValueError, match=r"^stats_logger.wandb.mode: invalid mode"):
        validate(cfg)
    # a nested block of the wrong type is named, not an AttributeError from deep inside
    bad: Any = {"mode": "offline"}
    with pytest.raises(ValueError, match=r"^stats_logger.wandb: expected a WandBConfig, got dict"):
        validate(StatsLoggerConfig("e", "t", "/x", wandb=bad))
    with pytest.raises(ValueError, match=r"^stats_logger.console: expected a ConsoleConfig"):
        validate(StatsLoggerConfig("e", "t", "/x", console=TensorBoardConfig()))  # type: ignore[arg-type]


def test_type_error_never_echoes_a_secret() -> None:
    for patch in ({"swanlab": {"api_key": 918273645}}, {"wandb": {"wandb_api_key": 918273645}}):
        with pytest.raises(ValueError, match="api_key: expected a string or null, got int") as e:
            load_config({**BASE, **patch})
        assert "918273645" not in str(e.value)


def test_secrets_never_in_repr_or_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWANLAB_API_KEY", "env-swan-key")
    cfg = load_config(
        {
            **BASE,
            "wandb": {"wandb_api_key": "wb-key", "config": {"nested": {"my_token": "tok-SECRET"}}},
            "swanlab": {"mode": "offline"},
        }
    )
    assert cfg.swanlab.api_key == "env-swan-key"  # from SWANLAB_API_KEY
    assert cfg.wandb.wandb_api_key == "wb-key"
    red = cfg.redacted()
    text = repr(cfg) + repr(red)
    for secret in ("env-swan-key", "wb-key", "tok-SECRET"):
        assert secret not in text
    assert red["swanlab"]["api_key"] == "<redacted>"
    assert red["wandb"]["wandb_api_key"] == "<redacted>"
    assert red["wandb"]["config"] == {"nested": {"my_token": "<redacted>"}}
    assert cfg.wandb.config == {"nested": {"my_token": "tok-SECRET"}}  # the config itself is intact
    monkeypatch.delenv("SWANLAB_API_KEY")
    assert load_config(dict(BASE)).redacted()["swanlab"]["api_key"] is None


def test_example_config_loads() -> None:
    root = Path(__file__).resolve().parent.parent
    cfg = load_config(root / "examples" / "config_all_backends.yaml")
    assert cfg.wandb.mode == "offline" and cfg.swanlab.mode == "offline"
    assert cfg.trackio.mode == "local" and cfg.tensorboard.path == "auto"
