"""deploy/: the Prometheus rules pass promtool, and every metric the Grafana dashboard and
the rules query is one that really exists.

Where the names come from:
    * a real `hf3fsctl serve` (created with `hf3fsctl init`, one namespace registered,
      keys allocated, committed, looked up and located, a quota set), its /metrics
      scraped with the bearer token;
    * the connector's `Hf3fsctlPromMetrics`, fed one stats dict with every counter, every
      failure kind, every latency and a state, read back from its registry;
    * vLLM's own metrics, listed in `VLLM_METRICS` with the file that defines them (the
      test checks that file of the installed vllm still does);
    * `up`, which Prometheus adds to every target.

The PromQL is parsed crudely: strings, Grafana variables, ranges, label matchers and
grouping clauses are cut out, numbers dropped, and the identifiers left that are not
followed by `(` (functions, aggregations) and are not keywords are metric names.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from helpers.meta_builders import keys, register, store_keys
from helpers.servers import TOKEN, ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "hf3fsctl.json"
RULES = ROOT / "deploy" / "prometheus" / "hf3fsctl-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "hf3fsctl-rules.test.yml"

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not installed (Debian package `prometheus`; `make pytest` installs it)",
)

# vLLM's metrics the dashboard uses: exposition name -> (file of the installed vllm
# package that defines it, the name it is defined under there).
VLLM_METRICS = {
    "vllm:external_prefix_cache_hits_total": (
        "vllm/v1/metrics/loggers.py",
        "vllm:external_prefix_cache_hits",
    ),
    "vllm:external_prefix_cache_queries_total": (
        "vllm/v1/metrics/loggers.py",
        "vllm:external_prefix_cache_queries",
    ),
    "vllm:prompt_tokens_by_source_total": (
        "vllm/v1/metrics/loggers.py",
        "vllm:prompt_tokens_by_source",
    ),
}
PROMETHEUS_METRICS = {"up"}  # added by Prometheus to every scrape target

# Grafana's variables, replaced by something PromQL accepts before promtool sees an expr.
GRAFANA_SUBSTITUTES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}

_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_GRAFANA_VAR = re.compile(r"\$\{?\w+\}?")
_RANGE = re.compile(r"\[[^\]]*\]")
_MATCHERS = re.compile(r"\{[^}]*\}")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NUMBER = re.compile(r"(?<![\w:.])\d+(?:\.\d*)?(?:[eE][+-]?\d+)?")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_KEYWORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
    "atan2",
}
_LABEL_VALUES = re.compile(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (a crude parse, see the module doc)."""
    text = _STRING.sub(" ", expr)
    text = _GRAFANA_VAR.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _MATCHERS.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    names = set()
    for match in _IDENT.finditer(text):
        if re.match(r"\s*\(", text[match.end() :]):  # a function or an aggregation
            continue
        if match.group().lower() not in _KEYWORDS:
            names.add(match.group())
    return names


def test_metric_names_parse_crudely_but_right() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (route, le) (rate(hf3fsctl_request_seconds_bucket"
        '{job=~"$serve_job", route=~"/v1/(lookup|locate)"}[$__rate_interval]))) > 0.25 '
        "and on (job) max without (instance) (up) * 1e9 / sum(hf3fsctl:connector_state) by (engine)"
    )
    assert metric_names(expr) == {
        "hf3fsctl_request_seconds_bucket",
        "up",
        "hf3fsctl:connector_state",
    }


# --- the files ---------------------------------------------------------------------------


def load_dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def dashboard_exprs() -> list[str]:
    return [
        target["expr"]
        for panel in all_panels(load_dashboard()["panels"])
        for target in panel.get("targets", [])
    ]


def variable_query(variable: dict[str, Any]) -> str:
    query = variable.get("query", "")
    return str(query.get("query", "") if isinstance(query, dict) else query)


def dashboard_variable_metrics() -> set[str]:
    names = set()
    for variable in load_dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            match = _LABEL_VALUES.search(variable_query(variable))
            assert match, f"variable {variable['name']}: not a label_values(metric, label) query"
            names.add(match.group(1))
    return names


def rule_exprs() -> list[str]:
    rules = yaml.safe_load(RULES.read_text())
    return [str(rule["expr"]) for group in rules["groups"] for rule in group["rules"]]


def used_metrics() -> set[str]:
    names = dashboard_variable_metrics()
    for expr in dashboard_exprs() + rule_exprs():
        names |= metric_names(expr)
    return names


# --- promtool ----------------------------------------------------------------------------


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, timeout=60, check=False
    )


@needs_promtool
def test_promtool_check_rules_passes() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


