"""The deployment files parse, configure the server only through settings it has, and fit together: every
Kubernetes document validates against the Kubernetes API's own schema (kubernetes-validate's bundled
OpenAPI schemas, strict: an unknown field fails), the manifest applies as shipped (the API key's Secret is
optional), runs the image the Dockerfile documents building, addresses each pod by its own name, gives a
slow start time before liveness counts, and scrapes /metrics on the server's port; the Dockerfile's health
check works against a real server. (No Docker engine or cluster here: neither is run by the tests.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from encode_server.ops.setting_values import exempt_networks, in_networks
from encode_server.ops.settings import OPTIONS
from tests.support.helpers import ROOT, ServerProcess, free_port

DEPLOY = ROOT / "deploy"
KNOWN_VARIABLES = {option.env_var for option in OPTIONS}
KNOWN_FLAGS = {option.flag for option in OPTIONS}


def test_shell_scripts_are_valid_and_use_real_flags():
    scripts = sorted(DEPLOY.glob("*.sh"))
    assert {p.name for p in scripts} >= {"single-gpu.sh", "tensor-parallel.sh", "data-parallel.sh", "multi-node.sh"}
    for script in scripts:
        subprocess.run(["bash", "-n", str(script)], check=True)
        text = script.read_text()
        assert text.splitlines()[1].startswith("#"), f"{script.name} should explain itself"
        for flag in re.findall(r"(--[a-z][a-z-]+)", text):
            assert flag in KNOWN_FLAGS, f"{script.name}: unknown flag {flag}"


KUBERNETES = DEPLOY / "kubernetes"
MANIFEST = KUBERNETES / "encode-server.yaml"
#: Every Kubernetes file shipped (examples included), each document of each checked.
KUBERNETES_FILES = sorted(KUBERNETES.rglob("*.yaml")) + sorted(KUBERNETES.rglob("*.yml"))
#: The oldest Kubernetes release the manifests are checked against, and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.29", kubernetes_validate.latest_version())
DOCKERFILE = ROOT / "Dockerfile"


def manifest() -> dict:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text())}


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, comments dropped and continued lines joined."""
    instructions, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip().removesuffix("\\") + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            keyword, _, rest = current.strip().partition(" ")
            instructions.append((keyword.upper(), " ".join(rest.split())))
            current = ""
    return instructions


def documented_build_tag(text: str) -> str:
    """The image of the `docker build -t <image> .` command a file's comments document."""
    tags = re.findall(r"#\s+docker build -t (\S+) \.$", text, flags=re.MULTILINE)
    assert len(tags) == 1, tags
    return tags[0]


@pytest.mark.parametrize("path", KUBERNETES_FILES, ids=lambda path: str(path.relative_to(KUBERNETES)))
def test_every_kubernetes_document_validates_against_the_schema(path):
    documents = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    assert documents, f"{path.name} holds no document"
    for document in documents:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(document, version, strict=True)


def test_the_schema_check_catches_a_mistake():
    """The validator is no rubber stamp: a misspelt field and a string where a number belongs both fail."""
    statefulset = manifest()["StatefulSet"]
    container = statefulset["spec"]["template"]["spec"]["containers"][0]
    key = next(entry for entry in container["env"] if entry["name"] == "ENCODER_API_KEY")
    key["valueFrom"]["secretKeyRef"]["optinal"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="optinal"):
        kubernetes_validate.validate(statefulset, KUBERNETES_VERSIONS[-1], strict=True)
    del key["valueFrom"]["secretKeyRef"]["optinal"]
    container["readinessProbe"]["failureThreshold"] = "3"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(statefulset, KUBERNETES_VERSIONS[-1], strict=True)


