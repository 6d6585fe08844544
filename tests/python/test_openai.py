"""The official OpenAI Python SDK against SnoozeML's /v1/embeddings, checked against
the sentence-transformers fixture; plus KServe v2 BYTES inference on the same model.
Run twice: on Candle (`minilm`, safetensors) and on ONNX Runtime (`minilm-onnx`, the
export `make prepare` builds), which must behave alike."""

import json
import os
import unittest

import numpy as np
import openai
import requests

from server import MODELS, ROOT, Server

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "minilm_embeddings.json")

CONFIG = f"""
[server]
max_embedding_inputs = 32
[models.minilm]
backend = "candle"
path = "{MODELS}/minilm"
[models.minilm-onnx]
path = "{MODELS}/minilm-onnx"
[models.mlp]
path = "{MODELS}/mlp-10m"
"""


def check(testcase, got, want, what):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    cos = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
    diff = float(np.max(np.abs(got - want)))
    testcase.assertGreaterEqual(cos, 0.9999, f"{what}: cosine {cos}")
    testcase.assertLessEqual(diff, 1e-4, f"{what}: max abs diff {diff}")


class OpenAiEmbeddingsTest(unittest.TestCase):
    MODEL = "minilm"

    @classmethod
    def setUpClass(cls):
        with open(FIXTURE) as f:
            cls.fixture = json.load(f)
        cls.server = Server.for_class(cls, CONFIG)
        cls.client = openai.OpenAI(base_url=cls.server.base + "/v1", api_key="unused", max_retries=0)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()

    def test_default_encoding_is_base64_and_matches_the_fixture(self):
        sentences = self.fixture["sentences"]
        resp = self.client.embeddings.create(model=self.MODEL, input=sentences)
        self.assertEqual(len(resp.data), len(sentences))
        for i, item in enumerate(resp.data):
            self.assertEqual(item.index, i)
            check(self, item.embedding, self.fixture["embeddings"][i], repr(sentences[i])[:40])
        self.assertEqual(resp.usage.prompt_tokens, sum(self.fixture["token_counts"]))
        self.assertEqual(resp.usage.total_tokens, resp.usage.prompt_tokens)

    def test_float_encoding_one_by_one(self):
        for i, sentence in enumerate(self.fixture["sentences"][:6]):
            resp = self.client.embeddings.create(model=self.MODEL, input=sentence, encoding_format="float")
            check(self, resp.data[0].embedding, self.fixture["embeddings"][i], repr(sentence)[:40])

    def test_raw_base64_is_little_endian_f32(self):
        r = requests.post(self.server.base + "/v1/embeddings",
                          json={"model": self.MODEL, "input": "hello", "encoding_format": "base64"})
        self.assertEqual(r.status_code, 200)
        import base64
        vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
        self.assertEqual(vec.shape, (384,))
        self.assertAlmostEqual(float(np.linalg.norm(vec)), 1.0, places=5)

    def test_dimensions_truncates_and_renormalizes(self):
        resp = self.client.embeddings.create(model=self.MODEL, input="hello", dimensions=64, encoding_format="float")
        vec = np.asarray(resp.data[0].embedding)
        self.assertEqual(vec.shape, (64,))
        self.assertAlmostEqual(float(np.linalg.norm(vec)), 1.0, places=5)
        with self.assertRaises(openai.BadRequestError):
            self.client.embeddings.create(model=self.MODEL, input="hello", dimensions=1000)

    def test_token_ids_equal_text(self):
        # [CLS] hello world [SEP] in the model's vocabulary.
        ids = [101, 7592, 2088, 102]
        by_ids = self.client.embeddings.create(model=self.MODEL, input=[ids], encoding_format="float")
        by_text = self.client.embeddings.create(model=self.MODEL, input="hello world", encoding_format="float")
        check(self, by_ids.data[0].embedding, by_text.data[0].embedding, "token ids")
        self.assertEqual(by_ids.usage.prompt_tokens, 4)

    def test_errors_have_the_openai_shape(self):
        with self.assertRaises(openai.NotFoundError) as e:
            self.client.embeddings.create(model="nope", input="x")
        self.assertEqual(e.exception.body["code"], "model_not_found")
        with self.assertRaises(openai.BadRequestError) as e:
            self.client.embeddings.create(model=self.MODEL, input=[])
        self.assertIn("empty", e.exception.body["message"])
        with self.assertRaises(openai.BadRequestError) as e:
            self.client.embeddings.create(model=self.MODEL, input=["x"] * 33)
        self.assertIn("more than the 32 inputs", e.exception.body["message"])
        with self.assertRaises(openai.BadRequestError) as e:
            self.client.embeddings.create(model="mlp", input="x")
        self.assertIn("not a text-embedding model", e.exception.body["message"])
        r = requests.post(self.server.base + "/v1/embeddings", json={"model": self.MODEL, "input": "x", "encoding_format": "int8"})
        self.assertEqual(r.status_code, 400)
        self.assertEqual(set(r.json()["error"]), {"message", "type", "param", "code"})

    def test_models_are_listed(self):
        ids = sorted(m.id for m in self.client.models.list())
        self.assertEqual(ids, ["minilm", "minilm-onnx", "mlp"])
        # One model, as the SDK retrieves it; an unknown one is the SDK's NotFoundError.
        model = self.client.models.retrieve("minilm-onnx")
        self.assertEqual((model.id, model.object, model.owned_by), ("minilm-onnx", "model", "snoozeml"))
        with self.assertRaises(openai.NotFoundError) as e:
            self.client.models.retrieve("nope")
        self.assertIn("nope", e.exception.body["message"])

    def test_kserve_bytes_infer(self):
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(self.server.addr)
        self.addCleanup(client.close)
        meta = client.get_model_metadata(self.MODEL)
        self.assertEqual(meta["inputs"][0]["datatype"], "BYTES")
        self.assertEqual(meta["outputs"][0]["shape"], [-1, 384])
        sentences = self.fixture["sentences"][:5]
        inp = httpclient.InferInput(meta["inputs"][0]["name"], [len(sentences)], "BYTES")
        inp.set_data_from_numpy(np.array([s.encode() for s in sentences], dtype=object))
        out = client.infer(self.MODEL, [inp]).as_numpy(meta["outputs"][0]["name"])
        self.assertEqual(out.shape, (5, 384))
        for i in range(5):
            check(self, out[i], self.fixture["embeddings"][i], f"kserve {i}")


class OnnxEmbeddingsTest(OpenAiEmbeddingsTest):
    """The same tests on the ONNX export, served by ONNX Runtime (the backend comes from
    the folder's files: onnx/model.onnx next to the sentence-transformers files)."""

    MODEL = "minilm-onnx"

    def test_the_backend_follows_the_files(self):
        models = {m["name"]: m for m in requests.get(self.server.base + "/admin/models").json()["models"]}
        self.assertEqual(models["minilm-onnx"]["backend"], "onnx")
        self.assertEqual(models["minilm"]["backend"], "candle")


if __name__ == "__main__":
    unittest.main()
