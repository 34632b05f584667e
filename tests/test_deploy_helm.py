"""The Helm chart (deploy/helm/ember) rendered by Helm itself and its manifests validated.

Helm's own engine renders and lints the chart offline: helm-python-sdk (PyPI) ships Helm
v4's library (libhelm_c.so, Go) with Python bindings, so `helm template`, `helm lint` and
the values.schema.json check run here without a helm binary or a cluster. Every rendered
manifest is then validated against the Kubernetes OpenAPI schemas that kubernetes-validate
(PyPI) bundles, strictly (unknown fields fail); the ServiceMonitor is a Prometheus
Operator CRD that those schemas lack, so it is checked field by field against the Service
it scrapes. The environment a pod gets is parsed by Ember's own CLI (`apply_defaults`), so
a setting that Ember would refuse fails here.
"""

from __future__ import annotations

import json
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

CHART = Path(__file__).resolve().parent.parent / "deploy" / "helm" / "ember"
KUBERNETES_VERSION = "1.33.0"
CHART_OWNED = {"EMBER_HOSTNAME", "EMBER_PORT", "EMBER_API_KEY", "EMBER_GRACEFUL_TERMINATION_TIMEOUT"}


def render(values: dict | None = None) -> list[dict]:
    """`helm template demo deploy/helm/ember --namespace ml` with ``values``: the manifests."""
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values or {})
        files = chart.render(values=values or {}, name="demo", namespace="ml", is_install=True)
    docs = []
    for name, text in sorted(files.items()):
        if name.endswith("NOTES.txt"):
            continue
        docs += [doc for doc in yaml.safe_load_all(text) if doc]
    return docs


def notes(values: dict | None = None) -> str:
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values=values or {}, name="demo", namespace="ml", is_install=True)
    return next(text for name, text in files.items() if name.endswith("NOTES.txt"))


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    kinds: dict[str, list[dict]] = {}
    for doc in docs:
        kinds.setdefault(doc["kind"], []).append(doc)
    return kinds


