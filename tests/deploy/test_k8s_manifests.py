"""The Kubernetes overlays, rendered by `kubectl kustomize` and checked object by object.

What is checked is what breaks a deployment silently: container args that `ferry` would reject,
probes or Services pointing at a port nobody listens on, selectors that select nothing, a grace
period shorter than the drain, RBAC broader than discovery needs, a router whose discovery URL
would not find the replica pools, weights that could be downloaded at start.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from deploy_support import (
    GPU_OVERLAYS,
    K8S,
    OVERLAYS,
    ROOT,
    WORKLOAD_KINDS,
    container_ports,
    env_of,
    expand,
    ferry_containers,
    is_ferry_image,
    kubectl,
    matches,
    of_kind,
    one,
    parsed_args,
    pod_labels,
    pod_spec,
    replica_pools,
    resolve_port,
    selector_matches,
    to_bytes,
)
from kubernetes import client

from ferry.cli import build_parser
from router.discovery_k8s import parse_k8s_url, replicas_from_slices
from server.config import api_key_from
from server.tracing import tracing_args_problem


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest, rendered: dict[str, list[dict]]) -> tuple[str, list[dict]]:
    return request.param, rendered[request.param]


# ---------------------------------------------------------------- tests


def test_every_overlay_renders_the_expected_objects(rendered: dict[str, list[dict]]) -> None:
    assert set(OVERLAYS) == {"mixed", "disaggregated", "disaggregated-gpu", "production"}
    pools = {
        name: sorted(d["metadata"]["name"] for d in replica_pools(docs)) for name, docs in rendered.items()
    }
    assert pools == {
        "mixed": ["ferry-replica"],
        "disaggregated": ["ferry-decode", "ferry-prefill"],
        "disaggregated-gpu": ["ferry-decode", "ferry-prefill"],
        "production": ["ferry-decode", "ferry-prefill"],
    }
    for name, docs in rendered.items():
        kinds = {d["kind"] for d in docs}
        assert {
            "Deployment",
            "Service",
            "PodDisruptionBudget",
            "Role",
            "RoleBinding",
            "ServiceAccount",
        } <= kinds
        for d in docs:
            if d["kind"] != "Namespace":
                assert d["metadata"].get("namespace") == "ferry", (
                    f"{name}: {d['kind']}/{d['metadata']['name']}"
                )
    assert {"HorizontalPodAutoscaler", "ServiceMonitor", "Ingress"} <= {
        d["kind"] for d in rendered["production"]
    }
    assert "StatefulSet" not in {d["kind"] for d in rendered["production"]}  # managed Redis there


def test_ferry_args_are_flags_ferry_accepts(overlay: tuple[str, list[dict]]) -> None:
    name, docs = overlay
    seen = set()
    for w in of_kind(docs, *WORKLOAD_KINDS):
        for container in ferry_containers(w):
            env = env_of(container, docs, w["metadata"]["namespace"])
            args = build_parser().parse_args(expand(container["args"], env))  # SystemExit on a bad flag
            seen.add(args.command)
            if args.command == "serve":
                assert args.role == pod_labels(w)["ferry.dev/role"]
                assert args.num_threads == int(container["resources"]["limits"]["cpu"])  # no oversubscription
                assert args.host == "0.0.0.0"
                assert args.kv_tier.startswith(("redis://", "rediss://"))
                assert args.responses_store == args.kv_tier  # chains continue on any replica
                assert args.served_model_name == [
                    one(docs, "ConfigMap", "ferry-config")["data"]["SERVED_MODEL_NAME"]
                ]
            if args.command == "router":
                assert args.host == "0.0.0.0" and args.discovery.startswith("k8s:")
                # The router follows the replicas' KV events in the very tier they write to.
                tiers = {parsed_args(p, docs).kv_tier for p in replica_pools(docs)}
                assert tiers == {args.kv_tier}
    assert seen == {"serve", "router"}


def test_ports_probes_and_services_agree(overlay: tuple[str, list[dict]]) -> None:
    _, docs = overlay
    workloads = of_kind(docs, "Deployment", "StatefulSet")
    for w in workloads:
        ports = container_ports(w)
        for c in pod_spec(w)["containers"]:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                action = c.get(probe, {}).get("httpGet") or c.get(probe, {}).get("tcpSocket")
                if action:
                    assert resolve_port(action["port"], ports) is not None, f"{w['metadata']['name']} {probe}"
                if c.get(probe, {}).get("httpGet"):
                    if probe == "livenessProbe" and w["metadata"]["name"] == "ferry-router":
                        # /health depends on the replicas; liveness must not restart a router for them.
                        assert action["path"] == "/metrics"
                    else:
                        assert action["path"] == "/health"
            if is_ferry_image(c["image"]):
                assert {"readinessProbe", "livenessProbe"} <= set(c)
        annotations = w["spec"]["template"]["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") == "true":
            assert int(annotations["prometheus.io/port"]) == ports["http"]
            assert annotations["prometheus.io/path"] == "/metrics"

    for svc in of_kind(docs, "Service"):
        selected = [w for w in workloads if matches(svc["spec"]["selector"], pod_labels(w))]
        assert len(selected) == 1, f"Service {svc['metadata']['name']} selects {len(selected)} workloads"
        ports = container_ports(selected[0])
        for p in svc["spec"]["ports"]:
            assert resolve_port(p["targetPort"], ports) is not None, f"Service {svc['metadata']['name']} {p}"
        if selected[0]["metadata"]["name"].startswith(("ferry-replica", "ferry-prefill", "ferry-decode")):
            # Headless: the router balances over pods itself; DNS returns one record per Ready pod.
            assert svc["spec"]["clusterIP"] == "None"
            assert not svc["spec"].get("publishNotReadyAddresses", False)
            assert svc["metadata"]["labels"]["ferry.dev/role"] == pod_labels(selected[0])["ferry.dev/role"]


def test_selectors_match_pod_labels(overlay: tuple[str, list[dict]]) -> None:
    _, docs = overlay
    workloads = of_kind(docs, "Deployment", "StatefulSet")
    for w in workloads:
        assert matches(w["spec"]["selector"]["matchLabels"], pod_labels(w))
        others = [o for o in workloads if o is not w]
        # Two workloads whose selectors overlap would fight over pods.
        assert not any(matches(w["spec"]["selector"]["matchLabels"], pod_labels(o)) for o in others)
    for pdb in of_kind(docs, "PodDisruptionBudget"):
        selected = [w for w in workloads if matches(pdb["spec"]["selector"]["matchLabels"], pod_labels(w))]
        assert len(selected) == 1, pdb["metadata"]["name"]
    for hpa in of_kind(docs, "HorizontalPodAutoscaler"):
        target = one(docs, "Deployment", hpa["spec"]["scaleTargetRef"]["name"])
        assert "replicas" not in target["spec"], "a re-apply would reset the HPA's replica count"
        (metric,) = hpa["spec"]["metrics"]
        assert metric["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    for sm in of_kind(docs, "ServiceMonitor"):
        services = [
            s
            for s in of_kind(docs, "Service")
            if matches(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
            and all(
                s["metadata"]["labels"].get(e["key"]) in e["values"]
                for e in sm["spec"]["selector"]["matchExpressions"]
            )
        ]
        assert sorted(s["metadata"]["name"] for s in services) == sorted(
            ["ferry-router", *(d["metadata"]["name"] for d in replica_pools(docs))]
        )
        for s in services:
            assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in s["spec"]["ports"]}


def test_graceful_termination_outlasts_the_drain(overlay: tuple[str, list[dict]]) -> None:
    _, docs = overlay
    for w in [one(docs, "Deployment", "ferry-router"), *replica_pools(docs)]:
        (container,) = ferry_containers(w)
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        drain = getattr(parsed_args(w, docs), "drain_timeout", None) or 0
        grace = pod_spec(w)["terminationGracePeriodSeconds"]
        assert grace >= int(pre_stop[1]) + drain + 10, w["metadata"]["name"]
        if w in replica_pools(docs):
            assert drain >= 60  # long generations get a real chance to finish
            assert w["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    # Every stream passes a router: a router rollout must give it as long as its replica would (the
    # router's own default, 30 s, would cut what a replica lets run for 120 s).
    router_drain = parsed_args(one(docs, "Deployment", "ferry-router"), docs).drain_timeout
    assert router_drain >= max(parsed_args(w, docs).drain_timeout for w in replica_pools(docs))


def test_resources_and_gpu_variant(overlay: tuple[str, list[dict]]) -> None:
    name, docs = overlay
    for w in of_kind(docs, *WORKLOAD_KINDS):
        spec = pod_spec(w)
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec.get("initContainers", []) + spec["containers"]:
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][part]), f"{w['metadata']['name']}/{c['name']}"
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
    for w in replica_pools(docs):
        (container,) = ferry_containers(w)
        limits = container["resources"]["limits"]
        if name in GPU_OVERLAYS:
            assert limits["nvidia.com/gpu"] == "1" and container["image"].endswith("-cuda")
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod_spec(w)[
                "tolerations"
            ]
        else:
            assert "nvidia.com/gpu" not in limits and container["image"].endswith("-cpu")
    router = ferry_containers(one(docs, "Deployment", "ferry-router"))[0]
    assert "nvidia.com/gpu" not in router["resources"]["limits"]
    for w in [one(docs, "Deployment", "ferry-router"), *replica_pools(docs)]:
        assert pod_spec(w)["enableServiceLinks"] is False  # no injected FERRY_ROUTER_PORT=tcp://… variables
        for c in ferry_containers(w):
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]  # the one writable place


def test_rbac_is_get_list_watch_endpointslices_for_the_router_only(overlay: tuple[str, list[dict]]) -> None:
    _, docs = overlay
    assert not of_kind(docs, "ClusterRole", "ClusterRoleBinding")
    (role,) = of_kind(docs, "Role")
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    (binding,) = of_kind(docs, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ferry-router", "namespace": "ferry"}]
    assert pod_spec(one(docs, "Deployment", "ferry-router"))["serviceAccountName"] == "ferry-router"
    for w in replica_pools(docs):
        assert pod_spec(w)["automountServiceAccountToken"] is False
        assert "serviceAccountName" not in pod_spec(w)


def test_router_discovery_finds_exactly_the_replica_pools(overlay: tuple[str, list[dict]]) -> None:
    """Simulate the EndpointSlice controller (one slice per Service, the Service's labels copied,
    one Ready pod each) and run the router's own --discovery URL over the result."""
    _, docs = overlay
    router = one(docs, "Deployment", "ferry-router")
    target = parse_k8s_url(parsed_args(router, docs).discovery)
    assert target.namespace == "ferry"
    slices, expected = [], []
    for i, svc in enumerate(of_kind(docs, "Service")):
        labels = {**svc["metadata"]["labels"], "kubernetes.io/service-name": svc["metadata"]["name"]}
        if not selector_matches(target.label_selector, labels):
            continue
        (pool,) = [w for w in replica_pools(docs) if matches(svc["spec"]["selector"], pod_labels(w))]
        port = svc["spec"]["ports"][0]
        container_port = resolve_port(port["targetPort"], container_ports(pool))
        ip = f"10.1.{i}.7"
        slices.append(
            client.V1EndpointSlice(
                address_type="IPv4",
                metadata=client.V1ObjectMeta(name=f"{svc['metadata']['name']}-abcde", labels=labels),
                endpoints=[
                    client.V1Endpoint(addresses=[ip], conditions=client.V1EndpointConditions(ready=True))
                ],
                ports=[
                    client.DiscoveryV1EndpointPort(name=port["name"], port=container_port, protocol="TCP")
                ],
            )
        )
        pool_args = parsed_args(pool, docs, pod_ip=ip)
        expected.append((f"http://{ip}:{container_port}", pool_args.role))
        # KV events name the replica by --advertise-url: it must be the URL discovery yields.
        assert pool_args.advertise_url == f"http://{ip}:{container_port}" and pool_args.kv_events
    assert len(slices) == len(replica_pools(docs)), (
        "the selector must match every replica Service, nothing else"
    )
    found = replicas_from_slices(slices, target)
    assert sorted((r.url, r.role) for r in found) == sorted(expected)


