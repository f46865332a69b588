"""`hf3fsctl vllm-config`: the value to give vLLM's `--kv-transfer-config`.

Prints exactly one JSON object on stdout, e.g.::

    vllm serve MODEL --kv-transfer-config "$(hf3fsctl vllm-config --compact)"
    LLM(model=..., kv_transfer_config=json.loads(...))

`kv_load_failure_policy` is `recompute` (vLLM's default `fail` ends a request whose
load failed; docs/design.md decision 3). `kv_connector_extra_config` names the config file in
use (absolute) and carries the resolved storage path and metadata URL, so a vLLM
process that lacks this shell's `HF3FSCTL_*` environment still finds the same store.

Before printing, the store is checked (it takes a second at most): a configuration must
have been found (a file or `HF3FSCTL_*` settings, not the packaged defaults alone), the
storage root must exist and the metadata store answer. A failed check is one line and
its exit code (2 no config, 3 no store, 6 service down) — an empty `$(…)` then fails the
`vllm serve` line instead of pointing vLLM at a store that is not there. `--no-check`
prints it anyway, for a store that is not reachable from here yet.

`--serve-args` prints instead the whole engine-args file of a serving engine: the
config's `vllm:` section (the args `hf3fsctl warm` and `verify` also run with) plus
`kv-transfer-config`, keys as `vllm serve --config FILE.yaml` takes them (JSON is YAML)::

    hf3fsctl vllm-config --serve-args > serve.yaml && vllm serve MODEL --config serve.yaml

`--offloading` prints instead the config of vLLM's own offloading stack with this store
behind it: the `OffloadingConnector` with `TieringOffloadingSpec` (a CPU DRAM primary tier
of `--cpu-size` bytes in front) and the store as a secondary tier (`Hf3fsctlOffloadTier`
from `hf3fsctl_connector.offload_tier`, docs/vllm.md "Offloading tier")::

    vllm serve MODEL --kv-transfer-config "$(hf3fsctl vllm-config --offloading --compact)"

`--role producer|consumer|both` sets `kv_role` (`kv_producer` / `kv_consumer` /
`kv_both`, the default): a producer (prefill instance) saves and never loads, a consumer
(decode instance) loads and never saves (docs/operations.md "Roles")::

    vllm serve MODEL --kv-transfer-config "$(hf3fsctl vllm-config --role consumer --compact)"
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from hf3fsctl.cli import context, output
from hf3fsctl.cli.options import ConfigOpt
from hf3fsctl.config.connector import kv_transfer_config
from hf3fsctl.errors import ConfigError, NotFound

if TYPE_CHECKING:
    from hf3fsctl.config import Config


def check_store(cfg: Config) -> None:
    """The configuration names a store that exists and answers.

    Raises:
        ConfigError: no config file and no `HF3FSCTL_*` setting: only the defaults.
        NotFound: the storage root or the embedded database does not exist.
        MetadataUnavailable: the metadata service or Redis does not answer.
        AuthError: it refuses this configuration's token or password.
    """
    from hf3fsctl.config import env_overrides

    if cfg.source is None and not env_overrides(os.environ):
        raise ConfigError(
            "no config file found (--config, $HF3FSCTL_CONFIG, ./hf3fs.yaml, "
            "~/.config/hf3fsctl/config.yaml, /etc/hf3fsctl/config.yaml): only the packaged "
            f"defaults, whose store {cfg.storage.path} is not one you made",
            hint="pass --config FILE (`hf3fsctl init … --write-config FILE` writes one), "
            "or --no-check to print the defaults anyway",
        )
    root = Path(cfg.storage.path)
    if not root.is_dir():
        raise NotFound(
            f"storage path {root} does not exist here",
            hint=f"mount its file system, or create the store with `hf3fsctl init "
            f"--storage-path {root} --create-path`; --no-check prints it anyway",
        )
    with context.open_client(cfg, read_only=True) as client:
        client.health()  # answers (a service's /healthz needs no token)
        if not client.url.startswith("sqlite:"):
            client.namespaces()  # and takes this config's credentials: AuthError if not


ROLES = {"producer": "kv_producer", "consumer": "kv_consumer", "both": "kv_both"}


def kv_role(role: str) -> str:
    """vLLM's `kv_role` for `--role` (producer, consumer or both).

    Raises:
        ConfigError: another word, naming the three.
    """
    try:
        return ROLES[role.strip().lower()]
    except KeyError:
        raise ConfigError(
            f"--role {role!r} is not a role", hint=f"choose one of {', '.join(ROLES)}"
        ) from None


OFFLOAD_TIER_CLASS = "Hf3fsctlOffloadTier"
OFFLOAD_TIER_MODULE = "hf3fsctl_connector.offload_tier"


def offloading_config(cfg: Config, cpu_bytes: int) -> dict[str, object]:
    """The `KVTransferConfig` of vLLM's OffloadingConnector with this store as a tier."""
    extra = dict(kv_transfer_config(cfg)["kv_connector_extra_config"])
    tier: dict[str, object] = {"type": OFFLOAD_TIER_CLASS, "module_path": OFFLOAD_TIER_MODULE}
    if "config_file" in extra:
        tier["config"] = extra.pop("config_file")
    tier["storage_path"] = extra.pop("storage.path")
    tier["metadata_url"] = extra.pop("metadata.url")
    tier.update(extra)  # metadata.token_file, as a dotted key
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": cpu_bytes,
            "secondary_tiers": [tier],
        },
    }


