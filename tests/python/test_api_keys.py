"""API keys and the admin token, held by the real clients: the OpenAI SDK's `api_key`,
tritonclient's HTTP header and gRPC metadata `authorization: Bearer <key>`. A right key
serves (and the answer is the model's, checked against its reference), a wrong or missing
one is refused the way each client reports it; health and readiness stay open; the admin
API and /metrics answer to the admin token only (an API key does not open them, the admin
token does not open inference), and are open when no token is set. The key file is read
again on SIGHUP: a rotated-out key stops working, a new one starts, without a restart."""

import json
import os
import signal
import tempfile
import time
import unittest

import numpy as np
import openai
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from server import MODELS, ROOT, Server, reference, wait_until

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "minilm_embeddings.json")
INLINE_KEY = "inline-key-7c1e"  # from --api-keys
FILE_KEY = "file-key-4d2a"  # from api_keys_file
ADMIN_TOKEN = "admin-token-93b0"

MODELS_TOML = f"""
[models.mlp]
path = "{MODELS}/mlp-10m"
[models.minilm-onnx]
path = "{MODELS}/minilm-onnx"
"""
# A valid request for mlp-10m ([-1, 256] FP32 in, as its reference.json).
ZEROS = {"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32", "data": [0.0] * 256}]}


def bearer(secret):
    return {"Authorization": f"Bearer {secret}"}


def mlp_input(module):
    """The mlp-10m reference as a tritonclient input of `module` (http or grpc), and the
    output it must give."""
    x, y = reference("mlp-10m")
    inp = module.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp, y