def container_of(kinds: dict) -> dict:
    return kinds["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]


def test_the_manifest_starts_without_a_secret_and_the_example_secret_fits_it():
    """Applied as shipped, no Secret exists: the key is optional, so pods start (no CreateContainerConfigError).
    The example Secret has the name and key the manifest reads."""
    env = {entry["name"]: entry for entry in container_of(manifest())["env"]}
    reference = env["ENCODER_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert reference["optional"] is True
    (secret,) = yaml.safe_load_all((KUBERNETES / "examples" / "api-key-secret.yaml").read_text())
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == reference["name"]
    assert reference["key"] in secret["stringData"]
    assert "kubectl create secret generic encode-server --from-literal=api-key=" in MANIFEST.read_text()


def test_sglang_and_vllm_callers_are_exempt_from_the_key_and_the_network_policy_admits_only_clients():
    """SGLang 0.5.23's receiver and vLLM's proxy send no Authorization header: the manifest exempts a pod
    network (kubeadm's default here), and its NetworkPolicy is what keeps everyone else off the encoders."""
    kinds = manifest()
    env = {entry["name"]: entry.get("value") for entry in container_of(kinds)["env"]}
    networks = exempt_networks(env["ENCODER_API_KEY_EXEMPT_CIDRS"])
    assert in_networks("10.244.1.17", networks) and not in_networks("192.168.1.1", networks)
    policy = kinds["NetworkPolicy"]["spec"]
    assert policy["podSelector"]["matchLabels"] == kinds["StatefulSet"]["spec"]["selector"]["matchLabels"]
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": int(env["ENCODER_PORT"])}]
    assert {"namespaceSelector": {}, "podSelector": {"matchLabels": {"encode-server-client": "true"}}} in rule["from"]


def test_probes_give_a_slow_start_time_and_readiness_tolerates_a_blip():
    container = container_of(manifest())
    startup, readiness, liveness = (container[name] for name in ("startupProbe", "readinessProbe", "livenessProbe"))
    for probe in (startup, readiness, liveness):
        assert probe["httpGet"] == {"path": "/health", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # a Hub download and a large tower
    assert readiness["failureThreshold"] > 1
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60
    assert "initialDelaySeconds" not in liveness  # the startupProbe holds liveness off instead


def test_resources_shared_memory_and_the_hub_cache():
    kinds = manifest()
    pod = kinds["StatefulSet"]["spec"]["template"]["spec"]
    container = container_of(kinds)
    for kind in ("requests", "limits"):
        assert {"cpu", "memory", "nvidia.com/gpu"} <= set(container["resources"][kind])
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    env = {entry["name"]: entry.get("value") for entry in container["env"]}
    hf_home = env["HF_HOME"]
    (cache_mount,) = [path for path in mounts if hf_home.startswith(path.rstrip("/") + "/")]
    templates = {claim["metadata"]["name"] for claim in kinds["StatefulSet"]["spec"]["volumeClaimTemplates"]}
    assert mounts[cache_mount] in templates  # a volume of each pod's own, kept across restarts
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True and security["fsGroup"] == security["runAsGroup"]


def test_docker_run_advice_gives_shared_memory_and_a_hub_cache_volume():
    dockerfile = DOCKERFILE.read_text()
    env = " ".join(rest for keyword, rest in dockerfile_instructions() if keyword == "ENV")
    hf_home = re.search(r"HF_HOME=(\S+)", env).group(1)
    uid = manifest()["StatefulSet"]["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    assert f"--uid {uid}" in dockerfile
    for text in (dockerfile, (DEPLOY / "README.md").read_text(), (ROOT / "docs" / "DEPLOYMENT.md").read_text()):
        runs = [line for line in text.splitlines() if "docker run --gpus" in line]
        assert runs and all("--shm-size" in line for line in runs), runs
        targets = re.findall(r"-v \S+?:(/[^\s:]+)", text)
        assert any(hf_home.startswith(target + "/") for target in targets), "a volume for HF_HOME"


def test_kubernetes_statefulset_probes_health_and_sets_known_variables():
    kinds = manifest()
    assert set(kinds) == {"StatefulSet", "Service", "NetworkPolicy"}
    container = kinds["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    names = {entry["name"] for entry in container["env"]} - {"HF_HOME"}
    assert names and names <= KNOWN_VARIABLES, names - KNOWN_VARIABLES
    assert kinds["Service"]["spec"]["selector"] == kinds["StatefulSet"]["spec"]["selector"]["matchLabels"]


def test_each_pod_is_addressed_by_its_own_name():
    """A request's /encode and its prefill ranks' registrations must reach the same pod: no virtual IP that
    balances connections, but a headless Service whose StatefulSet names each pod."""
    kinds = manifest()
    assert kinds["Service"]["spec"]["clusterIP"] == "None"
    assert kinds["StatefulSet"]["spec"]["serviceName"] == kinds["Service"]["metadata"]["name"]
    assert "--encoder-urls http://encode-server-0.encode-server:30000" in MANIFEST.read_text()


def test_prometheus_annotations_scrape_metrics_on_the_servers_port():
    pod = manifest()["StatefulSet"]["spec"]["template"]
    annotations = pod["metadata"]["annotations"]
    container = pod["spec"]["containers"][0]
    env = {entry["name"]: entry.get("value") for entry in container["env"]}
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert annotations["prometheus.io/port"] == env["ENCODER_PORT"] == str(container["ports"][0]["containerPort"])
    assert "ENCODER_METRICS_REQUIRE_KEY" not in env  # the default: a scraper needs no key


def test_manifest_runs_the_image_the_dockerfile_documents_building():
    tag = documented_build_tag(DOCKERFILE.read_text())
    assert documented_build_tag(MANIFEST.read_text()) == tag
    image = manifest()["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == tag and image.rsplit("/", 1)[-1].startswith("encode-server:")


def test_dockerfile_installs_the_video_vllm_and_mooncake_extras_on_a_cuda_base_and_runs_the_server():
    instructions = dockerfile_instructions()
    arguments = {}
    for keyword, rest in instructions:
        arguments.setdefault(keyword, []).append(rest)
    assert [keyword for keyword, _ in instructions].count("FROM") == 1
    base = next(rest for keyword, rest in instructions if keyword == "ARG" and rest.startswith("CUDA_IMAGE="))
    assert base.startswith("CUDA_IMAGE=nvidia/cuda:") and arguments["FROM"] == ["${CUDA_IMAGE}"]
    runs = " ".join(arguments["RUN"])
    torch_install = 'pip install "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" --index-url '
    assert torch_install + '"${TORCH_INDEX_URL}"' in runs
    # PyAV for video files; OpenCV for the vLLM producer's videos; Mooncake for --cache-store and its master
    assert 'pip install ".[video,vllm,mooncake]"' in runs and "libibverbs1" in runs
    assert json.loads(arguments["ENTRYPOINT"][0]) == ["encode-server"]
    assert arguments["EXPOSE"] == ["30000"]
    env = " ".join(arguments["ENV"])
    assert "ENCODER_HOST=0.0.0.0" in env and "ENCODER_PORT=30000" in env
    assert arguments["USER"] == ["encoder"]
    (healthcheck,) = arguments["HEALTHCHECK"]
    assert "/health" in healthcheck and "ENCODER_PORT" in healthcheck


def test_the_dockerfile_health_check_passes_on_a_healthy_server_and_fails_without_one():
    """The HEALTHCHECK's command itself, run here against a real server (python3 is the image's venv python)."""
    (healthcheck,) = [rest for keyword, rest in dockerfile_instructions() if keyword == "HEALTHCHECK"]
    command = healthcheck.split(" CMD ", 1)[1].replace("python3 ", f"{sys.executable} ", 1)
    with ServerProcess() as server:
        env = {**os.environ, "ENCODER_PORT": str(server.port)}
        assert subprocess.run(["sh", "-c", command], env=env, timeout=30).returncode == 0
    env = {**os.environ, "ENCODER_PORT": str(free_port())}
    assert subprocess.run(["sh", "-c", command], env=env, capture_output=True, timeout=30).returncode != 0


def test_systemd_unit_runs_the_server_with_an_environment_file():
    unit = (DEPLOY / "systemd" / "encode-server.service").read_text()
    assert "ExecStart=" in unit and "encode-server" in unit and "EnvironmentFile=" in unit
    assert "KillSignal=SIGTERM" in unit


MOONCAKE = DEPLOY / "kubernetes" / "mooncake-master.yaml"


def test_the_mooncake_manifest_runs_a_master_and_store_memory_the_encoders_point_at():
    docs = yaml.safe_load_all(MOONCAKE.read_text())
    kinds = {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}
    assert set(kinds) == {("Deployment", "mooncake-master"), ("Service", "mooncake-master"),
                          ("Deployment", "mooncake-store")}
    master = kinds[("Deployment", "mooncake-master")]["spec"]["template"]["spec"]["containers"][0]
    assert master["command"] == ["mooncake_master"] and "--rpc_port=50051" in master["args"]
    service = kinds[("Service", "mooncake-master")]["spec"]
    assert service["selector"] == kinds[("Deployment", "mooncake-master")]["spec"]["selector"]["matchLabels"]
    assert {"name": "rpc", "port": 50051, "targetPort": "rpc"} in service["ports"]
    store = kinds[("Deployment", "mooncake-store")]["spec"]["template"]["spec"]["containers"][0]
    assert store["command"] == ["mooncake_client"]
    assert "--master_server_address=mooncake-master:50051" in store["args"]
    # Both run from the image the encoders run (its mooncake extra), and the encoders point at the Service.
    assert master["image"] == store["image"] == documented_build_tag(DOCKERFILE.read_text())
    env = {entry["name"]: entry.get("value") for entry in
           manifest()["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["ENCODER_CACHE_STORE"] == "mooncake://mooncake-master:50051"
    assert env["ENCODER_CACHE_STORE_GLOBAL_SEGMENT_SIZE"] == "0"


def test_the_store_pool_launcher_is_valid_and_uses_real_flags():
    script = ROOT / "scripts" / "store_pool.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    launch = next(line for line in script.read_text().splitlines() if line.strip().startswith("encode-server "))
    continued = script.read_text().split(launch, 1)[1].splitlines()[0]
    for flag in re.findall(r"(--[a-z][a-z-]+)", launch + continued):
        assert flag in KNOWN_FLAGS, f"store_pool.sh: unknown flag {flag}"
