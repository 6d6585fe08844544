"""`POST /v1/ocr` as its users call it: examples/ocr_client.py (the README's client) run as a
command against the real binary reads a fixture page exactly as rapidocr 3.10 reads it
(tests/fixtures/ocr_reference.json) and a PDF page by page; its errors come back as one
line naming the problem. The same page through the KServe walk-through
(examples/ocr_kserve.py) is covered by test_ocr.py."""

import json
import os
import subprocess
import sys
import unittest

from server import MODELS, ROOT, Server

FIXTURES = os.path.join(ROOT, "tests", "fixtures")
CLIENT = os.path.join(ROOT, "examples", "ocr_client.py")

CONFIG = f"""
[models.ocr-det]
path = "{MODELS}/ocr-det"
[models.ocr-rec]
path = "{MODELS}/ocr-rec"
[models.ocr-cls]
path = "{MODELS}/ocr-cls"
[pipelines.ocr]
det = "ocr-det"
cls = "ocr-cls"
rec = "ocr-rec"
"""


class OcrServiceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server.for_class(cls, CONFIG, "--api-keys", "reader-key")
        with open(os.path.join(FIXTURES, "ocr_reference.json")) as f:
            cls.reference = {p["file"]: p for p in json.load(f)["pages"]}

    def client(self, *args: str, key: str = "reader-key") -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, CLIENT, *args, "--url", self.server.base, "--api-key", key],
                              capture_output=True, text=True, timeout=300)

    def test_the_client_prints_a_page_as_rapidocr_reads_it(self):
        page = "ocr_pages/fonts.png"
        run = self.client(os.path.join(FIXTURES, page))
        self.assertEqual(run.returncode, 0, run.stderr)
        expected = [line["text"] for line in self.reference[page]["lines"]]
        self.assertEqual(run.stdout.splitlines(), expected)

    def test_the_client_reads_a_pdf_and_prints_the_whole_answer(self):
        run = self.client(os.path.join(FIXTURES, "ocr_pages", "text.pdf"), "--json", "--no-cls")
        self.assertEqual(run.returncode, 0, run.stderr)
        answer = json.loads(run.stdout)
        self.assertEqual([p["page"] for p in answer["pages"]], [1])
        text = answer["pages"][0]["text"]
        for line in ("Quarterly report, third quarter", "Costs were flat at 3.1 million."):
            self.assertIn(line, text)
        self.assertEqual(answer["usage"]["runs"][1], 0, "--no-cls still ran the classifier")

    def test_errors_are_one_line_naming_the_problem(self):
        run = self.client(os.path.join(FIXTURES, "ocr_pages", "text.pdf"), "--pages", "4")
        self.assertNotEqual(run.returncode, 0)
        self.assertIn("400: the page selection asks for page 4 but the document has 1 page", run.stderr)
        run = self.client(os.path.join(FIXTURES, "ocr_pages", "small.png"), key="wrong")
        self.assertNotEqual(run.returncode, 0)
        self.assertTrue(run.stderr.startswith("401: "), run.stderr)


if __name__ == "__main__":
    unittest.main()