class ApiKeysTest(unittest.TestCase):
    """A server with keys from both places (`--api-keys` and `api_keys_file`) and an
    admin token."""

    @classmethod
    def setUpClass(cls):
        keys_dir = tempfile.TemporaryDirectory(prefix="snooze-py-keys-")
        cls.addClassCleanup(keys_dir.cleanup)
        cls.keys_file = os.path.join(keys_dir.name, "keys")
        with open(cls.keys_file, "w") as f:
            f.write(f"# one key a line\n{FILE_KEY}\n")
        config = (f'[server]\napi_keys_file = "{cls.keys_file}"\nadmin_token = "{ADMIN_TOKEN}"\n'
                  + MODELS_TOML)
        cls.server = Server.for_class(cls, config, "--api-keys", INLINE_KEY)
        if cls.server.grpc is None:
            raise RuntimeError("the server did not report its gRPC address:\n" + "".join(cls.server.lines))
        with open(FIXTURE) as f:
            cls.fixture = json.load(f)

    def openai_client(self, key):
        client = openai.OpenAI(base_url=self.server.base + "/v1", api_key=key, max_retries=0)
        self.addCleanup(client.close)
        return client

    def http_client(self):
        client = httpclient.InferenceServerClient(self.server.addr)
        self.addCleanup(client.close)
        return client

    def grpc_client(self):
        client = grpcclient.InferenceServerClient(self.server.grpc)
        self.addCleanup(client.close)
        return client

    # -- OpenAI SDK -------------------------------------------------------------------

    def test_openai_sdk_embeds_with_a_right_key_and_a_wrong_one_is_an_authentication_error(self):
        sentence, want = self.fixture["sentences"][0], self.fixture["embeddings"][0]
        for key in (INLINE_KEY, FILE_KEY):
            resp = self.openai_client(key).embeddings.create(model="minilm-onnx", input=sentence,
                                                             encoding_format="float")
            got = np.asarray(resp.data[0].embedding, dtype=np.float64)
            cos = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
            self.assertGreaterEqual(cos, 0.9999, f"{key}: cosine {cos} to the fixture")
        for wrong in ("wrong-key", INLINE_KEY + "x", ADMIN_TOKEN):
            with self.assertRaises(openai.AuthenticationError, msg=wrong) as e:
                self.openai_client(wrong).embeddings.create(model="minilm-onnx", input=sentence)
            self.assertEqual(e.exception.status_code, 401)
            self.assertIn("API key is wrong", e.exception.body["message"])
        r = requests.post(self.server.base + "/v1/embeddings", json={"model": "minilm-onnx", "input": "x"})
        self.assertEqual(r.status_code, 401, r.text)
        self.assertEqual(r.headers.get("WWW-Authenticate"), "Bearer", "a 401 names its scheme (RFC 9110)")
        self.assertEqual(set(r.json()["error"]), {"message", "type", "param", "code"}, "the OpenAI error shape")
        self.assertIn("needs an API key", r.json()["error"]["message"])

    # -- tritonclient over HTTP -------------------------------------------------------

    def test_tritonclient_http_infers_with_the_key_header_and_is_refused_without(self):
        client = self.http_client()
        inp, want = mlp_input(httpclient)
        for key in (INLINE_KEY, FILE_KEY):
            out = client.infer("mlp", [inp], headers=bearer(key)).as_numpy("y")
            self.assertLessEqual(float(np.max(np.abs(out - want))), 1e-4, key)
            meta = client.get_model_metadata("mlp", headers=bearer(key))
            self.assertEqual(meta["name"], "mlp")
        for headers in (None, bearer("wrong-key"), {"Authorization": f"Basic {INLINE_KEY}"}):
            with self.assertRaises(InferenceServerException, msg=str(headers)) as e:
                client.infer("mlp", [inp], headers=headers)
            self.assertEqual(e.exception.status(), "401", e.exception.message())
        with self.assertRaises(InferenceServerException) as e:
            client.get_server_metadata()
        self.assertIn("API key", e.exception.message())

    # -- tritonclient over gRPC -------------------------------------------------------

    def test_tritonclient_grpc_infers_with_the_key_metadata_and_is_refused_without(self):
        client = self.grpc_client()
        inp, want = mlp_input(grpcclient)
        for key in (INLINE_KEY, FILE_KEY):
            # gRPC metadata keys are lowercase; the server reads `authorization`.
            out = client.infer("mlp", [inp], headers={"authorization": f"Bearer {key}"}).as_numpy("y")
            self.assertLessEqual(float(np.max(np.abs(out - want))), 1e-4, key)
            meta = client.get_model_metadata("mlp", headers={"authorization": f"Bearer {key}"})
            self.assertEqual(meta.name, "mlp")
        for headers in (None, {"authorization": "Bearer wrong-key"}):
            with self.assertRaises(InferenceServerException, msg=str(headers)) as e:
                client.infer("mlp", [inp], headers=headers)
            self.assertEqual(e.exception.status(), "StatusCode.UNAUTHENTICATED", e.exception.message())
        with self.assertRaises(InferenceServerException) as e:
            client.get_model_repository_index()
        self.assertEqual(e.exception.status(), "StatusCode.UNAUTHENTICATED")
        # Repository loads are admin work: the admin token, not an API key.
        with self.assertRaises(InferenceServerException) as e:
            client.load_model("mlp", headers={"authorization": f"Bearer {INLINE_KEY}"})
        self.assertEqual(e.exception.status(), "StatusCode.UNAUTHENTICATED")
        client.load_model("mlp", headers={"authorization": f"Bearer {ADMIN_TOKEN}"})

    # -- what stays open, and what the admin token guards ------------------------------

    def test_health_and_readiness_need_no_key(self):
        http, grpc = self.http_client(), self.grpc_client()
        self.assertTrue(http.is_server_live())
        self.assertTrue(http.is_server_ready())
        self.assertTrue(http.is_model_ready("mlp"))
        self.assertTrue(grpc.is_server_live())
        self.assertTrue(grpc.is_server_ready())
        self.assertTrue(grpc.is_model_ready("mlp"))

    def test_the_admin_api_and_metrics_answer_to_the_admin_token_only(self):
        base = self.server.base
        for method, path in (("GET", "/admin/models"), ("GET", "/metrics"), ("GET", "/admin/memory/stats"),
                             ("POST", "/v2/repository/models/mlp/load")):
            for headers in ({}, bearer(INLINE_KEY), bearer(FILE_KEY), bearer("wrong")):
                r = requests.request(method, base + path, headers=headers, json={} if method == "POST" else None)
                self.assertEqual(r.status_code, 401, f"{method} {path} with {headers}: {r.text}")
                self.assertEqual(r.headers.get("WWW-Authenticate"), "Bearer", f"{method} {path}")
            r = requests.request(method, base + path, headers=bearer(ADMIN_TOKEN),
                                 json={} if method == "POST" else None)
            self.assertEqual(r.status_code, 200, f"{method} {path} with the admin token: {r.text}")
        # The admin token is not an API key.
        r = requests.post(base + "/v2/models/mlp/infer", headers=bearer(ADMIN_TOKEN), json=ZEROS)
        self.assertEqual(r.status_code, 401, r.text)

    # -- the key file, re-read on SIGHUP -------------------------------------------------

    def test_the_key_file_is_read_again_on_sighup(self):
        client = self.http_client()
        inp, _ = mlp_input(httpclient)
        rotated = "rotated-key-51f9"
        try:
            with open(self.keys_file, "w") as f:
                f.write(f"{rotated}\n")
            # Not before the signal: the file is read at start and on SIGHUP only.
            client.infer("mlp", [inp], headers=bearer(FILE_KEY))
            reloads = sum("API keys reloaded" in line for line in self.server.lines)
            self.server.proc.send_signal(signal.SIGHUP)
            wait_until(lambda: sum("API keys reloaded" in line for line in self.server.lines) > reloads, 10)
            client.infer("mlp", [inp], headers=bearer(rotated))
            client.infer("mlp", [inp], headers=bearer(INLINE_KEY))  # --api-keys stays
            with self.assertRaises(InferenceServerException) as e:
                client.infer("mlp", [inp], headers=bearer(FILE_KEY))
            self.assertEqual(e.exception.status(), "401", "the rotated-out key still works")
            # A file that names no key is refused and leaves the keys in force.
            with open(self.keys_file, "w") as f:
                f.write("# emptied by mistake\n")
            errors = sum("API keys not reloaded" in line for line in self.server.lines)
            self.server.proc.send_signal(signal.SIGHUP)
            wait_until(lambda: sum("API keys not reloaded" in line for line in self.server.lines) > errors, 10)
            client.infer("mlp", [inp], headers=bearer(rotated))
        finally:
            with open(self.keys_file, "w") as f:
                f.write(f"{FILE_KEY}\n")
            reloads = sum("API keys reloaded" in line for line in self.server.lines)
            self.server.proc.send_signal(signal.SIGHUP)
            wait_until(lambda: sum("API keys reloaded" in line for line in self.server.lines) > reloads, 10)