def vllm_config(
    ctx: typer.Context,
    config: ConfigOpt = None,
    compact: Annotated[
        bool, typer.Option("--compact", help="One line, for a shell argument.")
    ] = False,
    no_check: Annotated[
        bool,
        typer.Option(
            "--no-check",
            help="Print it without checking that a config was found and its store exists "
            "and answers (for a store not reachable from here yet).",
        ),
    ] = False,
    serve_args: Annotated[
        bool,
        typer.Option(
            "--serve-args",
            help="Print the serving engines' args instead: the config's vllm: section plus "
            "kv-transfer-config, for `vllm serve --config FILE.yaml`.",
        ),
    ] = False,
    offloading: Annotated[
        bool,
        typer.Option(
            "--offloading",
            help="Print vLLM's OffloadingConnector config instead: a CPU DRAM tier in front "
            "(--cpu-size) and this store behind it as a secondary tier.",
        ),
    ] = False,
    cpu_size: Annotated[
        str,
        typer.Option(
            "--cpu-size", help="With --offloading: bytes of vLLM's CPU DRAM primary tier."
        ),
    ] = "8GiB",
    role: Annotated[
        str,
        typer.Option(
            "--role",
            metavar="producer|consumer|both",
            help="The engine's kv_role: a producer (prefill) saves and never loads, a "
            "consumer (decode) loads and never saves, both does both.",
        ),
    ] = "both",
) -> None:
    """Print the JSON for vLLM's --kv-transfer-config (one object on stdout)."""
    cfg = context.load(ctx, config)
    if no_check:
        if cfg.source is None:
            output.warning("no config file found: printing the packaged defaults (--no-check)")
    else:
        check_store(cfg)
    if offloading and serve_args:
        raise ConfigError("--offloading and --serve-args: choose one", hint="pass one of them")
    role_name = kv_role(role)
    document = kv_transfer_config(cfg)
    if offloading:
        from hf3fsctl.config.units import parse_size

        document = offloading_config(cfg, parse_size(cpu_size, "--cpu-size"))
    document["kv_role"] = role_name
    if serve_args:
        document = {k.replace("_", "-"): v for k, v in cfg.vllm.items()} | {
            "kv-transfer-config": document
        }
    if compact:
        typer.echo(json.dumps(document, separators=(",", ":")))
    else:
        typer.echo(json.dumps(document, indent=2))
