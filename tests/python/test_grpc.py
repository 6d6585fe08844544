"""Conformance: the KServe v2 gRPC service against the real binary, with Triton's own
clients, `tritonclient.grpc` and `tritonclient.http` side by side on the same cases.
Outputs must be identical bit for bit across gRPC raw, gRPC typed contents, REST binary
and REST JSON; errors must carry the same meaning (gRPC code <-> HTTP status)."""

import os
import unittest

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from server import MODELS, Server, reference

TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}

CONFIG = f"""
[server]
admin_token = "{TOKEN}"
max_request_size = "4MiB"
[models.mlp]
path = "{MODELS}/mlp-10m"
[models.types]
path = "{MODELS}/test/identity-all-types"
[models.typed]
path = "{MODELS}/test/identity-typed"
[models.huge]
path = "{MODELS}/mlp-10m"
memory = "100TiB"
"""

TYPES = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
    "FP16": np.float16, "FP32": np.float32, "FP64": np.float64, "BYTES": np.object_,
}

# Which typed `contents` field holds each datatype (FP16 has none: raw only).
TYPED_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}


def sample(dt):
    if dt == "BYTES":
        return np.array([[b"a", b"bc", b""], ["d\u00e9j\u00e0".encode(), "\u65e5\u672c".encode(), b"yz"]], dtype=object)
    if dt == "BOOL":
        return np.array([[True, False, True], [False, False, True]])
    if dt in ("FP16", "FP32", "FP64"):
        return (np.arange(6).reshape(2, 3) * 0.37 - 1.1).astype(TYPES[dt])
    return (np.arange(6).reshape(2, 3) * 3).astype(TYPES[dt])


def same_bits(a, b):
    """Identical dtype, shape and bytes (objects: identical elements)."""
    if a.dtype == np.object_ or b.dtype == np.object_:
        return a.shape == b.shape and [bytes(x) for x in a.flatten()] == [bytes(x) for x in b.flatten()]
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


class GrpcConformanceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server.for_class(cls, CONFIG)
        if cls.server.grpc is None:
            raise RuntimeError("the server did not report its gRPC address:\n" + "".join(cls.server.lines))
        cls.g = grpcclient.InferenceServerClient(cls.server.grpc)
        cls.h = httpclient.InferenceServerClient(cls.server.addr)
        cls.channel = grpc.insecure_channel(cls.server.grpc)
        cls.stub = service_pb2_grpc.GRPCInferenceServiceStub(cls.channel)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        cls.g.close()
        cls.h.close()

    # -- health and metadata --------------------------------------------------------

    def test_health_and_metadata_match_rest(self):
        self.assertTrue(self.g.is_server_live())
        self.assertTrue(self.g.is_server_ready())
        self.assertTrue(self.g.is_model_ready("mlp"))
        self.assertTrue(self.g.is_model_ready("mlp", "1"))
        meta = self.g.get_server_metadata(as_json=True)
        self.assertEqual(meta["name"], "snoozeml")
        self.assertIn("model_repository", meta["extensions"])
        for model in ("mlp", "types"):
            gm = self.g.get_model_metadata(model, as_json=True)
            hm = self.h.get_model_metadata(model)
            self.assertEqual(gm["name"], hm["name"])
            self.assertEqual(gm["versions"], hm["versions"])
            self.assertEqual(gm["platform"], hm["platform"])
            for kind in ("inputs", "outputs"):
                g = [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in gm[kind]]
                h = [(t["name"], t["datatype"], t["shape"]) for t in hm[kind]]
                self.assertEqual(g, h, f"{model} {kind}")

    # -- inference ------------------------------------------------------------------

    def test_mlp_identical_on_every_encoding(self):
        x, y = reference("mlp-10m")
        gi = grpcclient.InferInput("x", list(x.shape), "FP32")
        gi.set_data_from_numpy(x)
        via_grpc = self.g.infer("mlp", [gi]).as_numpy("y")
        np.testing.assert_allclose(via_grpc, y, atol=1e-4)
        typed = self.typed_infer("mlp", {"x": ("FP32", x)})["y"]
        results = {"grpc raw": via_grpc, "grpc typed": typed}
        for binary in (True, False):
            hi = httpclient.InferInput("x", list(x.shape), "FP32")
            hi.set_data_from_numpy(x, binary_data=binary)
            out = httpclient.InferRequestedOutput("y", binary_data=binary)
            results["rest binary" if binary else "rest json"] = self.h.infer("mlp", [hi], outputs=[out]).as_numpy("y")
        for name, got in results.items():
            self.assertTrue(same_bits(got, via_grpc), f"{name} differs from grpc raw")

    def test_every_datatype_identical_over_grpc_and_rest(self):
        arrays = {dt: sample(dt) for dt in TYPES}
        g_inputs, h_inputs = [], []
        for dt, arr in arrays.items():
            name = f"in_{dt.lower()}"
            gi = grpcclient.InferInput(name, [2, 3], dt)
            gi.set_data_from_numpy(arr)
            g_inputs.append(gi)
            hi = httpclient.InferInput(name, [2, 3], dt)
            hi.set_data_from_numpy(arr, binary_data=True)
            h_inputs.append(hi)
        g = self.g.infer("types", g_inputs)
        hb = self.h.infer("types", h_inputs)
        for dt, arr in arrays.items():
            out = f"out_{dt.lower()}"
            got = g.as_numpy(out)
            self.assertTrue(same_bits(got, arr), f"{dt}: {got!r}")
            self.assertTrue(same_bits(got, hb.as_numpy(out)), f"{dt}: grpc vs rest binary")

    def test_typed_contents_for_every_datatype_that_has_them(self):
        arrays = {dt: sample(dt) for dt in TYPES if dt != "FP16"}
        typed = self.typed_infer("typed", {f"in_{dt.lower()}": (dt, arr) for dt, arr in arrays.items()})
        g_inputs = []
        for dt, arr in arrays.items():
            gi = grpcclient.InferInput(f"in_{dt.lower()}", [2, 3], dt)
            gi.set_data_from_numpy(arr)
            g_inputs.append(gi)
        g = self.g.infer("typed", g_inputs)
        for dt, arr in arrays.items():
            out = f"out_{dt.lower()}"
            self.assertTrue(same_bits(typed[out], arr), f"{dt}: typed {typed[out]!r}")
            self.assertTrue(same_bits(typed[out], g.as_numpy(out)), f"{dt}: typed vs raw")
        # FP16 has no typed form: a clear error naming the input.
        r = service_pb2.ModelInferRequest(model_name="types")
        for dt, arr in arrays.items():
            add_typed(r, f"in_{dt.lower()}", dt, arr)
        r.inputs.add(name="in_fp16", datatype="FP16", shape=[2, 3])
        _, err = self.call(r)
        self.assertEqual(err.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("in_fp16", err.details())
        # Values out of range for a narrow type are refused, not wrapped.
        r = service_pb2.ModelInferRequest(model_name="typed")
        for dt, arr in arrays.items():
            add_typed(r, f"in_{dt.lower()}", dt, arr)
        r.inputs[[i.name for i in r.inputs].index("in_int8")].contents.int_contents[0] = 300
        _, err = self.call(r)
        self.assertEqual(err.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("out of range", err.details())

    def test_rest_json_matches_grpc_for_json_datatypes(self):
        h_json, g_inputs = [], []
        arrays = {dt: sample(dt) for dt in TYPES if dt != "FP16"}
        for dt, arr in arrays.items():
            name = f"in_{dt.lower()}"
            hi = httpclient.InferInput(name, [2, 3], dt)
            hi.set_data_from_numpy(arr, binary_data=False)
            h_json.append(hi)
        # The model needs every input: FP16 goes binary on REST, raw on gRPC.
        fp16 = sample("FP16")
        hi = httpclient.InferInput("in_fp16", [2, 3], "FP16")
        hi.set_data_from_numpy(fp16, binary_data=True)
        h_json.append(hi)
        outs = [httpclient.InferRequestedOutput(f"out_{dt.lower()}", binary_data=False) for dt in arrays]
        hj = self.h.infer("types", h_json, outputs=outs)
        for dt, arr in {**arrays, "FP16": fp16}.items():
            gi = grpcclient.InferInput(f"in_{dt.lower()}", [2, 3], dt)
            gi.set_data_from_numpy(arr)
            g_inputs.append(gi)
        g = self.g.infer("types", g_inputs)
        for dt in arrays:
            out = f"out_{dt.lower()}"
            got, want = hj.as_numpy(out), g.as_numpy(out)
            if dt == "BYTES":
                # JSON carries BYTES as text: the same elements, as str.
                self.assertEqual([s.encode() if isinstance(s, str) else bytes(s) for s in got.flatten()],
                                 [bytes(s) for s in want.flatten()])
            else:
                self.assertTrue(same_bits(got.astype(want.dtype), want), f"{dt}: rest json vs grpc")

    def test_requested_outputs_only(self):
        g_inputs = []
        for dt in TYPES:
            gi = grpcclient.InferInput(f"in_{dt.lower()}", [2, 3], dt)
            gi.set_data_from_numpy(sample(dt))
            g_inputs.append(gi)
        r = self.g.infer("types", g_inputs, outputs=[grpcclient.InferRequestedOutput("out_int8"),
                                                     grpcclient.InferRequestedOutput("out_bytes")])
        names = [o.name for o in r.get_response().outputs]
        self.assertEqual(sorted(names), ["out_bytes", "out_int8"])
        self.assertIsNone(r.as_numpy("out_fp32"))
        with self.assertRaises(InferenceServerException) as e:
            self.g.infer("types", g_inputs, outputs=[grpcclient.InferRequestedOutput("nope")])
        self.assertEqual(e.exception.status(), "StatusCode.INVALID_ARGUMENT")
        self.assertIn("no output 'nope'", e.exception.message())

    def test_priority_parameter(self):
        x, y = reference("mlp-10m")
        # tritonclient sends its `priority` argument as a uint64 parameter.
        for p in (0, 1, 2, 3):
            gi = grpcclient.InferInput("x", list(x.shape), "FP32")
            gi.set_data_from_numpy(x)
            r = self.g.infer("mlp", [gi], priority=p)
            np.testing.assert_allclose(r.as_numpy("y"), y, atol=1e-4)
        # Names, as a string parameter (or x-snooze-priority metadata).
        for name in ("high", "low"):
            r = service_pb2.ModelInferRequest(model_name="mlp")
            r.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
            r.raw_input_contents.append(x.tobytes())
            r.parameters["priority"].string_param = name
            resp, err = self.call(r)
            self.assertIsNone(err)
        resp = self.stub.ModelInfer(r, timeout=60, metadata=(("x-snooze-priority", "high"),))
        self.assertEqual(len(resp.outputs), 1)
        r.parameters["priority"].string_param = "urgent"
        _, err = self.call(r)
        self.assertEqual(err.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("urgent", err.details())

    # -- repository -----------------------------------------------------------------

    def test_repository_index_load_unload_need_the_token(self):
        index = self.g.get_model_repository_index(as_json=True)["models"]
        self.assertEqual(sorted(m["name"] for m in index), ["huge", "mlp", "typed", "types"])
        with self.assertRaises(InferenceServerException) as e:
            self.g.load_model("mlp")
        self.assertEqual(e.exception.status(), "StatusCode.UNAUTHENTICATED")
        with self.assertRaises(InferenceServerException) as e:
            self.h.load_model("mlp")
        self.assertIn("401", str(e.exception.status()))
        self.g.load_model("mlp", headers=AUTH)
        ready = self.g.get_model_repository_index(as_json=True)["models"]
        self.assertEqual([m.get("state") for m in ready if m["name"] == "mlp"], ["READY"])
        self.g.unload_model("mlp", headers=AUTH)
        after = {m["name"]: m.get("state") for m in self.g.get_model_repository_index(as_json=True)["models"]}
        self.assertEqual(after["mlp"], "UNAVAILABLE")
        rest = {m["name"]: m.get("state") for m in self.h.get_model_repository_index()}
        self.assertEqual(after, rest)
        with self.assertRaises(InferenceServerException) as e:
            self.g.load_model("nope", headers=AUTH)
        self.assertEqual(e.exception.status(), "StatusCode.NOT_FOUND")

    # -- errors ---------------------------------------------------------------------

    def call(self, request):
        try:
            return self.stub.ModelInfer(request, timeout=60), None
        except grpc.RpcError as e:
            return None, e

    def test_errors_map_like_rest(self):
        x, _ = reference("mlp-10m")
        cases = []
        # Unknown model: NOT_FOUND / 404.
        cases.append(("unknown model", service_pb2.ModelInferRequest(model_name="nope"), grpc.StatusCode.NOT_FOUND))
        bad, full = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
        cases += [
            # Unknown input: INVALID_ARGUMENT / 400.
            ("unknown input", typed_request("mlp", "z", [1, 256], "fp32_contents", [0.0] * 256), bad),
            # A declared shape no body backs: a 400 that costs nothing.
            ("huge declared shape", raw_request("mlp", [1099511627776, 256], b""), bad),
            ("overflowing shape", raw_request("mlp", [4611686018427387904, 4], b"\0" * 16), bad),
            # Raw bytes that do not match the shape.
            ("raw size", raw_request("mlp", [1, 256], b"\0" * 1000), bad),
            # Typed contents in the wrong field, or too few.
            ("wrong contents field", typed_request("mlp", "x", [1, 256], "int_contents", [0] * 256), bad),
            ("too few elements", typed_request("mlp", "x", [2, 256], "fp32_contents", [0.0] * 256), bad),
            # Over max_request_size (4 MiB): RESOURCE_EXHAUSTED / 413.
            ("too large", raw_request("mlp", [5000, 256], b"\0" * (5000 * 256 * 4)), full),
            # A model that can never fit: UNAVAILABLE / 503 with retry-after.
            ("never fits", raw_request("huge", list(x.shape), x.tobytes()), grpc.StatusCode.UNAVAILABLE),
        ]
        for what, request, code in cases:
            resp, err = self.call(request)
            self.assertIsNone(resp, what)
            self.assertEqual(err.code(), code, f"{what}: {err.details()}")
            self.assertTrue(err.details(), f"{what}: the message names the problem")
        # The refusal carries its retry delay in metadata and in the message.
        _, err = self.call(cases[-1][1])
        meta = dict(err.trailing_metadata() or ())
        self.assertIn("retry-after", meta)
        self.assertGreaterEqual(int(meta["retry-after"]), 1)
        self.assertIn("retry after", err.details())
        # REST says the same for the same requests.
        hi = httpclient.InferInput("x", list(x.shape), "FP32")
        hi.set_data_from_numpy(x)
        with self.assertRaises(InferenceServerException) as e:
            self.h.infer("huge", [hi])
        self.assertIn("503", str(e.exception.status()))
        # And the server still serves.
        gi = grpcclient.InferInput("x", list(x.shape), "FP32")
        gi.set_data_from_numpy(x)
        self.assertIsNotNone(self.g.infer("mlp", [gi]).as_numpy("y"))

    # -- helpers --------------------------------------------------------------------

    def typed_infer(self, model, typed):
        """ModelInfer with every input in typed `contents` (tritonclient always sends raw)."""
        r = service_pb2.ModelInferRequest(model_name=model)
        for name, (dt, arr) in typed.items():
            add_typed(r, name, dt, arr)
        return outputs(self.stub.ModelInfer(r, timeout=60))


def raw_request(model, shape, data, name="x", datatype="FP32"):
    r = service_pb2.ModelInferRequest(model_name=model)
    r.inputs.add(name=name, datatype=datatype, shape=shape)
    r.raw_input_contents.append(data)
    return r


def typed_request(model, name, shape, field, values, datatype="FP32"):
    r = service_pb2.ModelInferRequest(model_name=model)
    t = r.inputs.add(name=name, datatype=datatype, shape=shape)
    getattr(t.contents, field).extend(values)
    return r


def add_typed(request, name, dt, arr):
    t = request.inputs.add(name=name, datatype=dt, shape=list(arr.shape))
    values = [bytes(v) for v in arr.flatten()] if dt == "BYTES" else arr.flatten().tolist()
    getattr(t.contents, TYPED_FIELD[dt]).extend(values)


NP_OF = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
         "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
         "FP16": np.float16, "FP32": np.float32, "FP64": np.float64}


def outputs(resp):
    got = {}
    for i, o in enumerate(resp.outputs):
        raw = resp.raw_output_contents[i]
        shape = tuple(o.shape)
        if o.datatype == "BYTES":
            items, j = [], 0
            while j < len(raw):
                n = int.from_bytes(raw[j:j + 4], "little")
                items.append(raw[j + 4:j + 4 + n])
                j += 4 + n
            got[o.name] = np.array(items, dtype=object).reshape(shape)
        else:
            got[o.name] = np.frombuffer(raw, dtype=NP_OF[o.datatype]).reshape(shape)
    return got


if __name__ == "__main__":
    unittest.main()
