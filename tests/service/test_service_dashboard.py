"""The Grafana dashboard of the service (examples/service/grafana-dashboard.json).

Every metric a query of the dashboard names must be one the running service exports: the
test scrapes the real service's /metrics and reads the metric names out of every PromQL
expression of the dashboard (panel targets and template variables). The picture of it in
docs/service.md is drawn again from its recording (examples/service/dashboard_picture.py).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from examples.service import dashboard_picture

from .test_service import REPO, Service

DASHBOARD = REPO / "examples" / "service" / "grafana-dashboard.json"
PICTURE = REPO / "docs" / "service-dashboard.png"
RECORDING = REPO / "examples" / "service" / "dashboard-run.json"

# PromQL words that are not metric names (operators, modifiers, grouping).
KEYWORDS = {"and", "or", "unless", "offset", "bool", "by", "without", "on", "ignoring",
            "group_left", "group_right", "inf", "nan", "atan2"}
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
TOKEN = re.compile(r"(?P<number>\d[\w.]*)|(?P<name>[A-Za-z_:][\w:]*)(?P<call>\s*\()?|.", re.S)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (Grafana's $variables allowed)."""
    assert "__name__" not in expr, f"select metrics by name, not by __name__: {expr}"
    text = STRING.sub('""', expr)  # label values, which may hold anything
    text = re.sub(r"\{[^{}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\[\]]*\]", " ", text)  # ranges and subqueries ($__rate_interval)
    text = GROUPING.sub(" ", text)  # label names of by (...), on (...)
    names = set()
    for token in TOKEN.finditer(text):
        name = token["name"]
        if name is None or token["call"] or name in KEYWORDS:
            continue  # a number, a function or aggregation, an operator
        names.add(name)
    return names


def grouping_labels(expr: str) -> set[str]:
    """The label names of ``by (...)``, ``on (...)`` and the like."""
    return {label.strip() for _, labels in GROUPING.findall(STRING.sub('""', expr))
            for label in labels.split(",") if label.strip()}


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every query: panel targets (rows' panels too), template variables."""

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for item in items:
            yield item
            yield from panels(item.get("panels", []))

    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            text = query["query"] if isinstance(query, dict) else query
            # label_values(<selector>, <label>): the selector is PromQL.
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", text)
            assert m, f"variable {variable['name']}: {text}"
            yield f"variable {variable['name']!r}", m[1]


def test_metric_names_are_read_out_of_promql() -> None:
    assert metric_names(
        'sum by (cpu) (rate(aperf_lost_total{instance=~"$instance", cpu!="a_b"}'
        "[$__rate_interval])) / on (cpu) group_left (reason) "
        "sum(rate(aperf_samples_total[5m] offset 1h)) + 1e3 * process_open_fds > bool 0.5"
    ) == {"aperf_lost_total", "aperf_samples_total", "process_open_fds"}
    assert metric_names('max(aperf_sse_max_lag{reason="rate(x)"})') == {"aperf_sse_max_lag"}
    assert metric_names("aperf_stream_open") == {"aperf_stream_open"}
    assert metric_names("histogram_quantile(0.99, sum by (le) (rate(x_bucket[1m])))") == {
        "x_bucket"}
    assert grouping_labels("sum by (cpu, reason) (x) / on(cpu) y") == {"cpu", "reason"}


def test_dashboard_is_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel
        assert panel["targets"], panel["title"]
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")
            # Every selector is limited to the chosen instances.
            for name in metric_names(expr):
                assert re.search(rf'\b{name}\{{instance=~"\$instance"\}}', expr), (name, expr)


@pytest.mark.kernel
def test_dashboard_queries_only_metrics_the_service_exports(
    tracefs: None, tmp_path: Path
) -> None:
    svc = Service(tmp_path / "service.log")
    try:
        svc.wait_ready()
        exported = {name for name, _ in svc.metrics()}
    finally:
        svc.close()
    dashboard = json.loads(DASHBOARD.read_text())
    queried: set[str] = set()
    for where, expr in queries(dashboard):
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr}"
        unknown = names - exported
        assert not unknown, f"{where} queries {sorted(unknown)}, which the service does not " \
            "export"
        # Grouped by labels the service's metrics have, or that Prometheus adds.
        assert grouping_labels(expr) <= {"cpu", "reason", "instance", "job"}, (where, expr)
        queried |= names
    # And the dashboard shows every metric of the service's own.
    assert {n for n in exported if n.startswith("aperf_")} <= queried


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def test_the_dashboard_picture_is_drawn_from_answers_to_every_query(tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    recording = json.loads(RECORDING.read_text())
    # Prometheus answered every query of the dashboard as it is now, with data: a panel
    # added or a query changed since the recording fails here until it is made again.
    panel_queries = [expr for where, expr in queries(dashboard) if where.startswith("panel")]
    assert set(recording["results"]) == set(panel_queries)
    empty = [expr for expr in panel_queries if not recording["results"][expr]]
    assert not empty, f"no series in the recording for {empty}"
    assert recording["prometheus"].startswith("prometheus, version ")
    # The script still draws it, at the size of the picture in the docs.
    drawn = tmp_path / "dashboard.png"
    assert dashboard_picture.main(["draw", str(RECORDING), str(drawn)]) == 0
    assert png_size(drawn) == png_size(PICTURE)
    # The page shows it and says what it is.
    page = (REPO / "docs" / "service.md").read_text()
    assert "](service-dashboard.png)" in page
    assert "not a Grafana screenshot" in page
