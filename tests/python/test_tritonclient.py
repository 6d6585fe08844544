"""Triton's own Python HTTP client against SnoozeML: KServe v2 unchanged, binary
tensor data (its default) in both directions, every datatype."""

import os
import unittest

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from server import MODELS, Server, reference

CONFIG = f"""
[models.mlp]
path = "{MODELS}/mlp-10m"
[models.types]
path = "{MODELS}/test/identity-all-types"
"""

TYPES = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
    "FP16": np.float16, "FP32": np.float32, "FP64": np.float64, "BYTES": np.object_,
}


class TritonClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server.for_class(cls, CONFIG)
        cls.client = httpclient.InferenceServerClient(cls.server.addr)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()

    def test_health_and_metadata(self):
        self.assertTrue(self.client.is_server_live())
        self.assertTrue(self.client.is_server_ready())
        self.assertTrue(self.client.is_model_ready("mlp"))
        meta = self.client.get_model_metadata("mlp")
        self.assertEqual(meta["inputs"], [{"name": "x", "datatype": "FP32", "shape": [-1, 256]}])
        index = self.client.get_model_repository_index()
        self.assertEqual(sorted(m["name"] for m in index), ["mlp", "types"])

    def test_infer_binary_and_json(self):
        x, y = reference("mlp-10m")
        for binary in (True, False):
            inp = httpclient.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=binary)
            out = httpclient.InferRequestedOutput("y", binary_data=binary)
            result = self.client.infer("mlp", [inp], outputs=[out])
            np.testing.assert_allclose(result.as_numpy("y"), y, atol=1e-4)
        # No outputs named: the client asks for all of them in binary.
        inp = httpclient.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_allclose(self.client.infer("mlp", [inp]).as_numpy("y"), y, atol=1e-4)

    def test_every_datatype_in_binary(self):
        inputs, expected = [], {}
        for dt, np_type in TYPES.items():
            if dt == "BYTES":
                arr = np.array([[b"a", b"bc", b""], ["déjà".encode(), "日本".encode(), b"yz"]], dtype=object)
            elif dt == "BOOL":
                arr = np.array([[True, False, True], [False, False, True]])
            else:
                arr = (np.arange(6).reshape(2, 3) * 3).astype(np_type)
            inp = httpclient.InferInput(f"in_{dt.lower()}", [2, 3], dt)
            inp.set_data_from_numpy(arr, binary_data=True)
            inputs.append(inp)
            expected[f"out_{dt.lower()}"] = arr
        outputs = [httpclient.InferRequestedOutput(n, binary_data=True) for n in expected]
        result = self.client.infer("types", inputs, outputs=outputs)
        for name, arr in expected.items():
            got = result.as_numpy(name)
            self.assertEqual(got.shape, (2, 3), name)
            np.testing.assert_array_equal(got, arr, err_msg=name)

    def test_bytes_that_onnx_strings_cannot_hold_are_a_400(self):
        inp = httpclient.InferInput("in_bytes", [1, 3], "BYTES")
        inp.set_data_from_numpy(np.array([[b"a", b"\x00\xff", b"c"]], dtype=object))
        others = []
        for dt, np_type in TYPES.items():
            if dt != "BYTES":
                o = httpclient.InferInput(f"in_{dt.lower()}", [1, 3], dt)
                o.set_data_from_numpy(np.zeros((1, 3), dtype=np_type))
                others.append(o)
        with self.assertRaises(InferenceServerException) as e:
            self.client.infer("types", [inp, *others])
        self.assertIn("in_bytes", str(e.exception))

    def test_errors_are_exceptions_with_the_reason(self):
        inp = httpclient.InferInput("x", [1, 3], "FP32")
        inp.set_data_from_numpy(np.zeros((1, 3), dtype=np.float32))
        with self.assertRaises(InferenceServerException) as e:
            self.client.infer("mlp", [inp])
        self.assertIn("'x'", str(e.exception))
        with self.assertRaises(InferenceServerException) as e:
            self.client.infer("nope", [inp])
        self.assertIn("nope", str(e.exception))

    def test_repository_load_and_unload(self):
        self.client.load_model("mlp")
        ready = [m["name"] for m in self.client.get_model_repository_index() if m.get("state") == "READY"]
        self.assertIn("mlp", ready)
        self.client.unload_model("mlp")
        ready = [m["name"] for m in self.client.get_model_repository_index() if m.get("state") == "READY"]
        self.assertNotIn("mlp", ready)


if __name__ == "__main__":
    unittest.main()
