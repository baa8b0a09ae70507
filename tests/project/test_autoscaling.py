"""The autoscaling recipe (deploy/kubernetes/autoscaling.yaml) fits the server and its manifest: the
prometheus-adapter rules read series the server exports, the HPA asks for exactly the metrics those rules
serve and scales the manifest's StatefulSet, a removed pod drains inside its grace period, and the schema
check is strict for the HPA too. The simulation of the rule (benchmarks/autoscale_sim.py) runs as documented
on a short trace and its rule does what the HPA's algorithm says."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from encode_server.ops.metrics import ServerMetrics
from tests.support.helpers import ROOT

pytestmark = pytest.mark.quick

KUBERNETES = ROOT / "deploy" / "kubernetes"


def documents(name: str) -> dict:
    return {doc["kind"]: doc for doc in yaml.safe_load_all((KUBERNETES / name).read_text())}


def adapter_rules() -> list[dict]:
    return yaml.safe_load(documents("autoscaling.yaml")["ConfigMap"]["data"]["config.yaml"])["rules"]


def test_the_adapter_rules_read_series_the_server_exports_and_serve_what_the_hpa_asks_for():
    exported = {line.split()[2] for line in ServerMetrics(modalities=("image",)).render().decode().splitlines()
                if line.startswith("# TYPE")}
    served = set()
    for rule in adapter_rules():
        series = re.match(r"(\w+)\{", rule["seriesQuery"]).group(1)
        assert series.removesuffix("_total") in exported or series in exported, series
        assert re.fullmatch(rule["name"]["matches"].strip("^$"), series)
        assert "<<.Series>>{<<.LabelMatchers>>}" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
        served.add(rule["name"]["as"])
    hpa = documents("autoscaling.yaml")["HorizontalPodAutoscaler"]["spec"]
    asked = {metric["pods"]["metric"]["name"] for metric in hpa["metrics"] if metric["type"] == "Pods"}
    assert asked == served


def test_the_hpa_scales_the_statefulset_out_quickly_and_in_slowly_after_a_drain():
    hpa = documents("autoscaling.yaml")["HorizontalPodAutoscaler"]["spec"]
    statefulset = documents("encode-server.yaml")["StatefulSet"]
    target = hpa["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("StatefulSet", statefulset["metadata"]["name"])
    assert 1 <= hpa["minReplicas"] < hpa["maxReplicas"]
    behavior = hpa["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] > behavior["scaleUp"]["stabilizationWindowSeconds"]
    pod = statefulset["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {entry["name"]: entry.get("value") for entry in container["env"]}
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > float(pre_stop[1]) + float(env["ENCODER_DRAIN_TIMEOUT_S"])


def test_the_schema_check_is_strict_for_the_hpa_too():
    hpa = documents("autoscaling.yaml")["HorizontalPodAutoscaler"]
    hpa["spec"]["metrics"][0]["pods"]["target"]["averageValu"] = "1"
    with pytest.raises(kubernetes_validate.ValidationError, match="averageValu"):
        kubernetes_validate.validate(hpa, kubernetes_validate.latest_version(), strict=True)


def simulate(*args: str) -> list[dict]:
    done = subprocess.run([sys.executable, "benchmarks/autoscale_sim.py", *args, "--json", "-"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_simulation_scales_out_and_back_in_serving_every_request_and_repeats_itself():
    """24 minutes of a quiet day with bursts: the recipe's HPA scales out and back in and every pool serves every
    request; the same seed gives the same figures."""
    results = {row["pool"]: row for row in simulate("--hours", "0.4", "--low-rps", "2", "--high-rps", "30",
                                                    "--burst-every-s", "200")}
    autoscaled = results["hpa"]
    assert autoscaled["scale_outs"] > 0 and autoscaled["scale_ins"] > 0
    assert autoscaled["replicas_min"] == 2 < autoscaled["replicas_max"]  # the recipe's minReplicas
    assert len({row["served"] for row in results.values()}) == 1 and autoscaled["served"] > 0
    assert autoscaled["provisioned_encoder_s"] == autoscaled["busy_encoder_s"] + autoscaled["idle_encoder_s"]
    short = ("--hours", "0.05", "--seed", "3")
    assert simulate(*short) == simulate(*short)
