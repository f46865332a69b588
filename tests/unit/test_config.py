"""Config: layering (defaults → file → env → overrides), sizes, and errors that name keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf3fsctl.config import (
    Config,
    build_config,
    dump_config,
    find_config_file,
    load_config,
    parse_size,
    read_yaml,
)
from hf3fsctl.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_documented_default_file_equals_builtin_defaults() -> None:
    documented = build_config([("file", read_yaml(REPO / "configs" / "hf3fs.yaml"))])
    assert documented == Config()


def test_documented_default_file_mentions_every_key() -> None:
    text = (REPO / "configs" / "hf3fs.yaml").read_text()
    for section, values in Config().to_dict().items():
        assert f"{section}:" in text
        for key in values:
            assert f"  {key}:" in text, f"{section}.{key} is not documented"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096", 4096), ("4k", 4096), ("64GiB", 64 << 30), ("1.5 MiB", 1572864), ("2GB", 2 * 10**9)],
    ids=["bytes", "k", "GiB", "fraction", "GB"],
)
def test_parse_size_accepts_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_layers_later_wins(tmp_path: Path) -> None:
    file = tmp_path / "c.yaml"
    file.write_text("storage:\n  path: /from/file\n  io_threads: 3\nserver:\n  port: 1000\n")
    config = load_config(
        file,
        overrides={"server.port": 3000},
        environ={"HF3FSCTL_STORAGE_PATH": "/from/env"},
    )
    assert (config.storage.path, config.storage.io_threads, config.server.port) == (
        "/from/env",
        3,
        3000,
    )
    assert config.source == str(file)


def test_env_config_file_is_found(tmp_path: Path) -> None:
    file = tmp_path / "c.yaml"
    file.write_text("storage: {path: /x}\n")
    assert find_config_file(None, {"HF3FSCTL_CONFIG": str(file)}) == file


def test_embedded_metadata_url_defaults_under_storage_path() -> None:
    config = build_config([("o", {"storage.path": "/data/kv"})])
    assert config.metadata_url == "sqlite:////data/kv/metadata.db"


@pytest.mark.parametrize(
    ("values", "names"),
    [
        ({"storage.file_size": "64 gigs"}, "storage.file_size"),
        ({"storage.engine": "fast"}, "storage.engine"),
        ({"storage.enigne": "posix"}, "storage.engine"),
        ({"server.port": "http"}, "server.port"),
        ({"server.port": 70000}, "server.port"),
        ({"metadata.url": "redis://x"}, "metadata.url"),
        ({"metadata.low_watermark": 0.99}, "metadata.low_watermark"),
        ({"storage.preallocate": "maybe"}, "storage.preallocate"),
        ({"bogus": {"x": 1}}, "bogus"),
    ],
    ids=["size", "choice", "typo", "int", "range", "url", "watermarks", "bool", "section"],
)
def test_bad_value_names_the_key(values: dict[str, object], names: str) -> None:
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        build_config([("test", values)])


def test_unknown_env_variable_suggests_the_right_one() -> None:
    with pytest.raises(ConfigError, match="HF3FSCTL_STORAGE_PATH"):
        load_config(environ={"HF3FSCTL_STORAGE_PAHT": "/x"})


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml", environ={})


def test_missing_explicit_file_names_the_origin_the_caller_gives(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"does not exist \(from --config\)"):
        find_config_file(tmp_path / "nope.yaml", {}, origin="--config")


def test_missing_explicit_file_of_a_library_caller_is_not_blamed_on_a_flag(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(tmp_path / "nope.yaml", environ={})
    assert "--config" not in raised.value.message


def test_missing_env_config_file_is_no_file_when_missing_ok(tmp_path: Path) -> None:
    environ = {"HF3FSCTL_CONFIG": str(tmp_path / "nope.yaml")}
    assert find_config_file(None, environ, missing_ok=True) is None


def test_invalid_yaml_names_the_file(tmp_path: Path) -> None:
    file = tmp_path / "bad.yaml"
    file.write_text("storage: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml"):
        load_config(file, environ={})


def test_dump_config_round_trips(tmp_path: Path) -> None:
    original = build_config(
        [("o", {"storage.path": "/kv", "metadata.url": "http://h:1", "server.token_file": "/t"})]
    )
    file = tmp_path / "out.yaml"
    file.write_text(dump_config(original))
    assert load_config(file, environ={}) == original