class KeysWithoutAdminTokenTest(unittest.TestCase):
    """API keys alone (`SNOOZE_API_KEYS`): inference needs a key; health, /metrics and the
    admin API stay open, as they are without an admin token."""

    @classmethod
    def setUpClass(cls):
        os.environ["SNOOZE_API_KEYS"] = f" {INLINE_KEY} , second-key "
        try:
            cls.server = Server.for_class(cls, MODELS_TOML)
        finally:
            del os.environ["SNOOZE_API_KEYS"]

    def test_inference_needs_a_key_and_the_rest_is_open(self):
        base = self.server.base
        self.assertEqual(requests.post(base + "/v2/models/mlp/infer", json=ZEROS).status_code, 401)
        for key in (INLINE_KEY, "second-key"):
            r = requests.post(base + "/v2/models/mlp/infer", json=ZEROS, headers=bearer(key))
            self.assertEqual(r.status_code, 200, f"{key}: {r.text}")
        for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/mlp/ready", "/metrics", "/admin/models"):
            r = requests.get(base + path)
            self.assertEqual(r.status_code, 200, f"{path} without a key: {r.text}")
        self.assertIn("snooze_", requests.get(base + "/metrics").text)

    def test_sighup_without_a_key_file_leaves_the_server_serving(self):
        # SIGHUP's default action ends a process: with keys inline only, the server must
        # still catch it (there is nothing to re-read) rather than die.
        self.server.proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        self.assertIsNone(self.server.proc.poll(), "the server died of SIGHUP")
        r = requests.post(self.server.base + "/v2/models/mlp/infer", json=ZEROS, headers=bearer(INLINE_KEY))
        self.assertEqual(r.status_code, 200, r.text)


if __name__ == "__main__":
    unittest.main()