def test_weights_come_from_a_volume_never_a_download(overlay: tuple[str, list[dict]]) -> None:
    name, docs = overlay
    for w in replica_pools(docs):
        (container,) = ferry_containers(w)
        env = env_of(container, docs, "ferry")
        assert env["HF_HUB_OFFLINE"] == "1"
        model = parsed_args(w, docs).model
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert model.startswith("/models/") and mounts["/models"]["readOnly"] is True
        volumes = {v["name"]: v for v in pod_spec(w)["volumes"]}
        (init,) = pod_spec(w)["initContainers"]
        if name == "production":
            assert volumes["models"] == {"name": "models", "emptyDir": {"sizeLimit": "200Gi"}}
            assert init["image"].startswith("rclone/") and init["args"][:3] == [
                "copy",
                "$(WEIGHTS_SOURCE)",
                "$(MODEL_PATH)",
            ]
        else:
            assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "ferry-models"
            assert one(docs, "PersistentVolumeClaim", "ferry-models")
            assert "config.json" in init["command"][-1]  # waits for a complete model directory
    if name in ("mixed", "disaggregated"):
        job = one(docs, "Job", "ferry-demo-model")
        assert "os.replace(tmp, target)" in pod_spec(job)["containers"][0]["command"][-1]


def test_kv_tier_points_at_the_deployed_redis_or_the_secret(overlay: tuple[str, list[dict]]) -> None:
    name, docs = overlay
    for w in replica_pools(docs):
        tier = urlsplit(parsed_args(w, docs).kv_tier)
        if name == "production":
            assert tier.scheme == "rediss" and tier.password  # from the Secret, TLS + password
        else:
            redis = one(docs, "Service", tier.hostname)
            assert tier.port == redis["spec"]["ports"][0]["port"]
            (redis_container,) = pod_spec(one(docs, "StatefulSet", "ferry-redis"))["containers"]
            args = redis_container["args"]
            # A cache: evicts instead of failing writes, and stays inside its memory limit (not OOM-killed).
            assert args[args.index("--maxmemory-policy") + 1] == "allkeys-lru"
            maxmemory = to_bytes(args[args.index("--maxmemory") + 1])
            assert maxmemory < to_bytes(redis_container["resources"]["limits"]["memory"])
            if name in GPU_OVERLAYS:
                assert maxmemory >= 16 << 30  # a real model's blocks need room