@needs_promtool
def test_promtool_rule_unit_tests_pass() -> None:
    """Each alert fires on synthetic series (deploy/prometheus/hf3fsctl-rules.test.yml)."""
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_every_dashboard_expr_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each dashboard query, as a recording rule, Grafana variables filled in."""
    rules = []
    for i, expr in enumerate(dashboard_exprs()):
        for variable, value in GRAFANA_SUBSTITUTES.items():
            expr = expr.replace(variable, value)
        expr = _GRAFANA_VAR.sub(".*", expr)  # $model_name etc.: only inside =~ matchers
        rules.append({"record": f"dashboard:expr_{i}", "expr": expr})
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# --- the dashboard's shape ---------------------------------------------------------------


def test_dashboard_is_importable_with_a_datasource_variable() -> None:
    dashboard = load_dashboard()
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] and dashboard["title"] and dashboard.get("id") is None
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"model_name", "namespace"} <= set(variables)
    panels = list(all_panels(dashboard["panels"]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    exprs = " ".join(dashboard_exprs())
    assert '$model_name"' in exprs and '$namespace"' in exprs


# --- the metrics that exist --------------------------------------------------------------


def scrape_real_server(directory: Path) -> str:
    """`hf3fsctl init`, `hf3fsctl serve`, some traffic, then /metrics (with the token)."""
    from hf3fsctl.meta.http.client import HttpMetadataClient

    storage, config = directory / "storage", directory / "hf3fs.yaml"
    init = ["init", "--storage-path", str(storage), "--create-path", "--write-config", str(config)]
    subprocess.run(
        [sys.executable, "-m", "hf3fsctl", *init],
        check=True,
        capture_output=True,
        timeout=120,
    )
    text = config.read_text()
    quota = "quotas:\n  tiny: 50%\n"  # the model of helpers.meta_builders.register
    config.write_text(text.replace("quotas: {}", quota) if "quotas: {}" in text else text + quota)
    token_file = directory / "token"
    token_file.write_text(TOKEN + "\n")
    server = ServerProcess(
        config=config,
        db_path=storage / "metadata.db",
        port=free_port(),
        token=TOKEN,
        log_path=directory / "serve.log",
        token_file=token_file,
    ).start()
    try:
        client = HttpMetadataClient(server.url, token=TOKEN, timeout_s=10)
        ns = register(client, num_pages=32)
        store_keys(client, ns, keys(4))  # allocate + commit
        assert client.lookup(ns, keys(6)) == 4
        client.locate(ns, 0, keys(2))
        request = urllib.request.Request(
            f"{server.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return str(response.read().decode())
    finally:
        server.stop()


def server_metrics(directory: Path) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    text = scrape_real_server(directory)
    return {
        sample.name for family in text_string_to_metric_families(text) for sample in family.samples
    }


def connector_metrics() -> set[str]:
    """The sample names of `Hf3fsctlPromMetrics` after one stats dict with everything."""
    from hf3fsctl_connector.stats import COUNTERS, FAILURE_KINDS, LATENCIES, STATE
    from hf3fsctl_connector.vllm_stats import Hf3fsctlPromMetrics
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()
    types: Any = {
        Counter: functools.partial(Counter, registry=registry),
        Gauge: functools.partial(Gauge, registry=registry),
        Histogram: functools.partial(Histogram, registry=registry),
    }
    labels = ["model_name", "engine"]  # vLLM's (vllm/v1/metrics/loggers.py)
    metrics = Hf3fsctlPromMetrics(
        SimpleNamespace(kv_transfer_config=None), types, labels, {0: ["tiny", "0"]}
    )
    data: dict[str, Any] = {name: 1 for name in COUNTERS}
    data.update({f"failed_{kind}": 1 for kind in FAILURE_KINDS})
    data.update({name: [0.002, 0.2] for name in LATENCIES})
    data[STATE] = 1
    metrics.observe(data, 0)
    return {sample.name for metric in registry.collect() for sample in metric.samples}


def vllm_metrics() -> set[str]:
    """`VLLM_METRICS`, each checked against the file of the installed vllm that defines it."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    site = Path(spec.origin).parent.parent
    for exposed, (relpath, defined) in VLLM_METRICS.items():
        source = (site / relpath).read_text()
        assert f'name="{defined}"' in source, f"{defined} is no longer defined in {relpath}"
        assert exposed == f"{defined}_total"  # all counters
    return set(VLLM_METRICS)


@pytest.mark.integration
def test_every_metric_the_dashboard_and_rules_use_exists(tmp_path: Path) -> None:
    used = used_metrics()
    # the parse found the metrics of every source (a parser that drops everything passes
    # nothing)
    assert {
        "hf3fsctl_store_used_bytes",
        "hf3fsctl_request_seconds_bucket",
        "hf3fsctl:connector_state",
        "vllm:external_prefix_cache_hits_total",
        "up",
    } <= used
    server = server_metrics(tmp_path / "serve")
    connector = connector_metrics()
    exported = server | connector | vllm_metrics() | PROMETHEUS_METRICS
    missing = sorted(used - exported)
    assert not missing, (
        f"queried but exported by nothing: {missing}\n"
        f"serve exports: {sorted(server)}\nconnector exports: {sorted(connector)}"
    )
    # every store gauge the dashboard shows was really there (capacity from `init`, a quota)
    assert {"hf3fsctl_store_capacity_bytes", "hf3fsctl_quota_bytes"} <= server