def validate(docs: list[dict]) -> None:
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            continue  # a CRD: check_service_monitor
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def container_of(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def serve_args(container: dict):
    """The container's environment (literal values; a Secret's as a placeholder) read by
    `ember serve`'s own option defaults."""
    from ember.api.cli import build_parser
    from ember.api.cli_env import apply_defaults

    env = {item["name"]: item.get("value", "secret-from-kubernetes") for item in container["env"]}
    args = build_parser().parse_args(["serve"])
    apply_defaults(args, env)
    return args, env


# -- the chart itself --------------------------------------------------------------------------


def test_helm_lint_is_clean():
    report = helm.lint(str(CHART), strict=True, kube_version=f"v{KUBERNETES_VERSION}")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report


def test_every_serve_option_is_a_chart_setting():
    """values.schema.json's `settings` names are exactly `ember serve`'s variables (less the
    four the chart sets itself): a flag added to api/cli_env.py must be added here too."""
    from ember.api.cli_env import ENV_OPTIONS

    schema = json.loads((CHART / "values.schema.json").read_text())
    names = set(schema["properties"]["settings"]["propertyNames"]["enum"])
    expected = {option.variable.removeprefix("EMBER_").lower()
                for option in ENV_OPTIONS.values() if option.variable not in CHART_OWNED}
    assert names == expected, (f"missing from the chart's settings: {sorted(expected - names)}; "
                               f"no longer options: {sorted(names - expected)}")


# -- single-node Deployment ------------------------------------------------------------------


def test_default_values_render_valid_manifests():
    docs = render()
    validate(docs)
    kinds = by_kind(docs)
    assert sorted(kinds) == ["Deployment", "Service"]
    deployment = kinds["Deployment"][0]
    container = container_of(deployment)
    pod = deployment["spec"]["template"]["spec"]
    # /health is 503 while loading, warming up and draining: startup and readiness probes use it,
    # liveness asks /info, which answers in all three
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/info"
    assert pod["terminationGracePeriodSeconds"] > 30
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000
    cache = next(v for v in pod["volumes"] if v["name"] == "cache")
    assert "emptyDir" in cache
    args, env = serve_args(container)
    assert (args.hostname, args.port, args.api_key, args.model_id) == ("0.0.0.0", 3000, None, None)
    assert args.graceful_termination_timeout == 30.0
    service = kinds["Service"][0]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert "http" in {p["name"] for p in container["ports"]}


def test_gpu_pvc_api_key_autoscaling_and_service_monitor():
    values = {
        "settings": {"model_id": "Qwen/Qwen3-8B", "dtype": "bfloat16", "max_total_tokens": 8192,
                     "disable_prefix_caching": True, "speculative_config": '{"method": "ngram"}'},
        "gpu": {"count": 2},
        "cache": {"type": "persistentVolumeClaim", "sizeLimit": "100Gi", "storageClassName": "fast"},
        "apiKey": {"value": "s3cret"},
        "autoscaling": {"enabled": True, "maxReplicas": 6, "targetAverageValue": "8"},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "gracefulTerminationTimeout": 120,
        "extraEnv": [{"name": "NCCL_DEBUG", "value": "WARN"}],
    }
    docs = render(values)
    validate(docs)
    kinds = by_kind(docs)
    assert sorted(kinds) == ["Deployment", "HorizontalPodAutoscaler", "PersistentVolumeClaim", "Secret",
                             "Service", "ServiceMonitor"]
    deployment = kinds["Deployment"][0]
    assert "replicas" not in deployment["spec"]  # the autoscaler owns the count
    container = container_of(deployment)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["resources"]["requests"]["memory"] == "4Gi"
    args, env = serve_args(container)
    assert (args.model_id, args.dtype, args.max_total_tokens) == ("Qwen/Qwen3-8B", "bfloat16", 8192)
    assert args.disable_prefix_caching is True and args.speculative_config == '{"method": "ngram"}'
    assert args.graceful_termination_timeout == 120.0 and env["NCCL_DEBUG"] == "WARN"
    key = next(item for item in container["env"] if item["name"] == "EMBER_API_KEY")
    secret = kinds["Secret"][0]
    assert key["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "api-key"}
    assert secret["data"]["api-key"] == "czNjcmV0"  # base64 of s3cret
    pod = deployment["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 135
    claim = next(v for v in pod["volumes"] if v["name"] == "cache")["persistentVolumeClaim"]["claimName"]
    pvc = kinds["PersistentVolumeClaim"][0]
    assert claim == pvc["metadata"]["name"] and pvc["spec"]["resources"]["requests"]["storage"] == "100Gi"
    assert pvc["spec"]["storageClassName"] == "fast"
    hpa = kinds["HorizontalPodAutoscaler"][0]
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "ember_requests_waiting"  # on /metrics: tests/test_deploy.py
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "8"}
    check_service_monitor(kinds["ServiceMonitor"][0], kinds["Service"], {"release": "prometheus"})
    assert "Authorization: Bearer" in notes(values)


def check_service_monitor(monitor: dict, services: list[dict], labels: dict) -> None:
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert labels.items() <= monitor["metadata"]["labels"].items()
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped = [s for s in services if selector.items() <= s["metadata"]["labels"].items()]
    assert len(scraped) == 1, "the ServiceMonitor must select the HTTP Service alone (not the ranks')"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] in {p["name"] for p in scraped[0]["spec"]["ports"]}


def test_existing_secret_is_referenced_not_made():
    docs = render({"apiKey": {"existingSecret": "ember-keys", "secretKey": "token"}})
    validate(docs)
    assert "Secret" not in by_kind(docs)
    container = container_of(by_kind(docs)["Deployment"][0])
    key = next(item for item in container["env"] if item["name"] == "EMBER_API_KEY")
    assert key["valueFrom"]["secretKeyRef"] == {"name": "ember-keys", "key": "token"}


# -- multi-node tensor/pipeline parallelism --------------------------------------------------


def test_parallel_statefulset_runs_torchrun_on_every_node():
    values = {"parallel": {"enabled": True, "nodes": 2, "procsPerNode": 2, "tensorParallelSize": 2,
                           "pipelineParallelSize": 2},
              "gpu": {"count": 2}, "cache": {"type": "persistentVolumeClaim"}, "serviceMonitor": {"enabled": True}}
    docs = render(values)
    validate(docs)
    kinds = by_kind(docs)
    assert set(kinds) == {"Service", "ServiceMonitor", "StatefulSet"}
    (statefulset,) = kinds["StatefulSet"]
    spec = statefulset["spec"]
    assert spec["replicas"] == 2 and spec["podManagementPolicy"] == "Parallel"
    headless = next(s for s in kinds["Service"] if s["spec"].get("clusterIP") == "None")
    http = next(s for s in kinds["Service"] if s is not headless)
    assert spec["serviceName"] == headless["metadata"]["name"] and headless["spec"]["publishNotReadyAddresses"]
    # only pod 0 (rank 0) serves HTTP
    assert http["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == "demo-ember-0"
    container = container_of(statefulset)
    command = " ".join(container["command"] + container["args"])
    assert "torchrun --nnodes 2 --nproc-per-node 2" in command and '--node-rank "${HOSTNAME##*-}"' in command
    assert f"--master-addr demo-ember-0.{headless['metadata']['name']}.ml.svc.cluster.local" in command
    assert "--master-port 29500 -m ember.api.cli serve" in command
    args, _ = serve_args(container)
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (2, 2)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "cache"
    check_service_monitor(kinds["ServiceMonitor"][0], kinds["Service"], {})


def test_parallel_world_size_must_match():
    with pytest.raises(helm.HelmRenderError, match=r"nodes x procsPerNode \(2 x 1\) must equal"):
        render({"parallel": {"enabled": True, "nodes": 2, "procsPerNode": 1, "tensorParallelSize": 4,
                             "pipelineParallelSize": 1}})


# -- values the schema refuses ---------------------------------------------------------------


@pytest.mark.parametrize(("values", "named"), [
    ({"settings": {"max_total_tokenz": 4096}}, "max_total_tokenz"),
    ({"settings": {"api_key": "in plain text"}}, "api_key"),  # the chart takes it from a Secret
    ({"cache": {"type": "hostPath"}}, "/cache/type"),
    ({"gpu": {"count": -1}}, "/gpu/count"),
    ({"replicas": 3}, "replicas"),
])
def test_schema_refuses_bad_values_by_name(values, named):
    with pytest.raises(helm.HelmValuesError, match=named):
        render(values)


def test_validation_catches_a_planted_fault():
    """The schema check is live: a misspelt probe field in the rendered Deployment fails it."""
    deployment = by_kind(render())["Deployment"][0]
    container = container_of(deployment)
    container["livenesProbe"] = container.pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="livenesProbe"):
        validate([deployment])