def test_production_guards_router_and_replicas_with_one_key(overlay: tuple[str, list[dict]]) -> None:
    """The api-key component: the router and every replica take the same key from the Secret (as
    FERRY_API_KEY, never on a command line); the other overlays run without one."""
    name, docs = overlay
    router = one(docs, "Deployment", "ferry-router")
    keys = set()
    for w in [router, *replica_pools(docs)]:
        (container,) = ferry_containers(w)
        env = env_of(container, docs, w["metadata"]["namespace"])
        args = parsed_args(w, docs)
        assert args.api_key is None  # not on the command line
        keys.add(api_key_from(args.api_key, env))
    assert keys == ({"sample-api-key"} if name == "production" else {None})


@pytest.mark.parametrize("name", ["mixed", "production"])
def test_the_tracing_component_gives_router_and_replicas_one_endpoint(
    name: str, tmp_path: Path, rendered: dict[str, list[dict]]
) -> None:
    """components/tracing, added to an overlay as its comment says (the endpoint, and for production
    the protocol, set by the overlay): the router and every replica pool take
    --otlp-traces-endpoint from ferry-config, each with the OTEL_SERVICE_NAME of its component."""
    endpoint = "http://collector.tracing:4317"
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(K8S / "overlays" / name, tmp_path)],
                "components": [os.path.relpath(K8S / "components" / "tracing", tmp_path)],
                "configMapGenerator": [
                    {
                        "name": "ferry-config",
                        "behavior": "merge",
                        "literals": [f"OTLP_TRACES_ENDPOINT={endpoint}"]
                        + (["OTLP_TRACES_PROTOCOL=http/protobuf"] if name == "production" else []),
                    }
                ],
            }
        )
    )
    proc = subprocess.run(
        [kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    docs = [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
    traced = {}
    for w in [one(docs, "Deployment", "ferry-router"), *replica_pools(docs)]:
        (container,) = ferry_containers(w)
        env = env_of(container, docs, w["metadata"]["namespace"])
        args = parsed_args(w, docs)
        assert tracing_args_problem(args) is None
        traced[w["metadata"]["name"]] = (args.otlp_traces_endpoint, env["OTEL_SERVICE_NAME"])
        protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        assert protocol == ("http/protobuf" if name == "production" else None)  # grpc by default
    pools = {"mixed": {"ferry-replica": "ferry-mixed"}}.get(
        name, {"ferry-prefill": "ferry-prefill", "ferry-decode": "ferry-decode"}
    )
    assert traced == {
        "ferry-router": (endpoint, "ferry-router"),
        **{pool: (endpoint, service) for pool, service in pools.items()},
    }
    # Everything else the overlay renders is as before.
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == sorted(
        (d["kind"], d["metadata"]["name"]) for d in rendered[name]
    )


def test_overlays_as_shipped_export_no_traces(overlay: tuple[str, list[dict]]) -> None:
    _, docs = overlay
    for w in [one(docs, "Deployment", "ferry-router"), *replica_pools(docs)]:
        (container,) = ferry_containers(w)
        assert parsed_args(w, docs).otlp_traces_endpoint is None
        assert "OTEL_SERVICE_NAME" not in env_of(container, docs, w["metadata"]["namespace"])


def test_embedded_scripts_run(rendered: dict[str, list[dict]], tmp_path: Path) -> None:
    """The shell and Python embedded in the manifests, run as the pods would run them: the demo-model
    Job builds a model `ferry` can load, atomically and idempotently; the replicas' init container
    waits for exactly that model."""
    docs = rendered["disaggregated"]
    job = pod_spec(one(docs, "Job", "ferry-demo-model"))["containers"][0]
    target = tmp_path / "models" / "model"
    target.parent.mkdir()
    env = {**os.environ, "MODEL_PATH": str(target), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    init = pod_spec(one(docs, "Deployment", "ferry-decode"))["initContainers"][0]["command"]
    with pytest.raises(subprocess.TimeoutExpired):  # no model yet: the replica keeps waiting
        subprocess.run(init, env=env, capture_output=True, timeout=1.5)

    build = [sys.executable, *job["command"][1:]]
    assert job["command"][0] == "python"
    first = subprocess.run(build, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert sorted(p.name for p in target.parent.iterdir()) == ["model"]  # no temporary left behind
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= {
        p.name for p in target.iterdir()
    }
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    again = subprocess.run(build, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and (target / "model.safetensors").stat().st_mtime_ns == stamp  # kept as is
    assert subprocess.run(init, env=env, capture_output=True, timeout=10).returncode == 0

    from engine.demo import DEMO_SPEC

    config = json.loads((target / "config.json").read_text())
    assert config["hidden_size"] == DEMO_SPEC["hidden_size"]
    assert config["num_hidden_layers"] == DEMO_SPEC["num_hidden_layers"]


def test_objects_match_the_kubernetes_api_schema(overlay: tuple[str, list[dict]]) -> None:
    """Each object deserialized into the official client's model (unknown fields rejected, types
    checked): a misspelt or misplaced field fails here rather than at `kubectl apply`."""
    _, docs = overlay
    api = client.ApiClient()
    for doc in docs:
        group_version = doc["apiVersion"]
        if group_version.startswith("monitoring.coreos.com/"):
            continue  # a CRD of the Prometheus Operator: not in the core API
        version = group_version.split("/")[-1]
        model = f"{version[0].upper()}{version[1:]}{doc['kind']}"
        assert hasattr(client, model), f"no API model {model} for {group_version} {doc['kind']}"
        cls = getattr(client, model)
        if hasattr(cls, "model_validate"):  # kubernetes >= 37: pydantic models, extra fields forbidden
            obj = cls.model_validate(doc)
        else:  # older clients check types only
            obj = api.deserialize(json.dumps(doc), model, "application/json")
        assert obj.metadata.name == doc["metadata"]["name"]


def test_object_storage_init_containers_copy_the_model(
    rendered: dict[str, list[dict]], tiny_llama: Path, tmp_path: Path
) -> None:
    """production's `weights` init containers, run with rclone's local backend standing in for the
    bucket (remote "store" configured from the environment, as the credentials Secret does): a
    replica gets the whole model, a router only the tokenizer and config files."""
    rclone = shutil.which("rclone")
    if rclone is None:
        pytest.skip("rclone is not installed (Debian: apt-get install rclone): cannot run the weights copy")
    docs = rendered["production"]
    source = one(docs, "ConfigMap", "ferry-weights")["data"]["SOURCE"]
    remote, _, path = source.partition(":")
    assert remote == "store"
    bucket = tmp_path / "bucket"
    shutil.copytree(tiny_llama, bucket / path)
    for name, expect_weights in (("ferry-decode", True), ("ferry-router", False)):
        (init,) = pod_spec(one(docs, "Deployment", name))["initContainers"]
        assert [e["secretRef"]["name"] for e in init["envFrom"]] == ["ferry-weights-credentials"]
        dest = tmp_path / name / "model"
        env = env_of(init, docs, "ferry")
        env.update(MODEL_PATH=str(dest), HOME=str(tmp_path), RCLONE_CONFIG=str(tmp_path / "rclone.conf"))
        env.update(RCLONE_CONFIG_STORE_TYPE="local", PATH=os.environ["PATH"])  # the Secret's part
        proc = subprocess.run(
            [rclone, *expand(init["args"], env)],
            env=env,
            cwd=bucket,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        copied = {p.name for p in dest.iterdir()}
        assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= copied
        assert ("model.safetensors" in copied) is expect_weights
        if expect_weights:
            assert copied == {p.name for p in tiny_llama.iterdir()}


def nginx_size(value: str) -> int:
    """nginx sizes: 32m, 512k, 1g, or bytes."""
    number, unit = re.fullmatch(r"(\d+)([kKmMgG]?)", value).groups()
    return int(number) << {"": 0, "k": 10, "m": 20, "g": 30}[unit.lower()]


def test_ingress_never_ends_what_the_router_would_still_serve(overlay: tuple[str, list[dict]]) -> None:
    """ingress-nginx in front of the routers: a stream quiet for as long as the router still waits
    on its replica (--request-timeout), or a body the router still takes (--max-request-bytes),
    must reach the router, not end in nginx's own 504 / 413 page."""
    _, docs = overlay
    router = parsed_args(one(docs, "Deployment", "ferry-router"), docs)
    for ingress in of_kind(docs, "Ingress"):
        notes = {
            k.removeprefix("nginx.ingress.kubernetes.io/"): v
            for k, v in ingress["metadata"]["annotations"].items()
        }
        assert notes["proxy-buffering"] == "off" and notes["proxy-http-version"] == "1.1"
        assert (
            min(int(notes["proxy-read-timeout"]), int(notes["proxy-send-timeout"])) >= router.request_timeout
        )
        assert nginx_size(notes["proxy-body-size"]) >= max(router.max_request_bytes, router.max_file_bytes)
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                backend = path["backend"]["service"]
                service = one(docs, "Service", backend["name"])
                assert backend["port"]["name"] in {p["name"] for p in service["spec"]["ports"]}
                assert matches(
                    service["spec"]["selector"], pod_labels(one(docs, "Deployment", "ferry-router"))
                )
