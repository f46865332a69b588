"""Config: layering (defaults → file → env → overrides), sizes, and errors that name keys."""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar

import pytest
from pydantic import Field, ValidationError

from hf3fsctl.config import (
    SECTIONS,
    Config,
    ConfigSection,
    MetadataUrl,
    StorageConfig,
    build_config,
    config_keys,
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


class _Sample(ConfigSection):
    """A section with the field shapes the schema may grow (`int | None`, …)."""

    section: ClassVar[str] = "sample"

    limit: int | None = Field(None, ge=1, description="an optional count")
    ratio: float = Field(1.0, ge=0, description="a number")


@pytest.mark.parametrize(
    ("value", "expected"), [("7", 7), (" 12 ", 12), (3, 3), ("", None), (None, None)]
)
def test_optional_int_field_is_none_or_an_int(value: object, expected: int | None) -> None:
    limit = _Sample.model_validate({"limit": value}).limit
    assert limit == expected and (limit is None or type(limit) is int)


@pytest.mark.parametrize(("value", "match"), [("many", "not an integer"), ("0", "minimum")])
def test_bad_optional_int_names_the_key(value: str, match: str) -> None:
    with pytest.raises(ConfigError, match=rf"sample\.limit: '?{value}'? .*{match}"):
        _Sample.model_validate({"limit": value})


def test_float_and_bool_fields_coerce_from_environment_strings() -> None:
    config = load_config(
        environ={
            "HF3FSCTL_METADATA_TIMEOUT_S": "3.5",
            "HF3FSCTL_CONNECTOR_LOOKUP_WAIT_MS": "0",
            "HF3FSCTL_STORAGE_PREALLOCATE": "yes",
            "HF3FSCTL_STORAGE_O_DIRECT": "off",
            "HF3FSCTL_SERVER_PORT": "9000",
            "HF3FSCTL_STORAGE_FILE_SIZE": "1GiB",
        }
    )
    assert config.metadata.timeout_s == 3.5 and type(config.metadata.timeout_s) is float
    assert config.connector.lookup_wait_ms == 0.0
    assert (config.storage.preallocate, config.storage.o_direct) == (True, False)
    assert config.server.port == 9000 and config.storage.file_size == 1 << 30
    assert _Sample.model_validate({"ratio": "0.25"}).ratio == 0.25


@pytest.mark.parametrize(
    ("environ", "names"),
    [
        ({"HF3FSCTL_METADATA_TIMEOUT_S": "soon"}, "metadata.timeout_s: 'soon'"),
        ({"HF3FSCTL_METADATA_TIMEOUT_S": "0"}, "metadata.timeout_s: 0.0 is below"),
        ({"HF3FSCTL_STORAGE_IO_THREADS": "1.5"}, "storage.io_threads: '1.5'"),
        ({"HF3FSCTL_CONNECTOR_LOAD_MODE": "lazy"}, "connector.load_mode: 'lazy' is not one of"),
        ({"HF3FSCTL_STORAGE_CAPACITY": "lots"}, "storage.capacity: 'lots'"),
    ],
    ids=["float", "float-range", "int", "choice", "amount"],
)
def test_bad_environment_value_names_the_key(environ: dict[str, str], names: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(names)):
        load_config(environ=environ)


def test_sections_built_directly_raise_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"storage\.io_threads: 0 is below the minimum 1"):
        StorageConfig(io_threads=0)
    with pytest.raises(ConfigError, match=r"did you mean storage\.engine"):
        StorageConfig.model_validate({"enigne": "posix"})


def test_config_is_frozen_and_ignores_source_in_equality() -> None:
    config = Config()
    with pytest.raises(ValidationError):
        config.storage.path = "/elsewhere"
    assert Config(source="/etc/x.yaml") == config
    assert set(config_keys()) == {
        f"{section}.{key}"
        for section, values in config.to_dict().items()
        if section in SECTIONS
        for key in values
    }
    assert config_keys()["server.port"].default == 18765 and config_keys()["server.port"].help


@pytest.mark.parametrize(
    ("url", "scheme", "path", "base"),
    [
        ("sqlite:////abs/meta.db", "sqlite", "/abs/meta.db", None),
        ("sqlite:///abs/meta.db", "sqlite", "/abs/meta.db", None),
        ("http://h:1", "http", None, "http://h:1"),
        ("https://h:1/prefix/", "https", None, "https://h:1/prefix"),
    ],
    ids=["sqlite-4-slashes", "sqlite-3-slashes", "http", "https-prefix"],
)
def test_metadata_url_parses(url: str, scheme: str, path: str | None, base: str | None) -> None:
    target = MetadataUrl.parse(url)
    assert (target.scheme, target.path, target.base, target.url) == (scheme, path, base, url)


@pytest.mark.parametrize(
    "url", ["redis://x", "sqlite:///", "sqlite://rel.db", "http://", "ftp://h:1", ""]
)
def test_metadata_url_rejects_others(url: str) -> None:
    with pytest.raises(ConfigError, match=r"metadata\.url: .* is not a metadata URL"):
        MetadataUrl.parse(url)


def test_config_metadata_target_follows_metadata_url() -> None:
    embedded = build_config([("o", {"storage.path": "/data/kv"})]).metadata_target
    assert (embedded.scheme, embedded.path) == ("sqlite", "/data/kv/metadata.db")
    served = build_config([("o", {"metadata.url": "https://h:1/p"})]).metadata_target
    assert (served.scheme, served.base) == ("https", "https://h:1/p")


def test_every_public_name_still_imports_from_hf3fsctl_config() -> None:
    """The package's rooms (units, urls, schema, loader) re-export what config.py held."""
    import hf3fsctl.config as config

    names = [
        "Amount",
        "Config",
        "ConfigKey",
        "ConfigSection",
        "ConnectorConfig",
        "MetadataConfig",
        "MetadataUrl",
        "ServerConfig",
        "StorageConfig",
        "SECTIONS",
        "QUOTAS",
        "QUOTAS_HELP",
        "ENV_PREFIX",
        "RESERVED_ENV",
        "build_config",
        "config_keys",
        "dump_config",
        "env_overrides",
        "find_config_file",
        "format_size",
        "load_config",
        "parse_amount",
        "parse_size",
        "read_yaml",
    ]
    assert [n for n in names if not hasattr(config, n)] == []
    assert len(config.__all__) == len(set(config.__all__))
    assert set(names) <= set(config.__all__)


def test_the_packaged_default_config_names_no_key_twice() -> None:
    """YAML keeps the last of two equal keys silently: a doubled key hides an edit."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        pass

    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[object, object]:
        keys = [loader.construct_object(key) for key, _ in node.value]
        doubled = sorted({str(k) for k in keys if keys.count(k) > 1})
        assert doubled == [], f"line {node.start_mark.line + 1}: {doubled} given twice"
        return loader.construct_mapping(node)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    path = Path(__file__).parents[2] / "hf3fsctl" / "default_config.yaml"
    assert isinstance(yaml.load(path.read_text(), Loader=StrictLoader), dict)
